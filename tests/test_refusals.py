"""Every configuration the runtime does not support is refused at start-up (exit 2, the flag or
setting named), and the defaults a CUDA server resolves to, checked without a GPU.

The refusal table is support._UNSUPPORTED: each of its flags must have a case here, so a new
refusal cannot land untested.
"""

from __future__ import annotations

import json
import types

import pytest

from sgl_kara import support
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
    "--tp-size": ["--tp-size", "2"],
    "--kv-cache-dtype": ["--kv-cache-dtype", "fp8_e4m3"],
}


def _parse_exit(argv, capsys) -> str:
    from conftest import PROXY_MODEL
    from sgl_kara.launch_server import parse

    with pytest.raises(SystemExit) as e:
        parse(["--model-path", PROXY_MODEL, *argv])
    assert e.value.code == 2
    return "\n".join(l for l in capsys.readouterr().err.splitlines() if l.startswith("error:"))


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

    cfg, sa = parse(["--model-path", PROXY_MODEL, "--kara-policy", "none", "--num-continuous-decode-steps", "2"])
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
    from sgl_kara.memory import ModelShape

    assert ModelShape.from_model_path(str(model)).mrope
    assert not ModelShape.from_model_path(PROXY_MODEL).mrope
    args = types.SimpleNamespace(model_path=str(model), device="cpu", dtype="float32", max_running_requests=8,
                                 max_total_tokens=4096, radix_cache_backend=None, disable_overlap_schedule=False,
                                 disable_cuda_graph=False)
    with pytest.raises(support.UnsupportedFeature, match="--model-path .* M-RoPE"):
        support.prepare_server_args(args, KaraConfig())


def test_beam_search_is_refused_per_request():
    from sgl_kara.request_options import check_supported

    check_supported(types.SimpleNamespace(beam_width=None), "kara")
    check_supported(types.SimpleNamespace(beam_width=1), "kara")
    with pytest.raises(ValueError, match=r"beam_width=4 \(beam search\) is not supported with --kara-policy snapkv"):
        check_supported(types.SimpleNamespace(beam_width=4), "snapkv")


# ------------------------------------------------------------------ CUDA defaults, no GPU here
def _cuda_args(model, **kw):
    base = dict(model_path=model, device="cuda", dtype="bfloat16", max_running_requests=None,
                max_total_tokens=None, radix_cache_backend=None, disable_overlap_schedule=False,
                disable_cuda_graph=False)
    return types.SimpleNamespace(**{**base, **kw})


def test_cuda_server_keeps_sglang_sizing(monkeypatch, tiny_llama):
    """On CUDA sgl_kara sets no device, backend, page size, dtype or memory sizing: SGLang's apply."""
    monkeypatch.setattr(support, "cuda_available", lambda: True)
    assert support.cpu_defaults() == {}
    assert support.server_defaults(tiny_llama, {}) == {}
    assert support.server_defaults(tiny_llama, {"device": "cuda"}) == {}


def test_cuda_server_defaults_to_recompute_with_graphs_on(monkeypatch, tiny_llama):
    """SGLang's default request limit (unset) makes a capture ring per request unaffordable:
    auto resolves to recompute and CUDA graphs stay on; capture, when chosen, turns them off."""
    monkeypatch.setattr(support, "cuda_available", lambda: False)  # no device memory to query
    args = _cuda_args(tiny_llama)
    cfg = support.prepare_server_args(args, KaraConfig())
    assert cfg.query_source == "recompute"
    assert args.disable_cuda_graph is False and args.disable_overlap_schedule is True
    assert args.radix_cache_backend == "kara"
    args = _cuda_args(tiny_llama)
    cfg = support.prepare_server_args(args, KaraConfig.build(query_source="capture"))
    assert cfg.query_source == "capture" and args.disable_cuda_graph is True


def test_cuda_ring_fits_small_request_limit(monkeypatch, tiny_llama):
    """With a known, small request limit and device memory to spare, auto picks capture."""
    import torch

    monkeypatch.setattr(support, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 << 30))
    args = _cuda_args(tiny_llama, max_running_requests=16)
    assert support.prepare_server_args(args, KaraConfig()).query_source == "capture"
    big = _cuda_args(tiny_llama, max_running_requests=4096)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=1 << 20))
    assert support.prepare_server_args(big, KaraConfig()).query_source == "recompute"
