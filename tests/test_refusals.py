"""Every configuration the runtime does not support is refused at start-up (exit 2, the flag or
setting named), and the defaults a CUDA server resolves to, checked without a GPU.

The refusal table is support._UNSUPPORTED: each of its flags must have a case here, so a new
refusal cannot land untested.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from sgl_kara import startup as support
from sgl_kara.config import KaraConfig

# CLI arguments that turn each refused feature on.
FLAG_ARGS = {
    "--speculative-algorithm": ["--speculative-algorithm", "EAGLE"],
    "--enable-dp-attention": ["--enable-dp-attention"],
    "--pp-size": ["--pp-size", "2"],
    "--disaggregation-mode": ["--disaggregation-mode", "prefill"],
    "--enable-hierarchical-cache": ["--enable-hierarchical-cache"],
    "--enable-mixed-chunk": ["--enable-mixed-chunk"],
    "--enable-lmcache": ["--enable-lmcache"],
    "--enable-flexkv": ["--enable-flexkv"],
    "--enable-streaming-session": ["--enable-streaming-session"],
    "--enable-session-radix-cache": ["--enable-session-radix-cache"],
    "--enable-two-batch-overlap": ["--enable-two-batch-overlap"],
    "--enable-unified-memory": ["--enable-unified-memory"],
    "--num-continuous-decode-steps": ["--num-continuous-decode-steps", "2"],
    "--enable-hisparse": ["--enable-hisparse"],
    "--kv-cache-dtype": ["--kv-cache-dtype", "fp8_e4m3"],
}


def _parse_exit(argv, capsys) -> str:
    from conftest import PROXY_MODEL

    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(["--model-path", PROXY_MODEL, *argv])
    assert e.value.code == 2
    return "\n".join(
        line
        for line in capsys.readouterr().err.splitlines()
        if line.startswith("error:")
    )


def test_every_refusal_has_a_case():
    assert {flag for _, _, flag, _ in support._UNSUPPORTED} == set(FLAG_ARGS)


@pytest.mark.parametrize("flag", sorted(FLAG_ARGS))
def test_unsupported_flag_exits_2_naming_it(flag, capsys):
    err = _parse_exit(FLAG_ARGS[flag], capsys)
    assert f"error: {flag} is not supported with --kara-policy kara" in err, err


def test_unsupported_flag_is_fine_without_compression():
    """--kara-policy none is plain SGLang: nothing is refused on Kara's behalf."""
    from conftest import PROXY_MODEL

    from sgl_kara.launch_server import parse

    cfg, sa = parse(
        [
            "--model-path",
            PROXY_MODEL,
            "--kara-policy",
            "none",
            "--num-continuous-decode-steps",
            "2",
        ]
    )
    assert not cfg.enabled and sa.num_continuous_decode_steps == 2


@pytest.mark.parametrize("value", ["1", "true"])
def test_hnd_kv_layout_is_refused(value, monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", value)
    err = _parse_exit([], capsys)
    assert "SGLANG_USE_HND_KVCACHE" in err and "HND" in err, err


def test_mrope_model_is_refused(tmp_path, capsys):
    """A Qwen2-VL-style config (M-RoPE sections): position offsets would not reach mrope_positions."""
    from conftest import PROXY_MODEL

    cfg = json.load(open(f"{PROXY_MODEL}/config.json"))
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": [8, 12, 12]}
    model = tmp_path / "mrope"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    from sgl_kara.model_shape import ModelShape

    assert ModelShape.from_model_path(str(model)).mrope
    assert not ModelShape.from_model_path(PROXY_MODEL).mrope
    args = types.SimpleNamespace(
        model_path=str(model),
        device="cpu",
        dtype="float32",
        max_running_requests=8,
        max_total_tokens=4096,
        radix_cache_backend=None,
        disable_overlap_schedule=False,
        disable_cuda_graph=False,
    )
    with pytest.raises(support.UnsupportedFeature, match="--model-path .* M-RoPE"):
        support.prepare_server_args(args, KaraConfig())


def test_beam_search_is_refused_per_request():
    from sgl_kara.request_options import check_supported

    check_supported(types.SimpleNamespace(beam_width=None), "kara")
    check_supported(types.SimpleNamespace(beam_width=1), "kara")
    with pytest.raises(
        ValueError,
        match=r"beam_width=4 \(beam search\) is not supported with --kara-policy snapkv",
    ):
        check_supported(types.SimpleNamespace(beam_width=4), "snapkv")


# ------------------------------------------------------------------ models: refused before they load
def _model_dir(tmp_path, name: str, **config) -> str:
    """A checkpoint directory holding only a config.json (the start-up check reads no weights)."""
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=4096,
    )
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**base, **config}))
    return str(path)


LOCAL_ATTENTION_MODELS = {
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=4096
    ),
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        sliding_window=512,
        num_hidden_layers=12,
    ),
    "cohere2": dict(
        architectures=["Cohere2ForCausalLM"],
        model_type="cohere2",
        sliding_window=4096,
        num_hidden_layers=8,
    ),
    "exaone4": dict(
        architectures=["Exaone4ForCausalLM"],
        model_type="exaone4",
        sliding_window=4096,
        sliding_window_pattern=4,
        num_hidden_layers=8,
    ),
    "gpt_oss": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        sliding_window=128,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "llama4": dict(
        architectures=["Llama4ForCausalLM"],
        model_type="llama4_text",
        attention_chunk_size=8192,
    ),
}


@pytest.mark.parametrize("name", sorted(LOCAL_ATTENTION_MODELS))
def test_sliding_window_models_are_refused_at_start_up(tmp_path, capsys, name):
    """Local layers would attend past their trained window once compaction moves kept entries
    down: refused by the launcher (exit 2) and by sgl_kara.Engine, naming the model and its
    window, before SGLang parses a weight. GPT-OSS is refused with SGLang's hybrid SWA pool
    turned off as well (its per-layer window then reaches the plain pool)."""
    from sgl_kara.engine import build_server_args

    model = _model_dir(tmp_path, name, **LOCAL_ATTENTION_MODELS[name])
    arch = LOCAL_ATTENTION_MODELS[name]["architectures"][0]
    extra = ["--disable-hybrid-swa-memory"] if name == "gpt_oss" else []
    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(["--model-path", model, *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"error: --model-path {model} ({arch}) uses sliding-window attention" in err
    ), err
    with pytest.raises(
        support.UnsupportedFeature,
        match=rf"\({arch}\) uses sliding-window attention \(a \d+-token window",
    ):
        build_server_args({"model_path": model, "kara_policy": "snapkv"})


@pytest.mark.parametrize(
    "name, config, what",
    [
        (
            "deepseek_v3",
            dict(
                architectures=["DeepseekV3ForCausalLM"],
                model_type="deepseek_v3",
                kv_lora_rank=64,
                q_lora_rank=32,
                qk_rope_head_dim=16,
                qk_nope_head_dim=16,
                v_head_dim=16,
                n_routed_experts=4,
                num_experts_per_tok=2,
            ),
            "multi-head latent attention",
        ),
        (
            "qwen3_next",
            dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next"),
            "linear_attention layers",
        ),
    ],
)
def test_mla_and_hybrid_models_are_refused_at_start_up(
    tmp_path, capsys, name, config, what
):
    from sgl_kara.launch_server import parse

    model = _model_dir(tmp_path, name, **config)
    with pytest.raises(SystemExit) as e:
        parse(["--model-path", model])
    assert e.value.code == 2
    assert what in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, config",
    [
        (
            "mistral",
            dict(
                architectures=["MistralForCausalLM"],
                model_type="mistral",
                sliding_window=4096,
            ),
        ),
        (
            "qwen2",
            dict(
                architectures=["Qwen2ForCausalLM"],
                model_type="qwen2",
                sliding_window=32768,
                use_sliding_window=False,
            ),
        ),
    ],
)
def test_models_attending_globally_are_accepted(tmp_path, name, config):
    """A sliding_window SGLang 0.5.23 does not apply (Mistral's Llama model; Qwen2 without
    use_sliding_window) is no reason to refuse."""
    from sgl_kara.model_shape import ModelShape

    shape = ModelShape.from_model_path(_model_dir(tmp_path, name, **config))
    assert shape.local_layers == 0 and not shape.mla_rank and not shape.other_layers
    support.check_model(shape, name, "kara")


def _scheduler(
    pool,
    attention,
    decode_graph_runner=None,
    policy="kara",
    query_source="recompute",
    tp=1,
    kv_heads=2,
):
    from transformers import LlamaConfig

    model = torch.nn.ModuleList(attention)
    runner = types.SimpleNamespace(
        model=model, decode_cuda_graph_runner=decode_graph_runner
    )
    scheduler = types.SimpleNamespace(
        token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: pool),
        tp_worker=types.SimpleNamespace(model_runner=runner),
        tp_cpu_group=None,
        tp=tp,
        model_config=types.SimpleNamespace(
            hf_config=LlamaConfig(
                num_attention_heads=4,
                num_key_value_heads=kv_heads,
                hidden_size=64,
                num_hidden_layers=2,
            )
        ),
    )
    return scheduler, KaraConfig.build(policy=policy, query_source=query_source)


def test_the_scheduler_checks_the_built_model_again(monkeypatch):
    """Behind the start-up checks: a pool other than SGLang's MHA pool, an attention layer with
    a window, decode graphs captured for a configuration that needs the hook each step, KV heads
    replicated over tensor-parallel ranks for a policy that scores from attention."""
    from sgl_kara import _sglang as adapter
    from sgl_kara._sglang import MHATokenToKVPool, RadixAttention

    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 16, 2, "cpu", False)
    layers = [RadixAttention(4, 16, 1.0, 2, layer_id=i) for i in range(2)]
    support.check_runtime_supported(*_scheduler(pool, layers))
    support.check_runtime_supported(
        *_scheduler(pool, layers, decode_graph_runner=object())
    )  # graphs: fine for kara
    with pytest.raises(
        support.UnsupportedFeature,
        match="KV pools only; this model uses SimpleNamespace",
    ):
        support.check_runtime_supported(*_scheduler(types.SimpleNamespace(), layers))
    windowed = [
        RadixAttention(4, 16, 1.0, 2, layer_id=0, sliding_window_size=63),
        layers[1],
    ]
    with pytest.raises(
        support.UnsupportedFeature, match=r"sliding window \(63 tokens\)"
    ):
        support.check_runtime_supported(*_scheduler(pool, windowed))
    with monkeypatch.context() as m:  # two and four tensor-parallel ranks
        m.setattr(adapter, "tensor_parallel", lambda s: (0, s.tp, None))
        support.check_runtime_supported(*_scheduler(pool, layers, tp=2))
        support.check_runtime_supported(
            *_scheduler(pool, layers, tp=4, policy="streaming")
        )
        with pytest.raises(
            support.UnsupportedFeature, match="--tp-size 4 is not supported.*2 KV heads"
        ):
            support.check_runtime_supported(*_scheduler(pool, layers, tp=4))
    for kw in (dict(policy="h2o"), dict(query_source="capture")):
        support.check_runtime_supported(*_scheduler(pool, layers, **kw))
        with pytest.raises(
            support.UnsupportedFeature, match="decode CUDA graphs were captured"
        ):
            support.check_runtime_supported(
                *_scheduler(pool, layers, decode_graph_runner=object(), **kw)
            )


# ------------------------------------------------------------------ CUDA defaults, no GPU here
def _cuda_args(model, **kw):
    base = dict(
        model_path=model,
        device="cuda",
        dtype="bfloat16",
        max_running_requests=None,
        max_total_tokens=None,
        radix_cache_backend=None,
        disable_overlap_schedule=False,
        disable_cuda_graph=False,
        disable_decode_cuda_graph=False,
    )
    return types.SimpleNamespace(**{**base, **kw})


def test_cuda_server_keeps_sglang_sizing(monkeypatch, tiny_llama):
    """On CUDA sgl_kara sets no device, backend, page size, dtype or memory sizing: SGLang's apply."""
    from sgl_kara import server_setup

    monkeypatch.setattr(support, "cuda_available", lambda: True)
    assert server_setup.server_defaults(tiny_llama, {}) == {}
    assert server_setup.server_defaults(tiny_llama, {"device": "cuda"}) == {}
    cpu = server_setup.server_defaults(tiny_llama, {"device": "cpu"})
    assert cpu["attention_backend"] == "torch_native" and cpu["max_total_tokens"] > 0


def test_cuda_server_defaults_to_recompute_with_graphs_on(monkeypatch, tiny_llama):
    """SGLang's default request limit (unset) makes a capture ring per request unaffordable:
    auto resolves to recompute and decode CUDA graphs stay on; capture needs a known request
    limit (its ring is taken from the pool at start-up) and turns decode graphs off."""
    monkeypatch.setattr(support, "cuda_available", lambda: False)
    monkeypatch.setattr(
        support, "device_memory_bytes", lambda device: None
    )  # no GPU memory to plan with
    args = _cuda_args(tiny_llama)
    cfg = support.prepare_server_args(args, KaraConfig())
    assert cfg.query_source == "recompute"
    assert args.disable_cuda_graph is False and args.disable_decode_cuda_graph is False
    assert args.radix_cache_backend == "kara"
    with pytest.raises(
        support.UnsupportedFeature,
        match="--max-running-requests or --kara-query-ring-rows",
    ):
        support.prepare_server_args(
            _cuda_args(tiny_llama), KaraConfig.build(query_source="capture")
        )
    args = _cuda_args(tiny_llama, max_running_requests=16)
    cfg = support.prepare_server_args(args, KaraConfig.build(query_source="capture"))
    assert cfg.query_source == "capture" and args.disable_decode_cuda_graph is True


def test_cuda_auto_captures_only_with_decode_graphs_off(monkeypatch, tiny_llama):
    """A known, small request limit and GPU memory to spare: auto keeps recompute while SGLang
    would replay decode graphs (capture would turn them off), and picks capture where the user
    turned them off; a ring past 5% of the GPU stays at recompute."""
    monkeypatch.setattr(support, "cuda_available", lambda: True)
    monkeypatch.setattr(
        support, "reserve_device_memory", lambda *a: {}
    )  # tests/test_gpu_resolution.py
    monkeypatch.setattr(support, "device_memory_bytes", lambda device: 80 << 30)
    args = _cuda_args(tiny_llama, max_running_requests=16)
    assert support.prepare_server_args(args, KaraConfig()).query_source == "recompute"
    assert args.disable_decode_cuda_graph is False
    for off in (
        dict(disable_cuda_graph=True),
        dict(disable_decode_cuda_graph=True),
        dict(cuda_graph_backend_decode="disabled"),
    ):
        assert (
            support.prepare_server_args(
                _cuda_args(tiny_llama, max_running_requests=16, **off), KaraConfig()
            ).query_source
            == "capture"
        )
    monkeypatch.setattr(support, "device_memory_bytes", lambda device: 1 << 20)
    big = _cuda_args(tiny_llama, max_running_requests=4096, disable_cuda_graph=True)
    assert support.prepare_server_args(big, KaraConfig()).query_source == "recompute"


# ------------------------------------------------------------------ CPU sizing
def test_cpu_pool_is_sized_for_the_given_request_limit(tiny_llama):
    """--max-running-requests sizes the CPU pool like the default 8 does (max(context, running x
    1,024) tokens, within 5% of RAM), from the launcher's flags (strings) and Engine keywords alike."""
    from sgl_kara.cpu.memory import CPU_KV_SHARE, CPU_TOKENS_PER_REQUEST, MIN_TOKENS
    from sgl_kara.cpu.server import server_defaults
    from sgl_kara.memory_plan import total_ram_bytes
    from sgl_kara.model_shape import ModelShape

    shape = ModelShape.from_model_path(tiny_llama)
    by_ram = int(CPU_KV_SHARE * total_ram_bytes()) // shape.kv_bytes_per_token(4)
    for running in (8, 24):
        want = max(
            MIN_TOKENS,
            min(by_ram, max(shape.context_len, running * CPU_TOKENS_PER_REQUEST)),
        )
        for given in (
            {"max_running_requests": running},
            {"max_running_requests": str(running)},
        ):
            assert (
                server_defaults(tiny_llama, {"device": "cpu", **given})[
                    "max_total_tokens"
                ]
                == want
            )
    assert (
        want == 24 * CPU_TOKENS_PER_REQUEST > shape.context_len
    )  # the given limit, not 8, set it


def test_cpu_memory_check_counts_karas_event_and_observer_memory(
    monkeypatch, tiny_llama
):
    """The RAM check adds one event chunk's scores (32 bytes per region entry, layer and KV head,
    for as many requests as one recompute forward's token budget scores, at most the running
    ones), the spread jobs' partial scores (4 bytes per entry, for every running request holding
    a whole region), one recompute forward's activations (a policy that scores with queries)
    and H2O's observer memory; a machine that holds everything but that is refused, naming
    it."""
    from sgl_kara.cpu import server as cpu_server
    from sgl_kara.cpu.memory import MemoryConfigError, check_cpu_fit
    from sgl_kara.model_shape import ModelShape
    from sgl_kara.policies.h2o import H2OPolicy
    from sgl_kara.server_setup import prepare

    shape = ModelShape.from_model_path(tiny_llama)
    seen = {}
    real = cpu_server.check_cpu_fit
    monkeypatch.setattr(
        cpu_server, "check_cpu_fit", lambda *a, **kw: seen.update(kw) or real(*a, **kw)
    )
    monkeypatch.setattr(cpu_server, "available_ram_bytes", lambda: 1 << 40)

    def args():
        return types.SimpleNamespace(
            model_path=tiny_llama,
            device="cpu",
            dtype="float32",
            max_running_requests=8,
            max_total_tokens=4096,
            radix_cache_backend=None,
            disable_cuda_graph=False,
            disable_decode_cuda_graph=False,
            chunked_prefill_size=None,
            dp_size=1,
            tp_size=1,
            pp_size=1,
        )

    per_entry = shape.layers * shape.kv_heads
    h2o = KaraConfig.build(policy="h2o")
    prepare(args(), h2o)
    region = h2o.options.threshold + 1  # C_max + 1 entries per request
    budget = 2048  # tokens of one recompute forward (memory_plan.MAX_RECOMPUTE_TOKENS)
    chunk = min(8, budget // h2o.options.window)  # requests one recompute budget scores
    scores = chunk * region * per_entry * 32
    observer = H2OPolicy.observer_bytes(shape, 4, 4096, 8)
    assert seen["kara_workspace"] == scores + observer and observer > 0
    kara = KaraConfig.build(policy="kara", query_source="recompute")
    prepare(args(), kara)
    window = kara.options.window
    event = min(8, budget // window) * window * per_entry * 32
    spread = min(8, 4096 // window) * window * per_entry * 4  # --kara-spread even
    # the recompute forward through one layer: residual, hidden and its norm, q / k / v and the
    # attention output, the MLP's gate, up and product (float32), from the model's config
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(tiny_llama)
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    heads = 2 * c.num_attention_heads + 2 * c.num_key_value_heads
    per_token = 3 * c.hidden_size + heads * d + 3 * c.intermediate_size
    activations = budget * per_token * 4
    assert seen["kara_workspace"] == event + spread + activations
    without = sum(check_cpu_fit(shape, 4, 4096, 0, 0, 1 << 40).values())
    check_cpu_fit(
        shape,
        4,
        4096,
        0,
        0,
        without + scores + observer,
        kara_workspace=scores + observer,
    )
    with pytest.raises(MemoryConfigError, match="Kara's scores and observer memory"):
        check_cpu_fit(
            shape,
            4,
            4096,
            0,
            0,
            without + scores + observer - 1,
            kara_workspace=scores + observer,
        )
