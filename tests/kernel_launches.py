"""Recording what Triton kernels the launchers compile, on CPU under the interpreter, a KV pool and
SGLang's free-list allocator: shared by the warm-up tests (tests/test_warm_up.py, tests/test_gpu_readiness.py).

Triton keys a compiled kernel on its constexprs and on each other argument's type and, unless the
kernel lists it in ``do_not_specialize``, on whether an integer equals 1 or is divisible by 16
(pointers: 16-byte alignment). ``Launches`` computes that key for every launch with Triton's own
``native_specialize_impl``, so a launch whose key the warm-up did not produce is a compile mid-serving
on a GPU."""

from __future__ import annotations

import importlib

import torch

KERNELS = {
    "sgl_kara.kernels.window_score": ("_lse_kernel", "_colsum_kernel"),
    "sgl_kara.kernels.compact": (
        "_compact_kernel",
        "_copy_rows_kernel",
        "_gather_rows_kernel",
        "_scatter_rows_kernel",
    ),
}


class Launches:
    """Every launch of the launchers' Triton kernels, keyed as Triton keys its compiled kernels."""

    def __init__(self, monkeypatch):
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        self.keys: set = set()
        log = self

        class Recorded:
            def __init__(self, name, kernel):
                self.name, self.kernel = name, kernel
                self.arg_names = list(kernel.arg_names)
                self.fixed = set(kernel.kwargs.get("do_not_specialize") or ())

            def __getitem__(self, grid):
                launch = self.kernel[grid]

                def run(*args, **kw):
                    key = tuple(
                        native_specialize_impl(
                            BaseBackend, a, False, name not in self.fixed, True
                        )
                        for name, a in zip(self.arg_names, args)
                    )
                    log.keys.add(
                        (
                            self.name,
                            key,
                            tuple(sorted((k, repr(v)) for k, v in kw.items())),
                        )
                    )
                    return launch(*args, **kw)

                return run

        for mod_name, names in KERNELS.items():
            mod = importlib.import_module(mod_name)
            for name in names:
                monkeypatch.setattr(mod, name, Recorded(name, getattr(mod, name)))

    def take(self) -> set:
        out, self.keys = self.keys, set()
        return out


class Pool:
    """One K and one V buffer per layer, as SGLang's MHATokenToKVPool hands them out (seeded normal)."""

    def __init__(
        self, dtype=torch.float32, seed=0, slots=256, layers=2, kv_heads=2, head_dim=16
    ):
        g = torch.Generator().manual_seed(seed)
        self.k = [
            torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
            for _ in range(layers)
        ]
        self.v = [
            torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
            for _ in range(layers)
        ]
        self.start_layer, self.layer_num = 0, layers

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


class Allocator:
    """SGLang's free list: each allocation a slice of what is left, at any offset."""

    def __init__(self, size: int, page: int):
        self.page = page
        self.free_pages = torch.arange(1, size // page)

    def alloc(self, n: int):
        pages = -(-n // self.page)
        got, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        if self.page == 1:
            return got
        return (got[:, None] * self.page + torch.arange(self.page)).reshape(-1)

    def free_page_ids(self, pages):
        pass
