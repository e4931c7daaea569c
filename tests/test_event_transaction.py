"""An event is a transaction (scheduler/events.py): whatever fails before its commit leaves every
row, slot, length and per-request state as it was, and the request found failing is finished
with an error while the others are compressed.

Driven without an engine: EventRunner over real tensors (a KV pool, ``req_to_token``), a token
allocator that tracks its free slots, and a threshold policy with per-request state re-laid at
every compaction (as H2O's), failing on purpose at each stage an event passes through after the
kept K/V are copied into fresh slots. Checked after every event: each slot is free or named by
exactly one row, never both; the failed request's row, lengths, K/V bytes and state are
untouched; the others hold exactly their kept entries. The engine-level case (an injected fault
at the commit stage in a running engine, under the overlap scheduler) is in tests/test_overlap.py.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch
from support import FakeReq

from sgl_kara.diagnostics import fault_observers
from sgl_kara.policies.threshold import ThresholdOptions, ThresholdPolicy
from sgl_kara.scheduler import plan as planning
from sgl_kara.scheduler.events import EventRunner
from sgl_kara.scheduler.evictions import EvictionRecorder
from sgl_kara.scheduler.observers import Observers
from sgl_kara.scheduler.scoring import Scorer
from sgl_kara.scheduler.shared import KaraStats, StepShared
from sgl_kara.scheduler.staging import DeviceStaging
from sgl_kara.scheduler.state import KaraReqState

LAYERS, HKV, D, SLOTS, WIDTH = 2, 2, 4, 256, 64


@dataclass(frozen=True)
class TallyOptions(ThresholdOptions):
    pass


class Tally(ThresholdPolicy):
    """Keeps the entries with the largest per-row tallies (a stand-in for H2O's accumulated
    attention: per-request state indexed by row position, re-laid at every compaction)."""

    name = "tally"
    prefix = "tally_"
    Options = TallyOptions
    needs_queries = False
    observes_decode = True
    fail_for: set = set()

    def score(self, inp):
        out = []
        for row, region in zip(inp.rows, inp.regions):
            t = row.state.policy_state["tally"]["acc"]  # [L, H_kv, rows]
            out.append(t[inp.layer, :, region.start : region.start + region.length])
        return torch.stack(out)

    def on_compacted(self, state, start, region, kept, length):
        acc = state.policy_state["tally"]["acc"]
        k = kept.shape[-1]
        new = torch.zeros_like(acc)
        new[..., :start] = acc[..., :start]
        new[..., start : start + k] = torch.gather(
            acc[..., start : start + region], 2, kept
        )
        tail = acc[..., start + region : length]
        new[..., start + k : start + k + tail.shape[-1]] = tail
        state.policy_state["tally"]["acc"] = new
        if (
            state.request["budget"] in self.fail_for
        ):  # the request's budget marks it as the one to fail
            raise torch.cuda.OutOfMemoryError(
                "simulated: no device memory for the re-laid state"
            )


class Allocator:
    def __init__(self):
        self.free_slots = set(range(1, SLOTS))  # slot 0: SGLang's padding slot

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        got = sorted(self.free_slots)[:n]
        self.free_slots -= set(got)
        return torch.tensor(got, dtype=torch.int64)

    def free_page_ids(self, pages):  # page size 1: a page is a slot
        s = pages.tolist()
        assert len(set(s)) == len(s), f"a page named twice: {sorted(s)}"
        assert not set(s) & self.free_slots, (
            f"double free: {sorted(set(s) & self.free_slots)}"
        )
        self.free_slots |= set(s)

    def available_size(self):
        return len(self.free_slots)


class Pool:
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.k = [torch.randn(SLOTS, HKV, D, generator=g) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, HKV, D, generator=g) for _ in range(LAYERS)]

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


def world(lengths, budget=12, recorder=None):
    policy = Tally(TallyOptions(threshold=20, budget=budget, window=4))
    alloc, pool = Allocator(), Pool()
    req_to_token = torch.zeros(len(lengths) + 1, WIDTH, dtype=torch.int32)
    reqs = []
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(lengths):
        row = i + 1
        req_to_token[row, :n] = alloc.alloc(n).to(torch.int32)
        state = KaraReqState(
            request={"budget": budget + i}
        )  # per-request budgets: one request per group
        state.policy_state = {
            "tally": {"acc": torch.rand(LAYERS, HKV, WIDTH, generator=g)}
        }
        reqs.append(
            FakeReq(
                rid=f"r{i}",
                prompt=4,
                generated=n - 4,
                max_new=1000,
                kara=state,
                row=row,
            )
        )
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    parts = types.SimpleNamespace(
        req_to_token=req_to_token,
        keys=pool.get_key_buffer,
        values=pool.get_value_buffer,
        layer_ids=list(range(LAYERS)),
        alloc=alloc.alloc,
        free_page_ids=alloc.free_page_ids,
        reserve=lambda n: None,
        available=alloc.available_size,
        evictable=lambda: 0,
        page_size=1,
        recompute_tokens=8192,
        forward_stream=None,
    )
    rt = types.SimpleNamespace(
        parts=parts,
        req_to_token=req_to_token,
        kv_pool=pool,
        policy=policy,
        allocator=alloc,
        recorder=recorder,
        stats=KaraStats(),
        forward=types.SimpleNamespace(
            add_offset=lambda rows, d: offsets.index_add_(
                0, rows, torch.full_like(rows, d)
            )
        ),
    )
    seq = torch.tensor(lengths)
    batch = types.SimpleNamespace(
        reqs=reqs,
        seq_lens=seq.clone(),
        orig_seq_lens=seq.clone().to(torch.int32),
        seq_lens_cpu=seq.clone(),
        seq_lens_sum=int(seq.sum()),
    )
    return rt, batch, reqs


def events(rt) -> EventRunner:
    """The event runner over the world's pools (the policy scores without queries), with the
    faults the environment injects (sgl_kara/diagnostics)."""
    shared = StepShared(
        rt.policy,
        rt.parts,
        DeviceStaging("cpu"),
        stats=rt.stats,
        observers=Observers(fault_observers()),
    )
    scorer = Scorer(shared, rt.forward, None)
    return EventRunner(shared, scorer, rt.forward, rt.recorder)


def snapshot(rt, req):
    row = int(req.kv.req_pool_idx)
    n = int(req.kv.kv_committed_len)
    slots = rt.req_to_token[row, :n].to(torch.int64).clone()
    return dict(
        slots=slots,
        k=[b[slots].clone() for b in rt.kv_pool.k],
        v=[b[slots].clone() for b in rt.kv_pool.v],
        lens=(int(req.kv.kv_committed_len), int(req.kv.kv_allocated_len)),
        state=(req.kara.pos_offset, req.kara.frontier, req.kara.compressions),
        acc=req.kara.policy_state["tally"]["acc"],
    )


def check_ownership(rt, reqs):
    named = []
    for r in reqs:
        named += rt.req_to_token[
            int(r.kv.req_pool_idx), : int(r.kv.kv_committed_len)
        ].tolist()
    assert len(named) == len(set(named)), "a slot is named by two rows"
    assert not set(named) & rt.allocator.free_slots, (
        "a slot is both free and named by a row"
    )
    assert set(named) | rt.allocator.free_slots == set(range(1, SLOTS)), (
        "a slot was lost"
    )


def plan(rt, reqs):
    seen = planning.snapshot(reqs, lambda r: r.kara, 1)
    planning.apply(planning.StepPlan(fixed=[s for s in seen if s.fixes]))
    jobs = planning.plan_jobs(rt.policy, seen, 30)
    assert len(jobs) == len(reqs)
    return jobs


@pytest.mark.parametrize("stage", ["relayout", "record", "commit_fault"])
def test_a_failure_after_the_kv_copy_leaves_that_request_as_it_was(
    monkeypatch, tmp_path, stage
):
    recorder = (
        EvictionRecorder(str(tmp_path / "ev.jsonl")) if stage == "record" else None
    )
    rt, batch, reqs = world([30, 31, 32], recorder=recorder)
    rt.policy.fail_for = set()
    victim = reqs[1]
    if stage == "relayout":
        rt.policy.fail_for = {victim.kara.request["budget"]}
    elif stage == "record":
        prepare = recorder.prepare

        def failing(rid, *a, **kw):
            if rid == victim.rid:
                raise OSError("simulated: the eviction record cannot be written")
            return prepare(rid, *a, **kw)

        monkeypatch.setattr(recorder, "prepare", failing)
    else:
        monkeypatch.setenv("KARA_INJECT_FAULT_RID_PREFIX", victim.rid)
        monkeypatch.setenv("KARA_INJECT_FAULT_AT", "commit")
    jobs = plan(rt, reqs)  # fixes P and the frontier
    before = {r.rid: snapshot(rt, r) for r in reqs}
    assert len({j.region.shape for j in jobs}) == 3  # per-request budgets: a group each
    events(rt).run(batch, jobs)
    check_ownership(rt, reqs)
    after = snapshot(rt, victim)
    b = before[victim.rid]
    assert (
        torch.equal(after["slots"], b["slots"])
        and after["lens"] == b["lens"]
        and after["state"] == b["state"]
    )
    assert all(
        torch.equal(x, y) for x, y in zip(after["k"] + after["v"], b["k"] + b["v"])
    )
    assert after["acc"] is b["acc"]  # the re-laid copy was dropped
    assert (
        victim.to_finish is not None
        and victim.to_finish.status_code == 500
        and not victim.kara.enabled
    )
    for r in reqs:
        if r is not victim:
            assert (
                r.kara.compressions == 1
                and r.kv.kv_committed_len < before[r.rid]["lens"][0]
            )
            assert r.to_finish is None
    assert rt.stats.failed_requests == 1 and rt.stats.requests_compressed == 2


def test_a_failing_group_is_undone_and_retried_one_by_one():
    """Three requests in one group (same shape), the middle one failing in its re-layout: the
    group is undone whole (no row touched), then the two others are compressed alone."""
    rt, batch, reqs = world([30, 30, 30])
    for r in reqs:
        r.kara.request["budget"] = 12
    victim = reqs[1]
    victim.kara.policy_state["fail"] = True
    rt.policy.fail_for = set()
    orig = Tally.on_compacted

    def relayout(self, state, *a):
        orig(self, state, *a)
        if state.policy_state.get("fail"):
            raise RuntimeError("simulated re-layout failure")

    Tally.on_compacted = relayout
    try:
        jobs = plan(rt, reqs)
        before = {r.rid: snapshot(rt, r) for r in reqs}
        assert len({j.region.shape for j in jobs}) == 1
        events(rt).run(batch, jobs)
    finally:
        Tally.on_compacted = orig
    check_ownership(rt, reqs)
    assert torch.equal(snapshot(rt, victim)["slots"], before[victim.rid]["slots"])
    assert [r.kara.compressions for r in reqs] == [1, 0, 1]
    assert batch.seq_lens.tolist() == [r.kv.kv_committed_len for r in reqs]


def test_a_committed_event_keeps_exactly_the_kept_entries():
    rt, batch, reqs = world([30, 33])
    rt.policy.fail_for = set()
    jobs = plan(rt, reqs)
    before = {r.rid: snapshot(rt, r) for r in reqs}
    events(rt).run(batch, jobs)
    check_ownership(rt, reqs)
    for j in jobs:
        r, b = j.req, before[j.req.rid]
        start, m = j.region.start, j.region.length
        acc = b["acc"][..., start : start + m]
        now = snapshot(rt, r)
        for layer in range(LAYERS):
            for h in range(HKV):
                kept = torch.sort(
                    torch.topk(acc[layer, h], j.region.keep, sorted=True).indices
                ).values
                want = b["k"][layer][start + kept, h]
                assert torch.equal(
                    now["k"][layer][start : start + j.region.keep, h], want
                )
        tail = b["k"][0][start + m :]
        assert torch.equal(
            now["k"][0][start + j.region.keep :], tail
        )  # the tail shifted down, bytes equal
        assert (
            r.kara.pos_offset == m - j.region.keep
            and r.kara.policy_state["tally"]["acc"] is not b["acc"]
        )
