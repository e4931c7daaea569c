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


def want_triton(use_triton: bool | None, t) -> bool:
    """use_triton=None: Triton on CUDA tensors or under TRITON_INTERPRET=1, else torch."""
    if use_triton is None:
        return bool(t.is_cuda) or os.environ.get("TRITON_INTERPRET") == "1"
    if use_triton and not t.is_cuda and not interpret_mode():
        raise RuntimeError("use_triton=True on CPU tensors needs TRITON_INTERPRET=1 "
                           "set before triton is imported")
    return use_triton
