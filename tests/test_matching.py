"""Equal KV at every decode step: Kara's trajectory as a pure function
(sgl_kara/policies/trajectory.py) against the runtime's recorded numbers and an independent
restatement of the runtime's rules; a threshold baseline in matched mode (``match_kara``) stepped
through a simulated row; the per-request option's checks. Pure (no engine)."""

from __future__ import annotations

import glob
import math
import os
from types import SimpleNamespace

import pytest

from bench.reasoning import gsm8k
from sgl_kara import request_options
from sgl_kara.policies import base, trajectory
from sgl_kara.policies.base import RowView
from sgl_kara.policies.kara import kept_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference(tokens, window, buffer, retention, period, recent=0, limit=None):
    """Per decode step 1..tokens-1: the rows before its event, written from the runtime's rules
    (plan.py: due at the request's own token count, ``eligible`` / Kara's ``worth_compressing``,
    the catch-up loop) rather than from trajectory.py."""
    keep = kept_count(window - buffer, retention)
    length = frontier = 0
    before = []
    for s in range(1, tokens):
        before.append(length)
        remaining = None if limit is None else limit - s
        for _ in range(8):
            if s % period:
                break
            if remaining is not None and remaining <= 1:
                break
            tail = length - frontier
            if tail < window + recent:
                break
            if remaining is not None and tail + remaining <= window + recent + period:
                break
            length -= window - buffer - keep
            frontier += keep
        length += 1
    return before, length


@pytest.mark.parametrize(
    "settings",
    [
        (256, 32, 0.2, 32, 0),
        (128, 16, 0.25, 32, 256),
        (40, 8, 0.25, 4, 0),
        (64, 8, 0.5, 1, 16),
        (32, 0, 1.0, 8, 0),
        (64, 8, 0.1, 128, 0),  # period above W - U: the catch-up loop compresses twice
    ],
)
@pytest.mark.parametrize("limit", [None, 300, 1024])
def test_trajectory_equals_the_runtime_rules(settings, limit):
    sched = trajectory.Schedule(*settings)
    t = trajectory.Trajectory(sched, limit)
    top = limit or 1500
    before, final = reference(top, *settings, limit=limit)
    assert [t.before(s) for s in range(1, top)] == before
    assert t.final(top) == final
    assert t.peak_kv(top) == max(before + [final])
    assert t.mean(top) == pytest.approx(sum(before) / len(before))
    # after(s) + 1 is the next step's before
    assert all(t.after(s) + 1 == t.before(s + 1) for s in range(1, top - 1))


def test_the_limit_only_changes_steps_near_it():
    sched = trajectory.Schedule(64, 8, 0.25, 4)
    free = trajectory.Trajectory(sched)
    differs = 0
    for limit in range(300, 420):
        limited = trajectory.Trajectory(sched, limit)
        near = limit - (
            64 + 4
        )  # Kara leaves alone only an event within W + R + delta of it
        assert [limited.before(s) for s in range(1, near)] == [
            free.before(s) for s in range(1, near)
        ]
        assert limited.final(limit) >= free.final(limit)
        differs += limited.final(limit) > free.final(limit)
    assert differs  # some limits fall where Kara left its last event alone


def _recorded():
    for path in sorted(
        p
        for pattern in (
            "kara*.json",
            "random*.json",
            "kara*.json.gz",
            "random*.json.gz",
        )
        for p in glob.glob(
            os.path.join(ROOT, "bench/results/**", pattern), recursive=True
        )
    ):
        res = gsm8k.read_result(path)
        opts = res.get("engine_options", {})
        pre = {"kara": "kara_", "random": "kara_random_"}.get(opts.get("kara_policy"))
        if pre is None or res.get("ratio") is None:
            continue
        yield (
            os.path.relpath(path, ROOT),
            trajectory.Schedule(
                opts[pre + "window"],
                opts[pre + "buffer"],
                opts[pre + "retention"],
                opts[pre + "period"],
                opts.get(pre + "recent", 0),
            ),
            res["max_new_tokens"],
            res.get("requests") or res.get("problems"),
        )


def test_trajectory_reproduces_every_recorded_kara_and_random_run():
    """The runtime's own meta_info.kara of every recorded answer (GSM8K, long answers on
    independent and chained problems; Kara with and without its recency band, random; stored
    plain or compressed, at any depth of bench/results), each from its length alone."""
    checked = 0
    for path, sched, limit, rows in _recorded():
        t = trajectory.trajectory(sched, limit)
        for r in rows:
            g = r["completion_tokens"]
            assert t.mean(g) == pytest.approx(r["kv_mean"], abs=1e-9), (path, g)
            assert t.peak_kv(g) == r["kv_peak"], (path, g)
            if "kv_final" in r:
                assert t.final(g) == r["kv_final"], (path, g)
            checked += 1
    assert checked >= 930  # the GSM8K runs and the first long-answer runs hold 930


class _State(SimpleNamespace):
    pass


def _policy(name, window, buffer, period):
    cls = base.policy_class(name)
    gap = window - buffer
    w = 8 if name == "rkv" else min(buffer, 32)
    opts = cls.Options(budget=w + 8, threshold=w + 8 + gap, window=w)
    return cls(opts)


@pytest.mark.parametrize("name", ["snapkv", "streaming", "h2o", "rkv"])
@pytest.mark.parametrize("limit", [None, 700])
def test_matched_baseline_holds_karas_rows_at_every_step(name, limit):
    """A threshold baseline stepped as the runtime steps it (region when due -- every step --,
    worth_compressing with the tokens left, the row cut to the region's keep) holds exactly
    Kara's rows before every step's event."""
    spec = dict(window=64, buffer=16, retention=0.25, period=8, recent=0)
    policy = _policy(name, 64, 16, 8)
    state = _State(request={"match_kara": request_options.validate_match(spec)})
    kara = trajectory.Trajectory(trajectory.schedule_of(spec), limit)
    P, length, offset, frontier = 100, 100, 0, 100
    tokens = limit or 900
    events = 0
    for s in range(1, tokens):
        assert length - P == kara.before(s), s
        row = RowView(P, frontier, length, offset, state)
        region = policy.region(row)
        remaining = None if limit is None else limit - s
        if region is not None and policy.schedule.worth_compressing(
            row, remaining if remaining is not None else 10**6
        ):
            assert (
                region.start == P
                and region.length == length - P - policy.options.window
            )
            dropped = region.length - region.keep
            length -= dropped
            offset += dropped
            frontier = P + region.keep
            events += 1
            assert (
                policy.schedule.tail_charge(row) < length - frontier + dropped + 1
            )  # overdue
        length += 1
    assert length - P == kara.final(tokens) and events > 5


def test_matched_admission_bounds_cover_the_trajectory():
    spec = dict(window=64, buffer=16, retention=0.25, period=8, recent=0)
    policy = _policy("snapkv", 64, 16, 8)
    state = _State(request={"match_kara": spec})
    kara = trajectory.Trajectory(trajectory.schedule_of(spec))
    for g in (10, 100, 500):
        assert policy.schedule.footprint(g, state) >= kara.peak(g)
        assert policy.schedule.footprint(g, state) <= g
    row = RowView(50, 50, 50 + kara.before(200), 200 - 1 - kara.before(200), state)
    grows = policy.schedule.growth(300, row)
    most = max(kara.before(s) for s in range(200, 501))
    assert kara.before(200) + grows >= most


def test_match_kara_option_is_checked_field_by_field():
    good = dict(window=256, buffer=32, retention=0.2, period=32)
    assert request_options.validate({"kara": {"match_kara": good}})[
        "match_kara"
    ] == dict(good, recent=0)
    cases = [
        (dict(good, window=1), "match_kara.window must be int in [2, 65536]"),
        (dict(good, buffer=256), "match_kara.buffer must be int in [0, window)"),
        (dict(good, retention=0.0), "match_kara.retention must be float in (0, 1]"),
        (dict(good, retention=math.inf), "match_kara.retention"),
        (dict(good, period=0), "match_kara.period must be int in [1, 1000000]"),
        (dict(good, recent=-1), "match_kara.recent must be int in [0, 1000000]"),
        (dict(good, window="256"), "match_kara.window must be int in [2, 65536]"),
        (dict(good, period=True), "match_kara.period"),
        (
            {k: v for k, v in good.items() if k != "period"},
            "missing field(s) ['period']",
        ),
        (dict(good, alpha=16), "unknown field(s) ['alpha']"),
    ]
    for spec, message in cases:
        with pytest.raises(
            ValueError,
            match=message.replace("(", r"\(")
            .replace(")", r"\)")
            .replace("[", r"\[")
            .replace("]", r"\]"),
        ):
            request_options.validate({"kara": {"match_kara": spec}})
    with pytest.raises(ValueError, match="must be an object"):
        request_options.validate({"kara": {"match_kara": [256, 32]}})
    with pytest.raises(ValueError, match="give one"):
        request_options.validate({"kara": {"match_kara": good, "budget": 300}})
    takers = {p.name for p in base.policies() if "match_kara" in p.request_options}
    assert {"snapkv", "streaming", "h2o", "rkv"} <= takers and "kara" not in takers
