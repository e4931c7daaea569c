"""The tensor-parallel design (docs/TENSOR_PARALLEL.md), checked without ranks: two simulated
TP ranks, each holding half of the KV heads, plan identical jobs from their replicated request
state, score from their own heads only, select per (layer, head) with the same global keep
count, and together keep exactly what one unsharded scheduler keeps. ``--tp-size 2`` itself is
refused (tests/test_refusals.py) and points to the design."""

from __future__ import annotations

import copy

import torch
from support import FakeReq

from sgl_kara.kernels.window_score import window_scores
from sgl_kara.policies.kara import KaraOptions, KaraPolicy
from sgl_kara.scheduler.jobs import plan_jobs
from sgl_kara.scheduler.state import KaraReqState

TP = 2
H_Q, H_KV, D = 8, 4, 16


def _shard(t: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    n = t.shape[dim] // TP
    return t.narrow(dim, rank * n, n)


def test_scoring_reads_only_the_ranks_heads():
    """A KV head's score depends on its own GQA group only: each rank's scores from its shard of
    query and KV heads equal the unsharded scores of those heads."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 24, H_Q, D, generator=g)
    k = torch.randn(3, 20, H_KV, D, generator=g)
    full = window_scores(q, k)  # [B, H_kv, M]
    for rank in range(TP):
        mine = window_scores(_shard(q, rank, 2), _shard(k, rank, 2))
        torch.testing.assert_close(mine, _shard(full, rank, 1), rtol=1e-6, atol=1e-6)


def test_selection_is_per_head_with_a_global_keep_count():
    """Selection works per (layer, head): each rank selecting over its heads keeps exactly what
    one scheduler selects for those heads, with the same K on every rank."""
    policy = KaraPolicy(
        KaraOptions(
            window=40, buffer=8, retention=0.25, chunk_budget=4, max_chunk=6, period=4
        )
    )
    g = torch.Generator().manual_seed(1)
    m, layers, keep = 32, 3, 8
    scores = torch.rand(5, layers, H_KV, m, generator=g)
    scores[0, 0, 0, 3:9] = 0.5  # ties: the stable order must hold on a shard too
    full = policy.select(scores, keep)
    kept = [policy.select(_shard(scores, rank, 2), keep) for rank in range(TP)]
    assert all(k.shape == (5, layers, H_KV // TP, keep) for k in kept)
    assert torch.equal(torch.cat(kept, dim=2), full)


def test_ranks_plan_identical_jobs_from_replicated_state():
    """Who is compressed, which region, how many kept and how many fresh slots: functions of the
    replicated integers only, so both ranks plan the same event with no communication."""
    policy = KaraPolicy(
        KaraOptions(
            window=16, buffer=4, retention=0.25, chunk_budget=2, max_chunk=3, period=4
        )
    )
    states = [
        KaraReqState(),
        KaraReqState(retention=0.5),
        KaraReqState(enabled=False),
        KaraReqState(),
        KaraReqState(),
    ]
    shapes = [(10, 40, 200), (5, 33, 200), (7, 50, 200), (12, 3, 200), (9, 60, 61)]
    ranks = []
    for _ in range(TP):
        reqs = [
            FakeReq(
                f"r{i}", prompt=p, generated=n, max_new=mx, kara=copy.deepcopy(s), row=i
            )
            for i, ((p, n, mx), s) in enumerate(zip(shapes, states))
        ]
        jobs = plan_jobs(policy, reqs, lambda r: r.kara, page_size=1, max_seqs=30)
        ranks.append(
            [
                (
                    j.index,
                    j.region,
                    j.fresh_slots(1),
                    j.state.protected,
                    j.state.frontier,
                )
                for j in jobs
            ]
        )
    assert ranks[0] == ranks[1]
    planned = {index for index, *_ in ranks[0]}
    # the disabled request, the one with too short a tail, and the one about to finish are left out
    assert planned == {0, 1}
    keeps = {index: region.keep for index, region, *_ in ranks[0]}
    assert keeps == {
        0: 3,
        1: 6,
    }  # kept_count(12, 0.25) and kept_count(12, 0.5): no head in it


def test_tp_refusal_points_to_the_design(capsys):
    import pytest
    from support import PROXY_MODEL

    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(["--model-path", PROXY_MODEL, "--tp-size", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        "error: --tp-size is not supported with --kara-policy kara" in err
        and "docs/TENSOR_PARALLEL.md" in err
    )
