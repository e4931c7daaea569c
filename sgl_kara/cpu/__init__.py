"""CPU serving: torch_native decode and window-extend attention and packed float32 linear weights
(the CPU kernels: one switchable part, ``KARA_CPU_KERNELS``, registered by sgl_kara/plugin.py),
the OpenMP waiting policy. Importing the package imports nothing (threads.py runs before torch
loads)."""
