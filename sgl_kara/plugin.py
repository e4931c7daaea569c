"""SGLang general plugin (entry point ``sglang.srt.plugins``: ``sgl_kara``).

SGLang calls ``register()`` early in every process it starts (the launcher or Engine process, the
scheduler, the detokenizer, the data-parallel controller) for every installed plugin, plain
``python -m sglang.launch_server`` and ``sglang.Engine`` included. What it registers depends on
the process's environment, so installing sgl_kara leaves plain SGLang as it was:

    always                  on a machine without CUDA, RoPE's CPU path (``apply_cpu_shim``):
                            SGLang 0.5.23 does not start on a CPU without vLLM otherwise
    KARA_SERVE=1            "serving": Kara's touch points (inert unless a Kara scheduler runs
                            in the process: ``runtime.active()``), the request checks
                            (``custom_params.kara``, beam search, out-of-vocabulary input ids),
                            the radix-cache backend "kara"
    KARA_CPU_KERNELS=1      "cpu_kernels": the CPU speed-ups of sgl_kara/cpu -- torch_native decode
      (default: KARA_SERVE) attention (one K/V gather per layer, one padded call per batch), the
                            recompute pass's window extend, float32 matmuls on oneDNN-packed
                            weights; each changes float summation order only
    either of the two       "report": ``kara_cpu_kernels`` in /server_info's internal states
    KARA_TRACE=path         "trace": one JSON line per decode step (benchmarks; any scheduler)

sgl_kara's launcher and Engine set ``KARA_SERVE=1`` for the SGLang processes they start (spawned
or forked, each runs ``register()`` again and reads it) and apply the hooks in their own process
(``serve`` / ``serving``). Each hook stands in for one upstream change (patches/).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

from sgl_kara import env
from sgl_kara.process import STATE

logger = logging.getLogger(__name__)

# The plugin's parts, in registration order (process.STATE.parts holds those registered).
PARTS = ("serving", "cpu_kernels", "report", "trace")


def wanted_parts() -> list[str]:
    """The parts this process's environment asks for."""
    serving, kernels = env.serving(), env.cpu_kernels()
    asked = {
        "serving": serving,
        "cpu_kernels": kernels,
        "report": serving or kernels,
        "trace": env.trace() is not None,
    }
    return [p for p in PARTS if asked[p]]


def register() -> None:
    """SGLang's entry point: RoPE's CPU path, then the hooks of every part asked for and not yet
    registered in this process (SGLang applies them after its plugins ran; ``serve`` otherwise)."""
    apply_cpu_shim()
    from sgl_kara import _sglang as sg

    for part in wanted_parts():
        if part in STATE.parts:
            continue
        STATE.parts.add(part)
        if part == "serving":
            from sgl_kara.mem_cache.radix import BACKEND_NAME, kara_radix_cache_factory

            if BACKEND_NAME not in sg.registered_radix_cache_backends():
                sg.register_radix_cache_backend(BACKEND_NAME, kara_radix_cache_factory)
        for target, hook, hook_type in HOOKS[part]():
            sg.HookRegistry.register(target, hook, hook_type)
            if target == sg.TARGET_LINEAR_APPLY:
                STATE.parts.add("packed_linear")
        if part == "cpu_kernels":
            logger.info(
                "sgl_kara: CPU kernels in this process: %s", cpu_kernels_in_use()
            )


def serve() -> None:
    """This process serves with sgl_kara, and so does every SGLang process it starts from now on:
    ``KARA_SERVE=1`` in its environment, then its hooks registered and applied -- by SGLang's own
    loader (idempotent; it calls ``register``), or, where SGLang loaded its plugins in this
    process before, by ``register`` for the parts now asked for and SGLang's ``apply_hooks``."""
    os.environ[env.SERVE] = "1"
    from sgl_kara import _sglang as sg

    sg.load_plugins()
    register()
    sg.HookRegistry.apply_hooks()


@contextlib.contextmanager
def serving():
    """``serve()`` for the duration (sgl_kara.Engine while it starts SGLang's processes, the
    launcher's flag parsing); the caller's ``KARA_SERVE`` after. Hooks stay applied in this
    process (SGLang cannot remove them): a plain ``sglang.Engine`` started later here serves with
    sgl_kara's request checks in this process, and plain SGLang in its scheduler."""
    saved = os.environ.get(env.SERVE)
    try:
        serve()
        yield
    finally:
        if saved is None:
            os.environ.pop(env.SERVE, None)
        else:
            os.environ[env.SERVE] = saved


def apply_cpu_shim() -> None:
    """On a machine without CUDA, SGLang's RoPE must take its CPU path (else it imports vllm)."""
    import torch

    if torch.cuda.is_available():
        return
    from sgl_kara._sglang import rotary_embedding_base

    rotary_embedding_base._is_cpu = True


def serving_hooks() -> list:
    from sgl_kara import _sglang as sg
    from sgl_kara.scheduler.output import unwrap_meta_hook

    return [
        (sg.TARGET_INIT_NEW, _init_new_hook, sg.HookType.AROUND),
        (sg.TARGET_ATTENTION, _attention_hook, sg.HookType.AROUND),
        (sg.TARGET_RESET_FOR_RETRACT, _reset_for_retract_hook, sg.HookType.AFTER),
        (sg.TARGET_RETRACTION_ORDER, _retraction_order_hook, sg.HookType.AROUND),
        (sg.TARGET_META_INFO, unwrap_meta_hook, sg.HookType.AROUND),
        (sg.TARGET_SAMPLING_VERIFY, _verify_hook, sg.HookType.AFTER),
        (sg.TARGET_VALIDATE_REQUEST, _validate_input_ids_hook, sg.HookType.AFTER),
    ]


def cpu_kernel_hooks() -> list:
    """sgl_kara/cpu as one part; ``KARA_FAST_CPU_DECODE`` / ``KARA_BATCHED_CPU_DECODE`` choose
    within the attention hooks at each call, ``KARA_PACKED_CPU_LINEAR`` whether the linear hooks
    are registered at all (the weights are packed when the model loads)."""
    from sgl_kara import _sglang as sg
    from sgl_kara.cpu.attention import reset_metadata_hook, run_sdpa_forward_decode

    hooks = [
        (sg.TARGET_TORCH_NATIVE_METADATA, reset_metadata_hook, sg.HookType.AFTER),
        (sg.TARGET_TORCH_NATIVE_DECODE, run_sdpa_forward_decode, sg.HookType.AROUND),
        (sg.TARGET_TORCH_NATIVE_EXTEND, _recompute_extend_hook, sg.HookType.AROUND),
    ]
    if not env.packed_cpu_linear():
        return hooks
    from sgl_kara.cpu import linear as cpu_linear

    if not cpu_linear.available():
        logger.warning(
            "sgl_kara: this torch has no oneDNN linear; CPU weight matmuls stay F.linear"
        )
        return hooks
    return hooks + [
        (
            sg.TARGET_LINEAR_PROCESS_WEIGHTS,
            cpu_linear.process_weights_hook,
            sg.HookType.AROUND,
        ),
        (
            sg.TARGET_LINEAR_RESTORE_WEIGHTS,
            cpu_linear.restore_weights_hook,
            sg.HookType.AROUND,
        ),
        (sg.TARGET_LINEAR_APPLY, cpu_linear.linear_apply_hook, sg.HookType.AROUND),
        (
            sg.TARGET_LINEAR_APPLY_INTO,
            cpu_linear.linear_apply_into_hook,
            sg.HookType.AROUND,
        ),
        (sg.TARGET_LM_HEAD, cpu_linear.lm_head_hook, sg.HookType.AROUND),
        *[
            (target, cpu_linear.weight_export_hook, sg.HookType.AROUND)
            for target in sg.TARGET_WEIGHT_EXPORTS
        ],
    ]


def report_hooks() -> list:
    from sgl_kara import _sglang as sg

    return [(sg.TARGET_GET_INTERNAL_STATE, _internal_state_hook, sg.HookType.AFTER)]


def trace_hooks() -> list:
    from sgl_kara import _sglang as sg

    return [(sg.TARGET_UPDATE_RUNNING_BATCH, _trace_hook, sg.HookType.AFTER)]


HOOKS = {
    "serving": serving_hooks,
    "cpu_kernels": cpu_kernel_hooks,
    "report": report_hooks,
    "trace": trace_hooks,
}


def cpu_kernels_in_use() -> dict:
    """What this process runs of sgl_kara/cpu: ``decode_attention`` "batched" (one padded call per
    layer where the cost rule says so), "gather" (one K/V gather per layer, SGLang's per-request
    SDPA loop) or "sglang" (SGLang's own code); ``window_extend`` (Kara's recompute pass);
    ``packed_linear`` and the weights held packed so far (torch_native / CPU models only)."""
    on = "cpu_kernels" in STATE.parts
    fast = on and env.fast_cpu_decode()
    return {
        "enabled": on,
        "decode_attention": ("batched" if env.batched_cpu_decode() else "gather")
        if fast
        else "sglang",
        "window_extend": fast,
        "packed_linear": "packed_linear" in STATE.parts,
        "packed_weights": _packed_weights(),
    }


def _internal_state_hook(result, scheduler, recv_req):
    """AFTER ``Scheduler.get_internal_state``: which CPU kernels this scheduler runs, so a
    benchmark can state it for each side (``kara_cpu_kernels`` in /server_info's internal states)."""
    result.internal_state["kara_cpu_kernels"] = cpu_kernels_in_use()
    return result


def fork_server_processes() -> None:
    """The launcher on CPU: start SGLang's scheduler and detokenizer by fork instead of spawn.

    SGLang 0.5.23 forces ``spawn`` in ``_set_envs_and_config``; every spawned process then imports
    torch + SGLang again (~10 s and ~0.9 GB of private memory each on a 2-core VM). Forked, they
    share the launcher's imported pages: measured on the default server, ready ~9 s sooner and
    ~0.7 GB less memory in all (docs/CONFIGURATION.md, "CPU defaults and memory sizing"). Only for
    ``python -m sgl_kara.launch_server`` on CPU: that process has run no torch parallel region
    before the fork (GNU OpenMP is not fork-safe after one) and holds no CUDA context.
    ``KARA_FORK=0`` keeps spawn.
    """
    from sgl_kara import _sglang as sg

    sg.HookRegistry.register(
        sg.TARGET_SET_ENVS, _fork_after_set_envs, sg.HookType.AFTER
    )
    sg.HookRegistry.apply_hooks()  # plugins were applied at start-up; this adds the new target


def _fork_after_set_envs(result, server_args):
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    return result


def _active():
    from sgl_kara.scheduler import runtime

    return runtime.active()


def _init_new_hook(original, cls, batch, model_runner, **kwargs):
    fb = original(cls, batch=batch, model_runner=model_runner, **kwargs)
    rt = _active()
    if rt is not None and batch is not None and hasattr(batch, "reqs"):
        rt.forward.on_forward_batch(batch, fb)
    return fb


def _attention_hook(
    original,
    layer,
    q,
    k,
    v,
    forward_batch,
    save_kv_cache=True,
    key_value_num_tokens=None,
    **kwargs,
):
    rt = _active()
    if rt is None:
        return original(
            layer,
            q=q,
            k=k,
            v=v,
            forward_batch=forward_batch,
            save_kv_cache=save_kv_cache,
            key_value_num_tokens=key_value_num_tokens,
            **kwargs,
        )

    def call(
        layer, q, k, v, forward_batch, save_kv_cache
    ):  # SGLang's forward, by keyword
        return original(
            layer,
            q=q,
            k=k,
            v=v,
            forward_batch=forward_batch,
            save_kv_cache=save_kv_cache,
            key_value_num_tokens=key_value_num_tokens,
            **kwargs,
        )

    return rt.forward.on_attention(call, layer, q, k, v, forward_batch, save_kv_cache)


def _recompute_extend_hook(
    original,
    backend,
    query,
    output,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_prefix_lens,
    extend_seq_lens,
    encoder_lens=None,
    scaling=None,
    enable_gqa=False,
    causal=False,
    is_cross_attn=False,
    sliding_window_size=None,
):
    """torch_native extend: Kara's recompute pass on CPU takes cpu.attention.run_window_extend
    (window queries only); every other extend (prefills, plain SGLang) takes SGLang's path."""
    rt = _active()
    if (
        rt is not None
        and rt.forward.scoring is not None
        and causal
        and encoder_lens is None
        and not is_cross_attn
        and query.device.type == "cpu"
        and (sliding_window_size is None or sliding_window_size <= -1)
        and env.fast_cpu_decode()
    ):
        from sgl_kara.cpu.attention import run_window_extend

        return run_window_extend(
            backend,
            query,
            output,
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices,
            seq_lens,
            extend_prefix_lens,
            extend_seq_lens,
            scaling=scaling,
            enable_gqa=enable_gqa,
        )
    return original(
        backend,
        query=query,
        output=output,
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        extend_prefix_lens=extend_prefix_lens,
        extend_seq_lens=extend_seq_lens,
        encoder_lens=encoder_lens,
        scaling=scaling,
        enable_gqa=enable_gqa,
        causal=causal,
        is_cross_attn=is_cross_attn,
        sliding_window_size=sliding_window_size,
    )


def _trace_hook(result, scheduler, batch, *args, **kwargs):
    """KARA_TRACE=path: append {t, cpu, running, rows, waiting, free, retracted, kara_*,
    packed_weights, cpu_kernels} per decode step (JSON lines). ``cpu``: this (scheduler) process's
    CPU clock; ``rows``: KV rows the running requests hold (physical, what decode attention reads);
    bench/step_costs.py reads both. ``cpu_kernels``: ``cpu_kernels_in_use()`` but the count."""
    running = 0 if result is None or result.is_empty() else len(result.reqs)
    lens = None if running == 0 else result.seq_lens_cpu
    rt = _active()
    record = {
        "t": time.perf_counter(),
        "cpu": time.process_time(),
        "rows": 0 if lens is None else int(lens.sum()),
        "running": running,
        "waiting": len(scheduler.waiting_queue),
        "free": int(scheduler.token_to_kv_pool_allocator.available_size()),
        "retracted": int(
            getattr(scheduler.metrics_reporter, "num_retracted_reqs", 0) or 0
        ),
        "kara_seconds": rt.stats.compression_seconds if rt is not None else 0.0,
        "kara_events": rt.stats.events if rt is not None else 0,
        "kara_deferred": rt.stats.deferred_events if rt is not None else 0,
        "kara_skipped_no_memory": rt.stats.skipped_no_memory if rt is not None else 0,
        "kara_event_peak_bytes": rt.stats.event_peak_bytes if rt is not None else 0,
        "kara_recompute_fallbacks": rt.stats.recompute_fallbacks
        if rt is not None
        else 0,
        "kara_ring_bytes": rt.ring.nbytes
        if rt is not None and rt.ring is not None
        else 0,
        "packed_weights": _packed_weights(),
        "cpu_kernels": {
            k: v for k, v in cpu_kernels_in_use().items() if k != "packed_weights"
        },
    }
    STATE.trace_file(env.trace()).write(json.dumps(record) + "\n")
    return result


def _packed_weights() -> int:
    """Weights held in oneDNN's packed form (KARA_PACKED_CPU_LINEAR: cpu/linear.py), 0 without."""
    import sys

    mod = sys.modules.get("sgl_kara.cpu.linear")
    return mod.packed_count() if mod is not None else 0


def set_serving_policy(policy: str) -> None:
    """The compression policy of the server this process fronts (per-request checks that depend on it)."""
    STATE.serving_policy = policy


def _verify_hook(result, sampling_params, *args, **kwargs):
    """SamplingParams.verify: reject invalid ``custom_params["kara"]``, and beam search under a
    compression policy, with a 400 naming the field."""
    from sgl_kara.request_options import check_supported, validate

    validate(getattr(sampling_params, "custom_params", None))
    if STATE.serving_policy not in (None, "none"):
        check_supported(sampling_params, STATE.serving_policy)
    return result


def _validate_input_ids_hook(result, manager, obj, input_ids, *args, **kwargs):
    """TokenizerManager._validate_one_request: out-of-vocabulary ids would crash the scheduler
    (embedding IndexError, whole server down); reject them with a 400 instead."""
    vocab = manager.model_config.vocab_size
    if input_ids and not all(isinstance(t, int) and 0 <= t < vocab for t in input_ids):
        bad = next(t for t in input_ids if not (isinstance(t, int) and 0 <= t < vocab))
        raise ValueError(
            f"input_ids contains out-of-vocabulary token id {bad!r}; valid range is [0, {vocab})."
        )
    return result


def _reset_for_retract_hook(result, req, *args, **kwargs):
    rt = _active()
    if rt is not None:
        rt.on_retract(req)
    return result


def _retraction_order_hook(original, reqs, **kwargs):
    """Retract uncompressed requests first (Zipage §4.4): the loop pops from the end.

    Among uncompressed requests, those already retracted more often are kept first: a request
    that was just re-prefilled is uncompressed again until its catch-up compression, and would
    otherwise be retracted again and again while the others never are."""
    order = original(reqs=reqs, **kwargs)
    if _active() is None:
        return order
    compressed = [
        i
        for i in order
        if getattr(getattr(reqs[i], "kara", None), "compressions", 0) > 0
    ]
    done = set(compressed)
    plain = [i for i in order if i not in done]
    plain.sort(
        key=lambda i: -int(getattr(reqs[i], "retraction_count", 0) or 0)
    )  # stable
    return compressed + plain
