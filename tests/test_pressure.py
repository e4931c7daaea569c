"""``--kara-trigger pressure`` / ``headroom`` (sgl_kara/scheduler/pressure.py): a due event runs only
while memory binds. The rule itself, the fresh-slot count it charges (what compaction really
allocates), and engines: one whose pool has room (nothing is compressed under either trigger: the
output is full KV's, token for token), one whose pool runs short mid-generation (pressure: deferred
events, then compression) and one whose pool cannot hold the requests' remainder from the start
(headroom: events from the first due step, as the schedule, then deferred once the remainder fits);
every decode step checked against the masked Hugging Face reference of tests/oracle.py."""

from __future__ import annotations

import json

import pytest
import torch

from sgl_kara.config import TRIGGERS, KaraConfig, KaraConfigError
from sgl_kara.mem_cache.compaction import (
    CompactionPlan,
    compact_rows,
    fresh_slots_needed,
)
from sgl_kara.scheduler.pressure import DEFERRING, growth_within, horizon, memory_binds


def test_waiting_requests_bind_only_below_the_running_limit():
    assert memory_binds(
        free=10_000, growth=10, fresh=10, waiting=1, running=3, max_running=8
    )
    assert not memory_binds(
        free=10_000, growth=10, fresh=10, waiting=5, running=8, max_running=8
    )
    assert not memory_binds(
        free=10_000, growth=10, fresh=10, waiting=0, running=3, max_running=8
    )


def test_pool_binds_when_growth_and_fresh_slots_exceed_free():
    assert not memory_binds(
        free=100, growth=60, fresh=40, waiting=0, running=3, max_running=8
    )
    assert memory_binds(
        free=99, growth=60, fresh=40, waiting=0, running=3, max_running=8
    )


def test_growth_is_remaining_up_to_the_interval_with_partial_pages():
    assert growth_within([100, 3, 0, -2], horizon=16) == 16 + 3
    assert growth_within([100, 3], horizon=16, page_size=16) == (16 + 15) + (3 + 15)


def test_headroom_looks_to_the_requests_end_and_pressure_to_the_next_due_step():
    assert horizon("pressure", 16) == 16 and horizon("headroom", 16) is None
    assert TRIGGERS == (
        "schedule",
        *DEFERRING,
    )  # every trigger but the schedule defers, with a horizon
    assert growth_within([100, 3, 0, -2], horizon=None) == 103
    assert growth_within([100, 3], horizon=None, page_size=16) == (100 + 15) + (3 + 15)
    # a pool with room for the next 16 steps but not for the whole remainder: pressure defers,
    # headroom compresses
    growth = {
        t: growth_within([100, 100], horizon(t, 16)) for t in ("pressure", "headroom")
    }
    assert not memory_binds(
        free=150,
        growth=growth["pressure"],
        fresh=10,
        waiting=0,
        running=2,
        max_running=8,
    )
    assert memory_binds(
        free=150,
        growth=growth["headroom"],
        fresh=10,
        waiting=0,
        running=2,
        max_running=8,
    )


def test_trigger_is_a_validated_common_knob():
    assert KaraConfig().trigger == "schedule"
    cfg = KaraConfig.build(policy="snapkv", trigger="pressure")
    assert cfg.trigger == "pressure" and cfg.flat()["trigger"] == "pressure"
    assert KaraConfig.build(**cfg.flat()) == cfg
    assert KaraConfig.build(trigger="headroom").trigger == "headroom"
    with pytest.raises(
        KaraConfigError,
        match=r"--kara-trigger \(kara_trigger\): must be one of schedule, pressure, headroom",
    ):
        KaraConfig.build(trigger="sometimes")


@pytest.mark.parametrize("page", [1, 4, 16])
def test_fresh_slots_needed_is_what_compaction_allocates(page):
    """The pressure rule charges an event the fresh slots of its compaction: count them."""
    g = torch.Generator().manual_seed(page)
    slots, layers, hkv, d = 4096, 2, 2, 8
    k = [torch.randn(slots, hkv, d, generator=g) for _ in range(layers)]
    v = [torch.randn(slots, hkv, d, generator=g) for _ in range(layers)]
    free = list(range(page, slots))  # slot 0..page-1 reserved, as SGLang's page 0
    req_to_token = torch.zeros(4, 512, dtype=torch.int32)
    starts, lengths, M, K = [16, 37, 64], [120, 95, 200], 40, 10
    for row, length in enumerate(lengths):
        n = -(-length // page) * page
        got, free = free[:n], free[n:]
        req_to_token[row, :length] = torch.tensor(got[:length], dtype=torch.int32)
    allocated = []

    def alloc(n):
        nonlocal free
        got, free = free[:n], free[n:]
        allocated.append(n)
        return torch.tensor(got, dtype=torch.int64)

    kept = torch.stack(
        [
            torch.sort(torch.randperm(M, generator=g)[:K]).values
            for _ in range(3 * layers * hkv)
        ]
    )
    plan = CompactionPlan(
        rows=torch.arange(3),
        starts=starts,
        lengths=lengths,
        region=M,
        kept=kept.view(3, layers, hkv, K),
    )
    compact_rows(
        plan,
        req_to_token,
        k,
        v,
        alloc,
        lambda s: None,
        page_size=page,
        use_triton=False,
    )
    assert sum(allocated) == sum(
        fresh_slots_needed(a, n, M, K, page) for a, n in zip(starts, lengths)
    )


@pytest.mark.integration  # engines of their own pool sizes and triggers (docs/TESTING.md, tiers)
def test_deferring_triggers_leave_a_request_exact_while_the_pool_has_room(
    tiny_llama, tmp_path
):
    """One long request in a pool that holds it uncompressed: under pressure and headroom every due
    event is deferred, the output is full KV's token for token."""
    import os

    from support import start_engine

    prompt = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
    gen = {"max_new_tokens": 180, "temperature": 0.0, "ignore_eos": True}
    outs, deferred = {}, {}
    for system in ("none", "pressure", "headroom"):
        extra = (
            {}
            if system == "none"
            else dict(
                kara_trigger=system,
                kara_window=40,
                kara_buffer=8,
                kara_period=4,
                kara_retention=0.25,
            )
        )
        trace = tmp_path / f"trace_{system}.jsonl"
        os.environ["KARA_TRACE"] = str(trace)
        try:
            engine = start_engine(
                "kara",
                tiny_llama,
                kara_policy="none" if system == "none" else "kara",
                max_total_tokens=4096,
                **extra,
            )
        finally:
            os.environ.pop("KARA_TRACE", None)
        try:
            outs[system] = engine.generate(input_ids=prompt, sampling_params=gen)[0]
        finally:
            engine.shutdown()
        if system != "none":
            deferred[system] = json.loads(trace.read_text().splitlines()[-1])[
                "kara_deferred"
            ]
    for system in ("pressure", "headroom"):
        kara = outs[system]["meta_info"]["kara"]
        assert (
            kara["compressions"] == 0
            and kara["kv_physical_len"] == kara["kv_logical_len"]
        ), system
        assert outs[system]["output_ids"] == outs["none"]["output_ids"], system
        # every due step that found a full window was deferred: the step feeding the request's
        # t-th token (t a multiple of the period, 4) when its tail of t - 1 rows holds a window
        # (40) and more than one of its 180 tokens is left
        full = sum(
            1 for t in range(1, 181) if t % 4 == 0 and t - 1 >= 40 and 180 - t > 1
        )
        assert deferred[system] == full, (system, deferred[system], full)


def _three_requests_checked(model, tmp_path, trigger: str, pool: int):
    """Three 220-token requests under ``trigger`` in a ``pool``-slot pool, every decode step checked
    against the masked reference (integrity checks on). Returns (outputs, per-step trace); asserts
    no retraction and that every request finished."""
    from oracle import run_and_check

    trace = tmp_path / "trace.jsonl"
    outs = run_and_check(
        model,
        tmp_path,
        1,
        "recompute",
        integrity=True,
        extra=dict(kara_trigger=trigger, max_total_tokens=pool),
        gen={"max_new_tokens": 220, "temperature": 0.0, "ignore_eos": True},
        env_extra={"KARA_TRACE": str(trace)},
    )[0]
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert all(s["retracted"] == 0 for s in steps)
    assert all(len(o["output_ids"]) == 220 for o in outs)
    return outs, steps


@pytest.mark.integration  # engines of their own pool sizes and triggers (docs/TESTING.md, tiers)
def test_pressure_compresses_when_the_pool_binds_and_stays_exact(tiny_llama, tmp_path):
    """Three requests in a pool that holds them uncompressed only part of the way: events are first
    deferred, then run when the pool would run short -- at times the periodic schedule never picks,
    compressing windows with a long uncompressed tail behind them. Every decode step still equals
    the masked reference; no request is retracted and every one finishes."""
    _, steps = _three_requests_checked(tiny_llama, tmp_path, "pressure", 420)
    assert steps[-1]["kara_deferred"] > 0 and steps[-1]["kara_events"] > 0
    first_event = next(i for i, s in enumerate(steps) if s["kara_events"] > 0)
    assert steps[first_event]["kara_deferred"] > 0  # deferred before the pool bound


@pytest.mark.integration  # engines of their own pool sizes and triggers (docs/TESTING.md, tiers)
def test_headroom_compresses_from_the_first_due_step_when_the_remainder_does_not_fit(
    tiny_llama, tmp_path
):
    """Three requests whose whole remainder (3 x 233-251 slots) never fits the 480-slot pool at the
    start: headroom runs the first due event (nothing deferred before it), as the schedule would;
    once what is left fits beside the compressed rows, later events are deferred. Every decode step
    equals the masked reference; no retraction; every request finishes."""
    _, steps = _three_requests_checked(tiny_llama, tmp_path, "headroom", 480)
    first_event = next(i for i, s in enumerate(steps) if s["kara_events"] > 0)
    assert steps[first_event]["kara_deferred"] == 0
    assert (
        steps[-1]["kara_deferred"] > 0
    )  # the tail: the remainder fits, events skipped
