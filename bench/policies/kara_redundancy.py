"""Kara with R-KV's redundancy term in its window score (a long-answer variant, not shipped).

Idea
    Kara keeps the top entries of each window by bidirectional attention (its Eq. 4 score A),
    so two near-copies of one key that both draw attention are both kept. R-KV subtracts a
    redundancy term: a key that many others in the candidate set resemble carries little new
    information. Here each window's compressible keys get

        score_j = lambda * A_j / sum(A) - (1 - lambda) * redundancy_j

    with ``redundancy`` R-KV's (softmax over the window's keys of their mean cosine similarity to
    the others, each key's most recent similar key exempted: sgl_kara/policies/rkv.py) and
    lambda R-KV's default weight. Windows, schedule, K and Token2Chunk are Kara's, so the KV it
    holds equals Kara's at every step.

Paper
    Kara (seed 000, Eq. 4) and R-KV (Cai et al. 2025, its score and defaults).

Parameters: Kara's (flags --kara-redundancy-<name>), and
    mix_lambda   weight of attention against redundancy, in [0, 1] (0.07, R-KV's)
    similarity   cosine similarity above which two keys are redundant, in (-1, 1) (0.5)

Run it with the long-answer harness: ``--policy-file bench/policies/kara_redundancy.py
--configs kara_redundancy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sgl_kara.policies.base import ScoreInput, register
from sgl_kara.policies.kara import KaraOptions, KaraPolicy
from sgl_kara.policies.rkv import check_mix, rkv_redundancy


def redundancy_score(
    attention: torch.Tensor, keys: torch.Tensor, mix_lambda: float, similarity: float
) -> torch.Tensor:
    """attention [B, H_kv, M] (Kara's window score), keys [B, M, H_kv, D] -> [B, H_kv, M]:
    the attention share less R-KV's redundancy, weighted by ``mix_lambda``."""
    share = attention / attention.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return mix_lambda * share - (1.0 - mix_lambda) * rkv_redundancy(keys, similarity)


@dataclass(frozen=True)
class RedundancyOptions(KaraOptions):
    mix_lambda: float = field(
        default=0.07,
        metadata={"help": "weight of attention against redundancy, in [0, 1]"},
    )
    similarity: float = field(
        default=0.5,
        metadata={"help": "cosine similarity above which keys are redundant"},
    )

    def __post_init__(self):
        super().__post_init__()
        check_mix(self.mix_lambda, self.similarity)


@register
class KaraRedundancyPolicy(KaraPolicy):
    """Kara's windows and selection; its score less R-KV's redundancy."""

    name = "kara_redundancy"
    prefix = "redundancy_"
    Options = RedundancyOptions
    additive = False  # the redundancy term is not a sum over queries

    def score(self, inp: ScoreInput) -> torch.Tensor:
        o = self.options
        return redundancy_score(
            super().score(inp), inp.keys(), o.mix_lambda, o.similarity
        )
