"""SGLang general plugin (entry point ``sglang.srt.plugins``: ``sgl_kara``).

SGLang calls ``register()`` early in every process it starts (the launcher or Engine process, the
scheduler, the detokenizer, the data-parallel controller) for every installed plugin, plain
``python -m sglang.launch_server`` and ``sglang.Engine`` included. What it registers depends on
the process's environment and device, so installing sgl_kara leaves plain SGLang as it was but
for two start-up fixes on a CPU (``rope`` and ``parallel`` below):

    serving      KARA_SERVE=1: Kara's touch points (inert unless a Kara scheduler runs in the
                 process: ``runtime.active()``), the request checks (``custom_params.kara``,
                 beam search, out-of-vocabulary input ids), the radix-cache backend "kara"
    trace        KARA_TRACE=path: one JSON line per decode step (benchmarks; any scheduler)

and, from the CPU serving kit (sgl_kara/cpu/hooks.py), only in a process without CUDA:

    rope         always: RoPE's CPU path (SGLang 0.5.23 does not start on a CPU without vLLM)
    parallel     always: ``--tp-size N`` starts on a CPU (no PyNccl, cores split among ranks)
    cpu_kernels  KARA_CPU_KERNELS (default: KARA_SERVE): the CPU kernels
    report       with either: ``kara_cpu_kernels`` in /server_info's internal states

``KARA_CPU_KERNELS=1`` asks for the CPU kernels (and their report) on a machine with CUDA too.
sgl_kara's launcher and Engine set ``KARA_SERVE=1`` for the SGLang processes they start (spawned
or forked, each runs ``register()`` again and reads it) and apply the hooks in their own process
(``serve`` / ``serving``). Each hook stands in for one upstream change (patches/).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time

from sgl_kara import env
from sgl_kara.process import STATE

logger = logging.getLogger(__name__)

KEY = "kara"  # custom_params.kara

# The plugin's parts, in registration order (process.STATE.parts holds those registered).
PARTS = ("serving", "rope", "parallel", "cpu_kernels", "report", "trace")
CPU_PARTS = ("rope", "parallel", "cpu_kernels", "report")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def wanted_parts() -> list[str]:
    """The parts this process's environment and device ask for."""
    serving = env.serving()
    cpu = not cuda_available()
    kernels = env.cpu_kernels_requested()
    kernels = (serving and cpu) if kernels is None else kernels
    asked = {
        "serving": serving,
        "rope": cpu,
        "parallel": cpu,
        "cpu_kernels": kernels,
        "report": kernels or (cpu and serving),
        "trace": env.trace() is not None,
    }
    return [p for p in PARTS if asked[p]]


def registers_cpu_kit() -> bool:
    """Does a serving process here register hooks of the CPU kit (``wanted_parts`` with
    KARA_SERVE set): a process without CUDA, or one where KARA_CPU_KERNELS=1 asks for the
    kit's kernels?"""
    return not cuda_available() or bool(env.cpu_kernels_requested())


def register() -> None:
    """SGLang's entry point: the hooks of every part asked for and not yet registered in this
    process (SGLang applies them after its plugins ran; ``serve`` otherwise)."""
    from sgl_kara import _sglang as adapter

    for part in wanted_parts():
        if part in STATE.parts:
            continue
        STATE.parts.add(part)
        if part in CPU_PARTS:
            from sgl_kara.cpu import hooks as cpu_hooks

            cpu_hooks.register(part)
            continue
        if part == "serving":
            from sgl_kara.mem_cache.radix import BACKEND_NAME, kara_radix_cache_factory

            if BACKEND_NAME not in adapter.registered_radix_cache_backends():
                adapter.register_radix_cache_backend(
                    BACKEND_NAME, kara_radix_cache_factory
                )
            STATE.recompute_in_flight = recompute_in_flight  # for the CPU kit
            register_extensions()
        for target, hook, hook_type in HOOKS[part]():
            adapter.register_hook(target, hook, hook_type)
            STATE.hooks.append(target)


def serve() -> None:
    """This process serves with sgl_kara, and so does every SGLang process it starts from now on:
    ``KARA_SERVE=1`` in its environment, then its hooks registered and applied -- by SGLang's own
    loader (idempotent; it calls ``register``), or, where SGLang loaded its plugins in this
    process before, by ``register`` for the parts now asked for and SGLang's ``apply_hooks``."""
    os.environ[env.SERVE] = "1"
    from sgl_kara import _sglang as adapter

    adapter.load_plugins()
    register()
    adapter.apply_hooks()


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


def serving_hooks() -> list:
    """Kara's hooks where the installed SGLang has none of the upstream series' extension points
    (the hooked backend, sgl_kara.backends; with the series: none, SGLang's extension points and
    the scheduler's overrides serve instead, ``register_extensions``)."""
    from sgl_kara import _sglang as adapter
    from sgl_kara import backends
    from sgl_kara.scheduler.output import unwrap_meta_hook

    if not backends.current().hooked:
        return []
    H = adapter.HookType
    return [
        (adapter.TARGET_UPDATE_RUNNING_BATCH, _decode_step_hook, H.BEFORE),
        (adapter.TARGET_GET_INTERNAL_STATE, _kara_state_hook, H.AFTER),
        (adapter.TARGET_INIT_NEW, _init_new_hook, H.AROUND),
        (adapter.TARGET_ATTENTION, _attention_hook, H.AROUND),
        (adapter.TARGET_RESET_FOR_RETRACT, _reset_for_retract_hook, H.AFTER),
        (adapter.TARGET_RETRACTION_ORDER, _retraction_order_hook, H.AROUND),
        (adapter.TARGET_META_INFO, unwrap_meta_hook, H.AROUND),
        (adapter.TARGET_SAMPLING_VERIFY, _verify_hook, H.AFTER),
        (adapter.TARGET_VALIDATE_REQUEST, _validate_input_ids_hook, H.AFTER),
    ]


def register_extensions() -> None:
    """The serving part's registrations in SGLang's own registries, where it has the series:
    ``custom_params.kara``'s validator (0003), the ``kara`` retraction policy (0005)."""
    from sgl_kara import _sglang as adapter
    from sgl_kara import backends

    if backends.current().hooked:
        return
    adapter.register_custom_params_validator(KEY, _validate_kara_params)
    from sgl_kara.scheduler.retraction import register_policy

    register_policy()


def _validate_kara_params(value, sampling_params) -> None:
    """SGLang's validator registry, for every request in the tokenizer (a 400):
    ``custom_params.kara`` where set, and beam search refused under a compression policy."""
    from sgl_kara.request_options import check_supported, validate

    if value is not None:
        validate({KEY: value})
    if STATE.serving_policy not in (None, "none"):
        check_supported(sampling_params, STATE.serving_policy)


def trace_hooks() -> list:
    from sgl_kara import _sglang as adapter

    return [(adapter.TARGET_UPDATE_RUNNING_BATCH, _trace_hook, adapter.HookType.AFTER)]


HOOKS = {"serving": serving_hooks, "trace": trace_hooks}


def _active():
    from sgl_kara.scheduler import runtime

    return runtime.active()


def recompute_in_flight() -> bool:
    """Is Kara's recompute forward running in this process (``ForwardContext.scoring_pass``)?
    The core's answer to the CPU kit, which asks through ``process.STATE``."""
    rt = _active()
    return rt is not None and rt.forward.scoring is not None


def _decode_step_hook(scheduler, batch, *args, **kwargs):
    """BEFORE ``Scheduler.update_running_batch``: this step's compression work, before SGLang's
    decode memory check, so freed slots avoid retractions."""
    rt = _active()
    if rt is not None:
        rt.on_decode_step(batch)


def _kara_state_hook(result, scheduler, recv_req):
    """AFTER ``Scheduler.get_internal_state``: this replica's Kara counters in /server_info
    (one entry per --dp-size replica)."""
    rt = _active()
    if rt is not None:
        from sgl_kara import backends
        from sgl_kara.scheduler.kara_scheduler import replica_stats

        backends.current().add_internal_state(result, "kara", replica_stats(rt))
    return result


def _init_new_hook(original, cls, batch, model_runner, **kwargs):
    forward_batch = original(cls, batch=batch, model_runner=model_runner, **kwargs)
    rt = _active()
    if rt is not None and batch is not None:
        rt.forward.on_forward_batch(batch, forward_batch)
    return forward_batch


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


def _trace_hook(result, scheduler, batch, *args, **kwargs):
    """KARA_TRACE=path: append {t, cpu, running, rows, waiting, free, retracted, kara_*,
    packed_weights, cpu_kernels} per decode step (JSON lines). ``cpu``: this (scheduler) process's
    CPU clock; ``rows``: KV rows the running requests hold (physical, what decode attention reads);
    bench/step_costs.py reads both. ``cpu_kernels``: ``cpu_kernels_in_use()`` but the count."""
    from sgl_kara import _sglang as adapter

    rt = _active()
    record = {
        "t": time.perf_counter(),
        "cpu": time.process_time(),
        **adapter.scheduler_trace(scheduler, result),
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
        **_cpu_kernels_record(),
    }
    STATE.trace_file(env.trace()).write(json.dumps(record) + "\n")
    return result


def _cpu_kernels_record() -> dict:
    """The CPU kernels this process runs, for the trace (none without the CPU kit)."""
    hooks = sys.modules.get("sgl_kara.cpu.hooks")
    if hooks is None:
        return {"packed_weights": 0, "cpu_kernels": {"enabled": False}}
    used = hooks.cpu_kernels_in_use()
    return {
        "packed_weights": used.pop("packed_weights"),
        "cpu_kernels": used,
    }


def set_serving_policy(policy: str) -> None:
    """The compression policy of the server this process fronts (per-request checks that depend on it)."""
    STATE.serving_policy = policy


def _verify_hook(result, sampling_params, *args, **kwargs):
    """SamplingParams.verify: reject invalid ``custom_params["kara"]``, and beam search under a
    compression policy, with a 400 naming the field."""
    from sgl_kara import _sglang as adapter
    from sgl_kara.request_options import check_supported, validate

    validate(adapter.custom_params(sampling_params))
    if STATE.serving_policy not in (None, "none"):
        check_supported(sampling_params, STATE.serving_policy)
    return result


def _validate_input_ids_hook(result, manager, obj, input_ids, *args, **kwargs):
    """TokenizerManager._validate_one_request: out-of-vocabulary ids would crash the scheduler
    (embedding IndexError, whole server down); reject them with a 400 instead."""
    from sgl_kara import backends

    vocab = backends.current().vocab_size(manager)
    if input_ids and not all(isinstance(t, int) and 0 <= t < vocab for t in input_ids):
        bad = next(t for t in input_ids if not (isinstance(t, int) and 0 <= t < vocab))
        raise ValueError(
            f"input_ids contains out-of-vocabulary token id {bad!r}; valid range is [0, {vocab})."
        )
    return result


def _reset_for_retract_hook(result, req, *args, **kwargs):
    """AFTER ``Req.reset_for_retract``: the retracted request's rows are exact again."""
    from sgl_kara.scheduler.retraction import on_retract

    on_retract(req)
    return result


def _retraction_order_hook(original, reqs, **kwargs):
    """AROUND ``ScheduleBatch._get_decode_retraction_order``: Kara's order
    (scheduler/retraction.py)."""
    from sgl_kara.scheduler.retraction import kara_order

    return kara_order(original(reqs=reqs, **kwargs), reqs)
