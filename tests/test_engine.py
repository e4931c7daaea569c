"""sgl_kara.Engine with policy none behaves exactly like sglang.Engine (tiny Llama fixture)."""

import pytest

from conftest import start_engine

PROMPTS = ["Hello world", "The answer is", "Let x = 3. Let y = x + 4, so", "Once upon a time"]
GREEDY = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def vanilla_outputs(tiny_llama):
    engine = start_engine("sglang", tiny_llama)
    try:
        return engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()


def test_policy_none_matches_sglang(tiny_llama, vanilla_outputs):
    engine = start_engine("kara", tiny_llama, kara_policy="none")
    try:
        outs = engine.generate(PROMPTS, GREEDY)
        # Out-of-vocabulary ids are rejected up front instead of crashing the scheduler.
        with pytest.raises(ValueError, match="out-of-vocabulary token id 100000"):
            engine.generate(input_ids=[100000, 5], sampling_params={"max_new_tokens": 2})
        assert engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    finally:
        engine.shutdown()
    for mine, ref in zip(outs, vanilla_outputs):
        assert mine["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
        assert mine["text"] == ref["text"]
        assert "kara" not in mine["meta_info"]


def test_engine_rejects_bad_option_before_loading(tiny_llama):
    import sgl_kara
    from sgl_kara.config import KaraConfigError
    from sgl_kara.support import UnsupportedFeature

    with pytest.raises(KaraConfigError, match="--kara-retention"):
        sgl_kara.Engine(model_path=tiny_llama, kara_retention=2.0)
    with pytest.raises(UnsupportedFeature, match="--enable-mixed-chunk"):
        sgl_kara.Engine(model_path=tiny_llama, enable_mixed_chunk=True)
