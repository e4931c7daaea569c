"""The CPU serving kit's hooks, registered by the plugin (sgl_kara/plugin.py) only where the
process runs on a CPU, or where ``KARA_CPU_KERNELS=1`` asks for them:

    rope          RoPE's CPU path (``apply_rope_shim``): SGLang 0.5.23 does not start on a CPU
                  without vLLM otherwise; every process without CUDA, plain SGLang included
    parallel      ``--tp-size N`` on a CPU: no PyNccl communicator, the cores split among the
                  ranks when the user set no binding (parallel.py); every process without CUDA,
                  plain SGLang included
    cpu_kernels   torch_native decode attention (one K/V gather per layer, one padded call per
                  batch), Kara's recompute pass attending its window queries only, float32
                  matmuls on oneDNN-packed weights: each changes float summation order only
    report        ``kara_cpu_kernels`` in /server_info's internal states
    fork          ``python -m sgl_kara.launch_server``: SGLang's workers forked, not spawned

Each hook stands in for one upstream change (patches/cpu*.md, patches/process_start.md).
"""

from __future__ import annotations

import logging
import sys

from sgl_kara import env
from sgl_kara.process import STATE

logger = logging.getLogger(__name__)


def apply_rope_shim() -> None:
    """SGLang's RoPE takes its CPU path (else it imports vllm's CUDA ops)."""
    from sgl_kara.cpu._sglang import rotary_embedding_base

    rotary_embedding_base._is_cpu = True


def register(part: str) -> None:
    """Register the hooks of one of the plugin's CPU parts (``rope`` is applied at once: a module
    flag, not a hook)."""
    from sgl_kara.cpu import _sglang as adapter

    if part == "rope":
        apply_rope_shim()
        return
    for target, hook, hook_type in {
        "parallel": parallel_hooks,
        "cpu_kernels": cpu_kernel_hooks,
        "report": report_hooks,
    }[part]():
        adapter.register_hook(target, hook, hook_type)
        if target == adapter.TARGET_LINEAR_APPLY:
            STATE.parts.add("packed_linear")
    if part == "cpu_kernels":
        logger.info("sgl_kara: CPU kernels in this process: %s", cpu_kernels_in_use())


def parallel_hooks() -> list:
    """Tensor parallelism on a CPU (parallel.py)."""
    from sgl_kara.cpu import _sglang as sg
    from sgl_kara.cpu import parallel

    return [
        (
            sg.TARGET_MODEL_PARALLEL_GROUP,
            parallel.model_parallel_group_hook,
            sg.HookType.AROUND,
        ),
        (sg.TARGET_THREADS_BINDING, parallel.threads_binding_hook, sg.HookType.AROUND),
    ]


def scoring_in_flight() -> bool:
    """Is a Kara recompute pass running in this process (its extend takes the window path)? The
    core says so through the per-process state (``STATE.recompute_in_flight``, set by the
    plugin's serving part); without it, never."""
    return STATE.recompute_in_flight()


def cpu_kernel_hooks() -> list:
    """sgl_kara/cpu as one part; ``KARA_FAST_CPU_DECODE`` / ``KARA_BATCHED_CPU_DECODE`` choose
    within the attention hooks at each call, ``KARA_PACKED_CPU_LINEAR`` whether the linear hooks
    are registered at all (the weights are packed when the model loads)."""
    from sgl_kara.cpu import _sglang as adapter
    from sgl_kara.cpu.attention import reset_metadata_hook, run_sdpa_forward_decode

    hooks = [
        (
            adapter.TARGET_TORCH_NATIVE_METADATA,
            reset_metadata_hook,
            adapter.HookType.AFTER,
        ),
        (
            adapter.TARGET_TORCH_NATIVE_DECODE,
            run_sdpa_forward_decode,
            adapter.HookType.AROUND,
        ),
        (
            adapter.TARGET_TORCH_NATIVE_EXTEND,
            _recompute_extend_hook,
            adapter.HookType.AROUND,
        ),
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
            adapter.TARGET_LINEAR_PROCESS_WEIGHTS,
            cpu_linear.process_weights_hook,
            adapter.HookType.AROUND,
        ),
        (
            adapter.TARGET_LINEAR_RESTORE_WEIGHTS,
            cpu_linear.restore_weights_hook,
            adapter.HookType.AROUND,
        ),
        (
            adapter.TARGET_LINEAR_APPLY,
            cpu_linear.linear_apply_hook,
            adapter.HookType.AROUND,
        ),
        (
            adapter.TARGET_LINEAR_APPLY_INTO,
            cpu_linear.linear_apply_into_hook,
            adapter.HookType.AROUND,
        ),
        (adapter.TARGET_LM_HEAD, cpu_linear.lm_head_hook, adapter.HookType.AROUND),
        *[
            (target, cpu_linear.weight_export_hook, adapter.HookType.AROUND)
            for target in adapter.TARGET_WEIGHT_EXPORTS
        ],
    ]


def report_hooks() -> list:
    from sgl_kara.cpu import _sglang as adapter

    return [
        (
            adapter.TARGET_GET_INTERNAL_STATE,
            _internal_state_hook,
            adapter.HookType.AFTER,
        )
    ]


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


def _packed_weights() -> int:
    """Weights held in oneDNN's packed form (KARA_PACKED_CPU_LINEAR: cpu/linear.py), 0 without."""
    mod = sys.modules.get("sgl_kara.cpu.linear")
    return mod.packed_count() if mod is not None else 0


def fork_server_processes() -> None:
    """The launcher on CPU: start SGLang's scheduler and detokenizer by fork instead of spawn.

    SGLang 0.5.23 forces ``spawn`` in ``_set_envs_and_config``; every spawned process then
    imports torch and SGLang again. Forked, they share the launcher's imported pages: ready
    sooner, with less memory in all (docs/CONFIGURATION.md, "CPU defaults and memory sizing").
    Only for ``python -m sgl_kara.launch_server`` on CPU: that process has run no torch parallel
    region before the fork (GNU OpenMP is not fork-safe after one) and holds no CUDA context.
    ``KARA_FORK=0`` keeps spawn.
    """
    from sgl_kara.cpu import _sglang as adapter

    adapter.register_hook(
        adapter.TARGET_SET_ENVS, _fork_after_set_envs, adapter.HookType.AFTER
    )
    adapter.apply_hooks()  # plugins were applied at start-up; this adds the target


def _fork_after_set_envs(result, server_args):
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    return result


def _window_extend(query, sliding_window_size) -> bool:
    """Does this causal extend take the window path: Kara's recompute pass in flight, on a
    CPU, no sliding window, the fast CPU decode on?"""
    return (
        scoring_in_flight()
        and query.device.type == "cpu"
        and (sliding_window_size is None or sliding_window_size <= -1)
        and env.fast_cpu_decode()
    )


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
    plain = encoder_lens is None and not is_cross_attn and causal
    if plain and _window_extend(query, sliding_window_size):
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
