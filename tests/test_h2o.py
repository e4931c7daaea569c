"""H2O (sgl_kara/policies/h2o.py): accumulated decode attention, its scores, its state under compaction."""

from __future__ import annotations

import math

import torch

from sgl_kara.policies import base
from sgl_kara.policies.base import ObserveInput, RowView, ScoreInput
from sgl_kara.scheduler.state import KaraReqState
from test_policy_seam import D, HKV, HQ, _policy


def test_h2o_accumulates_decode_attention_and_follows_compaction():
    p = _policy("h2o", threshold=80, budget=60)
    assert p.options.window == 30  # unset: half the budget (the paper's even split)
    g = torch.Generator().manual_seed(3)
    k_buffer = torch.randn(64, HKV, D, generator=g)
    state = KaraReqState()
    rows = [torch.arange(5, 5 + n) for n in (7, 8, 9)]  # three decode steps of one request
    expect = torch.zeros(HKV, 9)
    for slots in rows:
        q = torch.randn(1, HQ, D, generator=g)
        p.observe(ObserveInput(1, q, k_buffer, [slots], [state]))
        for h in range(HQ):
            kv = h // (HQ // HKV)
            att = torch.softmax(k_buffer[slots][:, kv] @ q[0, h] / math.sqrt(D), dim=0)
            expect[kv, : len(slots)] += att
    acc = state.policy_state["h2o"][1]
    torch.testing.assert_close(acc[:, :9], expect)
    # score reads the region's accumulated attention
    inp = ScoreInput(1, None, k_buffer, torch.zeros(1, 4, dtype=torch.long), [RowView(2, 2, 9, 0, state)],
                     [base.Region(2, 4, 2)])
    torch.testing.assert_close(p.score(inp)[0], expect[:, 2:6])
    # compaction: rows [2, 6) -> kept 1 and 3 (head 0), 0 and 2 (head 1); rows 6..8 move to 4..6
    kept = torch.tensor([[[1, 3], [0, 2]]] * 2)  # [layers, H_kv, K]
    p.on_compacted(state, 2, 4, kept, 9)
    new = state.policy_state["h2o"][1]
    torch.testing.assert_close(new[:, :2], expect[:, :2])
    torch.testing.assert_close(new[0, 2:4], expect[0, [3, 5]])
    torch.testing.assert_close(new[1, 2:4], expect[1, [2, 4]])
    torch.testing.assert_close(new[:, 4:7], expect[:, 6:9])
    assert (new[:, 7:] == 0).all()
