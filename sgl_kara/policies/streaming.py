"""StreamingLLM baseline: keep attention sinks plus the most recent tokens.

Idea
    The first few tokens act as attention sinks; keeping them plus a recent
    window keeps attention stable. No scores are needed.

Paper
    Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks".

Parameters (flags --kara-streaming-<name>)
    threshold / budget / window   the threshold trigger (policies/threshold.py): C_max, N, and the
                                  most recent entries always kept (1280 / 1024 / 32)
    sinks                         first generated entries always kept (4)

As a policy, the selection is a positional score (sinks first, then the most recent) with the
default top-K, which equals ``streaming_select``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import ScoreInput, need, register
from .threshold import ThresholdOptions, ThresholdPolicy


def streaming_select(
    m: int, budget: int, sinks: int, device=None, batch_shape=()
) -> torch.Tensor:
    """Returns int64 [*batch_shape, budget]: positions 0..sinks-1 then m-(budget-sinks)..m-1."""
    if not 0 <= sinks <= budget <= m:
        raise ValueError(
            f"need 0 <= sinks <= budget <= m, got sinks={sinks} budget={budget} m={m}"
        )
    idx = torch.cat(
        [
            torch.arange(sinks, device=device, dtype=torch.int64),
            torch.arange(m - (budget - sinks), m, device=device, dtype=torch.int64),
        ]
    )
    return idx.expand(*batch_shape, budget).contiguous()


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


def streaming_scores(m: int, sinks: int, device=None) -> torch.Tensor:
    """[m] positional scores whose top-K is ``streaming_select(m, K, min(sinks, K))``: the first
    ``sinks`` positions outrank everything, then later positions outrank earlier ones."""
    pos = torch.arange(m, device=device, dtype=torch.float32)
    return torch.where(pos < sinks, pos.new_full((), 2.0 * m) - pos, pos)


@register
class StreamingPolicy(ThresholdPolicy):
    name = "streaming"
    prefix = "streaming_"
    Options = StreamingOptions
    needs_queries = False

    def score(self, inp: ScoreInput) -> torch.Tensor:
        b, m = inp.slots.shape
        s = streaming_scores(m, self.options.sinks, device=inp.slots.device)
        return s.expand(b, inp.k_buffer.shape[1], m)
