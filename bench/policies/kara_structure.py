"""Kara that keeps the answer's structure: line heads and boxed answers (a long-answer variant,
not shipped).

Idea
    Where Kara loses long answers that full KV gets right, a quarter of the losses are the model
    losing its place in its own list (a heading repeated or renumbered, the answer ending early):
    the entries that mark where the answer stands -- the first tokens of each line ("**Problem 6:**",
    "Step 3:", "1.") and the boxed results -- are among those a window's own queries do not single
    out. This policy scores and selects as Kara does, then forces those entries in: the first
    ``line_head`` tokens after each newline and the ``boxed_span`` tokens from each token
    containing ``boxed``, at most ``protect_share`` of the window's K (the best-scored of them when
    more are marked); the rest of K goes to Kara's own choice, by score. Exactly K entries are kept
    (Kara's KV at every step).

Parameters: Kara's (flags --kara-structure-<name>), and
    line_head      tokens kept after each newline (3; 0: none)
    boxed_span     tokens kept from a ``boxed`` token on (8; 0: none)
    protect_share  most of K the marked entries may take, in (0, 1] (0.5)

Run it with the long-answer harness: ``--policy-file bench/policies/kara_structure.py --configs
kara_structure``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sgl_kara.policies.base import need, register
from sgl_kara.policies.kara import KaraOptions, KaraPolicy


def vocabulary_marks(pieces) -> tuple[torch.Tensor, torch.Tensor]:
    """(newline [V] bool, boxed [V] bool) of each token id's text."""
    newline = torch.tensor(["\n" in p for p in pieces], dtype=torch.bool)
    boxed = torch.tensor(["boxed" in p for p in pieces], dtype=torch.bool)
    return newline, boxed


def _after(mark: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """[B, M] bool: positions j with ``mark`` at some j - t, first <= t <= last."""
    out = torch.zeros_like(mark)
    m = mark.shape[1]
    for t in range(first, min(last, m - 1) + 1):
        out[:, t:] |= mark[:, : m - t]
    return out


def structure_mask(
    tokens: torch.Tensor,
    newline: torch.Tensor,
    boxed: torch.Tensor,
    line_head: int,
    boxed_span: int,
) -> torch.Tensor:
    """[B, M] bool: the first ``line_head`` tokens after each newline token and the ``boxed_span``
    tokens from each boxed token on. ``tokens`` [B, M] int64 (an id past the tables marks
    nothing); ``newline`` / ``boxed`` [V] bool on the tokens' device."""
    known = tokens < newline.shape[0]
    ids = torch.where(known, tokens, torch.zeros_like(tokens))
    nl = newline[ids] & known
    bx = boxed[ids] & known
    marked = torch.zeros_like(nl)
    if line_head > 0:
        marked |= _after(nl, 1, line_head)
    if boxed_span > 0:
        marked |= bx | _after(bx, 1, boxed_span - 1)
    return marked


def select_protecting(
    scores: torch.Tensor, keep: int, marked: torch.Tensor, cap: int, kara_select
) -> torch.Tensor:
    """Kara's selection with marked entries forced in.

    scores [B, L, H, M]; marked [B, M]; the best-scored ``cap`` marked entries of each (layer,
    head) are kept first, then Kara's own choice by score, then the rest by score, to ``keep``.
    Returns sorted kept indices int64 [B, L, H, keep]."""
    b, lyr, h, m = scores.shape
    if keep >= m:
        return kara_select(scores, keep)
    n = lyr * h
    a = scores.reshape(b, n, m).float()
    mk = marked[:, None, :].expand(b, n, m)
    by_score = torch.sort(a, dim=2, descending=True, stable=True).indices
    # the best `cap` marked entries of each row
    mk_sorted = mk.gather(2, by_score)
    forced_sorted = mk_sorted & (torch.cumsum(mk_sorted.int(), dim=2) <= cap)
    forced = torch.zeros_like(mk).scatter(2, by_score, forced_sorted)
    chosen = torch.zeros_like(mk)
    chosen.scatter_(2, kara_select(scores, keep).reshape(b, n, keep), True)
    rank = (
        forced.int() * 2 + chosen.int()
    )  # forced first, then Kara's choice, then the rest
    order = by_score.gather(
        2,
        torch.sort(
            rank.gather(2, by_score), dim=2, descending=True, stable=True
        ).indices,
    )
    out = order[..., :keep]
    return torch.sort(out, dim=2).values.reshape(b, lyr, h, keep)


def select_protecting_ref(
    scores_1d: torch.Tensor, keep: int, marked: list[bool], cap: int, kara_select
) -> list[int]:
    """Plain-Python ``select_protecting`` for one row [M], from the description."""
    a = [float(x) for x in scores_1d.tolist()]
    m = len(a)
    if keep >= m:
        return list(range(m))
    by_score = sorted(range(m), key=lambda j: (-a[j], j))
    forced = [j for j in by_score if marked[j]][:cap]
    chosen = set(kara_select(scores_1d[None, None, None], keep)[0, 0, 0].tolist())
    order = forced + [j for j in by_score if j in chosen and j not in forced]
    order += [j for j in by_score if j not in order]
    return sorted(order[:keep])


@dataclass(frozen=True)
class StructureOptions(KaraOptions):
    line_head: int = field(
        default=3, metadata={"help": "tokens kept after each newline (0: none)"}
    )
    boxed_span: int = field(
        default=8, metadata={"help": "tokens kept from each boxed token on (0: none)"}
    )
    protect_share: float = field(
        default=0.5, metadata={"help": "most of K the marked entries take, in (0, 1]"}
    )

    def __post_init__(self):
        super().__post_init__()
        need(
            0 <= self.line_head <= 64, "line_head", "must be in [0, 64]", self.line_head
        )
        need(
            0 <= self.boxed_span <= 64,
            "boxed_span",
            "must be in [0, 64]",
            self.boxed_span,
        )
        need(
            0.0 < self.protect_share <= 1.0,
            "protect_share",
            "must be in (0, 1]",
            self.protect_share,
        )


@register
class KaraStructurePolicy(KaraPolicy):
    """Kara's windows and scores; line heads and boxed answers kept first."""

    name = "kara_structure"
    prefix = "structure_"
    Options = StructureOptions
    needs_tokens = True

    def __init__(self, options):
        super().__init__(options)
        self._newline = self._boxed = None

    def bind_vocabulary(self, pieces) -> None:
        self._newline, self._boxed = vocabulary_marks(pieces)

    def select(self, scores: torch.Tensor, keep: int, tokens=None) -> torch.Tensor:
        if tokens is None or self._newline is None:
            raise RuntimeError(
                "kara_structure selects with the region's token ids and the model's "
                "vocabulary (the runtime passes both: needs_tokens)"
            )
        if self._newline.device != tokens.device:
            self._newline = self._newline.to(tokens.device)
            self._boxed = self._boxed.to(tokens.device)
        o = self.options
        marked = structure_mask(
            tokens.long(), self._newline, self._boxed, o.line_head, o.boxed_span
        )
        cap = math.floor(o.protect_share * keep)
        return select_protecting(scores, keep, marked, cap, super().select)
