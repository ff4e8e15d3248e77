"""The OpenAI-compatible HTTP server (FastAPI): ``server.build_app`` / ``server.run_server``."""
