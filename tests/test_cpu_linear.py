"""sgl_kara/cpu/linear.py (KARA_PACKED_CPU_LINEAR, on with the CPU kernels): float32 linear weights
packed in place after loading (no second copy) compute F.linear within float rounding for any
rows and leading dims, unpack exactly for a weight update, hand every other call to SGLang's own
function by keyword, and in an engine every weight matmul of the model runs packed, with the same
outputs as without, before and after a weight reload."""

from __future__ import annotations

import gc
import json
import os
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sgl_kara.cpu import linear as cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason="this torch has no oneDNN linear"
)


def _layer(out=300, inp=96, seed=0, dtype=torch.float32):
    """A module shaped like SGLang's linear layers: a registered, gradient-free weight Parameter
    carrying the loader's attributes."""
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    weight = torch.nn.Parameter(
        (torch.randn(out, inp, generator=g) * 0.05).to(dtype), requires_grad=False
    )
    weight.weight_loader, weight.input_dim, weight.output_dim = "loader", 1, 0
    layer.register_parameter("weight", weight)
    return layer


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 8, 64, 65, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear_for_any_rows(rows, with_bias):
    layer = _layer(seed=rows)
    dense = layer.weight.detach().clone()
    b = torch.randn(300) if with_bias else None
    x = torch.randn(rows, 96)
    assert cpu_linear.pack_in_place(layer)
    got, want = cpu_linear.packed_linear(x, layer.weight, b), F.linear(x, dense, b)
    assert got.shape == want.shape == (rows, 300) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_linear_other_shapes_and_dtypes():
    """3-D and 1-D inputs keep their leading dims; a bfloat16 input is computed in float32 and
    returned in bfloat16 (the packed weight is float32)."""
    layer = _layer(64, 32)
    dense = layer.weight.detach().clone()
    cpu_linear.pack_in_place(layer)
    for x in (torch.randn(2, 5, 32), torch.randn(32)):
        torch.testing.assert_close(
            cpu_linear.packed_linear(x, layer.weight),
            F.linear(x, dense),
            rtol=1e-5,
            atol=1e-5,
        )
    xb = torch.randn(4, 32, dtype=torch.bfloat16)
    got = cpu_linear.packed_linear(xb, layer.weight)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(xb.float(), dense).bfloat16())


def test_pack_in_place_replaces_the_weight_and_unpack_restores_it_exactly():
    layer = _layer()
    dense = layer.weight.detach().clone()
    old = weakref.ref(layer.weight)
    assert cpu_linear.pack_in_place(layer)
    gc.collect()
    assert old() is None  # the dense weight is released: no second copy of the model
    w = layer.weight
    assert isinstance(w, torch.nn.Parameter) and w.is_mkldnn and not w.requires_grad
    assert w.shape == dense.shape and w.dtype == torch.float32
    assert (w.weight_loader, w.input_dim, w.output_dim) == ("loader", 1, 0)
    assert dict(layer.named_parameters())["weight"] is w
    assert not cpu_linear.pack_in_place(layer)  # already packed
    assert layer in cpu_linear._packed_layers
    assert cpu_linear.unpack_in_place(layer)
    w = layer.weight
    assert not w.is_mkldnn and torch.equal(w, dense) and w.weight_loader == "loader"
    assert layer not in cpu_linear._packed_layers
    assert not cpu_linear.unpack_in_place(layer)  # dense already


def test_what_is_not_packed():
    """Other dtypes, trainable weights, AMX-packed layers (SGLang's own bf16 packing) stay as they are."""
    bf16 = _layer(dtype=torch.bfloat16)
    trainable = _layer()
    trainable.weight.requires_grad_(True)
    amx = _layer()
    amx.use_intel_amx_backend = True
    for layer in (bf16, trainable, amx):
        before = layer.weight
        assert (
            not cpu_linear.pack_in_place(layer)
            and layer.weight is before
            and not before.is_mkldnn
        )


def _original(
    calls, target="TARGET_LINEAR_APPLY", value="sglang's own", side_effect=None
):
    """SGLang's function as the hook calls it (tests/sglang_original.py: bound to SGLang's real
    signature, every argument but self by keyword)."""
    from sglang_original import sglang_original

    from sgl_kara.cpu import _sglang as adapter

    return sglang_original(getattr(adapter, target), calls, value, side_effect)


def test_weight_hooks_pack_after_sglang_and_unpack_before_it():
    layer, calls = _layer(), []
    dense = layer.weight.detach().clone()
    assert (
        cpu_linear.process_weights_hook(
            _original(calls, "TARGET_LINEAR_PROCESS_WEIGHTS", None), object(), layer
        )
        is None
    )
    assert (
        len(calls) == 1 and layer.weight.is_mkldnn
    )  # SGLang's processing ran, then the packing

    def restore(self, layer):
        assert (
            not layer.weight.is_mkldnn
        )  # SGLang's restore (and the loader after it) sees a dense weight

    cpu_linear.restore_weights_hook(
        _original(calls, "TARGET_LINEAR_RESTORE_WEIGHTS", None, restore),
        object(),
        layer,
    )
    assert (
        len(calls) == 2
        and calls[-1]["layer"] is layer
        and torch.equal(layer.weight, dense)
    )


def test_apply_hooks_take_the_packed_weight_and_leave_dense_ones_to_sglang():
    layer, calls = _layer(48, 24), []
    dense = layer.weight.detach().clone()
    x, bias = torch.randn(5, 24), torch.randn(48)
    assert (
        cpu_linear.linear_apply_hook(_original(calls), object(), layer, x, bias)
        == "sglang's own"
    )
    cpu_linear.pack_in_place(layer)
    out = cpu_linear.linear_apply_hook(_original(calls), object(), layer, x, bias)
    torch.testing.assert_close(out, F.linear(x, dense, bias), rtol=1e-5, atol=1e-5)
    buf = torch.empty(5, 48)
    assert (
        cpu_linear.linear_apply_into_hook(
            _original(calls, "TARGET_LINEAR_APPLY_INTO"), object(), layer, x, buf, bias
        )
        is buf
    )
    torch.testing.assert_close(buf, F.linear(x, dense, bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="shape"):
        cpu_linear.linear_apply_into_hook(
            _original(calls, "TARGET_LINEAR_APPLY_INTO"),
            object(),
            layer,
            x,
            torch.empty(4, 48),
        )
    assert len(calls) == 1 and calls[0]["x"] is x and calls[0]["bias"] is bias
    cpu_linear.unpack_in_place(layer)
    assert (
        cpu_linear.linear_apply_into_hook(
            _original(calls, "TARGET_LINEAR_APPLY_INTO"), object(), layer, x, buf
        )
        == "sglang's own"
    )
    assert calls[-1]["output"] is buf


def test_lm_head_copy_is_made_once_and_renewed_when_the_weight_changes():
    w = torch.randn(40, 16)
    first = cpu_linear.packed_copy(w)
    assert cpu_linear.packed_copy(w) is first
    x = torch.randn(4, 16)
    with torch.no_grad():
        w.mul_(2.0)  # a reload writes weights in place
    assert cpu_linear.packed_copy(w) is not first
    torch.testing.assert_close(
        cpu_linear.packed_linear(x, cpu_linear.packed_copy(w)),
        F.linear(x, w),
        rtol=1e-5,
        atol=1e-5,
    )


def test_lm_head_copy_does_not_keep_its_weight_alive():
    """A model replaced in the process (its old lm_head dropped) leaves no packed copy behind."""
    import gc
    import weakref

    w = torch.nn.Parameter(torch.randn(40, 16), requires_grad=False)
    before = cpu_linear.packed_count()
    copy = weakref.ref(cpu_linear.packed_copy(w))
    with torch.no_grad():
        w.mul_(2.0)
    cpu_linear.packed_copy(w)  # renewed for the same weight: still one entry
    assert cpu_linear.packed_count() == before + 1 and id(w) in cpu_linear._copies
    alive, key = weakref.ref(w), id(w)
    del w
    gc.collect()
    assert (
        alive() is None and copy() is None
    )  # nothing held the weight or its first copy
    assert cpu_linear.packed_count() == before and key not in cpu_linear._copies


# The rows for which the lm_head runs on its packed copy: decode batches of 3 to 64 requests
# (patches/cpu_linear.md); one or two rows, and prefill-sized batches, take SGLang's matmul.
DECODE_ROWS = range(3, 65)


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 64, 65, 300])
def test_lm_head_hook_packs_decode_rows_only(rows):
    proc = SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target=None)
    head = SimpleNamespace(weight=torch.randn(100, 24))
    h = torch.randn(rows, 24)
    calls = []
    got = cpu_linear.lm_head_hook(_original(calls, "TARGET_LM_HEAD"), proc, h, head)
    if rows in DECODE_ROWS:
        torch.testing.assert_close(got, h @ head.weight.T, rtol=1e-5, atol=1e-5)
        assert calls == []
    else:
        assert (
            got == "sglang's own" and len(calls) == 1 and calls[0]["hidden_states"] is h
        )


def test_lm_head_hook_takes_only_sglangs_plain_matmul_branch_for_decode_rows():
    proc = SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target=None)
    head = SimpleNamespace(weight=torch.randn(100, 24))
    h = torch.randn(6, 24)
    calls = []
    got = cpu_linear.lm_head_hook(_original(calls, "TARGET_LM_HEAD"), proc, h, head)
    torch.testing.assert_close(got, h @ head.weight.T, rtol=1e-5, atol=1e-5)
    assert calls == []
    lora = SimpleNamespace(weight=head.weight, set_lora=None, apply_lora=None)
    for args, kwargs, p in [
        ((h, lora), {}, proc),  # LoRA-wrapped
        ((h, head, torch.randn(100)), {}, proc),  # embedding bias
        ((h, head), {"out": torch.empty(6, 100)}, proc),  # caller-owned buffer
        (
            (h, head),
            {},
            SimpleNamespace(use_fp32_lm_head=True, rl_on_policy_target=None),
        ),
        (
            (h, head),
            {},
            SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target="x"),
        ),
    ]:
        assert (
            cpu_linear.lm_head_hook(
                _original(calls, "TARGET_LM_HEAD"), p, *args, **kwargs
            )
            == "sglang's own"
        )
    assert len(calls) == 5
    assert calls[1]["embedding_bias"] is not None and calls[2]["out"] is not None


def _checkpoint_tensor(path, name):
    from safetensors import safe_open

    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            if name in st.keys():
                return st.get_tensor(name)
    raise KeyError(name)


def _run(engine, prompts, params):
    outs = engine.generate(prompts, params, return_logprob=True)
    return [
        (o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]])
        for o in outs
    ]


def _agree(a, b, n_tokens):
    for (ia, la), (ib, lb) in zip(a, b):
        assert len(la) == len(lb) == n_tokens
        assert ia[:8] == ib[:8]  # greedy: no flip this early at 1e-6
        n = next((i for i, (x, y) in enumerate(zip(ia, ib)) if x != y), n_tokens)
        assert max(abs(x - y) for x, y in zip(la[:n], lb[:n])) < 1e-4


@pytest.mark.integration  # two engines of its own
def test_engine_default_packs_every_weight_matches_and_survives_a_weight_reload(
    tiny_llama, tmp_path
):
    """A default engine (variable unset) and one with KARA_PACKED_CPU_LINEAR=0 decode the same
    four greedy requests together (4 rows): by the trace, the default held every weight matmul of
    the model packed (qkv, o, gate_up, down per layer in place + the lm_head's copy; none with
    the variable 0), and the log-probabilities agree within float rounding. The default engine
    then reloads its weights from disk (SGLang's restore -> load -> process path): the reload
    succeeds and the outputs are unchanged; and get_weights_by_name reads a packed weight's
    values as the checkpoint has them."""
    from support import start_engine

    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(4)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    runs = {}
    for flag in (None, "0"):
        trace = tmp_path / f"trace_{flag}.jsonl"
        saved = {k: os.environ.get(k) for k in ("KARA_PACKED_CPU_LINEAR", "KARA_TRACE")}
        os.environ.pop("KARA_PACKED_CPU_LINEAR", None)
        os.environ.update(
            KARA_TRACE=str(trace),
            **({} if flag is None else {"KARA_PACKED_CPU_LINEAR": flag}),
        )
        try:
            engine = start_engine(
                "kara", tiny_llama, kara_policy="none", max_total_tokens=2048
            )
            try:
                first = _run(engine, prompts, params)
                reloaded = None
                if flag is None:
                    ok, message, *_ = engine.update_weights_from_disk(tiny_llama)
                    assert ok, message
                    reloaded = _run(engine, prompts, params)
                    got = engine.get_weights_by_name(
                        "model.layers.0.mlp.down_proj.weight", truncate_size=3
                    )
                    want = _checkpoint_tensor(
                        tiny_llama, "model.layers.0.mlp.down_proj.weight"
                    )[:3]
                    assert got is not None and torch.allclose(
                        torch.tensor(got, dtype=torch.float32), want.float()
                    )
            finally:
                engine.shutdown()
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        steps = [json.loads(line) for line in trace.read_text().splitlines()]
        runs[flag] = (
            first,
            reloaded,
            max(s["packed_weights"] for s in steps),
            steps[-1]["packed_weights"],
            max(s["running"] for s in steps),
        )
    (packed, reloaded, n_packed, n_last, running), (plain, _, n_plain, _, _) = (
        runs[None],
        runs["0"],
    )
    layers = json.loads((Path(tiny_llama) / "config.json").read_text())[
        "num_hidden_layers"
    ]
    assert (
        running == 4 and n_packed == n_last == 4 * layers + 1 and n_plain == 0
    )  # packed again after the reload
    _agree(packed, plain, 24)
    _agree(reloaded, packed, 24)


def test_weight_exports_read_dense_weights_and_leave_them_packed():
    """SGLang's WeightExporter methods (get_weights_by_name, save/send) read weight values: the hook
    unpacks the model's packed layers for the call and packs them again after it, also on error."""
    model = torch.nn.Module()
    model.a, model.b = _layer(seed=1), _layer(seed=2)
    dense = {n: m.weight.detach().clone() for n, m in (("a", model.a), ("b", model.b))}
    for m in (model.a, model.b):
        cpu_linear.pack_in_place(m)
    exporter = SimpleNamespace(get_model=lambda: model)

    def read(exp, name):
        return getattr(
            exp.get_model(), name
        ).weight.clone()  # would fail on an opaque tensor

    got = cpu_linear.weight_export_hook(read, exporter, "a")
    assert torch.equal(got, dense["a"])
    assert model.a.weight.is_mkldnn and model.b.weight.is_mkldnn

    def fail(exp):
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        cpu_linear.weight_export_hook(fail, exporter)
    assert model.a.weight.is_mkldnn and model.b.weight.is_mkldnn
    x = torch.randn(3, 96)
    torch.testing.assert_close(
        cpu_linear.packed_linear(x, model.b.weight),
        F.linear(x, dense["b"]),
        rtol=1e-5,
        atol=1e-5,
    )
