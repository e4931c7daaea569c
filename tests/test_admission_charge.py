"""What admission charges a request (``KaraRuntime.charge``, presented to SGLang's PrefillAdder by
sgl_kara/scheduler/admission.py), followed through a request's life on Kara's and the threshold
policies' schedules: the charge made when it is admitted bounds how far its KV ever grows, the
charge it has while it runs never exceeds it, and it does not shrink once the request runs (room
freed that way would wait for a request to leave: SGLang's prefill does not look again until
then)."""

from __future__ import annotations

import types

import pytest
from support import FakeReq
from support import make_policy as _policy

from sgl_kara.policies.base import RowView
from sgl_kara.scheduler.state import KaraReqState

PROMPT = 13
CASES = [
    ("kara", dict(window=64, buffer=16, period=8, retention=0.25)),
    ("kara", dict(window=128, buffer=8, period=32, retention=0.5)),
    ("kara", dict(window=64, buffer=16, period=8, retention=0.25, recent=40)),
    ("kara", dict(window=512, buffer=32, period=128, retention=0.25)),
    ("snapkv", dict(threshold=40, budget=20, window=4)),
    ("streaming", dict(threshold=60, budget=30, window=8)),
]


def _charge(policy, req, state, running: bool, slack: int = 0) -> int:
    """``KaraRuntime.charge`` of ``req``, less its output so far: the tokens SGLang counts for
    it beyond what it holds."""
    from sgl_kara.scheduler.runtime import KaraRuntime

    rt = types.SimpleNamespace(policy=policy, slack=slack, state_of=lambda _: state)
    return KaraRuntime.charge(rt, req, running) - len(req.output_ids)


def _life(policy, gen: int):
    """Per decode step of one request (PROMPT tokens, ``gen`` generated), as the runtime runs it:
    (request as SGLang holds it, its Kara state, the KV length); and the length after the last
    step. Kara compresses at its due steps, a threshold policy whenever its region is due; a
    request about to finish is left alone."""
    state = KaraReqState()
    length, out = PROMPT, []
    for done in range(1, gen):
        remaining = gen - done
        req = FakeReq(prompt=PROMPT, generated=done, max_new=gen)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = length
        snapshot = KaraReqState(
            protected=state.protected if done > 1 else -1, frontier=state.frontier
        )
        out.append((req, snapshot, length))
        if done == 1:
            state.protected = state.frontier = PROMPT
        row = RowView(state.protected, state.frontier, length, 0, state)
        due = policy.schedule.due(done) if policy.name == "kara" else True
        region = policy.region(row) if due else None
        if (
            region is not None
            and remaining > 1
            and policy.schedule.worth_compressing(row, remaining)
        ):
            length -= region.length - region.keep
            state.frontier = region.start + region.keep
        length += 1
    return out, length


@pytest.mark.parametrize("name,opts", CASES)
def test_the_admission_charge_bounds_the_request_for_its_whole_life(name, opts):
    p = _policy(name, **opts)
    # a threshold policy's request may write one entry past C_max + 1 with its last token
    last = 0 if name == "kara" else 1
    for gen in (2, 50, 137, 400, 1536):
        admitted = _charge(
            p, FakeReq(prompt=PROMPT, max_new=gen), KaraReqState(), running=False
        )
        assert admitted <= p.schedule.footprint(gen, KaraReqState())
        steps, final = _life(p, gen)
        lengths = [length for _, _, length in steps] + [final]
        assert max(lengths) - PROMPT <= admitted + last, (gen, max(lengths), admitted)
        for i, (req, state, length) in enumerate(steps):
            running = _charge(p, req, state, running=True)
            # what SGLang counts for it (held + charge) never rises above its admission ...
            assert length + running <= PROMPT + admitted, (gen, i, length, running)
            # ... and the running charge still bounds the rest of its life
            assert max(lengths[i:]) - length <= running + last, (gen, i)
        # once it runs, the count drops by at most the token its first step decodes
        req, state, length = steps[0] if steps else (None, None, PROMPT)
        if req is not None:
            first = length + _charge(p, req, state, running=True)
            assert PROMPT + admitted - first <= 1, (gen, admitted, first)


def test_the_admission_charge_is_the_growth_of_a_fresh_row_plus_the_spread_slack():
    p = _policy("kara", window=512, buffer=32, period=128, retention=0.25)
    fresh = RowView(-1, 0, 0, 0, KaraReqState())
    req = FakeReq(prompt=128, max_new=1536)
    # 1536 r + (W + period)(1 - r) = 384 + 480; the footprint (the peak bound) adds (W + period) r
    assert (
        _charge(p, req, KaraReqState(), running=False)
        == 864
        == p.schedule.growth(1536, fresh)
    )
    assert p.schedule.footprint(1536, KaraReqState()) == 1024
    assert _charge(p, req, KaraReqState(), running=False, slack=128) == 992
    # never more than the request's own output
    assert _charge(p, FakeReq(prompt=128, max_new=100), KaraReqState(), False) == 100
    # compression off for it: SGLang's own count
    from sgl_kara.scheduler.runtime import KaraRuntime

    rt = types.SimpleNamespace(
        policy=p, slack=0, state_of=lambda _: KaraReqState(enabled=False)
    )
    assert KaraRuntime.charge(rt, req, False) is None


def test_with_the_series_the_adder_asks_for_each_reservation():
    """Where SGLang's adder has ``reserved_new_tokens`` (patches/upstream 0010) Kara's adder
    answers it with the charge (a running request's, or one being admitted), SGLang's own answer
    where compression is off, and presents nothing as ``max_new_tokens``."""
    from sgl_kara.scheduler.admission import make_prefill_adder

    class Adder:
        def reserved_new_tokens(self, req, running):
            return req.sampling_params.max_new_tokens

    asked = []

    def charge(req, running):
        asked.append(running)
        return None if req.rid == "off" else 300 + running

    adder = make_prefill_adder(Adder, charge, asks=True)()
    on = FakeReq("on", max_new=1000)
    assert adder.reserved_new_tokens(on, True) == 301
    assert adder.reserved_new_tokens(on, False) == 300
    assert adder.reserved_new_tokens(FakeReq("off", max_new=1000), True) == 1000
    assert asked == [True, False, True]
    assert on.sampling_params.max_new_tokens == 1000
