"""Small helpers shared by the engine's processes."""
