"""R-KV (sgl_kara/policies/rkv.py): importance and redundancy against a direct computation."""

from __future__ import annotations

import math

import torch
from support import HKV, HQ, B, D, M
from support import make_policy as _policy
from support import score_input as _inputs


def test_rkv_scores_match_a_direct_computation():
    from sgl_kara.policies.rkv import rkv_importance, rkv_redundancy

    p = _policy("rkv", budget=60, window=8, kernel=1, mix_lambda=0.3)
    inp = _inputs(p)
    q, k = inp.queries, inp.keys()
    imp = torch.zeros(B, HKV, M)
    red = torch.zeros(B, HKV, M)
    g = HQ // HKV
    for b in range(B):
        for h in range(HKV):
            logits = torch.stack(
                [
                    torch.stack(
                        [q[b, w, h * g + j] @ k[b, :, h].T for j in range(g)]
                    ).amax(0)
                    for w in range(q.shape[1])
                ]
            ) / math.sqrt(D)  # [w, M]
            imp[b, h] = torch.softmax(logits, dim=-1).mean(0)
            kn = k[b, :, h] / (k[b, :, h].norm(dim=-1, keepdim=True) + 1e-8)
            sim = kn @ kn.T
            sim.fill_diagonal_(0)
            for i in range(M):
                similar = (sim[i] > 0.5).nonzero().flatten()
                sim[i, int(similar.max()) if len(similar) else 0] = 0
            red[b, h] = torch.softmax(sim.mean(0), dim=-1)
    torch.testing.assert_close(rkv_importance(q, k, 1), imp)
    torch.testing.assert_close(rkv_redundancy(k, 0.5), red)
    torch.testing.assert_close(p.score(inp), 0.3 * imp - 0.7 * red)
    assert (
        p.options.threshold == 60 + 128
    )  # unset: budget + the reference implementation's buffer
