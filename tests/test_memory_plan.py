"""Kara's memory beside the KV pool on a GPU, planned from the real model (sgl_kara/memory_plan.py,
startup.reserve_device_memory): Qwen3-8B and Llama-3-70B, from their published configs (a
checkpoint directory with config.json and the safetensors index, no weights), at TP 1 and 8 on
an 80 GB H100 (CUDA assumed, SGLang's own resolution of the server args).

- The weights come from the index (not 0), per rank under TP; the request limit is SGLang's own
  when the user sets none; every Kara structure is bounded by the request limit and the window,
  not by the pool: Kara's share of the GPU stays within 1% at SGLang's defaults.
- Where the weights and Kara's memory leave no pool (Llama-3-70B on one H100), the start-up
  refuses, naming the flags to change.
- The parameter count a config implies (used where no index is at hand) is within 2% of the
  published one.
- One recompute forward's activations (it runs on the schedule stream, whose caching-allocator
  pool SGLang's plan does not cover) are planned: their bytes, from the published widths, and
  their share of an 80 GB GPU for Qwen3-8B and Llama-3-70B at TP 1 and 8.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_gpu_resolution import H100_MIB, cuda_assumed  # noqa: F401  (fixture)

from sgl_kara.memory_plan import sglang_max_running
from sgl_kara.model_shape import ModelShape, config_parameters

# Published configs (the fields SGLang and Kara read) and safetensors index sizes (bf16).
QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
QWEN3_8B_BYTES = 16_381_470_720
LLAMA3_70B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
LLAMA3_70B_BYTES = 141_107_412_992
MODELS = {
    "qwen3-8b": (QWEN3_8B, QWEN3_8B_BYTES),
    "llama-3-70b": (LLAMA3_70B, LLAMA3_70B_BYTES),
}
GPU = H100_MIB * (1 << 20)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, (config, size) in MODELS.items():
        d = tmp_path_factory.mktemp(name)
        (d / "config.json").write_text(json.dumps(config))
        index = {"metadata": {"total_size": size}, "weight_map": {}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        out[name] = str(d)
    return out


def test_a_config_implies_its_published_parameter_count():
    import types

    for config, size in MODELS.values():
        params = config_parameters(types.SimpleNamespace(**config))
        assert abs(params * 2 - size) / size < 0.02, (params * 2, size)


def _plan(model, tp, monkeypatch, *argv):
    """Kara's memory plan for a server of ``model`` at ``--tp-size tp`` with sgl_kara's
    defaults (SGLang's resolution of the flags, CUDA assumed): (server args, shape, sizes)."""
    from sgl_kara import _sglang as adapter
    from sgl_kara import startup
    from sgl_kara.config import KaraConfig

    server_args = adapter.prepare_server_args(
        ["--model-path", model, "--tp-size", str(tp), *argv]
    )
    cfg = startup.resolve_query_source(KaraConfig(), server_args, None)
    shape = startup.model_shape(server_args)
    sizes = startup.reserve_device_memory(server_args, cfg, shape)
    return cfg, server_args, shape, sizes


@pytest.mark.parametrize("tp", [1, 8])
def test_qwen3_8b_takes_under_one_percent(cuda_assumed, checkpoints, monkeypatch, tp):  # noqa: F811
    cfg, sa, shape, sizes = _plan(checkpoints["qwen3-8b"], tp, monkeypatch)
    assert cfg.query_source == "recompute"  # decode graphs stay on
    assert shape.kv_heads == max(1, 8 // tp) and shape.tp_size == tp
    assert shape.weight_bytes(2) == -(-QWEN3_8B_BYTES // tp)
    share = sum(sizes.values()) / GPU
    assert 0 < share <= 0.01, sizes
    # bounded by the request limit and the window: a spread job per request holding a window,
    # one event chunk; the pool alone would allow far more
    pool = sizes["spread_scores"] // (shape.layers * shape.kv_heads * 512 * 4)
    assert pool <= sglang_max_running(10**9, shape.context_len)


@pytest.mark.parametrize("tp", [8])
def test_llama_3_70b_takes_under_one_percent_per_rank(
    cuda_assumed,  # noqa: F811
    checkpoints,
    monkeypatch,
    tp,
):
    cfg, sa, shape, sizes = _plan(checkpoints["llama-3-70b"], tp, monkeypatch)
    assert shape.kv_heads == 1 and shape.layers == 80
    assert shape.weight_bytes(2) == -(-LLAMA3_70B_BYTES // tp)
    assert 0 < sum(sizes.values()) / GPU <= 0.01, sizes


def test_llama_3_70b_on_one_gpu_leaves_no_pool(cuda_assumed, checkpoints, capsys):  # noqa: F811
    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(["--model-path", checkpoints["llama-3-70b"]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "leaves no KV pool" in err, err
    assert "--tp-size" in err and "--mem-fraction-static" in err


def test_a_checkpoint_without_weights_at_hand_is_sized_by_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    shape = ModelShape.from_model_path(str(tmp_path))
    assert shape.weight_file_bytes == 0
    assert abs(shape.weight_bytes(2) - QWEN3_8B_BYTES) / QWEN3_8B_BYTES < 0.02


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_recompute_forwards_activations_are_planned(model, tp):
    """A recompute forward of at most 2,048 tokens (memory_plan.MAX_RECOMPUTE_TOKENS) holds,
    through one layer on one rank, the residual stream, the hidden state and its norm, q / k / v
    and the attention output, and the MLP's gate, up and product: computed here from the
    published widths, in bf16; its share of an 80 GB GPU (printed: 0.28% for Qwen3-8B, 0.62%
    for Llama-3-70B at TP 1; 0.09% and 0.18% per rank at TP 8) stays under 1%."""
    import types

    from sgl_kara.memory_plan import (
        MAX_RECOMPUTE_TOKENS,
        KaraFootprint,
        kara_memory,
        recompute_tokens,
    )

    config, _ = MODELS[model]
    shape = ModelShape.from_config(types.SimpleNamespace(**config)).per_rank(tp)
    hidden, inter = config["hidden_size"], config["intermediate_size"] // tp
    q, kv = (
        config["num_attention_heads"] // tp,
        max(1, config["num_key_value_heads"] // tp),
    )
    d = config.get("head_dim") or hidden // config["num_attention_heads"]
    per_token = 3 * hidden + (2 * q + 2 * kv) * d + 3 * inter
    tokens = recompute_tokens(None)
    assert tokens == MAX_RECOMPUTE_TOKENS == recompute_tokens(16384)
    assert recompute_tokens(512) == 512  # a smaller chunked-prefill budget is kept
    plan = KaraFootprint(
        pool_tokens=100_000,
        running=256,
        region_tokens=512,
        query_tokens=512,
        recompute_tokens=tokens,
        recomputes=True,
    )
    got = kara_memory(shape, 2, plan)["recompute_activations"]
    assert got == tokens * per_token * 2
    print(
        f"\n{model} TP {tp}: recompute activations {got / 2**20:.0f} MiB, {got / GPU:.4f}"
    )
    assert got / GPU < 0.01
    assert (
        kara_memory(shape, 2, dataclasses.replace(plan, recomputes=False))[
            "recompute_activations"
        ]
        == 0
    )
