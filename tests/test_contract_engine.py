"""Engine-level parts of SGLang's serving contract under compression (tiny Llama, CPU).

- The threshold baselines (SnapKV, StreamingLLM, H2O, R-KV) at page size 16: several events per
  request, integrity checks clean at every event, each decode step equal to the Hugging Face
  reference with exactly the evicted entries masked (tests/oracle.py), every slot free after.
- The recompute pass of an event is split into forwards of at most ``--chunked-prefill-size``
  window tokens, each forward scoring its own requests (the split is checked here without an
  engine; tests/test_contract_openai.py runs it on a server against captured queries).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from oracle import check_policy_through_engine

from sgl_kara.policies.base import Region
from sgl_kara.scheduler.plan import Job
from sgl_kara.scheduler.scoring import Scorer
from sgl_kara.scheduler.shared import StepShared
from sgl_kara.scheduler.staging import DeviceStaging

# the tier run on SGLang with the upstream series applied too (docs/TESTING.md)
pytestmark = pytest.mark.patched

BASELINES = ["snapkv", "streaming", "h2o", "rkv"]


@pytest.mark.integration  # an engine per baseline at page size 16 (docs/TESTING.md, tiers)
@pytest.mark.parametrize("name", BASELINES)
def test_threshold_baseline_at_page_size_16(name, tiny_llama, tmp_path, engines):
    check_policy_through_engine(tiny_llama, tmp_path, 16, name, engines)


@pytest.mark.parametrize(
    "tokens, jobs, forwards", [(64, 4, 4), (80, 4, 2), (8192, 4, 1), (120, 5, 2)]
)
def test_recompute_pass_is_split_by_chunked_prefill_size(tokens, jobs, forwards):
    """Window queries of 40 tokens per request: a forward takes max(1, tokens // 40) requests,
    each sub-pass scores exactly its own requests' rows and slots, results in the jobs' order."""
    calls = []
    parts = SimpleNamespace(recompute_tokens=tokens)
    runner = Scorer(StepShared(None, parts, DeviceStaging("cpu")), None, None)

    def scoring_pass(sub, slots):
        return SimpleNamespace(
            jobs=sub,
            slots=slots,
            result=lambda: slots[:, None, None, :].float(),
            error=None,
        )

    def recompute(sub, rows, scoring, q_lo, n):
        assert [j.index for j in sub] == rows.tolist() and scoring.jobs is sub
        assert n == 40 and q_lo == [0] * len(sub)
        calls.append(len(sub))

    runner.scoring_pass, runner._recompute = scoring_pass, recompute
    js = [Job(i, None, None, Region(10, 32, 8, 0, 40)) for i in range(jobs)]
    rows = torch.arange(jobs)
    slots = torch.arange(jobs * 32).view(jobs, 32)
    scores = runner._recompute_scores(js, rows, slots, [0] * jobs, 40)
    assert len(calls) == forwards and sum(calls) == jobs
    assert max(calls) * 40 <= max(tokens, 40)
    assert torch.equal(scores, slots[:, None, None, :].float())
