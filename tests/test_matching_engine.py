"""Equal KV at every decode step, through the runtime: Kara and threshold baselines matched to it
(``custom_params.kara.match_kara``) on the tiny Llama hold the same KV rows at every decode step of
an answer (KARA_TRACE: the rows the running request holds per step), and each request's
``meta_info.kara`` (final, peak, mean) equals Kara's trajectory at its length
(sgl_kara/policies/trajectory.py), its max_new_tokens included. Small windows (W 32, U 8, r 0.25,
delta 4) so that an answer of a few hundred tokens crosses dozens of events."""

from __future__ import annotations

import json

import pytest

from sgl_kara.policies.trajectory import Schedule, trajectory

SPEC = dict(window=32, buffer=8, retention=0.25, period=4, recent=0)
PROMPT = [1, 17, 93, 5, 200, 41, 7, 300, 12, 64, 3, 88]
LONG = 300
LENGTHS = (9, 40, 77, 150, 203)


def _engine(engines, model, policy, trace):
    # overlap off, as the harnesses run: SGLang's overlap scheduler plans one more decode step of
    # a request before its end is known, and the runtime's mean counts that step too
    opts = dict(
        kara_policy=policy,
        kara_spread="off",
        kara_max_seqs=64,
        disable_overlap_schedule=True,
    )
    if policy == "kara":
        opts.update(
            kara_window=SPEC["window"],
            kara_buffer=SPEC["buffer"],
            kara_retention=SPEC["retention"],
            kara_period=SPEC["period"],
        )
    else:  # server-wide values only need to be valid: every request brings match_kara
        prefix = f"kara_{policy}_"
        opts.update(
            {prefix + "window": 4, prefix + "budget": 12, prefix + "threshold": 36}
        )
    return engines("kara", model, env={"KARA_TRACE": str(trace)}, **opts)


def _run(engine, policy, lengths):
    params = []
    for g in lengths:
        sp = {"max_new_tokens": g, "temperature": 0.0, "ignore_eos": True}
        if policy != "kara":
            sp["custom_params"] = {"kara": {"match_kara": dict(SPEC)}}
        params.append(sp)
    outs = engine.generate(input_ids=[PROMPT] * len(lengths), sampling_params=params)
    return [o["meta_info"] for o in outs]


def _rows(trace) -> list[int]:
    return [json.loads(line)["rows"] for line in trace.read_text().splitlines()]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tmp_path_factory.mktemp("matching_traces")


@pytest.fixture(scope="module")
def runs(tiny_llama, engines, traces):
    """Per policy: (the rows per decode step of one LONG-token answer, each request's meta of
    the LENGTHS batch)."""
    out = {}
    for policy in ("kara", "streaming", "snapkv"):
        trace = traces / f"{policy}.jsonl"
        engine = _engine(engines, tiny_llama, policy, trace)
        (long_meta,) = _run(engine, policy, [LONG])
        rows = _rows(trace)
        metas = _run(engine, policy, list(LENGTHS))
        out[policy] = (rows, long_meta, metas)
    return out


@pytest.mark.parametrize("policy", ["streaming", "snapkv"])
def test_matched_baseline_holds_karas_rows_at_every_step(runs, policy):
    kara_rows, kara_meta, _ = runs["kara"]
    rows, meta, _ = runs[policy]
    assert len(rows) == len(kara_rows) >= LONG - 1
    assert rows == kara_rows
    assert meta["kara"]["compressions"] == kara_meta["kara"]["compressions"] >= 10
    for key in ("kv_physical_len", "kv_peak_len", "kv_mean_len"):
        assert meta["kara"][key] == kara_meta["kara"][key], key


@pytest.mark.parametrize("policy", ["kara", "streaming", "snapkv"])
def test_every_request_ends_on_karas_trajectory(runs, policy):
    """The runtime's numbers against the pure function, each request at its own length and
    max_new_tokens; the per-step rows of the long answer against its trajectory (the trace reads
    the batch after the step's event: a constant offset, the prompt and the row being fed)."""
    rows, long_meta, metas = runs[policy]
    prompt = len(PROMPT)
    sched = Schedule(**SPEC)
    for g, meta in [(LONG, long_meta), *zip(LENGTHS, metas)]:
        t = trajectory(sched, g)
        k = meta["kara"]
        assert meta["completion_tokens"] == g
        assert k["kv_physical_len"] - prompt == t.final(g), g
        assert k["kv_peak_len"] - prompt == t.peak_kv(g), g
        assert k["kv_mean_len"] - prompt == pytest.approx(t.mean(g), abs=1e-9), g
    t = trajectory(sched, LONG)
    offsets = {r - t.after(s) for s, r in enumerate(rows[: LONG - 1], 1)}
    assert len(offsets) == 1 and offsets.pop() in (prompt, prompt + 1)
