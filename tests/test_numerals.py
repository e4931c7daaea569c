"""kara_numerals (sgl_kara/policies/numerals.py): Kara's selection with numerals kept whole.
Against a plain-Python reference written from the description, and the invariants: exactly K kept,
every numeral kept or dropped whole, Kara's selection where no numeral stands."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support import TEST_VOCABULARY, make_policy

from sgl_kara.policies.kara import select as kara_select_fn
from sgl_kara.policies.numerals import (
    numeral_groups,
    numeral_mask,
    select_whole,
    select_whole_ref,
    vocabulary_masks,
)

DIGIT, SEP = vocabulary_masks(TEST_VOCABULARY)
DOT, COMMA, WORD = 10, 11, 12


def _kara(chunk_budget=4, max_chunk=8):
    def run(s, k):
        m = s.shape[-1]
        return kara_select_fn(s, k / m, min(chunk_budget, k - 1), max_chunk)

    return run


def test_vocabulary_masks_read_digits_and_separators():
    digit, sep = vocabulary_masks(
        ["12", " 7", "3", "a1", "1a", "", ".", ",", " .", "x"]
    )
    assert digit.tolist() == [True, True, True] + [False] * 7
    assert sep.tolist() == [False] * 6 + [True, True, False, False]


def test_a_separator_belongs_to_a_numeral_only_between_digits():
    # 4 . 5 w  | . 5 w , | 4 . w 3 , 3
    rows = torch.tensor(
        [
            [4, DOT, 5, WORD, WORD, WORD],
            [DOT, 5, WORD, COMMA, WORD, WORD],
            [4, DOT, WORD, 3, COMMA, 3],
        ]
    )
    got = numeral_mask(rows, DIGIT, SEP).tolist()
    assert got[0] == [True, True, True, False, False, False]
    assert got[1] == [False, True, False, False, False, False]
    assert got[2] == [True, False, False, True, True, True]
    # ids past the vocabulary are no numeral
    assert not numeral_mask(torch.tensor([[999, 1000]]), DIGIT, SEP).any()


def test_groups_name_runs_by_their_first_position_and_cap_long_runs():
    mask = torch.tensor([[False, True, True, False, True, True, True, True, False]])
    assert numeral_groups(mask, 16).tolist() == [[0, 1, 1, 3, 4, 4, 4, 4, 8]]
    # a run longer than max_len: every token its own group
    assert numeral_groups(mask, 3).tolist() == [[0, 1, 1, 3, 4, 5, 6, 7, 8]]


def _groups(tokens, max_len=16):
    return numeral_groups(numeral_mask(tokens, DIGIT, SEP), max_len)


@pytest.mark.parametrize("seed", range(12))
def test_selection_matches_the_reference_and_keeps_numerals_whole(seed):
    g = torch.Generator().manual_seed(seed)
    b, layers, heads, m = 2, 2, 3, 48
    # numeral-heavy tokens: about half digits, some separators
    tokens = torch.where(
        torch.rand(b, m, generator=g) < 0.5,
        torch.randint(0, 12, (b, m), generator=g),
        torch.randint(12, len(TEST_VOCABULARY), (b, m), generator=g),
    )
    group = _groups(tokens)
    scores = torch.rand(b, layers, heads, m, generator=g)
    kara = _kara()
    for keep in (10, 17, 30, m):
        got = select_whole(scores, keep, group, kara)
        assert got.shape == (b, layers, heads, keep) and got.dtype == torch.int64
        assert (got.diff(dim=-1) > 0).all()
        for i in range(b):
            members: dict[int, list[int]] = {}
            for j, gj in enumerate(group[i].tolist()):
                members.setdefault(gj, []).append(j)
            singles = sum(len(v) == 1 for v in members.values())
            for lyr in range(layers):
                for h in range(heads):
                    want = select_whole_ref(
                        scores[i, lyr, h], keep, group[i].tolist(), kara
                    )
                    assert got[i, lyr, h].tolist() == want
                    kept = set(want)
                    whole = all(
                        len(kept & set(js)) in (0, len(js)) for js in members.values()
                    )
                    # whole unless the tokens outside numerals ran out
                    assert whole or singles < keep


def test_without_numerals_it_is_karas_selection():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(12, len(TEST_VOCABULARY), (2, 40), generator=g)
    scores = torch.rand(2, 3, 2, 40, generator=g)
    kara = _kara()
    for keep in (5, 16, 39):
        assert torch.equal(
            select_whole(scores, keep, _groups(tokens), kara), kara(scores, keep)
        )


def test_a_number_karas_selection_would_cut_is_kept_whole():
    """ "... w 4 0 w ...": the 4 scores high, the 0 low. Kara keeps the 4 alone (the cache then
    reads a different number); kara_numerals keeps 4 and 0, at the same count."""
    m = 12
    tokens = torch.tensor([[WORD] * 5 + [4, 0] + [WORD] * 5])
    scores = torch.full((1, 1, 1, m), 0.1)
    scores[..., 5] = 0.9  # "4"
    scores[..., 6] = 0.05  # "0"
    scores[..., 0] = 0.8
    scores[..., 11] = 0.7
    kara = _kara(chunk_budget=0)
    assert kara(scores, 3)[0, 0, 0].tolist() == [0, 5, 11]
    assert select_whole(scores, 3, _groups(tokens), kara)[0, 0, 0].tolist() == [0, 5, 6]


def test_the_policy_needs_tokens_and_its_vocabulary():
    policy = make_policy("kara_numerals", window=64, buffer=16, period=8)
    assert policy.needs_tokens and policy.region is not None
    scores = torch.rand(1, 2, 2, 48)
    with pytest.raises(RuntimeError, match="token ids"):
        policy.select(scores, 10)
    tokens = torch.tensor(
        [[4, 0] * 24]
    )  # every token in one numeral run of 48 > max 16
    kept = policy.select(scores, 10, tokens=tokens)
    assert kept.shape == (1, 2, 2, 10)
    with pytest.raises(Exception, match="max_numeral"):
        make_policy("kara_numerals", max_numeral=0)


def test_events_read_each_regions_tokens_at_its_logical_positions():
    """Row p of a region in the uncompressed tail holds token p + pos_offset."""
    from sgl_kara.policies.base import Region
    from sgl_kara.scheduler.events import EventRunner

    req = SimpleNamespace(origin_input_ids=[100, 101, 102], output_ids=list(range(40)))
    job = SimpleNamespace(
        req=req,
        region=Region(start=6, length=4, keep=2),
        state=SimpleNamespace(pos_offset=5),
    )
    runner = SimpleNamespace(staging=SimpleNamespace(to_device=torch.tensor))
    got = EventRunner._region_tokens(runner, [job, job], 4)
    # logical positions 11..14 = output tokens 8..11
    assert got.tolist() == [[8, 9, 10, 11]] * 2


def test_the_tokenizer_is_read_once_and_a_missing_one_refused(tiny_llama, tmp_path):
    from sgl_kara.config import KaraConfig
    from sgl_kara.startup import UnsupportedFeature, check_vocabulary
    from sgl_kara.vocabulary import token_pieces

    pieces = token_pieces(tiny_llama)
    assert len(pieces) >= 256 and all(isinstance(p, str) for p in pieces)
    assert any(p.strip().isdigit() for p in pieces)
    cfg = KaraConfig.build(policy="kara_numerals")
    check_vocabulary(SimpleNamespace(model_path=tiny_llama, revision=None), cfg)
    with pytest.raises(
        UnsupportedFeature, match="--kara-policy kara_numerals: no tokenizer"
    ):
        check_vocabulary(SimpleNamespace(model_path=str(tmp_path), revision=None), cfg)
    # other policies never read it
    check_vocabulary(
        SimpleNamespace(model_path=str(tmp_path), revision=None), KaraConfig.build()
    )
