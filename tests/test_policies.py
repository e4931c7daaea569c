"""Kara / SnapKV / StreamingLLM selection policies: hand-worked cases + properties."""

import math
import random

import pytest
import torch

from sgl_kara.policies import (
    kept_count,
    select,
    select_ref,
    snapkv_scores,
    snapkv_select,
    streaming_select,
    window_scores,
)

# --------------------------------------------------------------------------- kept_count


def test_kept_count_float_robust():
    assert kept_count(100, 0.3) == 30  # 0.3 * 100 = 30.000000000000004
    assert kept_count(10, 0.7) == 7  # 0.7 * 10 = 7.000000000000001
    assert kept_count(100, 0.301) == 31
    assert kept_count(3, 0.01) == 1
    assert kept_count(1, 0.2) == 1
    assert kept_count(0, 0.5) == 0
    assert kept_count(57, 1.0) == 57


@pytest.mark.parametrize("r", [0.0, -0.1, 1.01])
def test_kept_count_rejects_bad_retention(r):
    with pytest.raises(ValueError, match="retention"):
        kept_count(10, r)


# --------------------------------------------------------------------------- hand-worked Token2Chunk


# M = 20, retention 0.5 -> K = 10; chunk_budget 4 -> K0 = 6 discrete candidates.
# Candidates I = {0, 2, 6, 9, 12, 13}; background 0.1 except position 15 (0.5, best fill).
#   pair     gap  interior  R = (A_i + A_j) * (gap - 1)
#   (0, 2)    2   {1}        (1.0 + 5.0) * 1 = 6
#   (2, 6)    4   {3,4,5}    (5.0 + 5.0) * 3 = 30   candidate only if gamma > 4
#   (6, 9)    3   {7,8}      (5.0 + 1.5) * 2 = 13
#   (9, 12)   3   {10,11}    (1.5 + 1.2) * 2 = 5.4
#   (12, 13)  1   {}         adjacent: never a candidate
def _hand_scores():
    a = torch.full((20,), 0.1)
    for i, v in {0: 1.0, 2: 5.0, 6: 5.0, 9: 1.5, 12: 1.2, 13: 1.1, 15: 0.5}.items():
        a[i] = v
    return a


def _both(a, r, cb, g):
    out = select(a, r, cb, g).tolist()
    assert out == select_ref(a, r, cb, g)
    return out


def test_gamma_filters_long_chunk():
    # gamma 4: (2, 6) has gap 4, not < 4 -> dropped; floor(4 / 2) = 2 chunks: (6,9), (0,2).
    # 6 + 3 interior = 9 kept, fill 1 with the best free position: 15.
    assert _both(_hand_scores(), 0.5, 4, 4) == [0, 1, 2, 6, 7, 8, 9, 12, 13, 15]


def test_gamma_admits_long_chunk_and_ranks_by_length():
    # gamma 5: (2, 6) qualifies and wins (R 30); floor(4 / 3) = 1 chunk.
    assert _both(_hand_scores(), 0.5, 4, 5) == [0, 2, 3, 4, 5, 6, 9, 12, 13, 15]


def test_chunk_ranking_uses_endpoint_scores():
    # retention 0.4 -> K = 8, budget 2 -> same K0 = 6 candidates; gamma 4: floor(2 / 2) = 1
    # chunk; (6, 9) (R 13) beats (0, 2) (R 6) and (9, 12) (R 5.4); 6 + 2 = K, no fill.
    assert _both(_hand_scores(), 0.4, 2, 4) == [0, 2, 6, 7, 8, 9, 12, 13]


def test_budget_fill_when_no_candidate():
    # Top-6 are the adjacent run 0..5: every gap is 1, so no chunk; fill 4 by score.
    a = torch.tensor([9.0, 8, 7, 6, 5, 4, 0, 0, 1, 0, 3, 0, 2, 0, 0, 0, 0, 0, 0, 0])
    # fill order: 10 (3), 12 (2), 8 (1), then ties at 0 -> lowest index 6.
    assert _both(a, 0.5, 4, 8) == [0, 1, 2, 3, 4, 5, 6, 8, 10, 12]


def test_adjacent_pairs_and_partial_interior():
    # I = {0, 1, 3}: (0, 1) adjacent, (1, 3) has interior {2}. budget 3, gamma 4:
    # floor(3 / 2) = 1 chunk -> +{2}; 4 kept, fill 2: index 7 (0.6) then 4 (0.2 tie, lowest).
    a = torch.tensor([1.0, 1.0, 0.2, 1.0, 0.2, 0.2, 0.2, 0.6, 0.2, 0.2, 0.2, 0.2])
    assert _both(a, 0.5, 3, 4) == [0, 1, 2, 3, 4, 7]


def test_tie_break_lower_chunk_first():
    # I = {0, 2, 4}: both chunks R = 2 * 1; one chunk allowed -> the lower one, {1}.
    a = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert _both(a, 0.4, 1, 3) == [0, 1, 2, 4]


def test_retention_one_keeps_all():
    a = torch.rand(3, 17)
    assert torch.equal(select(a, 1.0, 4, 8), torch.arange(17).expand(3, 17))
    assert select_ref(a[0], 1.0, 4, 8) == list(range(17))


def test_chunk_budget_zero_is_plain_topk():
    torch.manual_seed(1)
    a = torch.rand(5, 40)
    out = select(a, 0.25, 0, 8)
    ref = torch.sort(torch.topk(a, 10, dim=-1).indices, dim=-1).values
    assert torch.equal(out, ref)


def test_validation_names_parameter():
    a = torch.rand(20)
    with pytest.raises(ValueError, match="chunk_budget"):
        select(a, 0.5, 10, 8)  # K = 10
    with pytest.raises(ValueError, match="chunk_budget"):
        select_ref(a, 0.5, 12, 8)
    with pytest.raises(ValueError, match="max_chunk"):
        select(a, 0.5, 2, 2)
    with pytest.raises(ValueError, match="retention"):
        select(a, 0.0, 0, 8)


# --------------------------------------------------------------------------- properties


def _random_case(rng):
    m = rng.randint(1, 160)
    r = rng.choice([0.1, 0.2, 0.25, 0.3, 0.5, 0.7, 1.0, rng.uniform(0.05, 1.0)])
    k = kept_count(m, r)
    cb = rng.choice([0, 0, rng.randint(0, k - 1)])
    g = rng.randint(3, 12)
    return m, r, cb, g


def _random_scores(gen, shape, mode):
    if mode == 0:
        return torch.rand(shape, generator=gen)
    if mode == 1:  # many ties
        return torch.randint(0, 4, shape, generator=gen).float()
    return torch.softmax(3 * torch.randn(shape, generator=gen), -1).to(torch.bfloat16)


def test_select_properties_random():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for it in range(300):
        m, r, cb, g = _random_case(rng)
        n = rng.randint(1, 6)
        a = _random_scores(gen, (n, m), it % 3)
        k = kept_count(m, r)
        out = select(a, r, cb, g)
        assert out.shape == (n, k) and out.dtype == torch.int64
        order = torch.sort(a.float(), dim=-1, descending=True, stable=True).indices
        for i in range(n):
            row = out[i].tolist()
            assert row == sorted(set(row)) and 0 <= row[0] and row[-1] < m
            assert set(order[i, : k - cb].tolist()) <= set(
                row
            )  # top K - alpha always kept
            assert row == select_ref(a[i], r, cb, g)
            assert torch.equal(
                select(a[i : i + 1], r, cb, g)[0], out[i]
            )  # batch-independent


def test_select_leading_dims():
    gen = torch.Generator().manual_seed(3)
    a = torch.rand(2, 3, 4, 64, generator=gen)
    out = select(a, 0.3, 6, 5)
    assert out.shape == (2, 3, 4, 20)
    assert torch.equal(out.reshape(-1, 20), select(a.reshape(-1, 64), 0.3, 6, 5))


def test_select_hypothesis():
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    @hyp.settings(max_examples=150, deadline=None)
    @hyp.given(st.data())
    def check(data):
        m = data.draw(st.integers(1, 60))
        r = data.draw(st.sampled_from([0.1, 0.3, 0.5, 0.9, 1.0]))
        k = kept_count(m, r)
        cb = data.draw(st.integers(0, k - 1))
        g = data.draw(st.integers(3, 9))
        vals = data.draw(st.lists(st.integers(0, 6), min_size=m, max_size=m))
        a = torch.tensor(vals, dtype=torch.float32)
        assert select(a, r, cb, g).tolist() == select_ref(a, r, cb, g)

    check()


# --------------------------------------------------------------------------- window_scores


def _naive_scores(q, k, scale=None):
    b, w, hq, d = q.shape
    hkv = k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, hkv, k.shape[1], dtype=torch.float64)
    for bi in range(b):
        for j in range(hq):
            h = j // (hq // hkv)
            p = torch.softmax(
                q[bi, :, j].double() @ k[bi, :, h].double().T * scale, dim=-1
            )  # [W, M]
            out[bi, h] += p.sum(0)
    return out


@pytest.mark.parametrize("hq,hkv", [(1, 1), (2, 1), (4, 2), (8, 2), (4, 4)])
def test_window_scores_vs_naive(hq, hkv):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    q = torch.randn(2, 23, hq, 16, generator=gen)
    k = torch.randn(2, 19, hkv, 16, generator=gen)
    a = window_scores(q, k)
    assert a.shape == (2, hkv, 19) and a.dtype == torch.float32
    torch.testing.assert_close(a.double(), _naive_scores(q, k), rtol=1e-5, atol=1e-5)
    # every query row sums to 1 -> each kv head receives W * group mass
    torch.testing.assert_close(a.sum(-1), torch.full((2, hkv), 23.0 * hq / hkv))


def test_window_scores_gqa_grouping_is_contiguous():
    # Only query head 1 (kv head 0 for G=2) sees a spike at key 3; kv head 1 must not.
    q = torch.zeros(1, 4, 4, 8)
    k = torch.zeros(1, 6, 2, 8)
    q[0, :, 1, 0] = 10.0
    k[0, 3, 0, 0] = 10.0
    k[0, 3, 1, 0] = 10.0
    a = window_scores(q, k, scale=1.0)
    assert a[0, 0].argmax() == 3 and a[0, 0, 3] > 4.0
    torch.testing.assert_close(a[0, 1], torch.full((6,), 8 / 6))


def test_window_scores_buffer_zero_and_scale():
    # U = 0: the keys are the window's own tokens (M == W).
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 12, 2, 8, generator=gen)
    k = torch.randn(1, 12, 2, 8, generator=gen)
    torch.testing.assert_close(window_scores(q, k).double(), _naive_scores(q, k))
    torch.testing.assert_close(
        window_scores(q, k, 0.3).double(), _naive_scores(q, k, 0.3)
    )


def test_window_scores_chunked_over_w(monkeypatch):
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 41, 4, 8, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(2, 30, 2, 8, generator=gen, dtype=torch.bfloat16)
    full = window_scores(q, k)
    import sgl_kara.kernels.window_score as ws

    monkeypatch.setattr(ws, "_SCORE_BLOCK_ELEMS", 2 * 4 * 30 * 3)  # 3 queries per chunk
    torch.testing.assert_close(window_scores(q, k), full)
    torch.testing.assert_close(
        full.double(), _naive_scores(q.float(), k.float()), rtol=1e-5, atol=1e-5
    )


# --------------------------------------------------------------------------- SnapKV


def test_snapkv_scores_no_pool_equals_colsum():
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 8, 4, 16, generator=gen)
    k = torch.randn(2, 33, 2, 16, generator=gen)
    torch.testing.assert_close(snapkv_scores(q, k, 1).double(), _naive_scores(q, k))


def test_snapkv_pooling():
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(1, 8, 2, 16, generator=gen)
    k = torch.randn(1, 33, 1, 16, generator=gen)
    raw = _naive_scores(q, k)[0, 0]
    pooled = snapkv_scores(q, k, 5)[0, 0].double()
    for i in range(33):
        torch.testing.assert_close(pooled[i], raw[max(0, i - 2) : i + 3].max())
    with pytest.raises(ValueError, match="kernel_size"):
        snapkv_scores(q, k, 4)


def test_snapkv_select():
    s = torch.tensor([[0.5, 0.9, 0.5, 0.1, 0.9, 0.5]])
    assert snapkv_select(s, 3).tolist() == [[0, 1, 4]]  # ties at 0.5 -> lowest index
    assert snapkv_select(s, 0).shape == (1, 0)
    with pytest.raises(ValueError, match="budget"):
        snapkv_select(s, 7)


# --------------------------------------------------------------------------- StreamingLLM


def test_streaming_select():
    assert streaming_select(10, 5, 2).tolist() == [0, 1, 7, 8, 9]
    assert streaming_select(10, 3, 0).tolist() == [7, 8, 9]
    assert streaming_select(10, 3, 3).tolist() == [0, 1, 2]
    out = streaming_select(10, 4, 1, batch_shape=(2, 3))
    assert out.shape == (2, 3, 4) and out.dtype == torch.int64
    assert (out == torch.tensor([0, 7, 8, 9])).all()
    for bad in [(10, 5, 6), (10, 11, 2), (10, 5, -1)]:
        with pytest.raises(ValueError, match="sinks"):
            streaming_select(*bad)


# --------------------------------------------------------------------------- random


def test_random_selection_is_a_uniform_subset():
    """random: K distinct sorted indices in [0, M) per (layer, head), K = ceil(r (W - U)), and
    over many windows every position is kept about K / M of the time (chi-square-like bound)."""
    from sgl_kara.config import KaraConfig
    from sgl_kara.policies.base import Region, RowView, ScoreInput
    from sgl_kara.scheduler.state import KaraReqState

    p = KaraConfig.build(
        policy="random", random_window=48, random_buffer=8, random_retention=0.25
    ).make_policy()
    m, keep, heads, windows = 40, 10, 2, 400
    counts = torch.zeros(m)
    k_buffer = torch.zeros(100, heads, 4)
    slots = torch.arange(m)[None]
    for w in range(windows):
        row = RowView(0, 0, 200, w * 32, KaraReqState())
        inp = ScoreInput(w % 3, None, k_buffer, slots, [row], [Region(0, m, keep)])
        kept = p.select(p.score(inp)[:, None], keep)  # [1, 1, heads, keep]
        assert kept.shape == (1, 1, heads, keep)
        assert (kept.diff(dim=-1) > 0).all() and kept.min() >= 0 and kept.max() < m
        counts += torch.bincount(kept.flatten(), minlength=m)
    expected = windows * heads * keep / m  # 200 per position
    # binomial sd = sqrt(800 * 0.25 * 0.75) ~ 12.2; 5 sd is far beyond chance for 40 positions
    assert (counts - expected).abs().max() < 5 * (
        windows * heads * (keep / m) * (1 - keep / m)
    ) ** 0.5, counts
    assert p.options.kept_per_window == keep
