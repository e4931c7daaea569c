"""Fidelity probe of the quality harness (bench/quality/fidelity.py) without an engine: the
per-step statistics against a direct computation, and the record -> force protocol of the logit
processor driven by fake requests."""

import json
from types import SimpleNamespace

import pytest
import torch

from bench.quality import fidelity

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration


def test_step_stats_matches_direct_kl():
    g = torch.Generator().manual_seed(0)
    ref_logits, logits = torch.randn(50, generator=g), torch.randn(50, generator=g)
    p, q = torch.softmax(ref_logits, -1), torch.softmax(logits, -1)
    want = float((p * (p.log() - q.log())).sum())
    # ref given unnormalised (shifted): step_stats renormalises it; agreement = same greedy choice
    agree, kl, nll, hit = fidelity.step_stats(
        logits, torch.log_softmax(ref_logits, -1) + 3.0, 4
    )
    assert agree == int(q.argmax() == p.argmax()) and kl == pytest.approx(
        want, rel=1e-5
    )
    assert nll == pytest.approx(float(-q[4].log()), rel=1e-5)
    assert (
        hit == int(int(q.argmax()) == 4)
        and fidelity.step_stats(logits, logits, int(q.argmax()))[3] == 1
    )
    agree, kl, _, _ = fidelity.step_stats(logits, logits.clone(), 4)
    assert agree == 1 and kl == pytest.approx(0.0, abs=1e-6)
    flipped = logits.clone()
    flipped[int(q.argmax())] = -10.0
    assert fidelity.step_stats(logits, flipped, 4)[0] == 0
    # a token masked in both runs (EOS under min_new_tokens) adds nothing, it is not nan
    masked = logits.clone()
    masked[7] = float("-inf")
    assert fidelity.step_stats(masked, masked.clone(), 4)[1] == pytest.approx(
        0.0, abs=1e-6
    )


def test_force_makes_token_the_greedy_choice():
    out = fidelity.force(torch.randn(20), 7)
    assert int(out.argmax()) == 7 and torch.isinf(out).sum() == 19


def test_record_with_tokens_forces_the_text(tmp_path):
    """Teacher-forced text: the full-KV record keeps every step's log-probabilities (of the
    logits as given) and emits the text's tokens, not its own greedy choices."""
    g = torch.Generator().manual_seed(2)
    steps = [torch.randn(1, 30, generator=g) for _ in range(3)]
    text = [int(s[0].argmin()) for s in steps]  # never the greedy choice
    proc = fidelity.FidelityProcessor()
    req = SimpleNamespace(output_ids=[])
    rec = [
        {
            "__req__": req,
            "fidelity": {
                "mode": "record",
                "dir": str(tmp_path),
                "k": 0,
                "tokens": text,
            },
        }
    ]
    for s in steps:
        out = _call(proc, [s[0].clone()], rec)
        req.output_ids.append(int(out[0].argmax()))
    assert req.output_ids == text
    rows = torch.from_numpy(
        fidelity._ref_rows(fidelity.ref_path(str(tmp_path), 0), 30).copy()
    )
    torch.testing.assert_close(rows, torch.log_softmax(torch.cat(steps), -1))


def _call(proc, rows, params):
    """One sampling step: logits rows [B, V] for the requests in params (each with __req__)."""
    logits = torch.stack(rows)
    return proc(logits, params)


def test_record_then_force_protocol(tmp_path):
    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(2, 30, generator=g) for _ in range(4)]  # [step][request, V]
    tokens = [[int(s[r].argmax()) for s in steps] for r in range(2)]
    proc = fidelity.FidelityProcessor()

    reqs = [SimpleNamespace(output_ids=[]) for _ in range(2)]
    rec = [
        {
            "__req__": reqs[r],
            "fidelity": {"mode": "record", "dir": str(tmp_path), "k": r},
        }
        for r in range(2)
    ]
    for s in steps:
        out = _call(proc, list(s), rec)
        assert torch.equal(out, s)  # recording leaves the logits alone
        for r in range(2):
            reqs[r].output_ids.append(int(out[r].argmax()))
    assert [r.output_ids for r in reqs] == tokens

    # Force request 0 through the identical logits and request 1 through perturbed ones, in a
    # batch with a request that has no fidelity params.
    reqs = [SimpleNamespace(output_ids=[]) for _ in range(2)]
    forced = [
        {
            "__req__": reqs[r],
            "fidelity": {
                "mode": "force",
                "dir": str(tmp_path),
                "k": r,
                "tag": "p",
                "tokens": tokens[r],
            },
        }
        for r in range(2)
    ]
    other = {"__req__": SimpleNamespace(output_ids=[])}
    for t, s in enumerate(steps):
        perturbed = -s[1]  # reverses the ranking: never agrees
        out = _call(proc, [s[0], perturbed, s[0]], [forced[0], forced[1], other])
        for r in range(2):
            assert int(out[r].argmax()) == tokens[r][t]
            reqs[r].output_ids.append(tokens[r][t])
        assert torch.equal(out[2], s[0])
    same = json.load(open(fidelity.stats_path(str(tmp_path), "p", 0)))
    flipped = json.load(open(fidelity.stats_path(str(tmp_path), "p", 1)))
    assert same["agree"] == [1] * 4 and max(same["kl"]) < 1e-5
    assert flipped["agree"] == [0] * 4 and min(flipped["kl"]) > 0.1
    summary = fidelity.summarize(str(tmp_path), "p", [0, 1])
    assert summary["agree"] == 0.5 and summary["fid_tokens"] == 8
    with pytest.raises(RuntimeError, match="no stats for problems"):
        fidelity.summarize(str(tmp_path), "p", [0, 1, 2])


def test_force_rejects_out_of_order_steps(tmp_path):
    proc = fidelity.FidelityProcessor()
    req = SimpleNamespace(output_ids=[])
    proc(
        torch.zeros(1, 5),
        [
            {
                "__req__": req,
                "fidelity": {"mode": "record", "dir": str(tmp_path), "k": 0},
            }
        ],
    )
    req = SimpleNamespace(output_ids=[0, 0])  # step 2, but step 0 was never forced
    params = {
        "__req__": req,
        "fidelity": {
            "mode": "force",
            "dir": str(tmp_path),
            "k": 0,
            "tag": "x",
            "tokens": [0, 0, 0],
        },
    }
    with pytest.raises(RuntimeError, match="ref_0 has 1 rows"):
        proc(torch.zeros(1, 5), [params])


def test_disagreement_by_role(tmp_path):
    for k, agree in enumerate([[1, 0, 1], [0, 1]]):
        with open(fidelity.stats_path(str(tmp_path), "t", k), "w") as f:
            json.dump({"agree": agree, "kl": [0.0] * len(agree)}, f)
    roles = {
        0: ["arith", "arith"],
        1: ["pointer", "arith"],
    }  # problem 0's last step is past its roles
    assert fidelity.summarize(str(tmp_path), "t", [0, 1], roles)[
        "disagree_by_role"
    ] == {"arith": [1, 3], "pointer": [1, 1], "eos": [0, 1]}
