"""Kara with numerals kept whole: a number's tokens are kept or dropped together.

Idea
    Kara's selection is per token. A number the model wrote spans several tokens where the
    tokenizer splits digits (Qwen2 / Qwen2.5: one token per digit; Llama 3: up to three), and a
    selection that keeps "4" of "40" but drops "0" leaves a different number in the cache: a
    later step that reads it back recalls a wrong value, which is worse than recalling none
    (the model then derives it again). This policy scores and selects as Kara does, with one
    change: the tokens of a numeral -- a run of digit tokens, with a "." or "," between two
    digit tokens -- count as one unit. Each token of a run takes the run's highest score, so
    the run ranks as a unit; a run the selection still cuts (at the budget's edge, or inside a
    Token2Chunk interior) is dropped whole and its entries go to the best-scored tokens outside
    numerals. Exactly as many entries are kept as Kara keeps (equal KV). Runs longer than
    ``max_numeral`` tokens (hashes, long ids) are left to per-token selection.

Where it matters
    Answers that reuse their own results from far back: on chained problems Kara's recall of
    an earlier answer is one digit off for about a quarter of the values it states
    (bench/RESULTS.md, long answers).

Parameters: Kara's (flags --kara-numerals-<name>), and
    max_numeral        longest run of tokens kept as one unit (16)

Tie-breaking and device behaviour as Kara's: no host sync in ``select``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .base import need, register
from .kara import KaraOptions, KaraPolicy

NUMERAL = re.compile(r"^\s*\d+$")  # a token's text: digits, after at most leading space
SEPARATORS = (".", ",")  # inside a numeral when a digit token stands on both sides


def vocabulary_masks(pieces) -> tuple[torch.Tensor, torch.Tensor]:
    """(digit [V] bool, separator [V] bool) of each token id's text."""
    digit = torch.tensor([bool(NUMERAL.match(p)) for p in pieces], dtype=torch.bool)
    sep = torch.tensor([p in SEPARATORS for p in pieces], dtype=torch.bool)
    return digit, sep


def numeral_mask(
    tokens: torch.Tensor, digit: torch.Tensor, sep: torch.Tensor
) -> torch.Tensor:
    """[B, M] bool: which tokens belong to a numeral. ``tokens`` [B, M] int64 ids (an id past
    the tables is no numeral); ``digit`` / ``sep`` [V] bool on the tokens' device."""
    v = digit.shape[0]
    known = tokens < v
    ids = torch.where(known, tokens, torch.zeros_like(tokens))
    d = digit[ids] & known
    s = sep[ids] & known
    false = torch.zeros_like(d[:, :1])
    left = torch.cat([false, d[:, :-1]], dim=1)
    right = torch.cat([d[:, 1:], false], dim=1)
    return d | (s & left & right)


def numeral_groups(mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, M] int64: each token's group, named by the group's first position. A run of
    numeral tokens of at most ``max_len`` is one group; every other token is its own."""
    b, m = mask.shape
    idx = torch.arange(m, device=mask.device).expand(b, m)
    prev = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    start = mask & ~prev
    first = torch.cummax(torch.where(start, idx, torch.full_like(idx, -1)), dim=1)
    group = torch.where(mask, first.values, idx)
    size = torch.zeros_like(idx).scatter_add(1, group, torch.ones_like(idx))
    return torch.where(size.gather(1, group) > max_len, idx, group)


def select_whole(
    scores: torch.Tensor, keep: int, group: torch.Tensor, kara_select
) -> torch.Tensor:
    """Kara's selection with each group kept or dropped whole.

    scores [B, L, H, M]; group [B, M] (numeral_groups); ``kara_select(scores, keep)`` Kara's
    selection. Returns sorted kept indices int64 [B, L, H, keep]."""
    b, lyr, h, m = scores.shape
    if keep >= m:
        return kara_select(scores, keep)
    n = lyr * h
    a = scores.reshape(b, n, m).float()
    g = group[:, None, :].expand(b, n, m)
    pooled = torch.full_like(a, float("-inf")).scatter_reduce(
        2, g, a, reduce="amax", include_self=True
    )
    pooled = pooled.gather(2, g)  # each token: its group's highest score
    first = kara_select(pooled.reshape(b, lyr, h, m), keep).reshape(b, n, keep)
    kept = torch.zeros(b, n, m, dtype=torch.bool, device=scores.device)
    kept.scatter_(2, first, True)
    ones = torch.ones_like(group)
    size = torch.zeros_like(group).scatter_add(1, group, ones).gather(1, group)
    held = torch.zeros(b, n, m, dtype=torch.int64, device=scores.device)
    held = held.scatter_add(2, g, kept.long()).gather(2, g)
    kept = kept & (
        held == size[:, None, :]
    )  # a group cut by the selection: dropped whole
    # refill with the best-scored tokens outside numerals, then (if those run out) any token
    order = torch.sort(pooled, dim=2, descending=True, stable=True).indices
    single = (size == 1)[:, None, :].expand(b, n, m).gather(2, order)
    for allowed in (single, torch.ones_like(single)):
        free = ~kept.gather(2, order) & allowed
        short = keep - kept.sum(dim=2, keepdim=True)
        take = free & (torch.cumsum(free.int(), dim=2) <= short)
        kept = kept | torch.zeros_like(kept).scatter(2, order, take)
    out = torch.sort((~kept).int(), dim=2, stable=True).indices[..., :keep]
    return torch.sort(out, dim=2).values.reshape(b, lyr, h, keep)


def select_whole_ref(
    scores_1d: torch.Tensor, keep: int, group: list[int], kara_select
) -> list[int]:
    """Plain-Python ``select_whole`` for one row [M] (``group`` [M]), from the description."""
    a = [float(x) for x in scores_1d.tolist()]
    m = len(a)
    best: dict[int, float] = {}
    for j, gj in enumerate(group):
        best[gj] = max(best.get(gj, float("-inf")), a[j])
    pooled = [best[gj] for gj in group]
    if keep >= m:
        return list(range(m))
    kept = set(
        kara_select(torch.tensor(pooled)[None, None, None], keep)[0, 0, 0].tolist()
    )
    members: dict[int, list[int]] = {}
    for j, gj in enumerate(group):
        members.setdefault(gj, []).append(j)
    for js in members.values():
        if not all(j in kept for j in js):
            kept -= set(js)
    order = sorted(range(m), key=lambda j: (-pooled[j], j))
    for only_single in (True, False):
        for j in order:
            if len(kept) >= keep:
                break
            if j not in kept and (not only_single or len(members[group[j]]) == 1):
                kept.add(j)
    return sorted(kept)


@dataclass(frozen=True)
class NumeralsOptions(KaraOptions):
    max_numeral: int = field(
        default=16,
        metadata={
            "help": "longest run of numeral tokens kept or dropped as one unit; longer runs are selected per token"
        },
    )

    def __post_init__(self):
        super().__post_init__()
        need(
            1 <= self.max_numeral <= 256,
            "max_numeral",
            "must be an integer in [1, 256]",
            self.max_numeral,
        )


@register
class KaraNumeralsPolicy(KaraPolicy):
    """Kara's windows, scores and Token2Chunk, with numerals kept or dropped whole."""

    name = "kara_numerals"
    prefix = "numerals_"
    Options = NumeralsOptions
    needs_tokens = True

    def __init__(self, options):
        super().__init__(options)
        self._digit = self._sep = None

    def bind_vocabulary(self, pieces) -> None:
        self._digit, self._sep = vocabulary_masks(pieces)

    def select(self, scores: torch.Tensor, keep: int, tokens=None) -> torch.Tensor:
        if tokens is None or self._digit is None:
            raise RuntimeError(
                "kara_numerals selects with the region's token ids and the model's vocabulary "
                "(the runtime passes both: needs_tokens)"
            )
        # the tables move to the tokens' device once: at the CUDA warm-up (warm_up.py)
        if self._digit.device != tokens.device:
            self._digit = self._digit.to(tokens.device)
            self._sep = self._sep.to(tokens.device)
        mask = numeral_mask(tokens.long(), self._digit, self._sep)
        group = numeral_groups(mask, self.options.max_numeral)
        return select_whole(scores, keep, group, super().select)
