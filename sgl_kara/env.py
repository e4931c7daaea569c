"""Every ``SGL_KARA_*`` environment variable, typed, in one place (read at call time, so a test or
a spawned process sees the value its environment has).

| variable | type | default | meaning |
|---|---|---|---|
| SGL_KARA_CACHE | path | $XDG_CACHE_HOME/sgl_kara or ~/.cache/sgl_kara | converted default model |
| SGL_KARA_FORK | bool | 1 | launcher on CPU: fork SGLang's workers instead of spawn |
| SGL_KARA_CHECK_INTEGRITY | bool | 0 | check prefixes, slot ownership, ring, offsets at every event |
| SGL_KARA_CROSSCHECK_QUERIES | bool | 0 | compare capture and recompute scores on first windows |
| SGL_KARA_RECORD_EVICTIONS | path | - | JSON lines: evicted logical positions per event (oracle) |
| SGL_KARA_TRACE | path | - | JSON lines: running and waiting requests and free slots per decode step |
| SGL_KARA_INJECT_FAULT_RID_PREFIX | str | - | scoring raises for rids with this prefix (tests) |
| SGL_KARA_FAST_CPU_DECODE | bool | 1 | torch_native on CPU: decode gathers K/V once per layer; the recompute pass attends its window queries only (cpu/attention.py) |
| SGL_KARA_BATCHED_CPU_DECODE | bool | 1 | with the fast decode: one padded SDPA call per layer for the whole batch, GQA group folded into the query axis (not bit-identical to SGLang's: float summation order; 0 = the per-request loop, bit-identical; bench/cpu_decode_batched.py) |
| SGL_KARA_PACKED_CPU_LINEAR | bool | 1 | on CPU: float32 weight matmuls through oneDNN on weights packed in place after loading (the lm_head: a packed copy, for decode batches), instead of MKL's sgemm (not bit-identical: float summation order; cpu/linear.py; read when the plugin loads) |

SGLang rewrites any ``SGL_*`` variable to ``SGLANG_*`` with a deprecation warning at import;
sgl_kara/__init__ silences that warning for these names, and they keep working.
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value not in ("0", "false", "False", "no")


def cache_dir() -> Path:
    value = os.environ.get("SGL_KARA_CACHE")
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sgl_kara"


def fork_workers() -> bool:
    return _flag("SGL_KARA_FORK", True)


def check_integrity() -> bool:
    return _flag("SGL_KARA_CHECK_INTEGRITY", False)


def crosscheck_queries() -> bool:
    return _flag("SGL_KARA_CROSSCHECK_QUERIES", False)


def record_evictions() -> str | None:
    return os.environ.get("SGL_KARA_RECORD_EVICTIONS") or None


def trace() -> str | None:
    return os.environ.get("SGL_KARA_TRACE") or None


def inject_fault_rid_prefix() -> str:
    return os.environ.get("SGL_KARA_INJECT_FAULT_RID_PREFIX", "")


def fast_cpu_decode() -> bool:
    return _flag("SGL_KARA_FAST_CPU_DECODE", True)


def batched_cpu_decode() -> bool:
    return _flag("SGL_KARA_BATCHED_CPU_DECODE", True)


def packed_cpu_linear() -> bool:
    return _flag("SGL_KARA_PACKED_CPU_LINEAR", True)
