"""The live engine dashboard of ``pagedllm serve`` (``/dashboard``): the KV block pool as a map,
the KVs each (layer, KV head) holds under KV-Compress, the requests, and the engine's rates.
``service.py`` keeps its data, ``routes.py`` serves it, ``static/`` is the page (plain
JavaScript and canvas, no build step), ``report.py`` writes the same map to an HTML file for
``pagedllm bench``."""

from pathlib import Path

STATIC = Path(__file__).parent / "static"  # the page, its script and style sheet
KEY_COOKIE = "pagedllm_api_key"  # the API key a browser gave /dashboard/login
