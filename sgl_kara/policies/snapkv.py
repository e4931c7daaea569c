"""SnapKV scoring, used by the threshold-triggered baseline.

Idea
    The last w queries (the observation window) vote for the keys before them:
    per query head, softmax over the M keys, summed over the w queries, query
    heads summed into their kv head, then a 1-D max pool over positions so that
    neighbours of a strong key survive with it (clustering). The top-`budget`
    positions are kept.

Paper
    Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"; as a
    decode-time, threshold-triggered baseline: the Kara paper's vLLM+SnapKV (App. B.1).

Parameters (flags --kara-snapkv-<name>)
    threshold    C_max: generated KV entries that trigger compression (1280)
    budget       N: generated KV entries kept (1024)
    window       w: observation queries, also the most recent entries always kept (32)
    kernel       odd pooling width (padding kernel // 2, stride 1, same length); 1 disables
                 pooling (7)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels.window_score import window_scores, window_scores_paged
from .base import ScoreInput, need, register
from .threshold import ThresholdOptions, ThresholdPolicy


def snapkv_scores(
    q_obs: torch.Tensor, k: torch.Tensor, kernel_size: int = 7
) -> torch.Tensor:
    """q_obs: [B, w, H_q, D] last w queries; k: [B, M, H_kv, D] keys to compress
    (all before the observation window, so no mask). Returns [B, H_kv, M] float32."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd and >= 1, got {kernel_size}")
    return snapkv_pool(
        window_scores(q_obs, k), kernel_size
    )  # softmax over M, summed over queries/heads


def snapkv_pool(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """1-D max pooling over the last dim of ``[..., M]`` scores (same length; 1 = identity)."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd and >= 1, got {kernel_size}")
    if kernel_size == 1 or scores.shape[-1] == 0:
        return scores
    shape = scores.shape
    pooled = F.max_pool1d(
        scores.reshape(-1, 1, shape[-1]),
        kernel_size,
        stride=1,
        padding=kernel_size // 2,
    )
    return pooled.reshape(shape)


def snapkv_select(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """scores: [..., M] -> sorted top-`budget` indices, int64 [..., budget].
    Ties: higher score first, then lower index."""
    m = scores.shape[-1]
    if not 0 <= budget <= m:
        raise ValueError(f"budget must be in [0, M={m}], got {budget}")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return torch.sort(order[..., :budget], dim=-1).values


@dataclass(frozen=True)
class SnapKVOptions(ThresholdOptions):
    kernel: int = field(
        default=7, metadata={"help": "max-pooling width over positions (odd; 1 = off)"}
    )

    def __post_init__(self):
        super().__post_init__()
        need(
            1 <= self.kernel <= 63 and self.kernel % 2 == 1,
            "kernel",
            "must be an odd integer in [1, 63]",
            self.kernel,
        )


@register
class SnapKVPolicy(ThresholdPolicy):
    name = "snapkv"
    prefix = "snapkv_"
    Options = SnapKVOptions

    def score(self, inp: ScoreInput) -> torch.Tensor:
        return snapkv_pool(
            window_scores_paged(inp.queries.contiguous(), inp.k_buffer, inp.slots),
            self.options.kernel,
        )
