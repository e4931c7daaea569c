"""The torch_native CPU decode hook (sgl_kara/cpu/attention.py) is bit-identical to SGLang's own
``_run_sdpa_forward_decode`` on random pools, rows and lengths (GQA and MHA, float32 and
bfloat16, one request and many), reuses its slots within a forward and reads them anew after
``init_forward_metadata``; unsupported cases go to SGLang's path."""

from __future__ import annotations

import pytest
import torch

from sgl_kara.cpu.attention import reset_metadata_hook, run_sdpa_forward_decode


def _sglang_decode():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    fn = TorchNativeAttnBackend._run_sdpa_forward_decode
    return getattr(
        fn, "__wrapped__", fn
    )  # SGLang's own, whether or not the plugin hooked it


def _case(seed, batch, hq, hkv, d, dtype, max_len=300, slots=5000, rows=40):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, hkv, d, generator=g).to(dtype)
    req_to_token = torch.randint(
        1, slots, (rows, max_len + 8), generator=g, dtype=torch.int32
    )
    pool_idx = torch.randperm(rows, generator=g)[:batch]
    lens = torch.randint(1, max_len, (batch,), generator=g)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    return q, k, v, req_to_token, pool_idx, lens


class _Backend:  # the instance state the hook keeps (SGLang's backend needs a model runner)
    pass


@pytest.mark.parametrize(
    "batch, hq, hkv, d, dtype",
    [
        (1, 4, 4, 16, torch.float32),
        (7, 9, 3, 64, torch.float32),
        (16, 8, 2, 32, torch.bfloat16),
        (33, 4, 1, 64, torch.float32),
    ],
)
def test_bit_identical_to_sglang(monkeypatch, batch, hq, hkv, d, dtype):
    monkeypatch.setenv("KARA_BATCHED_CPU_DECODE", "0")  # the per-request loop
    original = _sglang_decode()
    q, k, v, rtt, idx, lens = _case(batch * 7 + d, batch, hq, hkv, d, dtype)
    kw = dict(scaling=d**-0.5, enable_gqa=hq != hkv, causal=False)
    want = torch.empty_like(q)
    original(_Backend(), q, want, k, v, rtt, idx, lens, None, **kw)
    backend = _Backend()
    reset_metadata_hook(None, backend)
    for _ in range(3):  # layers of one forward share the slots
        got = torch.full_like(q, float("nan"))
        run_sdpa_forward_decode(
            original, backend, q, got, k, v, rtt, idx, lens, None, **kw
        )
        assert torch.equal(got, want)


@pytest.mark.parametrize("batched", ["0", "1"])
def test_new_forward_reads_rows_anew(monkeypatch, batched):
    """After a compaction rewrites rows between steps, the next forward must not reuse slots
    (loop and batched decode)."""
    monkeypatch.setenv("KARA_BATCHED_CPU_DECODE", batched)
    original = _sglang_decode()
    q, k, v, rtt, idx, lens = _case(3, 5, 4, 2, 16, torch.float32)
    backend = _Backend()
    reset_metadata_hook(None, backend)
    out = torch.empty_like(q)
    run_sdpa_forward_decode(
        original,
        backend,
        q,
        out,
        k,
        v,
        rtt,
        idx,
        lens,
        None,
        scaling=0.25,
        enable_gqa=True,
    )
    rtt[idx[0], : int(lens[0])] = torch.randint(
        1, k.shape[0], (int(lens[0]),), dtype=torch.int32
    )
    lens = lens.clone()  # SGLang hands each forward new length tensors
    reset_metadata_hook(None, backend)
    got, want = torch.empty_like(q), torch.empty_like(q)
    run_sdpa_forward_decode(
        original,
        backend,
        q,
        got,
        k,
        v,
        rtt,
        idx,
        lens,
        None,
        scaling=0.25,
        enable_gqa=True,
    )
    original(
        _Backend(),
        q,
        want,
        k,
        v,
        rtt,
        idx,
        lens,
        None,
        scaling=0.25,
        enable_gqa=True,
        causal=False,
    )
    if batched == "1":  # summation order differs; stale slots would differ by O(1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(got, want)


def test_unsupported_cases_take_sglang_path(monkeypatch):
    from sglang_original import sglang_original

    from sgl_kara.cpu._sglang import TARGET_TORCH_NATIVE_DECODE

    calls = []
    original = sglang_original(
        TARGET_TORCH_NATIVE_DECODE, calls, "sglang"
    )  # by keyword, SGLang's names
    q, k, v, rtt, idx, lens = _case(5, 2, 4, 2, 16, torch.float32)
    b = _Backend()
    assert (
        run_sdpa_forward_decode(
            original, b, q, q, k, v, rtt, idx, lens, None, sliding_window_size=8
        )
        == "sglang"
    )
    assert (
        run_sdpa_forward_decode(
            original, b, q, q, k, v, rtt, idx, lens, lens, scaling=0.5
        )
        == "sglang"
    )  # encoder
    monkeypatch.setenv("KARA_FAST_CPU_DECODE", "0")
    assert (
        run_sdpa_forward_decode(original, b, q, q, k, v, rtt, idx, lens, None)
        == "sglang"
    )
    assert [c["sliding_window_size"] for c in calls] == [8, None, None]
    assert (
        calls[1]["encoder_lens"] is lens
        and calls[1]["scaling"] == 0.5
        and calls[0]["seq_lens"] is lens
    )


def _sglang_extend():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    fn = TorchNativeAttnBackend._run_sdpa_forward_extend
    return getattr(fn, "__wrapped__", fn)


@pytest.mark.parametrize(
    "batch, hq, hkv, d, window, dtype, tol",
    [
        (1, 4, 4, 16, 8, torch.float32, 2e-6),
        (6, 9, 3, 64, 64, torch.float32, 2e-6),
        (5, 8, 2, 32, 1, torch.float32, 2e-6),
        (4, 4, 1, 64, 40, torch.bfloat16, 2e-2),
    ],
)
def test_window_extend_matches_sglang(batch, hq, hkv, d, window, dtype, tol):
    """The recompute pass's extend (E window queries at the end of each row, causal) equals
    SGLang's padded L x L extend, up to float summation order; rows of different lengths, the
    slots shared by the layers of one forward."""
    from sgl_kara.cpu.attention import run_window_extend

    q1, k, v, rtt, idx, _ = _case(batch * 11 + d, batch, hq, hkv, d, dtype)
    g = torch.Generator().manual_seed(batch + window)
    prefix = torch.randint(0, 250, (batch,), generator=g)
    extend = torch.full((batch,), window)
    lens = prefix + extend
    q = torch.randn(batch * window, hq, d, generator=g).to(dtype)
    kw = dict(scaling=d**-0.5, enable_gqa=hq != hkv, causal=True)
    want = torch.empty_like(q)
    _sglang_extend()(
        _Backend(), q, want, k, v, rtt, idx, lens, prefix, extend, None, **kw
    )
    backend = _Backend()
    reset_metadata_hook(None, backend)
    for _ in range(2):
        got = torch.full_like(q, float("nan"))
        run_window_extend(
            backend,
            q,
            got,
            k,
            v,
            rtt,
            idx,
            lens,
            prefix,
            extend,
            scaling=kw["scaling"],
            enable_gqa=kw["enable_gqa"],
        )
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_extend_outside_the_recompute_pass_is_sglangs(monkeypatch):
    """The plugin's extend hook: with no Kara scoring pass in flight (prefills, plain SGLang) the
    call goes to SGLang's own function, by keyword, with every argument as given."""
    from sglang_original import sglang_original

    from sgl_kara.cpu import hooks
    from sgl_kara.cpu._sglang import TARGET_TORCH_NATIVE_EXTEND

    monkeypatch.setattr(hooks, "scoring_in_flight", lambda: False)
    calls = []
    q, k, v, rtt, idx, lens = _case(6, 2, 4, 2, 16, torch.float32)
    prefix = torch.zeros_like(lens)
    out = hooks._recompute_extend_hook(
        sglang_original(TARGET_TORCH_NATIVE_EXTEND, calls, "sglang"),
        _Backend(),
        q,
        q,
        k,
        v,
        rtt,
        idx,
        lens,
        prefix,
        lens,
        scaling=0.25,
        causal=True,
    )
    assert out == "sglang" and len(calls) == 1
    assert (
        calls[0]["extend_prefix_lens"] is prefix and calls[0]["extend_seq_lens"] is lens
    )
    assert (
        calls[0]["scaling"] == 0.25
        and calls[0]["causal"] is True
        and calls[0]["encoder_lens"] is None
    )


def test_extend_takes_the_window_path_exactly_inside_karas_recompute_pass(monkeypatch):
    """The kit asks the per-process state whether a Kara recompute forward runs; the plugin's
    serving part, when it registers, answers with the runtime's forward context: inside
    ``ForwardContext.scoring_pass`` the window-only path, outside it (prefills) and without a
    runtime SGLang's; in plain SGLang with the CPU kernels (no serving part) never the window."""
    import types

    from sglang_original import sglang_original

    from sgl_kara import _sglang as core_adapter
    from sgl_kara import plugin, process
    from sgl_kara.cpu import _sglang as kit_adapter
    from sgl_kara.cpu import attention, hooks
    from sgl_kara.cpu._sglang import TARGET_TORCH_NATIVE_EXTEND
    from sgl_kara.scheduler import runtime
    from sgl_kara.scheduler.forward import ForwardContext

    fresh = process.ProcessState()
    for mod in (plugin, hooks, runtime):
        monkeypatch.setattr(mod, "STATE", fresh)
    monkeypatch.setattr(attention, "run_window_extend", lambda *a, **kw: "window-only")
    q, k, v, rtt, idx, lens = _case(5, 2, 4, 2, 16, torch.float32)
    prefix = torch.zeros_like(lens)

    def extend():
        return hooks._recompute_extend_hook(
            sglang_original(TARGET_TORCH_NATIVE_EXTEND, [], "sglang"),
            _Backend(),
            q,
            q,
            k,
            v,
            rtt,
            idx,
            lens,
            prefix,
            lens,
            scaling=0.25,
            causal=True,
        )

    context = types.SimpleNamespace(scoring=None, scoring_batch=None)
    runtime.activate(types.SimpleNamespace(forward=context))
    scoring_pass = ForwardContext.scoring_pass(context, object(), object())
    with scoring_pass:  # plain SGLang with KARA_CPU_KERNELS=1: nobody answers
        assert extend() == "sglang"
    # a serving process: the plugin registers (its hooks recorded, not applied)
    for var, value in (("KARA_SERVE", "1"), ("KARA_CPU_KERNELS", None)):
        monkeypatch.setenv(var, value) if value else monkeypatch.delenv(var, False)
    monkeypatch.delenv("KARA_TRACE", raising=False)
    monkeypatch.setattr(plugin, "cuda_available", lambda: False)
    for adapter in (core_adapter, kit_adapter):
        monkeypatch.setattr(adapter, "register_hook", lambda *a: None)
    monkeypatch.setattr(
        core_adapter, "registered_radix_cache_backends", lambda: ["kara"]
    )
    monkeypatch.setattr(hooks, "apply_rope_shim", lambda: None)
    plugin.register()
    assert {"serving", "cpu_kernels"} <= fresh.parts
    assert extend() == "sglang"  # a prefill: no recompute pass
    with ForwardContext.scoring_pass(context, object(), object()):
        assert extend() == "window-only"
    assert extend() == "sglang"
    with ForwardContext.scoring_pass(context, object(), object()):
        runtime.activate(None)  # the scheduler stopped serving
        assert extend() == "sglang"


def test_window_extend_refuses_a_row_that_is_not_prefix_plus_window():
    from sgl_kara.cpu.attention import run_window_extend

    q1, k, v, rtt, idx, _ = _case(4, 2, 4, 2, 16, torch.float32)
    prefix, extend = torch.tensor([10, 20]), torch.tensor([4, 4])
    q = torch.randn(8, 4, 16)
    with pytest.raises(ValueError, match="prefix 20 \\+ extend 4 != row length 25"):
        run_window_extend(
            _Backend(),
            q,
            torch.empty_like(q),
            k,
            v,
            rtt,
            idx,
            torch.tensor([14, 25]),
            prefix,
            extend,
            enable_gqa=True,
        )


@pytest.mark.parametrize(
    "batch, hq, hkv, d, dtype, tol",
    [
        (1, 4, 4, 16, torch.float32, 1e-5),
        (7, 9, 3, 64, torch.float32, 1e-5),
        (16, 8, 2, 32, torch.bfloat16, 3e-2),
        (33, 4, 1, 64, torch.float32, 1e-5),
    ],
)
def test_batched_decode_matches_sglang(monkeypatch, batch, hq, hkv, d, dtype, tol):
    """KARA_BATCHED_CPU_DECODE=1: one padded SDPA for the batch equals SGLang's per-request
    attention up to summation order; padding never leaks (rows of very different lengths, pool
    entries beyond each row set to huge values)."""
    from sgl_kara.cpu.attention import _META

    monkeypatch.setenv("KARA_BATCHED_CPU_DECODE", "1")
    original = _sglang_decode()
    q, k, v, rtt, idx, lens = _case(batch * 5 + d, batch, hq, hkv, d, dtype)
    lens = torch.randint(
        150, 300, (batch,), generator=torch.Generator().manual_seed(batch)
    )
    # every slot a row does not read holds a huge value: a padded entry that leaked would show
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    for r, n in zip(idx.tolist(), lens.tolist()):
        used[rtt[r, :n].long()] = True
    k[~used], v[~used] = 1e4, 1e4
    kw = dict(scaling=d**-0.5, enable_gqa=hq != hkv, causal=False)
    want = torch.empty_like(q)
    original(_Backend(), q, want, k, v, rtt, idx, lens, None, **kw)
    backend = _Backend()
    reset_metadata_hook(None, backend)
    for _ in range(2):
        got = torch.full_like(q, float("nan"))
        run_sdpa_forward_decode(
            original, backend, q, got, k, v, rtt, idx, lens, None, **kw
        )
        assert (
            getattr(backend, _META).padded(hq * d) is not None
        )  # the batched path ran
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_batched_decode_falls_back_to_the_loop_when_padding_dominates(monkeypatch):
    """One long row among short ones (heads large enough that the loop's per-request overhead does
    not pay for the padding): the loop runs and the output stays bit-identical to SGLang's."""
    from sgl_kara.cpu.attention import _META

    monkeypatch.setenv("KARA_BATCHED_CPU_DECODE", "1")
    original = _sglang_decode()
    q, k, v, rtt, idx, lens = _case(11, 8, 8, 2, 64, torch.float32)
    lens = torch.tensor([290] + [5] * 7)
    kw = dict(scaling=64**-0.5, enable_gqa=True, causal=False)
    want = torch.empty_like(q)
    original(_Backend(), q, want, k, v, rtt, idx, lens, None, **kw)
    backend = _Backend()
    reset_metadata_hook(None, backend)
    got = torch.full_like(q, float("nan"))
    run_sdpa_forward_decode(original, backend, q, got, k, v, rtt, idx, lens, None, **kw)
    assert getattr(backend, _META).padded(8 * 64) is None and torch.equal(got, want)


def test_padded_call_is_chosen_by_the_cost_rule():
    """T x L_max <= PAD_RATIO x sum(L) + T x CALL_UNITS / (H_q x D): equal rows always pad; one
    long row among short ones pads only where the loop's per-request overhead outweighs the
    padding (small heads); the decision is per head size and cached for the forward."""
    from sgl_kara.cpu.attention import CALL_UNITS, PAD_RATIO, _Rows

    rtt = torch.arange(8 * 1000, dtype=torch.int32).view(8, 1000)
    idx = torch.arange(8)

    def rule(lens, units):
        return 8 * max(lens) <= PAD_RATIO * sum(lens) + 8 * CALL_UNITS / units

    for lens in (
        [600] * 8,
        [100, 900] * 4,
        [500] * 7 + [700],
        [10] * 7 + [300],
        [300] * 7 + [900],
    ):
        rows = _Rows(rtt, idx, torch.tensor(lens))
        for units in (64, 576):
            got = rows.padded(units)
            assert (got is not None) == rule(lens, units), (lens, units)
            assert rows.padded(units) is got  # cached
            if got is not None:
                pad, mask, width = got
                assert (
                    width == max(lens)
                    and pad.numel() == 8 * width
                    and int(mask.sum()) == sum(lens)
                )
    assert _Rows(rtt, idx, torch.tensor([600] * 8)).padded(576) is not None
    assert _Rows(rtt, idx, torch.tensor([300] * 7 + [900])).padded(576) is None
    assert (
        _Rows(rtt, idx, torch.tensor([10] * 7 + [300])).padded(64) is not None
    )  # overhead-bound


@pytest.mark.parametrize("batched", ["0", "1"])
def test_buffers_grown_in_inference_mode_serve_the_decode_outside_it(
    monkeypatch, batched
):
    """The recompute pass (inference_mode) can be the first to need a K/V buffer; the next decode
    forward runs outside inference_mode and writes into the same buffer (found by the spread
    grid: 'Inplace update to inference tensor outside InferenceMode')."""
    from sgl_kara.cpu.attention import _META, run_window_extend

    monkeypatch.setenv("KARA_BATCHED_CPU_DECODE", batched)
    original = _sglang_decode()
    q, k, v, rtt, idx, lens = _case(21, 4, 8, 2, 64, torch.float32)
    backend = _Backend()
    prefix, extend = torch.tensor([200, 220, 240, 260]), torch.tensor([8, 8, 8, 8])
    with torch.inference_mode():
        reset_metadata_hook(None, backend)
        qe = torch.randn(32, 8, 64)
        run_window_extend(
            backend,
            qe,
            torch.empty_like(qe),
            k,
            v,
            rtt,
            idx,
            prefix + extend,
            prefix,
            extend,
            enable_gqa=True,
        )
    for lens, padded in (
        (torch.tensor([20, 30, 40, 50]), batched == "1"),
        (torch.tensor([5, 290, 5, 5]), False),
    ):
        reset_metadata_hook(None, backend)
        got, want = torch.empty_like(q), torch.empty_like(q)
        run_sdpa_forward_decode(
            original,
            backend,
            q,
            got,
            k,
            v,
            rtt,
            idx,
            lens,
            None,
            scaling=0.25,
            enable_gqa=True,
        )
        original(
            _Backend(),
            q,
            want,
            k,
            v,
            rtt,
            idx,
            lens,
            None,
            scaling=0.25,
            enable_gqa=True,
            causal=False,
        )
        if batched == "1":  # which path ran (with the flag off the loop always runs)
            assert (getattr(backend, _META).padded(8 * 64) is not None) == padded
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
