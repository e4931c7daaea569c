"""The long-answer variants of Kara under trial (bench/policies/): each scores or selects as its
file says, against a plain-Python reference, keeping exactly Kara's K. Pure, no engine."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from support import policy_registry_restored

from sgl_kara.policies import base
from sgl_kara.policies.base import OptionError
from sgl_kara.policies.kara import select as kara_select_fn
from sgl_kara.policies.rkv import rkv_redundancy


@pytest.fixture
def variants():
    """The modules, imported (and registered) for this test only."""
    with policy_registry_restored():
        mods = []
        for n in ("kara_redundancy", "kara_structure", "kara_global", "kara_together"):
            name = f"bench.policies.{n}"
            # imported before: import again, to register again
            mod = sys.modules.get(name)
            mods.append(importlib.reload(mod) if mod else importlib.import_module(name))
        yield mods


def _kara_select():
    def sel(scores, keep):
        m = scores.shape[-1]
        return kara_select_fn(scores, keep / m, min(4, keep - 1), 8)

    return sel


def test_redundancy_score_is_the_attention_share_less_redundancy(variants):
    red, *_ = variants
    g = torch.Generator().manual_seed(0)
    att = torch.rand(2, 3, 20, generator=g)
    keys = torch.randn(2, 20, 3, 8, generator=g)
    got = red.redundancy_score(att, keys, 0.25, 0.5)
    share = att / att.sum(-1, keepdim=True)
    want = 0.25 * share - 0.75 * rkv_redundancy(keys, 0.5)
    torch.testing.assert_close(got, want)
    # lambda 1: Kara's ranking
    only = red.redundancy_score(att, keys, 1.0, 0.5)
    assert torch.equal(only.argsort(-1), att.argsort(-1))
    # a key repeated many times ranks below a distinct one of equal attention
    k = torch.zeros(1, 6, 1, 4)
    k[0, :5, 0] = torch.tensor([1.0, 0, 0, 0])
    k[0, 5, 0] = torch.tensor([0, 1.0, 0, 0])
    s = red.redundancy_score(torch.ones(1, 1, 6), k, 0.07, 0.5)
    assert s[0, 0, 5] > s[0, 0, :4].max()


def test_structure_marks_line_heads_and_boxed_spans(variants):
    _, st, *_ = variants
    pieces = [
        "a",
        "\n",
        "**",
        "Problem",
        " 6",
        ":**",
        "\\boxed",
        "{",
        "4",
        "2",
        "}",
        "x",
    ]
    newline, boxed = st.vocabulary_marks(pieces)
    assert newline.tolist() == [p == "\n" for p in pieces]
    toks = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 6, 7, 8, 9, 10, 11, 0, 99]])
    mask = st.structure_mask(toks, newline, boxed, line_head=3, boxed_span=5)
    marked = [i for i, v in enumerate(mask[0].tolist()) if v]
    assert marked == [2, 3, 4, 7, 8, 9, 10, 11]  # three after the newline; boxed + 4 on
    assert not st.structure_mask(toks, newline, boxed, 0, 0).any()


@pytest.mark.parametrize("seed", range(6))
def test_protected_selection_matches_its_reference_and_keeps_k(variants, seed):
    _, st, *_ = variants
    g = torch.Generator().manual_seed(seed)
    b, lyr, h, m = 2, 2, 3, 40
    scores = torch.rand(b, lyr, h, m, generator=g)
    marked = torch.rand(b, m, generator=g) < 0.3
    sel = _kara_select()
    for keep, cap in ((10, 5), (10, 0), (10, 10), (39, 20), (40, 3)):
        got = st.select_protecting(scores, keep, marked, cap, sel)
        assert got.shape == (b, lyr, h, keep)
        for i in range(b):
            for layer in range(lyr):
                for head in range(h):
                    ref = st.select_protecting_ref(
                        scores[i, layer, head], keep, marked[i].tolist(), cap, sel
                    )
                    assert got[i, layer, head].tolist() == ref
        if cap == 0:
            assert torch.equal(got, sel(scores, keep))  # nothing forced: Kara's choice
        if keep < m:  # the best-scored `cap` marked entries are all kept
            for i in range(b):
                a = scores[i, 0, 0]
                mk = [j for j in a.argsort(descending=True).tolist() if marked[i, j]]
                assert set(mk[:cap]) <= set(got[i, 0, 0].tolist())


def test_variant_options_name_the_bad_field(variants):
    red, st, *_ = variants
    with pytest.raises(OptionError) as e:
        red.RedundancyOptions(mix_lambda=1.5)
    assert e.value.field == "mix_lambda"
    with pytest.raises(OptionError) as e:
        st.StructureOptions(protect_share=0.0)
    assert e.value.field == "protect_share"
    assert base.policy_class("kara_structure").needs_tokens
    assert not base.policy_class("kara_redundancy").additive


class _State:
    def __init__(self):
        self.request = {}


def test_global_region_widens_kara_window_to_every_generated_row(variants):
    _, _, gl, _ = variants
    from sgl_kara.policies.base import RowView
    from sgl_kara.policies.kara import KaraOptions, KaraPolicy, kept_count

    opts = dict(window=64, buffer=8, retention=0.25, period=8)
    kara = KaraPolicy(KaraOptions(**opts))
    glob = base.policy_class("kara_global")(gl.KaraGlobalPolicy.Options(**opts))
    k = kept_count(56, 0.25)
    # P = 40 prompt rows, three windows compressed before (f = 40 + 3K), a full window + more
    for f, length in ((40, 40 + 64), (40 + 3 * k, 40 + 3 * k + 70)):
        row = RowView(40, f, length, 0, _State())
        want, got = kara.region(row), glob.region(row)
        assert (got.start, got.length, got.keep) == (40, f - 40 + 56, f - 40 + k)
        # the same rows dropped, the same queries, the same frontier after the event
        assert got.length - got.keep == want.length - want.keep
        assert (got.query_start, got.query_len) == (want.query_start, want.query_len)
        assert got.start + got.keep == want.start + want.keep
    # not due: no region either way
    assert glob.region(RowView(40, 40, 40 + 63, 0, _State())) is None
    # per-request retention keeps Kara's K for the window part
    st = _State()
    st.request["retention"] = 0.5
    r = glob.region(RowView(40, 50, 50 + 64, 0, st))
    assert r.keep == 10 + kept_count(56, 0.5)


def _rows(policy, tags, p=40, extra=(0, 70)):
    """RowViews of requests due now, request i naming variant ``tags[i]`` by its retention;
    window-aligned frontiers with 0 or 3 windows compressed before."""
    from bench.policies.kara_together import retention_of
    from sgl_kara.policies.base import RowView

    o = policy.options
    rows = []
    for i, tag in enumerate(tags):
        st = _State()
        st.request["retention"] = retention_of(o.retention, tag, o.compressible)
        f = p + (3 * o.kept_per_window if i % 2 else 0)
        rows.append(RowView(p, f, f + o.window + extra[i % 2], 0, st))
    return rows


def _scores_as_alone(pol, alone, rows, regions, tags, g):
    """Score the requests one batch per region shape, as the runtime batches them (some batch
    mixing tags), and check each request's scores against ``alone[its tag]`` scoring it by
    itself. Returns the batches (lists of request indices)."""
    from sgl_kara.policies.base import ScoreInput

    s, h_kv, h_q, d = 400, 2, 4, 16
    k_buffer = torch.randn(s, h_kv, d, generator=g)
    shapes = {}
    for b, reg in enumerate(regions):
        shapes.setdefault(reg.shape, []).append(b)
    assert any(len({tags[b] for b in idx}) > 1 for idx in shapes.values())
    for idx in shapes.values():
        m, _, q = regions[idx[0]].shape
        slots = torch.stack([torch.randperm(s, generator=g)[:m] for _ in idx])
        queries = torch.randn(len(idx), q, h_q, d, generator=g)
        rows_b, regs = [rows[b] for b in idx], [regions[b] for b in idx]
        got = pol.score(ScoreInput(0, queries, k_buffer, slots, rows_b, regs))
        for n, b in enumerate(idx):
            one = ScoreInput(
                0,
                queries[n : n + 1],
                k_buffer,
                slots[n : n + 1],
                [rows[b]],
                [regions[b]],
            )
            want = alone[tags[b]].score(one)
            assert torch.allclose(got[n : n + 1], want, rtol=1e-6, atol=1e-7)
    return list(shapes.values())


def test_together_serves_each_request_as_its_variant_alone(variants):
    """Kara, kara_redundancy and kara_global requests in one batch: each one's region and score
    are those of an engine of its own variant, and its K is Kara's at r."""
    from sgl_kara.policies.kara import KaraOptions, KaraPolicy

    *_, tg = variants
    opts = dict(window=64, buffer=8, retention=0.2, period=8)
    pol = base.policy_class("kara_together")(
        tg.TogetherOptions(**opts, variants="kara_redundancy,kara_global")
    )
    alone = [KaraPolicy(KaraOptions(**opts))] + [
        base.policy_class(n)(base.policy_class(n).Options(**opts))
        for n in ("kara_redundancy", "kara_global")
    ]
    tags = [0, 1, 2, 1, 0, 2]
    rows = _rows(pol, tags)
    regions = [pol.region(r) for r in rows]
    for r, t, reg in zip(rows, tags, regions):
        assert reg == alone[t].region(r)
        assert reg.length - reg.keep == 56 - alone[0].options.kept_per_window
    g = torch.Generator().manual_seed(0)
    for idx in _scores_as_alone(pol, alone, rows, regions, tags, g):
        m, keep = regions[idx[0]].shape[0], regions[idx[0]].keep
        sel = torch.rand(len(idx), 2, 2, m, generator=g)
        assert torch.equal(pol.select(sel, keep), alone[0].select(sel, keep))


def test_together_refuses_what_cannot_share_karas_engine(variants):
    *_, tg = variants
    opts = dict(window=64, buffer=8, retention=0.2, period=8)
    cls = base.policy_class("kara_together")
    for names in ("kara_structure", "snapkv", "nothing", "kara_together"):
        with pytest.raises(OptionError) as e:
            cls(tg.TogetherOptions(**opts, variants=names))
        assert e.value.field == "variants", names
    # W 2000, U 32, r 0.2: K = ceil(393.6) = 394; four tags above reach 393.68 + 0.79 > 394
    # and four below 393.6 - 0.79 < 393, so no direction keeps K
    with pytest.raises(OptionError) as e:
        tg.TogetherOptions(
            **dict(opts, window=2000, buffer=32, period=32, retention=0.2),
            variants="kara_global,kara_redundancy,kara_global,kara_redundancy",
        )
    assert "changes K" in str(e.value)
    # a retention with a fourth decimal cannot carry tags
    with pytest.raises(OptionError, match="multiple of 0.001"):
        tg.TogetherOptions(**dict(opts, retention=0.2004), variants="kara_global")
    st = _State()
    st.request["retention"] = 0.2005  # tag 5 of one variant
    pol = cls(tg.TogetherOptions(**opts, variants="kara_global"))
    from sgl_kara.policies.base import RowView

    with pytest.raises(ValueError, match="names no variant"):
        pol.region(RowView(40, 40, 40 + 64, 0, st))


def test_tags_step_below_r_where_a_tag_above_would_change_k(variants):
    """r (W - U) a whole number (0.25 of 56 keeps 14, 0.4 of 480 keeps 192): a tag above r would
    keep one more, so the tags name r - i * TAG; otherwise they name r + i * TAG."""
    from sgl_kara.policies.base import RowView
    from sgl_kara.policies.kara import kept_count

    *_, tg = variants
    for compressible, r, down in ((56, 0.25, True), (480, 0.4, True), (56, 0.2, False)):
        tg.check_tags(compressible, r, 3, "")
        for tag in range(3):
            named = tg.retention_of(r, tag, compressible)
            assert named == round(r + (-tag if down else tag) * tg.TAG, 6)
            assert tg.tag_of(named) == tag
            assert kept_count(compressible, named) == kept_count(compressible, r)
    opts = dict(window=64, buffer=8, retention=0.25, period=8)
    pol = base.policy_class("kara_together")(
        tg.TogetherOptions(**opts, variants="kara_global")
    )
    st = _State()
    st.request["retention"] = 0.2499
    assert pol.chosen(RowView(40, 40, 40 + 64, 0, st)) is pol.variants[1]


def _matched_rows(tags, p=40):
    """RowViews of threshold requests matched to Kara (W 64, U 8, r 0.2, delta 8), request i
    naming baseline ``tags[i]`` by its match_kara retention, each past Kara's target."""
    from bench.policies.kara_together import retention_of
    from sgl_kara.policies.base import RowView

    rows = []
    for i, tag in enumerate(tags):
        st = _State()
        spec = dict(window=64, buffer=8, retention=retention_of(0.2, tag, 56), period=8)
        st.request["match_kara"] = dict(spec, recent=0)
        length = p + 120 + 7 * (i % 2)
        rows.append(RowView(p, p + 20, length, 0, st))
    return rows


def test_threshold_together_serves_each_request_as_its_baseline_alone(variants):
    """R-KV and SnapKV requests matched to Kara in one batch: each one's region and score are
    those of an engine of its own baseline (its window min(its default, the engine's)), and its
    kept rows are Kara's target whatever its tag."""
    from sgl_kara.policies.threshold import target

    *_, tg = variants
    pol = base.policy_class("threshold_together")(
        tg.ThresholdTogetherOptions(
            window=8, budget=16, threshold=72, variants="rkv,snapkv"
        )
    )
    rkv, snap = base.policy_class("rkv"), base.policy_class("snapkv")
    alone = [
        rkv(rkv.Options(window=8, budget=16, threshold=72)),
        snap(snap.Options(window=8, budget=16, threshold=72)),
    ]
    tags = [0, 1, 1, 0, 1, 0]
    rows = _matched_rows(tags)
    regions = [pol.region(r) for r in rows]
    assert all(reg is not None for reg in regions)
    for r, t, reg in zip(rows, tags, regions):
        assert reg == alone[t].region(r)
        assert reg.start + reg.keep + 8 == r.protected + target(r)
    assert target(rows[0]) == target(_matched_rows([0])[0]) == target(rows[4])
    _scores_as_alone(pol, alone, rows, regions, tags, torch.Generator().manual_seed(1))
    # R-KV's default window is 8: with the engine's window 32 it keeps its own 8
    wide = base.policy_class("threshold_together")(
        tg.ThresholdTogetherOptions(
            window=32, budget=40, threshold=96, variants="rkv,snapkv"
        )
    )
    assert [v.options.window for v in wide.variants] == [8, 32]


def test_threshold_together_refuses_what_cannot_share_its_engine(variants):
    *_, tg = variants
    cls = base.policy_class("threshold_together")
    opts = dict(window=8, budget=16, threshold=72)
    for names in ("kara", "h2o", "nothing", "threshold_together", "", "rkv," * 6):
        with pytest.raises(OptionError) as e:
            cls(tg.ThresholdTogetherOptions(**opts, variants=names))
        assert e.value.field == "variants", names
    pol = cls(tg.ThresholdTogetherOptions(**opts, variants="rkv"))
    from sgl_kara.policies.base import RowView

    (row,) = _matched_rows([1])  # tag 1 of one baseline
    with pytest.raises(ValueError, match="names no variant"):
        pol.region(row)
    with pytest.raises(ValueError, match="match_kara"):
        pol.region(RowView(40, 40, 200, 0, _State()))
