"""The policy contract (sgl_kara/policies/base.py), run over every registered policy.

kvpress-style: one matrix for all methods -- options and flags, scores and selections on random
inputs ("kept = top-scored" for the default selection), regions and footprints -- plus the
per-method checks of what each one computes, against direct computations written here.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
import torch
from support import HKV, HQ, LAYERS, B, D, M  # noqa: F401  (the shapes; tests/test_h2o.py imports them here)
from support import make_policy as _policy
from support import row_view as _row
from support import score_input as _inputs
from support import select as _select

from sgl_kara.config import KaraConfig, KaraConfigError, add_cli_args, flag_name
from sgl_kara.policies import base
from sgl_kara.policies.base import RowView, ScoreInput, top_k
from sgl_kara.scheduler.state import KaraReqState

POLICIES = base.names()


def test_the_contract_is_as_small_as_a_press():
    """A policy implements at most six methods of the base (``region``, ``score``, ``select`` and
    three optional ones), and the smallest shipped policy, StreamingLLM, is one file of at most 60
    lines."""
    import inspect
    from pathlib import Path

    methods = [
        name
        for name, member in vars(base.Policy).items()
        if inspect.isfunction(member) and not name.startswith("__")
    ]
    assert {"region", "score", "select"} <= set(methods) and len(methods) <= 6, methods
    streaming = Path(inspect.getfile(base.policy_class("streaming")))
    assert streaming.name == "streaming.py"
    assert len(streaming.read_text().splitlines()) <= 60


def test_registry_names_every_policy_and_refuses_unknown_ones():
    assert {"kara", "snapkv", "streaming"} <= set(POLICIES)
    with pytest.raises(ValueError, match="known: " + ", ".join(POLICIES)):
        base.policy_class("nope")


@pytest.mark.parametrize("name", POLICIES)
def test_options_defaults_valid_and_every_option_has_a_flag(name):
    pcls = base.policy_class(name)
    cfg = KaraConfig.build(policy=name)
    assert isinstance(cfg.options, pcls.Options)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    flags = {a for action in parser._actions for a in action.option_strings}
    for f in fields(pcls.Options):
        assert flag_name(pcls.prefix + f.name) in flags
    assert (
        cfg.to_dict() == KaraConfig.build(**cfg.to_dict()).to_dict()
    )  # the scheduler's round trip


@pytest.mark.parametrize("name", POLICIES)
def test_scores_and_selection_properties(name):
    policy = _policy(name)
    per_layer = [
        policy.score(_inputs(policy, layer, seed=layer)) for layer in range(LAYERS)
    ]
    for s in per_layer:
        assert (
            s.shape == (B, HKV, M)
            and s.dtype == torch.float32
            and torch.isfinite(s).all()
        )
    scores = torch.stack(per_layer, dim=1)  # [B, L, H_kv, M]
    for keep in (1, 12, M):
        kept = _select(policy, scores, keep)
        assert kept.shape == (B, LAYERS, HKV, keep) and kept.dtype == torch.int64
        assert (
            (kept.diff(dim=-1) > 0).all() and kept.min() >= 0 and kept.max() < M
        )  # sorted, unique
        if (
            type(policy).select is base.Policy.select
        ):  # default selection: kept = top-scored
            thresh = scores.sort(dim=-1, descending=True).values[..., keep - 1 : keep]
            assert (scores.gather(-1, kept) >= thresh).all()


def test_top_k_ties_go_to_the_lower_index():
    assert top_k(torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0]), 2).tolist() == [1, 2]


@pytest.mark.parametrize("name", POLICIES)
def test_footprint_is_bounded_and_monotone(name):
    policy = _policy(name)
    state = KaraReqState()
    prev = 0
    for remaining in (0, 1, 100, 1000, 10_000, 100_000):
        f = policy.schedule.footprint(remaining, state)
        assert 0 <= f <= remaining and f >= prev
        prev = f
    assert (
        policy.schedule.footprint(100_000, state) < 100_000
    )  # compression discounts long futures


def test_kara_region_schedule_and_per_request_retention():
    p = _policy("kara", window=64, buffer=16, period=8, retention=0.25)
    assert [p.schedule.due(s) for s in (7, 8, 16)] == [False, True, True]
    assert p.region(_row(10 + 63)) is None
    r = p.region(_row(10 + 64, frontier=10))
    assert (r.start, r.length, r.keep, r.query_start, r.query_len) == (
        10,
        48,
        12,
        10,
        64,
    )
    assert p.region(_row(10 + 64, retention=0.5)).keep == 24
    assert p.schedule.query_capacity() == 64 + 8


def test_kara_buffer_scoring_names_only_the_last_u_queries():
    """--kara-scoring buffer: the same region, scored by the last U queries of the window only,
    so its query window is exactly those U positions (a recompute forward computes U tokens,
    not W); the scores are those of the full window's queries with the first W - U dropped."""
    full = _policy("kara", window=64, buffer=16, period=8, retention=0.25)
    buf = _policy(
        "kara", window=64, buffer=16, period=8, retention=0.25, scoring="buffer"
    )
    row = _row(10 + 70, frontier=10)
    a, b = full.region(row), buf.region(row)
    assert (b.start, b.length, b.keep) == (a.start, a.length, a.keep) == (10, 48, 12)
    assert (b.query_start, b.query_len) == (a.query_start + 48, 16)
    assert (
        b.query_start + b.query_len == a.query_start + a.query_len
    )  # the window's last U
    g = torch.Generator().manual_seed(3)
    k_buffer = torch.randn(200, HKV, D, generator=g)
    slots = torch.randperm(200, generator=g)[:48][None]
    q = torch.randn(1, 64, HQ, D, generator=g)
    got = buf.score(ScoreInput(0, q[:, 48:], k_buffer, slots, [row], [b]))
    # Direct computation: each of the U queries' softmax over the region's keys (no causal
    # mask), per KV head summed over the queries of its GQA group and over the queries.
    keys = k_buffer[slots[0]]  # [48, HKV, D]
    qh = q[0, 48:].reshape(16, HKV, HQ // HKV, D)
    att = torch.softmax(torch.einsum("uhgd,mhd->hgum", qh, keys) / D**0.5, dim=-1)
    want = att.sum(dim=(1, 2))[None]  # [1, HKV, 48]
    torch.testing.assert_close(
        got / got.sum(-1, keepdim=True),
        want / want.sum(-1, keepdim=True),
        rtol=1e-5,
        atol=1e-6,
    )


def test_kara_leaves_a_window_that_finishes_within_its_charged_tail():
    p = _policy("kara", window=64, buffer=16, period=8, retention=0.25)
    due = _row(10 + 64, frontier=10)  # tail = W: its first window is complete
    assert p.region(due) is not None
    assert p.schedule.worth_compressing(due, 9)  # tail would reach 73 > W + period
    assert not p.schedule.worth_compressing(
        due, 8
    )  # 72 = W + period: admission charged exactly that
    assert not p.schedule.worth_compressing(due, 1)
    assert p.schedule.worth_compressing(
        _row(10 + 200, frontier=10), 8
    )  # a long tail (re-prefilled) is compressed


def _simulate(p, gen, skip=True, prompt=10):
    """One request through Kara's schedule as the runtime runs it (plan_jobs, events before each
    decode step's forward): its peak generated KV and its events."""
    state = KaraReqState()
    frontier, length, peak, events = (
        prompt,
        prompt,
        0,
        0,
    )  # after the prefill: P entries, 1 token out
    for step in range(
        1, gen
    ):  # decode step `step` writes token `step` (0-based output index)
        remaining = gen - step
        if p.schedule.due(step):
            row = RowView(prompt, frontier, length, 0, state)
            region = p.region(row)
            if (
                region is not None
                and remaining > 1
                and (not skip or p.schedule.worth_compressing(row, remaining))
            ):
                length -= region.length - region.keep
                frontier = region.start + region.keep
                events += 1
        length += 1
        peak = max(peak, length - prompt)
    return peak, events


@pytest.mark.parametrize(
    "window,buffer,period,saves,recent",
    [
        (64, 16, 8, False, 0),
        (128, 8, 32, True, 0),
        (128, 16, 1, False, 0),
        (512, 32, 128, True, 0),
        (64, 16, 8, False, 40),
        (128, 16, 1, False, 128),
        (128, 8, 32, True, 100),
    ],
)
def test_kara_never_holds_more_than_admission_charged(
    window, buffer, period, saves, recent
):
    """Peak generated KV <= footprint(G) (what the admission reserved) for every G, with and
    without leaving the last window of a finishing request; leaving it saves events only. It
    saves some when the window cycle W - U is not a multiple of the period (at 64/16/8 every
    event finds a tail of W + period - 1, so only a request finishing next step is left alone)."""
    p = _policy(
        "kara",
        window=window,
        buffer=buffer,
        period=period,
        retention=0.25,
        recent=recent,
    )
    saved = 0
    for gen in range(2, 3 * window + 40, 3):
        charged = p.schedule.footprint(gen, KaraReqState())
        peak, events = _simulate(p, gen)
        peak_all, events_all = _simulate(p, gen, skip=False)
        assert peak_all <= charged and peak <= charged, (gen, peak, peak_all, charged)
        assert events <= events_all
        saved += events_all - events
    assert (saved > 0) == saves


def test_kara_recency_band_region_capacity_and_footprint():
    """--kara-recent R: the window [f, f + W) is due only once R newer rows follow it (the last
    R + W rows stay exact); its region and query window are the R = 0 ones; the capture ring
    holds R more queries; admission charges R more tail; a finishing request is left alone while
    its tail stays within W + R + period."""
    p0 = _policy("kara", window=64, buffer=16, period=8, retention=0.25)
    p = _policy("kara", window=64, buffer=16, period=8, retention=0.25, recent=32)
    assert p.region(_row(10 + 64 + 31)) is None
    row = _row(10 + 64 + 32, frontier=10)
    r, r0 = p.region(row), p0.region(row)
    assert (
        (r.start, r.length, r.keep, r.query_start, r.query_len)
        == (10, 48, 12, 10, 64)
        == (r0.start, r0.length, r0.keep, r0.query_start, r0.query_len)
    )
    assert (
        p.region(_row(10 + 96, retention=0.5)).keep == 24
    )  # per-request retention still honoured
    assert (
        p.schedule.query_capacity() == p0.schedule.query_capacity() + 32 == 64 + 8 + 32
    )
    state = KaraReqState()
    for remaining in (200, 1000, 10_000):
        assert (
            p.schedule.footprint(remaining, state)
            == p0.schedule.footprint(remaining, state) + 32
        )
    assert not p.schedule.worth_compressing(
        row, 104 - 96
    )  # 96 + 8 = W + R + period: within the charged tail
    assert p.schedule.worth_compressing(row, 9)


@pytest.mark.parametrize("recent", [0, 24])
def test_random_policy_uses_karas_windows_without_queries(recent):
    """random: Kara's region, schedule, capacity-free (no queries) and footprint; its draws are
    reproducible per (seed, layer, window start) and differ between seeds, layers and windows."""
    p = _policy(
        "random", window=64, buffer=16, period=8, retention=0.25, recent=recent, seed=1
    )
    k = _policy("kara", window=64, buffer=16, period=8, retention=0.25, recent=recent)
    assert not p.needs_queries and p.schedule.query_capacity() == 0
    for length in (10 + 63 + recent, 10 + 64 + recent, 10 + 200):
        a, b = p.region(_row(length)), k.region(_row(length))
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.start, a.length, a.keep, a.query_len) == (
                b.start,
                b.length,
                b.keep,
                0,
            )
    assert p.region(_row(10 + 64 + recent, retention=0.5)).keep == 24
    assert [p.schedule.due(s) for s in (7, 8)] == [False, True]
    assert p.schedule.footprint(5000, KaraReqState()) == k.schedule.footprint(
        5000, KaraReqState()
    )
    inp = _inputs(p)
    s1 = p.score(inp)
    assert torch.equal(s1, p.score(inp))  # reproducible
    assert torch.equal(
        s1[0], s1[1]
    )  # the two rows' windows start at the same logical position
    other = _policy(
        "random", window=64, buffer=16, period=8, retention=0.25, recent=recent, seed=2
    )
    assert not torch.equal(s1, other.score(inp))
    assert not torch.equal(s1, p.score(_inputs(p, layer=1)))
    shifted = ScoreInput(
        0,
        None,
        inp.k_buffer,
        inp.slots,
        [_row(M + 60, offset=7), inp.rows[1]],
        inp.regions,
    )
    assert not torch.equal(p.score(shifted)[0], s1[0]) and torch.equal(
        p.score(shifted)[1], s1[1]
    )


@pytest.mark.parametrize(
    "name", [n for n in POLICIES if "budget" in base.policy_class(n).request_options]
)
def test_threshold_regions_use_the_request_budget(name):
    p = _policy(name, threshold=80, budget=60, window=8)
    assert p.region(_row(10 + 80)) is None  # generated == C_max: not yet
    r = p.region(_row(10 + 81))
    assert (r.start, r.length, r.keep) == (10, 81 - 8, 60 - 8)
    # budget matching: N = 30 for this request, threshold keeps the gap of 20
    assert p.region(_row(10 + 50, budget=30)) is None
    r = p.region(_row(10 + 51, budget=30))
    assert (r.length, r.keep) == (51 - 8, 30 - 8)
    assert p.schedule.footprint(10_000, KaraReqState(request={"budget": 30})) == 51


def test_retraction_keeps_the_request_options():
    """The bug of the old hand-rebuilt state: a retracted snapkv request fell back to the
    server-wide budget. reset_row clears the row state and keeps the request's own options."""
    state = KaraReqState(enabled=True, request={"retention": 0.5, "budget": 30})
    state.protected, state.frontier, state.pos_offset, state.compressions = (
        16,
        40,
        120,
        3,
    )
    state.policy_state["h2o"] = {0: torch.ones(1, 4)}
    state.kv_peak = 99
    state.reset_row()
    assert (state.request, state.enabled, state.kv_peak) == (
        {"retention": 0.5, "budget": 30},
        True,
        99,
    )
    assert (
        state.protected,
        state.frontier,
        state.pos_offset,
        state.compressions,
        state.policy_state,
    ) == (-1, 0, 0, 0, {})
    p = _policy("snapkv", threshold=80, budget=60, window=8)
    assert p.region(RowView(10, 10, 10 + 51, 0, state)).keep == 30 - 8


def test_streaming_scores_keep_sinks_then_recent():
    from sgl_kara.policies.streaming import streaming_select

    p = _policy("streaming", threshold=80, budget=60, window=8, sinks=3)
    scores = torch.stack([p.score(_inputs(p, layer)) for layer in range(LAYERS)], dim=1)
    for keep in (2, 3, 10, M):
        expect = streaming_select(M, keep, min(3, keep), batch_shape=(B, LAYERS, HKV))
        assert torch.equal(p.select(scores, keep), expect)


def test_snapkv_scores_match_pooled_window_scores():
    from sgl_kara.policies.snapkv import snapkv_scores

    p = _policy("snapkv", kernel=5)
    inp = _inputs(p)
    torch.testing.assert_close(p.score(inp), snapkv_scores(inp.queries, inp.keys(), 5))


def test_per_request_option_of_another_policy_is_listed_in_the_error():
    with pytest.raises(KaraConfigError, match="applies to --kara-policy snapkv"):
        KaraConfig.build(policy="kara", snapkv_budget=100)


def _trajectory(p, gen, prompt=10):
    """(remaining, row before the step, KV length before the step) at every decode step of one
    request through Kara's schedule (as ``_simulate``), and the length after each step."""
    state = KaraReqState(protected=prompt, frontier=prompt)
    frontier, length, out = prompt, prompt, []
    for step in range(1, gen):
        remaining = gen - step
        state.frontier = frontier
        out.append((remaining, RowView(prompt, frontier, length, 0, state), length))
        if p.schedule.due(step):
            row = RowView(prompt, frontier, length, 0, state)
            region = p.region(row)
            if (
                region is not None
                and remaining > 1
                and p.schedule.worth_compressing(row, remaining)
            ):
                length -= region.length - region.keep
                frontier = region.start + region.keep
        length += 1
    return out, length


@pytest.mark.parametrize(
    "name,opts",
    [
        ("kara", dict(window=64, buffer=16, period=8, retention=0.25)),
        ("kara", dict(window=128, buffer=8, period=32, retention=0.5)),
        ("kara", dict(window=64, buffer=16, period=8, retention=0.25, recent=40)),
        ("snapkv", dict(threshold=40, budget=20, window=4)),
        ("streaming", dict(threshold=60, budget=30, window=8)),
    ],
)
def test_a_running_request_never_grows_past_its_charge(name, opts):
    """Admission charges a running request ``growth(remaining, row)``: at every step of its
    life, its KV never grows beyond what it holds then plus that charge, and the charge is never
    more than its footprint (what it was charged when admitted). A threshold policy's request
    may write one entry past C_max + 1 with its last token (no event runs for a request about
    to finish), as its footprint allows too."""
    p = _policy(name, **opts)
    last = 0 if name == "kara" else 1
    for gen in (50, 137, 400):
        if name == "kara":
            steps, final = _trajectory(p, gen)
        else:
            steps, final = _threshold_trajectory(p, gen)
        lengths = [length for _, _, length in steps] + [final]
        for i, (remaining, row, length) in enumerate(steps):
            grow = p.schedule.growth(remaining, row)
            future = max(lengths[i:])
            assert future - length <= grow + last, (gen, i, future - length, grow)
            assert grow <= p.schedule.footprint(remaining, row.state)


def _threshold_trajectory(p, gen, prompt=10):
    state = KaraReqState(protected=prompt, frontier=prompt)
    frontier, length, out = prompt, prompt, []
    for step in range(1, gen):
        remaining = gen - step
        row = RowView(prompt, frontier, length, 0, state)
        out.append((remaining, row, length))
        region = p.region(row)
        if region is not None and remaining > 1:
            length -= region.length - region.keep
            frontier = region.start + region.keep
        length += 1
    return out, length
