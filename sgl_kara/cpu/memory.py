"""CPU memory sizing: the request limit and KV pool a CPU server can hold, and the RAM check at
start-up. SGLang sizes its KV pool from free memory (~11 GB of float32 KV for a 14 MB model on a
24 GB machine, killed at the first request), so unless the user sets them (or
``--mem-fraction-static``) the kit sets the two below, and refuses, naming the flags, weights +
KV pool + Kara's memory + PROCESS_FLOOR_BYTES that do not fit in the available memory
(docs/CONFIGURATION.md, "CPU defaults and memory sizing"). No SGLang import.

    --max-running-requests  CPU_RUNNING_REQUESTS unless the user sets it; a compressing server
                            may run COMPRESSED_RUNNING_FACTOR times as many in the same pool:
                            admission by compressed footprint decides how many fit
    --max-total-tokens      min(CPU_KV_SHARE of physical RAM / KV bytes per token,
                                max(context length, max_running_requests * CPU_TOKENS_PER_REQUEST))
"""

from __future__ import annotations

from sgl_kara.memory_plan import gib
from sgl_kara.model_shape import ModelShape

CPU_RUNNING_REQUESTS = 8
COMPRESSED_RUNNING_FACTOR = 2
CPU_KV_SHARE = 0.05
CPU_TOKENS_PER_REQUEST = 1024
MIN_TOKENS = 4096
# Private memory of the launcher (tokenizer manager), scheduler and detokenizer processes, each
# of which imports torch and SGLang.
PROCESS_FLOOR_BYTES = 3 * 900 * (1 << 20)


class MemoryConfigError(ValueError):
    """A memory configuration that cannot work; the message names the flags to change."""


def cpu_memory_defaults(
    shape: ModelShape | None,
    itemsize: int,
    total_ram: int,
    given,
    compressing: bool = False,
) -> dict:
    """SGLang server args for a CPU server that the user did not set (names as ServerArgs fields).
    ``given``: the ServerArgs fields the user set, with their values (a mapping; a set of names
    means values unknown); a given ``max_running_requests`` sizes the pool like the default does.
    ``compressing``: the pool is sized for CPU_RUNNING_REQUESTS uncompressed requests and the
    request limit is COMPRESSED_RUNNING_FACTOR times that (each holds less)."""
    given = given if isinstance(given, dict) else dict.fromkeys(given)
    out = {}
    if "max_running_requests" not in given:
        factor = COMPRESSED_RUNNING_FACTOR if compressing else 1
        out["max_running_requests"] = CPU_RUNNING_REQUESTS * factor
    if shape is not None and not given.keys() & {
        "max_total_tokens",
        "mem_fraction_static",
    }:
        running = int(given.get("max_running_requests") or CPU_RUNNING_REQUESTS)
        by_ram = int(CPU_KV_SHARE * total_ram) // shape.kv_bytes_per_token(itemsize)
        by_work = max(shape.context_len, running * CPU_TOKENS_PER_REQUEST)
        out["max_total_tokens"] = max(MIN_TOKENS, min(by_ram, by_work))
    return out


def check_cpu_fit(
    shape: ModelShape,
    itemsize: int,
    max_total_tokens: int,
    ring_rows: int,
    ring_capacity: int,
    available: int,
    packed_linear: bool = False,
    max_running_requests: int | None = None,
    ranks: int = 1,
    kara_workspace: int = 0,
) -> dict:
    """Raise MemoryConfigError when weights (+ the lm_head's packed copy when ``packed_linear``
    and float32: cpu/linear.py packs the other weights in place) + KV pool + ring + Kara's other
    memory (``kara_workspace``: memory_plan.kara_memory less the ring) (+ the processes' floor)
    exceed ``available``; returns the byte counts (for the start-up log). ``shape`` is one
    rank's; ``ranks`` (``--dp-size`` x ``--tp-size``): each rank's scheduler holds its own
    weights share, pool, ring and workspace, and adds a process (a DP controller one more)."""
    sizes = {
        "weights": ranks * shape.weight_bytes(itemsize),
        "packed_lm_head": ranks * shape.lm_head_elements * 4
        if packed_linear and itemsize == 4
        else 0,
        "kv_pool": ranks * max_total_tokens * shape.kv_bytes_per_token(itemsize),
        "capture_ring": ranks * shape.ring_bytes(ring_rows, ring_capacity, itemsize)
        if ring_rows
        else 0,
        "kara_workspace": ranks * kara_workspace,
        "processes": PROCESS_FLOOR_BYTES
        + (ranks * PROCESS_FLOOR_BYTES // 3 if ranks > 1 else 0),
    }
    need = sum(sizes.values())
    if need > available:
        running = (
            f"--max-running-requests ({max_running_requests})"
            if max_running_requests
            else "--max-running-requests"
        )
        raise MemoryConfigError(
            f"this server needs {gib(need)} ({plan_text(sizes, max_total_tokens, ring_rows, ring_capacity)}) but "
            f"{gib(available)} of RAM is available: lower --max-total-tokens ({max_total_tokens}) or {running}, "
            "or shrink the capture ring with a smaller --kara-window / --kara-period, --kara-query-ring-rows or "
            "--kara-query-source recompute"
            + (
                f", or fewer ranks (--dp-size x --tp-size: {ranks})"
                if ranks > 1
                else ""
            )
        )
    return sizes


def plan_text(
    sizes: dict, max_total_tokens: int, ring_rows: int, ring_capacity: int
) -> str:
    """``check_cpu_fit``'s sizes, each named by what it holds (the start-up log and the refusal)."""
    what = {
        "weights": "weights",
        "packed_lm_head": "lm_head packed copy",
        "kv_pool": f"KV pool ({max_total_tokens} tokens)",
        "capture_ring": f"capture ring ({ring_rows} rows x {ring_capacity} queries)",
        "kara_workspace": "Kara's scores and observer memory",
        "processes": "SGLang's processes",
    }
    return ", ".join(f"{what.get(k, k)} {gib(v)}" for k, v in sizes.items() if v)
