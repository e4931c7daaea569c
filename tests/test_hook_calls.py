"""The plugin's AROUND hooks hand SGLang's function every argument but ``self`` by keyword, under
SGLang's names (a stand-in bound to SGLang's real signature, tests/sglang_original.py), when no
Kara scheduler runs in the process -- as in plain SGLang's processes and sgl_kara's tokenizer --
and through the attention hook's Kara path too. The CPU kernels' hooks: tests/test_cpu_*.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang_original import sglang_original

from sgl_kara import _sglang as adapter
from sgl_kara import plugin
from sgl_kara.scheduler.output import unwrap_meta_hook


@pytest.fixture
def no_runtime(monkeypatch):
    monkeypatch.setattr(plugin, "_active", lambda: None)


def test_init_new(no_runtime):
    calls, batch, runner = [], object(), object()
    fb = plugin._init_new_hook(
        sglang_original(adapter.TARGET_INIT_NEW, calls, "fb"),
        "cls",
        batch,
        runner,
        return_hidden_states_before_norm=False,
    )
    assert (
        fb == "fb" and calls[0]["batch"] is batch and calls[0]["model_runner"] is runner
    )
    assert calls[0]["return_hidden_states_before_norm"] is False


@pytest.mark.parametrize("kara", [False, True])
def test_attention(monkeypatch, kara):
    """Without a runtime SGLang's forward gets the call as made; with one, Kara's ForwardContext
    calls it back positionally and the hook passes it on by keyword, key_value_num_tokens kept."""
    seen = []

    class Forward:
        def on_attention(self, original, layer, q, k, v, fb, save_kv_cache):
            seen.append(save_kv_cache)
            return original(layer, q, k, v, fb, False)

    monkeypatch.setattr(
        plugin, "_active", lambda: SimpleNamespace(forward=Forward()) if kara else None
    )
    calls = []
    out = plugin._attention_hook(
        sglang_original(adapter.TARGET_ATTENTION, calls, "out"),
        "layer",
        "q",
        "k",
        "v",
        "fb",
        True,
        7,
        extra=1,
    )
    assert out == "out" and seen == ([True] if kara else [])
    assert calls == [
        {
            "self": "layer",
            "q": "q",
            "k": "k",
            "v": "v",
            "forward_batch": "fb",
            "save_kv_cache": not kara,
            "key_value_num_tokens": 7,
            "kwargs": {"extra": 1},
        }
    ]


def test_retraction_order(no_runtime):
    calls, reqs = [], ["a", "b"]
    assert plugin._retraction_order_hook(
        sglang_original(adapter.TARGET_RETRACTION_ORDER, calls, [1, 0]), reqs
    ) == [1, 0]
    assert calls == [{"reqs": reqs}]


def test_meta_info():
    calls, meta = [], {"kara": [{"compressions": 1}]}
    unwrap_meta_hook(
        sglang_original(adapter.TARGET_META_INFO, calls, None),
        "manager",
        meta,
        "state",
        {},
        0,
        None,
    )
    assert (
        meta == {"kara": {"compressions": 1}}
        and calls[0]["meta_info"] is meta
        and calls[0]["index"] == 0
    )
