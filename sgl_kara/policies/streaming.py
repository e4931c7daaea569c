"""StreamingLLM baseline: keep attention sinks plus the most recent tokens.

Idea
    The first few tokens act as attention sinks; keeping them plus a recent
    window keeps attention stable. No scores are needed.

Paper
    Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks".

Parameters
    m        length of the region being compressed.
    budget   positions kept.
    sinks    leading positions always kept (0 <= sinks <= budget <= m).
"""

from __future__ import annotations

import torch


def streaming_select(m: int, budget: int, sinks: int, device=None, batch_shape=()) -> torch.Tensor:
    """Returns int64 [*batch_shape, budget]: positions 0..sinks-1 then m-(budget-sinks)..m-1."""
    if not 0 <= sinks <= budget <= m:
        raise ValueError(f"need 0 <= sinks <= budget <= m, got sinks={sinks} budget={budget} m={m}")
    idx = torch.cat(
        [
            torch.arange(sinks, device=device, dtype=torch.int64),
            torch.arange(m - (budget - sinks), m, device=device, dtype=torch.int64),
        ]
    )
    return idx.expand(*batch_shape, budget).contiguous()
