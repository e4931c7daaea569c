"""The GPU suite (``pytest -m gpu``; skipped without CUDA): every check of the plan in
tests/gpu_checks.py -- token identity at retention 1.0 on SGLang's GPU attention backends, page
sizes 1 and 64, decode CUDA graphs on (recompute) and off (capture), each against vanilla SGLang
with the same graph setting; the exactness oracle; a retraction storm; the kernels at serving
shapes (bench/gpu_kernels.py); memory per event. ``bench/gpu_suite.py`` runs the same plan and
writes a results file. Budget: < 10 minutes on one H100, by construction (gpu_checks.budget_seconds,
checked without a GPU in tests/test_gpu_plan.py).
"""

from __future__ import annotations

import gpu_checks as gc
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PLAN = gc.plan(cpu=False)


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    return gc.write_gpu_model(str(tmp_path_factory.mktemp("gpu_llama")))


@pytest.mark.parametrize(
    "name, fn, args, starts, steps, ok", PLAN, ids=[c[0] for c in PLAN]
)
def test_gpu_check(gpu_model, tmp_path, name, fn, args, starts, steps, ok):
    f = getattr(gc, fn)
    if fn == "kernels":
        r = f()
    elif fn == "oracle":
        r = f(gpu_model, *args, str(tmp_path))
    else:
        r = f(gpu_model, *args)
    if fn == "token_identity":
        assert r["cuda_graphs"] == (args[2] == "recompute"), r
    assert ok(r), r
