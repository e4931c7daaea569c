"""H2O (sgl_kara/policies/h2o.py): accumulated decode attention, its scores, its state under
compaction; the batched observer against the per-request loop it replaces and a per-head torch
reference."""

from __future__ import annotations

import math

import pytest
import torch
from test_policy_seam import HKV, HQ, D, _policy

from sgl_kara.policies import base
from sgl_kara.policies import h2o as h2o_mod
from sgl_kara.policies.base import ObserveInput, RowView, ScoreInput
from sgl_kara.scheduler.state import KaraReqState


def loop_observe(acc: dict, layer: int, queries, k_buffer, row_slots, states) -> None:
    """The observer as a loop over requests (one softmax per request and layer): accumulators
    [H_kv, L] of whole rows, from row position 0, by ``id(state)``."""
    hq, d = queries.shape[1], queries.shape[2]
    hkv = k_buffer.shape[1]
    for i, (slots, state) in enumerate(zip(row_slots, states)):
        if state is None or not state.enabled:
            continue
        keys = k_buffer[slots]
        q = queries[i].float().reshape(hkv, hq // hkv, d)
        probs = torch.softmax(
            torch.einsum("hgd,lhd->hgl", q, keys.float()) / math.sqrt(d), dim=-1
        ).sum(1)
        per = acc.setdefault((id(state), layer), torch.zeros(hkv, 0))
        if per.shape[1] < slots.numel():
            per = torch.cat(
                [per, torch.zeros(hkv, slots.numel() - per.shape[1])], dim=1
            )
        per[:, : slots.numel()] += probs
        acc[(id(state), layer)] = per


def test_h2o_accumulates_decode_attention_and_follows_compaction():
    p = _policy("h2o", threshold=80, budget=60)
    assert p.options.window == 30  # unset: half the budget (the paper's even split)
    g = torch.Generator().manual_seed(3)
    k_buffer = torch.randn(64, HKV, D, generator=g)
    state = KaraReqState()
    rows = [
        torch.arange(5, 5 + n) for n in (7, 8, 9)
    ]  # three decode steps of one request: prompt of 6
    expect = torch.zeros(HKV, 9)
    for slots in rows:
        q = torch.randn(1, HQ, D, generator=g)
        p.observe(ObserveInput(1, q, k_buffer, [slots], [state]))
        for h in range(HQ):
            kv = h // (HQ // HKV)
            att = torch.softmax(k_buffer[slots][:, kv] @ q[0, h] / math.sqrt(D), dim=0)
            expect[kv, : len(slots)] += att
    # Only decoded entries are kept: rows from the length before the first decode token (6).
    assert state.policy_state["h2o_base"] == 6
    acc = state.policy_state["h2o"][1]
    torch.testing.assert_close(acc[:3].T, expect[:, 6:9])
    assert (acc[3:] == 0).all()
    # score reads the region's accumulated attention; rows below the base have none
    inp = ScoreInput(
        1,
        None,
        k_buffer,
        torch.zeros(1, 4, dtype=torch.long),
        [RowView(6, 6, 9, 0, state)],
        [base.Region(6, 2, 1)],
    )
    torch.testing.assert_close(p.score(inp)[0][:, :3], expect[:, 6:9])
    inp = ScoreInput(
        1,
        None,
        k_buffer,
        torch.zeros(1, 4, dtype=torch.long),
        [RowView(4, 4, 9, 0, state)],
        [base.Region(4, 4, 2)],
    )
    got = p.score(inp)[0]
    assert (got[:, :2] == 0).all()
    torch.testing.assert_close(got[:, 2:], expect[:, 6:8])
    # compaction: rows [6, 8) -> kept 1 (head 0), 0 (head 1); row 8 moves to 7
    kept = torch.tensor([[[1], [0]]] * 2)  # [layers, H_kv, K]
    p.on_compacted(state, 6, 2, kept, 9)
    new = state.policy_state["h2o"][1]
    torch.testing.assert_close(new[0, 0], expect[0, 7])
    torch.testing.assert_close(new[0, 1], expect[1, 6])
    torch.testing.assert_close(new[1], expect[:, 8])
    assert (new[2:] == 0).all()


def test_region_below_the_base_is_relaid_with_zeros():
    """After a retraction the first observed length is past the prompt: a region from P re-lays
    the unobserved rows as zeros and moves the base down."""
    p = _policy("h2o", threshold=80, budget=60)
    g = torch.Generator().manual_seed(4)
    k_buffer = torch.randn(64, HKV, D, generator=g)
    state = KaraReqState()
    for n in (11, 12):
        p.observe(
            ObserveInput(
                0,
                torch.randn(1, HQ, D, generator=g),
                k_buffer,
                [torch.arange(n)],
                [state],
            )
        )
    acc = state.policy_state["h2o"][0].clone()
    assert state.policy_state["h2o_base"] == 10
    kept = torch.tensor(
        [[[0, 5], [1, 6]]]
    )  # region rows [4, 12) -> rows 4, 9 (head 0); 5, 10 (head 1)
    p.on_compacted(state, 4, 8, kept, 12)
    assert state.policy_state["h2o_base"] == 4
    new = state.policy_state["h2o"][0]
    assert (new[:2, 0] == 0).all() and new[0, 1] == 0  # rows 4, 9 and 5: never observed
    torch.testing.assert_close(new[1, 1], acc[0, 1])  # row 10, head 1
    assert (new[2:] == 0).all()


@pytest.mark.parametrize("chunk_tokens", [h2o_mod.OBSERVE_TOKENS, 40])
def test_batched_observer_matches_the_per_request_loop(monkeypatch, chunk_tokens):
    """Several decode steps of requests of different lengths (one disabled, one joining late) and
    two layers; with a chunk budget small enough to split the batch (40 padded entries) or not.
    Every accumulator equals the loop's whole-row accumulator over the decoded rows, the rows
    below the base hold nothing, and a disabled request keeps no state."""
    monkeypatch.setattr(h2o_mod, "OBSERVE_TOKENS", chunk_tokens)
    p = _policy("h2o", threshold=80, budget=60)
    g = torch.Generator().manual_seed(7)
    k_buffer = torch.randn(512, HKV, D, generator=g)
    states = [KaraReqState() for _ in range(5)]
    states[2].enabled = False
    prompts = [3, 17, 9, 30, 5]
    slot_rows = [torch.randperm(512, generator=g)[:60] for _ in states]
    joined = [0, 0, 0, 0, 2]  # request 4 starts decoding at step 2
    ref: dict = {}
    for step in range(6):
        live = [i for i in range(5) if step >= joined[i]]
        row_slots = [slot_rows[i][: prompts[i] + step - joined[i] + 1] for i in live]
        sts = [states[i] for i in live]
        for layer in (0, 1):
            q = torch.randn(len(live), HQ, D, generator=g)
            p.observe(ObserveInput(layer, q, k_buffer, row_slots, sts))
            loop_observe(ref, layer, q, k_buffer, row_slots, sts)
    for i, st in enumerate(states):
        if not st.enabled:
            assert st.policy_state == {}
            continue
        b = st.policy_state["h2o_base"]
        assert b == prompts[i]
        n = prompts[i] + 6 - joined[i]
        for layer in (0, 1):
            want = ref[(id(st), layer)]
            assert (want[:, b:n] > 0).all()
            torch.testing.assert_close(
                st.policy_state["h2o"][layer][: n - b].T,
                want[:, b:n],
                rtol=1e-5,
                atol=1e-6,
            )
            assert (st.policy_state["h2o"][layer][n - b :] == 0).all()


def test_observer_reads_no_device_value_on_the_host():
    """Every tensor on the meta device (a host read such as .item() or .tolist() raises there):
    the batched observer plans its chunks from tensor shapes only."""
    p = _policy("h2o", threshold=80, budget=60)
    k_buffer = torch.empty(64, HKV, D, device="meta")
    states = [KaraReqState(), KaraReqState()]
    slots = [torch.empty(n, dtype=torch.int64, device="meta") for n in (7, 12)]
    for layer in (0, 1):
        p.observe(
            ObserveInput(
                layer, torch.empty(2, HQ, D, device="meta"), k_buffer, slots, states
            )
        )
    assert [s.policy_state["h2o"][1].shape[1] for s in states] == [HKV, HKV]
    assert [s.policy_state["h2o_base"] for s in states] == [6, 11]


def test_accumulators_stay_within_the_memory_bound():
    """observer_bytes assumes each request's accumulator holds at most 1.25 x its decoded entries
    + ACC_MIN_SLACK rows, growth included, and at most the pool's decoded entries in all."""
    from sgl_kara.model_shape import ModelShape

    state = KaraReqState()
    for n in range(
        1, 2000
    ):  # one more decoded entry per step, as the observer grows it
        acc = h2o_mod._accumulator(state, 0, HKV, n, "cpu")
        assert n <= acc.shape[0] <= 1.25 * n + h2o_mod.ACC_MIN_SLACK, (n, acc.shape)
    shape = ModelShape(
        layers=2,
        q_heads=HQ,
        kv_heads=HKV,
        head_dim=D,
        context_len=4096,
        checkpoint_dtype="float32",
        weight_file_bytes=0,
    )
    p = _policy("h2o", threshold=800, budget=600)
    g = torch.Generator().manual_seed(9)
    k_buffer = torch.randn(1600, HKV, D, generator=g)
    states = [KaraReqState() for _ in range(8)]
    steps = 20
    for step in range(steps):
        row_slots = [torch.arange(i * 200, i * 200 + 4 + step + 1) for i in range(8)]
        for layer in range(shape.layers):
            p.observe(
                ObserveInput(
                    layer,
                    torch.randn(8, HQ, D, generator=g),
                    k_buffer,
                    row_slots,
                    states,
                )
            )
    held = sum(t.numel() * 4 for s in states for t in s.policy_state["h2o"].values())
    workspace = h2o_mod.OBSERVE_TOKENS * (HKV * D * 8 + HQ * 8 + HKV * 8 + 16)
    pool = 8 * steps  # a pool holding exactly the decoded entries
    assert (
        held <= (h2o_mod.H2OPolicy.observer_bytes(shape, 4, pool, 8) - workspace) // 2
    )
