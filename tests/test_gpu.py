"""The GPU suite (``pytest -m gpu``; skipped without CUDA): the runtime on SGLang's GPU attention
backends, page sizes 1 and 64, decode CUDA graphs, both query sources; the exactness oracle; a
retraction storm; kernels on serving shapes; memory per event. ``bench/gpu_suite.py`` runs the same
checks (tests/gpu_checks.py) and writes a results file; with ``--cpu`` it runs the parts that can
here. Budget: < 10 minutes on one H100.
"""

from __future__ import annotations

import pytest
import torch

import gpu_checks as gc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BACKENDS = ["fa3", "flashinfer", "triton"]


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    return gc.write_gpu_model(str(tmp_path_factory.mktemp("gpu_llama")))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("query_source", ["recompute", "capture"])
def test_full_retention_token_identical(gpu_model, backend, page, query_source):
    r = gc.token_identity(gpu_model, backend, page, query_source)
    assert min(r["compressions"]) >= 2, r
    assert r["identical"], r
    assert r["cuda_graphs"] == (query_source == "recompute"), r


@pytest.mark.parametrize("backend, page, query_source", [("fa3", 1, "recompute"), ("flashinfer", 64, "capture"),
                                                         ("triton", 1, "capture")])
def test_oracle_after_events(gpu_model, backend, page, query_source, tmp_path):
    """With decode CUDA graphs on (recompute), this also checks the graph runner's static positions
    buffer: it is copied from ForwardBatch.positions, which the positions hook offsets."""
    r = gc.oracle(gpu_model, backend, page, query_source, str(tmp_path))
    assert r["max_err"] < r["tol"], r


@pytest.mark.parametrize("page", [1, 64])
def test_retraction_storm(gpu_model, page):
    r = gc.retraction_storm(gpu_model, "flashinfer", page)
    assert r["all_finished"] and r["all_slots_free"] and r["retractions"] > 0, r


def test_kernels_on_serving_shapes():
    r = gc.kernels(layers=32, kv_heads=8, head_dim=128, slots=1 << 20)
    assert r["compact_exact"] and r["copy_exact"] and r["score_rel_err"] < 2e-2, r


def test_event_memory_is_bounded(gpu_model):
    r = gc.event_memory(gpu_model, "fa3", 1)
    assert r["events"] > 0 and 0 < r["event_peak_bytes"] < 1 << 30, r
