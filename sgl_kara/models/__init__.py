"""Models sgl_kara serves or builds itself: the default model and the reasoning proxy (default.py),
the SmolLM2 conversion (smollm2.py) and random-weight test fixtures (tiny.py)."""
