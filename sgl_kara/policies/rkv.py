"""R-KV: attention importance combined with key redundancy, for decode-time compression of
reasoning traces.

Idea
    Reasoning models repeat themselves; a key that many other keys resemble carries little new
    information. Each candidate key j gets
        importance_j = maxpool_k( mean over the last w queries of softmax_j(max over the KV
                       head's query heads of the logits) )
        redundancy_j = softmax_j( mean_i cos(k_i, k_j) ), where for each key i its most recent
                       similar key (cos > 0.5) is exempt (set to 0), so the newest copy survives
        score_j      = lambda * importance_j - (1 - lambda) * redundancy_j
    and the top N - w by score are kept with the last w entries. Decode-time, threshold-
    triggered: when generated KV reaches C_max = N + buffer it is cut back to N
    (policies/threshold.py), i.e. once every ``buffer`` tokens.

Paper
    Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models";
    defaults from its reference implementation: w = 8 observation queries, pooling kernel 7,
    lambda = 0.07, similarity threshold 0.5, "last" retention, buffer 128. Deviation: the
    candidate set is the generated region [P, L - w) (the prompt stays protected, as for every
    sgl_kara policy) and redundancy is computed among those candidates.

Parameters (flags --kara-rkv-<name>)
    budget      N: generated KV entries kept (1024)
    threshold   C_max; unset: budget + 128 (the reference's buffer)
    window      w: observation queries and most recent entries kept (8)
    kernel      odd max-pooling width over positions (7)
    mix_lambda  weight of importance against redundancy, in [0, 1] (0.07)
    similarity  cosine similarity above which two keys are redundant, in (-1, 1) (0.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .base import ScoreInput, need, register
from .snapkv import snapkv_pool
from .threshold import ThresholdPolicy

REFERENCE_BUFFER = 128


@dataclass(frozen=True)
class RKVOptions:
    budget: int = field(default=1024, metadata={"help": "N: generated KV entries kept"})
    threshold: int | None = field(
        default=None, metadata={"help": "C_max; unset: budget + 128 (R-KV's buffer)"}
    )
    window: int = field(
        default=8,
        metadata={"help": "w: observation queries, also most recent entries kept"},
    )
    kernel: int = field(
        default=7, metadata={"help": "max-pooling width over positions (odd; 1 = off)"}
    )
    mix_lambda: float = field(
        default=0.07, metadata={"help": "weight of importance vs redundancy, in [0, 1]"}
    )
    similarity: float = field(
        default=0.5,
        metadata={"help": "cosine similarity above which keys are redundant"},
    )

    def __post_init__(self):
        if self.threshold is None:
            object.__setattr__(self, "threshold", self.budget + REFERENCE_BUFFER)
        need(
            1 <= self.window <= 65536,
            "window",
            "must be an integer in [1, 65536]",
            self.window,
        )
        need(
            self.window < self.budget,
            "budget",
            f"must be > window={self.window}",
            self.budget,
        )
        need(
            self.budget < self.threshold <= 10_000_000,
            "threshold",
            f"must be in (budget={self.budget}, 10000000]",
            self.threshold,
        )
        need(
            1 <= self.kernel <= 63 and self.kernel % 2 == 1,
            "kernel",
            "must be an odd integer in [1, 63]",
            self.kernel,
        )
        check_mix(self.mix_lambda, self.similarity)


def check_mix(mix_lambda: float, similarity: float) -> None:
    """R-KV's weight of importance against redundancy and its similarity threshold."""
    need(0.0 <= mix_lambda <= 1.0, "mix_lambda", "must be in [0, 1]", mix_lambda)
    need(-1.0 < similarity < 1.0, "similarity", "must be in (-1, 1)", similarity)


def rkv_importance(q: torch.Tensor, k: torch.Tensor, kernel: int) -> torch.Tensor:
    """q [B, w, H_q, D], k [B, M, H_kv, D] -> [B, H_kv, M]: softmax over the M keys of the group's
    max logit, mean over the w queries, max-pooled over positions."""
    b, w, hq, d = q.shape
    hkv = k.shape[2]
    logits = torch.einsum(
        "bwhgd,bmhd->bhgwm", q.float().reshape(b, w, hkv, hq // hkv, d), k.float()
    ) / math.sqrt(d)
    probs = torch.softmax(logits.amax(dim=2), dim=-1)  # [B, H_kv, w, M]
    return snapkv_pool(probs.mean(dim=2), kernel)


def rkv_redundancy(k: torch.Tensor, threshold: float) -> torch.Tensor:
    """k [B, M, H_kv, D] -> [B, H_kv, M] softmax over keys of their mean cosine similarity to the
    others, each key's most recent similar key (cos > threshold) exempted."""
    kn = k.float().transpose(1, 2)
    kn = kn / (kn.norm(dim=-1, keepdim=True) + 1e-8)  # [B, H, M, D]
    sim = kn @ kn.transpose(-1, -2)  # [B, H, M, M]
    m = sim.shape[-1]
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    idx = torch.arange(m, device=k.device)
    last_similar = torch.where(sim > threshold, idx, torch.zeros_like(idx)).amax(
        dim=-1, keepdim=True
    )
    sim.scatter_(-1, last_similar, 0.0)
    return torch.softmax(sim.mean(dim=-2), dim=-1)


@register
class RKVPolicy(ThresholdPolicy):
    name = "rkv"
    prefix = "rkv_"
    Options = RKVOptions

    def score(self, inp: ScoreInput) -> torch.Tensor:
        o = self.options
        keys = inp.keys()
        importance = rkv_importance(inp.queries, keys, o.kernel)
        return o.mix_lambda * importance - (1.0 - o.mix_lambda) * rkv_redundancy(
            keys, o.similarity
        )
