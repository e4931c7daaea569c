"""The default model (default.py) and its one-time conversion (smollm2.py)."""
