"""CPU serving: torch_native decode and window-extend attention, packed float32 linear weights, the
OpenMP waiting policy. Importing the package imports nothing (threads.py runs before torch loads)."""
