"""SGLang's triton attention backend over Kara-compacted rows, run by Triton's CPU interpreter.

Slow (the interpreter runs every attention kernel in Python): run with ``pytest -m slow``.
retention 1.0 exercises the full compaction path, so greedy tokens must equal vanilla SGLang
with the same backend.
"""

import gpu_checks as gc
import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["Hello world", "Let x = 3. Let y"]
GEN = 64
GREEDY = {"max_new_tokens": GEN, "temperature": 0.0, "ignore_eos": True}


def _engine(kind, path, **kw):
    return gc.start(
        kind, path, **gc.device_options("triton", 1), **kw
    )  # interpreter on CPU


def test_triton_backend_over_compacted_rows(tiny_llama):
    ref_engine = _engine("sglang", tiny_llama)
    try:
        ref = [o["text"] for o in ref_engine.generate(PROMPTS, GREEDY)]
    finally:
        ref_engine.shutdown()
    engine = _engine(
        "kara",
        tiny_llama,
        kara_retention=1.0,
        kara_window=24,
        kara_buffer=4,
        kara_chunk_budget=2,
        kara_max_chunk=4,
        kara_period=4,
    )
    try:
        outs = engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()
    for out, r in zip(outs, ref):
        assert out["meta_info"]["kara"]["compressions"] >= 2
        assert out["text"] == r
