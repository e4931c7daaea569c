"""Kara's own memory beside the KV pool, bounded before the model loads, and its place in the
GPU's budget.

What Kara holds besides the pool, per scheduler (per tensor-parallel rank: heads and weights are
the rank's, ``ModelShape.per_rank``), each bounded by the request limit and the window, never by
the pool alone:

    capture_ring   ``--kara-query-source capture``: ring_rows x (W + period) queries x layers x
                   H_q x D, allocated at start-up (model_shape.ring_bytes)
    event_scores   one event chunk's scores and selection: at most ``event_requests`` requests
                   (the recompute token budget over the query window: events are scored,
                   selected and compacted a chunk at a time, scheduler/events.py) x layers x
                   H_kv x region entries x EVENT_BYTES_PER_SCORE
    spread_scores  the partial scores of every window scored ahead of its compaction (``--kara-
                   spread even``'s parts, and an event's settled queries, scored before the step's
                   fence), float32 [layers, H_kv, region] per request, for at most the running
                   requests and at most as many as the pool holds whole regions
    observer       a decode observer's state and workspace (H2O: ``policies/h2o.py``
                   ``observer_bytes``)
    recompute_activations
                   a policy that scores with queries: one recompute forward's activations
                   (``recompute_tokens`` tokens through a layer: the residual stream, q / k / v,
                   the attention output, the MLP's gate, up and activation), held by the caching
                   allocator's pool of the stream the forward runs on (the schedule stream:
                   SGLang plans its own forward's activations on the forward stream only)

On CUDA the sum is taken from the KV pool's share of the GPU (``reserve_device_memory``: a lower
``--mem-fraction-static``); on CPU it joins the RAM check of the CPU serving kit.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from sgl_kara.model_shape import ModelShape

logger = logging.getLogger(__name__)

# auto query source: capture on CPU while the ring needs at most this share of available RAM;
# on CUDA only when the running-request limit is known and the ring fits this share of the GPU.
CPU_RING_SHARE = 0.25
CUDA_RING_SHARE = 0.05
# An event's scores [B, layers, H_kv, M] and their selection, per score: the float32 score (4),
# its sort's float32 values and int64 order (12), Token2Chunk's float64 copy (8) and masks:
# <= 32 bytes (policies/base.py top_k, policies/kara.py select).
EVENT_BYTES_PER_SCORE = 32
SPREAD_BYTES_PER_SCORE = 4  # a spread job's float32 partial sum
# SGLang's token budget of one forward when --chunked-prefill-size does not set it.
DEFAULT_RECOMPUTE_TOKENS = 8192
# Most tokens one recompute forward takes (and one event chunk's query windows): its activations
# are planned beside the pool; on a GPU a forward of this many tokens is far past the roofline
# ridge (docs/GPU.md, "Scoring cost on a GPU"), so splitting a larger budget costs no weight read
# that matters.
MAX_RECOMPUTE_TOKENS = 2048


def recompute_tokens(chunked_prefill_size: int | None) -> int:
    """Tokens per recompute forward: SGLang's chunked-prefill budget (its default when unset),
    at most MAX_RECOMPUTE_TOKENS."""
    budget = (
        chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else 0
    )
    return min(budget or DEFAULT_RECOMPUTE_TOKENS, MAX_RECOMPUTE_TOKENS)


@dataclass(frozen=True)
class KaraFootprint:
    """What bounds Kara's memory under one server's settings."""

    pool_tokens: int
    running: int  # the request limit (SGLang's own when the user set none)
    region_tokens: int  # the most entries one request's region holds
    query_tokens: int  # queries scoring one region
    recompute_tokens: int  # tokens per recompute forward and per event chunk's queries
    ring_rows: int = 0
    ring_capacity: int = 0
    spread: bool = False  # windows are scored ahead (spread parts, settled queries)
    recomputes: bool = (
        False  # the policy scores with queries (a recompute forward may run)
    )

    @property
    def event_requests(self) -> int:
        """Requests one event chunk scores, selects and compacts at once."""
        return max(
            1, min(self.running, event_chunk(self.recompute_tokens, self.query_tokens))
        )

    @property
    def spread_requests(self) -> int:
        """Requests that can hold a spread job at once: running, each holding a whole region."""
        whole = self.pool_tokens // max(1, self.region_tokens)
        return max(0, min(self.running, whole))


def event_chunk(recompute_tokens: int, query_tokens: int) -> int:
    """Requests per event chunk: as many query windows as one recompute forward takes (SGLang
    budgets a forward's activations for its chunked-prefill size)."""
    return max(1, recompute_tokens // max(1, query_tokens))


def kara_memory(
    shape: ModelShape, itemsize: int, plan: KaraFootprint, observer=None
) -> dict:
    """Bytes Kara holds beside the KV pool, by what holds them (per scheduler)."""
    scores = shape.layers * shape.kv_heads * plan.region_tokens
    return {
        "capture_ring": shape.ring_bytes(plan.ring_rows, plan.ring_capacity, itemsize)
        if plan.ring_rows
        else 0,
        "event_scores": plan.event_requests * scores * EVENT_BYTES_PER_SCORE,
        "spread_scores": plan.spread_requests * scores * SPREAD_BYTES_PER_SCORE
        if plan.spread
        else 0,
        "observer": observer(shape, itemsize, plan.pool_tokens, plan.running)
        if observer is not None
        else 0,
        "recompute_activations": plan.recompute_tokens
        * shape.activation_elements_per_token()
        * itemsize
        if plan.recomputes
        else 0,
    }


def sglang_max_running(pool_tokens: int, context_len: int, dp_size: int = 1) -> int:
    """The request limit SGLang 0.5.23 sets when the user sets none (``KVCacheConfigurator
    .resolve_max_num_reqs``): the pool over the context times 512, clamped to [2048, 4096], at
    most half the pool's tokens."""
    estimated = int(pool_tokens / max(1, context_len) * 512)
    estimated = max(min(estimated, 4096), 2048)
    return max(1, min(estimated, pool_tokens // 2) // max(1, dp_size))


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def plan_text(sizes: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in sizes.items() if v)


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_ram_bytes()


class NoPoolLeft(ValueError):
    """Kara's memory beside the pool would leave no KV pool; the message names the flags."""


def device_share(
    shape: ModelShape,
    itemsize: int,
    total: int,
    fraction: float,
    plan_for_pool,
    observer=None,
) -> tuple[dict, float, int]:
    """(sizes, share of the device, pool tokens) for a device of ``total`` bytes whose KV pool
    gets ``fraction`` of it less the weights. ``plan_for_pool(pool_tokens) -> KaraFootprint``.
    Raises NoPoolLeft when the weights and Kara's memory leave no pool."""
    weights = shape.weight_bytes(itemsize)
    pool_tokens = max(0, int(fraction * total) - weights) // shape.kv_bytes_per_token(
        itemsize
    )
    sizes = kara_memory(shape, itemsize, plan_for_pool(pool_tokens), observer)
    share = math.ceil(1000 * sum(sizes.values()) / total) / 1000
    lowered = fraction - share
    if pool_tokens <= 0 or lowered * total <= weights:
        raise NoPoolLeft(
            f"Kara's memory beside the KV pool ({plan_text(sizes) or 'none'}) with the "
            f"weights ({gib(weights)} per rank) leaves no KV pool in {fraction:.3f} of the "
            f"{gib(total)} device"
        )
    return sizes, share, pool_tokens
