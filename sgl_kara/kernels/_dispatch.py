"""Triton-or-torch dispatch shared by the kernel launchers.

Triton reads TRITON_INTERPRET when it is imported (triton.language's own helpers are
jitted then), so the CPU interpreter needs the variable set before the first
`import triton` in the process."""

from __future__ import annotations

import os

import triton


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET") == "1"


def want_triton(
    use_triton: bool | None, t, pow2_dim: int | None = None, min_dim: int = 1
) -> bool:
    """use_triton=None: Triton on CUDA tensors or under TRITON_INTERPRET=1, else torch; also torch
    when the kernel needs a power-of-two head dim >= ``min_dim`` and ``pow2_dim`` is not one (a
    model with head_dim 80 or 96 still runs, on the torch path). use_triton=True insists."""
    shape_ok = pow2_dim is None or (
        pow2_dim >= min_dim and pow2_dim & (pow2_dim - 1) == 0
    )
    if use_triton is None:
        return (
            bool(t.is_cuda) or os.environ.get("TRITON_INTERPRET") == "1"
        ) and shape_ok
    if use_triton and not t.is_cuda and not interpret_mode():
        raise RuntimeError(
            "use_triton=True on CPU tensors needs TRITON_INTERPRET=1 "
            "set before triton is imported"
        )
    if use_triton and not shape_ok:
        raise ValueError(
            f"D must be a power of two >= {min_dim} for the Triton path, got {pow2_dim}"
        )
    return use_triton


def aligned(t):
    """``t`` contiguous at a 16-byte aligned address (a copy when it is not). Triton specialises
    pointer arguments on 16-byte alignment, so an index tensor sliced from an allocator's free
    list at an odd offset would compile the kernel again mid-serving."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()
