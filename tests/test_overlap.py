"""Compression under SGLang's overlap scheduler, on engines (tiny Llama, W 16, U 4, period 4:
events every few tokens of every request).

    plain SGLang, overlap on             the reference
    sgl_kara, overlap on, spread even    the defaults: events ordered after the overlapped
                                         forward, windows scored a few queries per step
    sgl_kara, overlap off, spread off    the paper's schedule on SGLang's normal scheduler

Per-request retention 1.0 runs the whole event path (score, select, compact into fresh slots)
and must reproduce plain SGLang's tokens exactly under overlap; at retention 0.25 the overlap
scheduler and the spread scoring may change when work happens, never what is kept: the same
evicted positions (KARA_RECORD_EVICTIONS), tokens and lengths as the paper's schedule without
overlap. Integrity checks run at every event (prefix, ownership, offsets, and a request's token
count agreeing with SGLang's under either scheduler). A fault injected just before an event's
commit (KARA_INJECT_FAULT_AT=commit) fails that request alone and leaves the pool whole.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from support import flush_when_idle

pytestmark = pytest.mark.integration  # engines of their own (docs/TESTING.md, tiers)

WINDOW = dict(kara_window=16, kara_buffer=4, kara_period=4)
PROMPTS = [[1 + (i * 7 + j) % 200 for j in range(10 + 3 * i)] for i in range(6)]
GREEDY = {"max_new_tokens": 80, "temperature": 0, "ignore_eos": True}
FAULT = "fault-"


@pytest.fixture(scope="module")
def runs(engines, tiny_llama, tmp_path_factory):
    """Every engine's outputs, run one engine at a time."""
    tmp = tmp_path_factory.mktemp("overlap")
    out = {}
    vanilla = engines("sglang", tiny_llama, disable_overlap_schedule=False)
    out["vanilla"] = vanilla.generate(
        input_ids=PROMPTS,
        sampling_params={**GREEDY},
        return_logprob=True,
        logprob_start_len=-1,
    )
    for name, options in (
        ("overlap", dict(disable_overlap_schedule=False, kara_spread="even")),
        ("plain", dict(disable_overlap_schedule=True, kara_spread="off")),
    ):
        evictions = tmp / f"{name}.jsonl"
        env = {
            "KARA_CHECK_INTEGRITY": "1",
            "KARA_RECORD_EVICTIONS": str(evictions),
            "KARA_INJECT_FAULT_RID_PREFIX": FAULT,
            "KARA_INJECT_FAULT_AT": "commit",
        }
        kara = engines("kara", tiny_llama, env=env, **WINDOW, **options)
        full = kara.generate(
            input_ids=PROMPTS,
            sampling_params={**GREEDY, "custom_params": {"kara": {"retention": 1.0}}},
            return_logprob=True,
            logprob_start_len=-1,
            rid=[f"full-{i}" for i in range(len(PROMPTS))],
        )
        part = kara.generate(
            input_ids=PROMPTS,
            sampling_params={**GREEDY, "custom_params": {"kara": {"retention": 0.25}}},
            rid=[f"part-{i}" for i in range(len(PROMPTS))],
        )
        faulted = None
        if name == "overlap":
            import asyncio

            # the failing request and two others, running together (in the same events)
            calls = [
                kara.async_generate(
                    input_ids=PROMPTS[0], sampling_params=GREEDY, rid=f"{FAULT}0"
                )
            ]
            calls += [
                kara.async_generate(input_ids=p, sampling_params=GREEDY, rid=f"ok-{i}")
                for i, p in enumerate(PROMPTS[1:3])
            ]
            faulted = asyncio.get_event_loop().run_until_complete(
                asyncio.gather(*calls, return_exceptions=True)
            )
        assert flush_when_idle(kara), f"{name}: the pool is not whole after the runs"
        state = kara.get_server_info()["internal_states"][0]["kara"]
        out[name] = dict(
            full=full,
            part=part,
            faulted=faulted,
            evicted=_evictions(evictions),
            state=state,
        )
    return out


def _evictions(path) -> dict:
    """rid -> [(logical_len, evicted positions per layer and head), ...]"""
    out = defaultdict(list)
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["rid"]].append((rec["logical_len"], rec["evicted"]))
    return out


def test_retention_one_under_overlap_is_token_identical_to_plain_sglang(runs):
    for name in ("overlap", "plain"):
        for want, got in zip(runs["vanilla"], runs[name]["full"]):
            assert got["output_ids"] == want["output_ids"], name
            assert got["meta_info"]["kara"]["compressions"] >= 4, got["meta_info"][
                "kara"
            ]
            lp = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
            ref = [x[0] for x in want["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(lp, ref)) < 1e-4, name


def test_overlap_and_spread_change_when_work_runs_not_what_is_kept(runs):
    a, b = runs["overlap"], runs["plain"]
    assert a["state"]["spread_queries"] > 0 and b["state"]["spread_queries"] == 0
    for x, y in zip(a["part"], b["part"]):
        assert x["output_ids"] == y["output_ids"]
        mx, my = x["meta_info"]["kara"], y["meta_info"]["kara"]
        assert mx["compressions"] == my["compressions"] >= 4
        assert (
            mx["kv_physical_len"] == my["kv_physical_len"] < 0.6 * mx["kv_logical_len"]
        )
    for i in range(len(PROMPTS)):
        rid = f"part-{i}"
        assert a["evicted"][rid] == b["evicted"][rid] and len(a["evicted"][rid]) >= 4, (
            rid
        )
    assert a["state"]["failed_requests"] == 1 and b["state"]["failed_requests"] == 0


def test_a_fault_before_an_event_commits_fails_that_request_alone(runs):
    error, ok1, ok2 = runs["overlap"]["faulted"]
    assert (
        isinstance(error, Exception)
        and "500" in str(error)
        and "KV compression failed" in str(error)
    ), error
    assert "injected fault at commit" in str(error)
    for o in (ok1, ok2):
        assert o["meta_info"]["finish_reason"]["type"] == "length"
        assert o["meta_info"]["kara"]["compressions"] >= 4
    # after the flush no slot is held (SGLang's strict idle check ran in the scheduler too)
    for name in ("overlap", "plain"):
        state = runs[name]["state"]
        assert (
            state["free_slots"] == state["pool_slots"] and state["evictable_slots"] == 0
        ), state
