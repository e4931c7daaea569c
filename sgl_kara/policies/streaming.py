"""StreamingLLM baseline: keep attention sinks plus the most recent tokens.

Idea
    The first few tokens act as attention sinks; keeping them plus a recent window keeps
    attention stable. The score is positional (no queries); its top-K is ``streaming_select``.

Paper
    Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks".

Parameters (flags --kara-streaming-<name>)
    threshold, budget, window   C_max, N, most recent entries kept (threshold.py; 1280, 1024, 32)
    sinks                       first generated entries always kept (4)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import ScoreInput, need, register
from .threshold import ThresholdOptions, ThresholdPolicy


def streaming_select(m: int, budget: int, sinks: int, device=None, batch_shape=()):
    """int64 [*batch_shape, budget]: positions 0..sinks-1 then m-(budget-sinks)..m-1."""
    if not 0 <= sinks <= budget <= m:
        raise ValueError(f"need 0 <= sinks <= budget <= m, got {sinks=} {budget=} {m=}")
    idx = torch.cat([torch.arange(sinks), torch.arange(m - (budget - sinks), m)])
    return idx.to(device).expand(*batch_shape, budget).contiguous()


@dataclass(frozen=True)
class StreamingOptions(ThresholdOptions):
    sinks: int = field(
        default=4, metadata={"help": "first generated entries always kept"}
    )

    def __post_init__(self):
        super().__post_init__()
        need(
            0 <= self.sinks < self.budget - self.window,
            "sinks",
            f"must be in [0, budget - window = {self.budget - self.window})",
            self.sinks,
        )


@register
class StreamingPolicy(ThresholdPolicy):
    name = "streaming"
    prefix = "streaming_"
    Options = StreamingOptions
    needs_queries = False

    def score(self, inp: ScoreInput) -> torch.Tensor:
        b, m = inp.slots.shape
        pos = torch.arange(m, device=inp.slots.device, dtype=torch.float32)
        s = torch.where(pos < self.options.sinks, pos.new_full((), 2.0 * m) - pos, pos)
        return s.expand(b, inp.k_buffer.shape[1], m)
