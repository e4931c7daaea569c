"""Batched on-device Kara selection (Eq. 5-8 + App. C.3).

Shapes
    scores  [N, M]  importance per (request x kv head x layer) row, any float dtype
    out     [N, K]  int64 sorted kept indices, K = kept_count(M, retention)

No Triton kernel: `policies.kara.select` is already vectorised torch over rows
(sorts, gathers, scatters, cumsum) with no `.item()` or host sync, so on GPU it
runs as a handful of launches for the whole batch. This module exists so that
`kernels/` exposes all three steps (score -> select -> compact).
"""

from __future__ import annotations

import torch

from ..policies.kara import select


def select_batched(scores: torch.Tensor, retention: float, chunk_budget: int, max_chunk: int) -> torch.Tensor:
    """scores [N, M] -> int64 [N, K] sorted kept indices (see policies.kara.select)."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [N, M], got {tuple(scores.shape)}")
    return select(scores, retention, chunk_budget, max_chunk)
