"""Every ``KARA_*`` environment variable, typed, in one place, and the one parser of boolean
variables (read at call time, so a test or a spawned process sees the value its environment has).

| variable | type | default | meaning |
|---|---|---|---|
| KARA_SERVE | bool | 0 | this process and the SGLang processes it starts serve with sgl_kara: the plugin registers its hooks (set by sgl_kara's launcher and Engine; unset, on a machine without CUDA the plugin only puts RoPE on its CPU path and lets `--tp-size` start there) |
| KARA_CPU_KERNELS | bool | KARA_SERVE on a machine without CUDA | the CPU speed-ups of sgl_kara/cpu in this process (decode and window-extend attention, packed linear); 1 opts plain SGLang in, or asks for them where CUDA is present |
| KARA_CACHE | path | $XDG_CACHE_HOME/sgl_kara or ~/.cache/sgl_kara | converted default model |
| KARA_FORK | bool | 1 | launcher on CPU: fork SGLang's workers instead of spawn |
| KARA_CHECK_INTEGRITY | bool | 0 | check prefixes, slot ownership, ring, offsets at every event |
| KARA_CHECK_SYNC | bool | 0 | count what would make the host wait for a GPU in every Kara step, SGLang's calls inside it included (diagnostics/sync_check.py; `sync_violations` after the step's fence, `sync_pre_fence_waits` of SGLang's before it, in /server_info) |
| KARA_CROSSCHECK_QUERIES | bool | 0 | compare capture and recompute scores on first windows |
| KARA_RECORD_EVICTIONS | path | - | JSON lines: evicted logical positions per event (oracle) |
| KARA_TRACE | path | - | JSON lines: running and waiting requests and free slots per decode step |
| KARA_INJECT_FAULT_RID_PREFIX | str | - | an event raises for rids with this prefix (tests; diagnostics/faults.py) |
| KARA_CHECK_TP_PLAN | bool | 0 | with --tp-size > 1: the ranks all-gather a digest of their event plans and state at every decode step and stop the server naming the first rank that differs (scheduler/tp_lockstep.py) |
| KARA_INJECT_TP_DIVERGENCE | `rank` or `rank:prefix` | - | with the TP plan check: this TP rank drops a job from the first event it runs (with `prefix`: the job of a request whose rid starts with it) (tests) |
| KARA_INJECT_FAULT_TP_RANK | int | - | with --tp-size > 1: the injected fault fires on this TP rank only (the others agree to undo the event: scheduler/tp_lockstep.py) |
| KARA_INJECT_FAULT_AT | str | score | where that event raises: `score` (as it completes the window's scores), `recompute` (inside the recompute forward, at its middle layer) or `commit` (after the kept K/V are copied into fresh slots, just before the rows are rewritten) (diagnostics/faults.py) |
| KARA_FAST_CPU_DECODE | bool | 1 | with the CPU kernels: torch_native on CPU: decode gathers K/V once per layer; the recompute pass attends its window queries only (cpu/attention.py) |
| KARA_BATCHED_CPU_DECODE | bool | 1 | with the fast decode: one padded SDPA call per layer for the whole batch, GQA group folded into the query axis (not bit-identical to SGLang's: float summation order; 0 = the per-request loop, bit-identical; bench/results/kernels.md) |
| KARA_PACKED_CPU_LINEAR | bool | 1 | with the CPU kernels, on CPU: float32 weight matmuls through oneDNN on weights packed in place after loading (the lm_head: a packed copy, for decode batches), instead of MKL's sgemm (not bit-identical: float summation order; cpu/linear.py; read when the plugin loads) |

Booleans take SGLang's spellings (``EnvBool``), in any case: true ``1 true yes y``, false
``0 false no n``; empty means the default, and any other value warns once and means the default.
The prefix is not ``SGL_``: SGLang rewrites every ``SGL_*`` variable to ``SGLANG_*`` and warns.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

PREFIX = "KARA_"
TRUE = ("1", "true", "yes", "y")
FALSE = ("0", "false", "no", "n")

_warned: set[str] = set()  # variables warned about in this process (each warning once)


def _warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, category, stacklevel=3)


def parse_bool(name: str, value: str | None, default: bool) -> bool:
    """``value`` of the variable ``name`` as a boolean (None or empty: ``default``)."""
    if value is None or value.strip() == "":
        return default
    word = value.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    _warn_once(
        f"{name}={value}",
        f"{name}={value!r} is not a boolean (true: {', '.join(TRUE)}; false: "
        f"{', '.join(FALSE)}); using the default, {int(default)}",
    )
    return default


def flag(name: str, default: bool) -> bool:
    """Any boolean environment variable (SGLang's too), parsed as sgl_kara's own are."""
    return parse_bool(name, os.environ.get(name), default)


def _get(name: str) -> str | None:
    return os.environ.get(PREFIX + name)


def _bool(name: str, default: bool) -> bool:
    return parse_bool(PREFIX + name, _get(name), default)


def cache_dir() -> Path:
    value = _get("CACHE")
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return Path(base) / "sgl_kara"


SERVE = PREFIX + "SERVE"
CPU_KERNELS = PREFIX + "CPU_KERNELS"


def serving() -> bool:
    return _bool("SERVE", False)


def cpu_kernels_requested() -> bool | None:
    """``KARA_CPU_KERNELS`` as set (None: unset, the plugin decides by device and KARA_SERVE)."""
    value = _get("CPU_KERNELS")
    if value is None or value.strip() == "":
        return None
    return _bool("CPU_KERNELS", False)


def fork_workers() -> bool:
    return _bool("FORK", True)


def check_integrity() -> bool:
    return _bool("CHECK_INTEGRITY", False)


def check_sync() -> bool:
    return _bool("CHECK_SYNC", False)


def crosscheck_queries() -> bool:
    return _bool("CROSSCHECK_QUERIES", False)


def record_evictions() -> str | None:
    return _get("RECORD_EVICTIONS") or None


def trace() -> str | None:
    return _get("TRACE") or None


def inject_fault_rid_prefix() -> str:
    return _get("INJECT_FAULT_RID_PREFIX") or ""


def check_tp_plan() -> bool:
    return _bool("CHECK_TP_PLAN", False)


def inject_tp_divergence() -> tuple[int | None, str]:
    """(TP rank, rid prefix) of ``KARA_INJECT_TP_DIVERGENCE`` (``rank`` or ``rank:prefix``;
    (None, "") unset)."""
    value = (_get("INJECT_TP_DIVERGENCE") or "").strip()
    if not value:
        return None, ""
    rank, _, prefix = value.partition(":")
    return int(rank), prefix


def inject_fault_tp_rank() -> int | None:
    value = (_get("INJECT_FAULT_TP_RANK") or "").strip()
    return int(value) if value else None


def inject_fault_stage() -> str:
    return _get("INJECT_FAULT_AT") or "score"


def fast_cpu_decode() -> bool:
    return _bool("FAST_CPU_DECODE", True)


def batched_cpu_decode() -> bool:
    return _bool("BATCHED_CPU_DECODE", True)


def packed_cpu_linear() -> bool:
    return _bool("PACKED_CPU_LINEAR", True)
