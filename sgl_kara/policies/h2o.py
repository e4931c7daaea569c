"""H2O: heavy hitters by accumulated attention, plus the most recent tokens.

Idea
    Every key accumulates the attention it receives from every later query; the keys with the
    largest totals (heavy hitters) are kept together with a window of the most recent tokens,
    the rest is evicted. Here: the accumulation runs over decode steps (a per-step observer:
    each decode query's attention over its request's keys, query heads summed into their KV
    head), and eviction is threshold-triggered like the other baselines (policies/threshold.py)
    so that evictions are batched: when a request's generated KV exceeds C_max it is cut back to
    N = heavy hitters + the last ``window`` entries.

Paper
    Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models" (NeurIPS); its default splits the budget evenly between heavy hitters and
    recent tokens.

Parameters (flags --kara-h2o-<name>)
    threshold   C_max: generated KV entries that trigger eviction (1280)
    budget      N: generated KV entries kept (1024)
    window      recent entries always kept; unset: N / 2 (the paper's even split)

State: per request, ``policy_state["h2o"][layer]`` [capacity, H_kv] float32, the accumulated
attention of row positions ``base`` .. ``base + capacity`` (``policy_state["h2o_base"]``: the row
length before the request's first observed decode token, so only decoded entries -- those a
threshold region can hold, each in a slot of its own -- are kept; positions below ``base`` have
none: after a retraction the re-prefilled decoded entries start from zero); re-laid like the row at
every compaction. The observer is batched: per layer, one padded attention over every observed
request (in chunks of at most OBSERVE_TOKENS padded row entries) and one ``_foreach_add_`` into the
accumulators. Memory, for the start-up budget: ``observer_bytes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .base import ObserveInput, ScoreInput, need, register
from .threshold import ThresholdPolicy

KEY = "h2o"
BASE_KEY = "h2o_base"


@dataclass(frozen=True)
class H2OOptions:
    threshold: int = field(
        default=1280,
        metadata={"help": "C_max: generated KV entries that trigger eviction"},
    )
    budget: int = field(default=1024, metadata={"help": "N: generated KV entries kept"})
    window: int | None = field(
        default=None, metadata={"help": "recent entries always kept; unset: budget / 2"}
    )

    def __post_init__(self):
        need(
            2 <= self.budget < self.threshold <= 10_000_000,
            "threshold",
            f"must be in (budget={self.budget}, 10000000] with budget >= 2",
            self.threshold,
        )
        if self.window is None:
            object.__setattr__(self, "window", self.budget // 2)
        need(
            1 <= self.window < self.budget,
            "window",
            f"must be in [1, budget={self.budget})",
            self.window,
        )


# Padded row entries (requests x longest row) one observer chunk attends over; bounds its workspace.
OBSERVE_TOKENS = 16384
# Accumulator capacity grows to the entries needed plus max(ACC_MIN_SLACK, a quarter).
ACC_MIN_SLACK = 64


@register
class H2OPolicy(ThresholdPolicy):
    name = "h2o"
    prefix = "h2o_"
    Options = H2OOptions
    needs_queries = False
    observes_decode = True

    def __init__(self, options):
        super().__init__(options)
        # (the forward's row_slots list, its chunks): built at its first layer
        self._batch = None

    def observe(self, inp: ObserveInput) -> None:
        """Add each decode query's attention (softmax over its row's keys, itself included) to
        its request's accumulator, query heads summed per KV head: per chunk of requests one
        padded attention and one ``_foreach_add_``."""
        hq, d = inp.queries.shape[1], inp.queries.shape[2]
        hkv = inp.k_buffer.shape[1]
        heads_first = inp.k_buffer.transpose(
            0, 1
        )  # [H_kv, S, D]: gathered keys need no transpose
        for idx, slots, mask, accs in self._chunks(inp):
            keys = heads_first[:, slots].float()  # [H_kv, t, Lmax, D]
            q = (
                inp.queries[idx]
                .float()
                .reshape(len(accs), hkv, hq // hkv, d)
                .transpose(0, 1)
            )  # [H_kv, t, G, D]
            logits = torch.matmul(q, keys.transpose(-1, -2)).div_(
                math.sqrt(d)
            )  # [H_kv, t, G, Lmax]
            logits.masked_fill_(~mask[None, :, None, :], float("-inf"))
            probs = (
                torch.softmax(logits, dim=-1).sum(2).permute(1, 2, 0).contiguous()
            )  # [t, Lmax, H_kv]
            dst, src = [], []
            for i, (state, base, n) in enumerate(accs):
                dst.append(
                    _accumulator(state, inp.layer, hkv, n - base, probs.device)[
                        : n - base
                    ]
                )
                src.append(probs[i, base:n])
            torch._foreach_add_(dst, src)

    def _chunks(self, inp: ObserveInput) -> list:
        """The forward's observed requests in chunks of at most OBSERVE_TOKENS padded entries:
        (the requests' indices in the batch [t] or a slice, padded slots [t, Lmax], valid [t, Lmax],
        (state, base, length) per request). Built once per forward: every layer gets the same ``row_slots`` list."""
        if self._batch is not None and self._batch[0] is inp.row_slots:
            return self._batch[1]
        rows = []
        for i, (slots, state) in enumerate(zip(inp.row_slots, inp.rows)):
            if state is None or not state.enabled:
                continue
            n = int(slots.shape[0])
            base = state.policy_state.setdefault(BASE_KEY, n - 1)
            rows.append((i, slots, state, min(base, n), n))
        chunks, start = [], 0
        while start < len(rows):
            end, longest = start, 0
            while end < len(rows) and (
                end == start
                or (end - start + 1) * max(longest, rows[end][4]) <= OBSERVE_TOKENS
            ):
                longest = max(longest, rows[end][4])
                end += 1
            part = rows[start:end]
            padded = torch.nn.utils.rnn.pad_sequence(
                [r[1].long() for r in part], batch_first=True, padding_value=-1
            )
            first, last = part[0][0], part[-1][0]
            # Consecutive requests (every one observed, the usual case) are a slice: no index
            # tensor to copy to the device.
            idx = (
                slice(first, last + 1)
                if last - first + 1 == len(part)
                else torch.tensor([r[0] for r in part], dtype=torch.long).to(
                    padded.device
                )
            )
            chunks.append(
                (
                    idx,
                    padded.clamp(min=0),
                    padded >= 0,
                    [(r[2], r[3], r[4]) for r in part],
                )
            )
            start = end
        self._batch = (inp.row_slots, chunks)
        return chunks

    def score(self, inp: ScoreInput) -> torch.Tensor:
        b, m = inp.slots.shape
        hkv = inp.k_buffer.shape[1]
        out = torch.zeros(b, hkv, m, dtype=torch.float32, device=inp.slots.device)
        for i, (row, region) in enumerate(zip(inp.rows, inp.regions)):
            acc = row.state.policy_state.get(KEY, {}).get(inp.layer)
            if acc is None:
                continue
            base = row.state.policy_state.get(BASE_KEY, 0)
            lo, hi = max(region.start, base), min(region.start + m, base + acc.shape[0])
            if hi > lo:
                out[i, :, lo - region.start : hi - region.start] = acc[
                    lo - base : hi - base
                ].T
        return out

    def on_compacted(
        self, state, start: int, region: int, kept: torch.Tensor, length: int
    ) -> None:
        """rows [start, start + region) -> the kept ones (per layer and head); the tail moves down."""
        per_layer = state.policy_state.get(KEY)
        if not per_layer:
            return
        base = state.policy_state.get(BASE_KEY, 0)
        if (
            start < base
        ):  # a region reaching below the observed entries (after a retraction)
            per_layer = {
                layer: torch.cat([acc.new_zeros(base - start, acc.shape[1]), acc])
                for layer, acc in per_layer.items()
            }
            state.policy_state[KEY] = per_layer
            state.policy_state[BASE_KEY] = base = start
        s0, k = start - base, kept.shape[-1]
        for layer, acc in list(per_layer.items()):
            n = min(acc.shape[0], length - base)
            new = torch.zeros_like(acc)
            new[:s0] = acc[:s0]
            new[s0 : s0 + k] = torch.gather(
                acc[s0 : s0 + region], 0, kept[layer].to(acc.device).T
            )
            tail = acc[s0 + region : n]
            new[s0 + k : s0 + k + tail.shape[0]] = tail
            per_layer[layer] = new

    @classmethod
    def observer_bytes(
        cls, shape, itemsize: int, pool_tokens: int, running: int | None
    ) -> int:
        """Device memory the observer can hold, for the start-up budget (memory.kara_memory):
        accumulators for at most every decoded entry the pool holds (each in a slot of its own),
        grown by a quarter plus ACC_MIN_SLACK per request (``running`` None: SGLang's request
        limit, at most half the pool's entries), twice (an event re-lays a copy); and one chunk's
        workspace (keys, their float32 copy, logits, probabilities)."""
        requests = running if running is not None else pool_tokens // 2
        entries = pool_tokens + pool_tokens // 4 + ACC_MIN_SLACK * requests
        accumulators = 2 * entries * shape.layers * shape.kv_heads * 4
        per_entry = (
            shape.kv_heads * shape.head_dim * (itemsize + 4)
            + shape.q_heads * 8
            + shape.kv_heads * 8
            + 16
        )
        return accumulators + OBSERVE_TOKENS * per_entry


def _accumulator(state, layer: int, heads: int, length: int, device) -> torch.Tensor:
    """This request's accumulator of ``layer`` [capacity >= length, H_kv] (grown as it decodes)."""
    per_layer = state.policy_state.setdefault(KEY, {})
    acc = per_layer.get(layer)
    if acc is None or acc.shape[0] < length:
        grown = torch.zeros(
            length + max(ACC_MIN_SLACK, length // 4),
            heads,
            dtype=torch.float32,
            device=device,
        )
        if acc is not None:
            grown[: acc.shape[0]] = acc
        per_layer[layer] = acc = grown
    return acc
