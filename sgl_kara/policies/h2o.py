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

State: per request and layer, ``acc[layer]`` [H_kv, capacity] float32 indexed by row position
(``row.state.policy_state["h2o"]``); re-laid like the row at every compaction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .base import ObserveInput, ScoreInput, need, register
from .threshold import ThresholdPolicy

KEY = "h2o"


@dataclass(frozen=True)
class H2OOptions:
    threshold: int = field(default=1280, metadata={"help": "C_max: generated KV entries that trigger eviction"})
    budget: int = field(default=1024, metadata={"help": "N: generated KV entries kept"})
    window: int | None = field(default=None, metadata={"help": "recent entries always kept; unset: budget / 2"})

    def __post_init__(self):
        need(2 <= self.budget < self.threshold <= 10_000_000, "threshold",
             f"must be in (budget={self.budget}, 10000000] with budget >= 2", self.threshold)
        if self.window is None:
            object.__setattr__(self, "window", self.budget // 2)
        need(1 <= self.window < self.budget, "window", f"must be in [1, budget={self.budget})", self.window)


@register
class H2OPolicy(ThresholdPolicy):
    name = "h2o"
    prefix = "h2o_"
    Options = H2OOptions
    needs_queries = False
    observes_decode = True

    def observe(self, inp: ObserveInput) -> None:
        """Add each decode query's attention (softmax over its row's keys, itself included) to
        its request's accumulator, query heads summed per KV head."""
        hq, d = inp.queries.shape[1], inp.queries.shape[2]
        hkv = inp.k_buffer.shape[1]
        for i, (slots, state) in enumerate(zip(inp.row_slots, inp.rows)):
            if state is None or not state.enabled:
                continue
            keys = inp.k_buffer[slots]  # [L, H_kv, D]
            q = inp.queries[i].float().reshape(hkv, hq // hkv, d)
            probs = torch.softmax(torch.einsum("hgd,lhd->hgl", q, keys.float()) / math.sqrt(d), dim=-1).sum(1)
            acc = _accumulator(state, inp.layer, hkv, slots.numel(), probs.device)
            acc[:, : slots.numel()] += probs

    def score(self, inp: ScoreInput) -> torch.Tensor:
        b, m = inp.slots.shape
        hkv = inp.k_buffer.shape[1]
        out = torch.zeros(b, hkv, m, dtype=torch.float32, device=inp.slots.device)
        for i, (row, region) in enumerate(zip(inp.rows, inp.regions)):
            acc = row.state.policy_state.get(KEY, {}).get(inp.layer)
            if acc is not None:
                have = max(0, min(m, acc.shape[1] - region.start))
                out[i, :, :have] = acc[:, region.start : region.start + have]
        return out

    def on_compacted(self, state, start: int, region: int, kept: torch.Tensor, length: int) -> None:
        """rows [start, start + region) -> the kept ones (per layer and head); the tail moves down."""
        per_layer = state.policy_state.get(KEY)
        if not per_layer:
            return
        k = kept.shape[-1]
        for layer, acc in per_layer.items():
            n = min(acc.shape[1], length)
            new = torch.zeros_like(acc)
            new[:, :start] = acc[:, :start]
            new[:, start : start + k] = torch.gather(acc[:, start : start + region], 1, kept[layer].to(acc.device))
            tail = acc[:, start + region : n]
            new[:, start + k : start + k + tail.shape[1]] = tail
            per_layer[layer] = new


def _accumulator(state, layer: int, heads: int, length: int, device) -> torch.Tensor:
    per_layer = state.policy_state.setdefault(KEY, {})
    acc = per_layer.get(layer)
    if acc is None or acc.shape[1] < length:
        grown = torch.zeros(heads, max(64, 2 * length), dtype=torch.float32, device=device)
        if acc is not None:
            grown[:, : acc.shape[1]] = acc
        per_layer[layer] = acc = grown
    return acc
