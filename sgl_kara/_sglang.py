"""The core's one adapter to SGLang 0.5.23: every SGLang internal the compression core imports,
hooks, overrides, reads or writes is here, so a version bump is one file to review.

No other module of the core imports ``sglang`` or reads an attribute of an SGLang object: they
call the functions below (requests, batches, forwards, the scheduler's pools and model). The
CPU serving kit has its own adapter (``sgl_kara/cpu/_sglang.py``). Declared here and checked by
tests/test_layering.py against the installed SGLang and against this file's code:

    SIGNATURES   every SGLang callable sgl_kara hooks or overrides, with its signature
    EXTENSION_OVERRIDES  the methods it overrides on an extension point's classes
    ATTRIBUTES   every attribute of an SGLang runtime object read or written here, by owner
    SERVER_ARGS  every ServerArgs field (a public CLI flag) the start-up reads or sets

The signatures are pinned: recorded once from SGLang 0.5.23 (the series' for an extension
point's), and the start-up refuses an SGLang that lacks one of these callables or gives it
another signature (``pins``, ``pin_problems``; startup.check_pins), so no hook or override goes
silently uncalled. Every hook and override is listed in patches/ with the upstream change it
stands in for.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from sglang.srt.arg_groups.overrides import model_config_of, resolving_view  # noqa: F401
from sglang.srt.entrypoints.engine import Engine as SGLangEngine  # noqa: F401
from sglang.srt.entrypoints.http_server import (  # noqa: F401
    launch_server as sglang_launch_server,
)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.managers.scheduler import Scheduler, run_scheduler_process  # noqa: F401
from sglang.srt.managers.scheduler_components.output_streamer import (  # noqa: F401
    SchedulerOutputStreamer,
)
from sglang.srt.mem_cache.common import evict_from_tree_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.registry import (  # noqa: F401
    create_unified_radix_cache,
    register_radix_cache_backend,
    registered_radix_cache_backends,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: F401
from sglang.srt.plugins import load_plugins  # noqa: F401
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: F401
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: F401
from sglang.srt.utils import kill_process_tree  # noqa: F401
from sglang.srt.utils.common import get_device_memory_capacity  # noqa: F401

# ------------------------------------------------------------------------------- touch points
# Hook targets (dotted paths), one per touch point (patches/*.md), each with its signature in
# SGLang 0.5.23: parameter names, order, kinds and defaults, as ``str(inspect.signature)``
# prints them without annotations (a class: its ``__init__``). ``SIGNATURES`` also holds the
# SGLang methods sgl_kara's subclasses override. Hooks call the original with keywords wherever
# SGLang's parameters allow it.
SIGNATURES: dict[str, str] = {}


def _target(path: str, signature: str) -> str:
    SIGNATURES[path] = signature
    return path


_FB = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_STREAMER = (
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
)
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"

TARGET_INIT_NEW = _target(
    f"{_FB}.init_new",
    "(cls, batch, model_runner, *, capture_hidden_mode=None, "
    "return_hidden_states_before_norm, extend_position_info=None, "
    "spec_mrope_positions=None, kv_loc_plan=None, write_cols=None)",
)
TARGET_ATTENTION = _target(
    "sglang.srt.layers.radix_attention.RadixAttention.forward",
    "(self, q, k, v, forward_batch, save_kv_cache=True, key_value_num_tokens=None, "
    "**kwargs)",
)
TARGET_RESET_FOR_RETRACT = _target(
    "sglang.srt.managers.schedule_batch.Req.reset_for_retract", "(self)"
)
TARGET_RETRACTION_ORDER = _target(  # a staticmethod
    "sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order",
    "(reqs)",
)
TARGET_META_INFO = _target(
    f"{_TOKENIZER_MANAGER}.update_request_meta_info",
    "(self, meta_info, state, customized_info, index, finish_reason)",
)
TARGET_SAMPLING_VERIFY = _target(
    "sglang.srt.sampling.sampling_params.SamplingParams.verify", "(self, vocab_size)"
)
TARGET_UPDATE_RUNNING_BATCH = _target(
    f"{_SCHEDULER}.update_running_batch", "(self, batch)"
)
TARGET_GET_INTERNAL_STATE = _target(
    f"{_SCHEDULER}.get_internal_state", "(self, recv_req)"
)
TARGET_VALIDATE_REQUEST = _target(
    f"{_TOKENIZER_MANAGER}._validate_one_request", "(self, obj, input_ids)"
)
# The scheduler class itself: KaraScheduler replaces it (a class REPLACE hook) in the scheduler
# processes of a compressing server only (scheduler/kara_scheduler.py, patches/scheduler.md).
TARGET_SCHEDULER = _target(_SCHEDULER, "(self, server_args, port_args)")

# ------------------------------------------------------------------------------- extension points
# SGLang's own extension points for what a hook stands in for (patches/upstream: one PR each).
# Each is found by the public name its patch adds, never by version string; where the installed
# SGLang has it, sgl_kara uses it and registers no hook for that touch point (plugin.py).
EXTENSION_POINTS = {
    # touch point: (patch, module, name)
    "input_ids": (
        "0001",
        "sglang.srt.managers.tokenizer_manager",
        "validate_input_ids_in_vocab",
    ),
    "request_info": (
        "0002",
        "sglang.srt.managers.io_struct",
        "RequestLevelCustomizedInfo",
    ),
    "custom_params": (
        "0003",
        "sglang.srt.sampling.sampling_params",
        "register_custom_params_validator",
    ),
    "decode_step": ("0004", _SCHEDULER, "pre_decode_step"),
    "retraction": (
        "0005",
        "sglang.srt.managers.retraction_policy",
        "register_retraction_policy",
    ),
    "attention": (
        "0006",
        "sglang.srt.layers.radix_attention",
        "register_attention_observer",
    ),
    "cached_extend": ("0007", _FB, "kv_already_cached"),
    # the batched KV compaction RFC: positions, the tail release, the cached extend
    "positions": (
        "0008",
        "sglang.srt.mem_cache.memory_pool.ReqToTokenPool",
        "enable_position_offsets",
    ),
    "kv_tail": ("0008", "sglang.srt.mem_cache.kv_compaction", "release_kv_tails"),
    "cached_extend_batch": ("0008", _SCHEDULER, "run_cached_extend"),
    "engine_shutdown": (
        "0009",
        "sglang.srt.managers.tokenizer_manager.TokenizerManager",
        "release_event_loop",
    ),
    "admission": ("0010", _ADDER, "reserved_new_tokens"),
}
# Methods sgl_kara overrides on the classes an extension point adds or extends, each pinned as
# the series defines it (patches/upstream): overridden, and checked at start-up (``pins``), only
# where the installed SGLang has that extension point.
_RETRACTION_POLICY = "sglang.srt.managers.retraction_policy.RetractionPolicy"
_OBSERVER = "sglang.srt.layers.radix_attention.AttentionObserver"
EXTENSION_OVERRIDES: dict[str, dict[str, str]] = {
    # KaraScheduler's subclass points (0004)
    "decode_step": {
        f"{_SCHEDULER}.pre_decode_step": "(self, batch)",
        f"{_SCHEDULER}.extra_internal_state": "(self)",
    },
    # KaraRetractionPolicy (scheduler/retraction.py, 0005)
    "retraction": {
        f"{_RETRACTION_POLICY}.get_retraction_order": "(self, reqs)",
        f"{_RETRACTION_POLICY}.on_retract": "(self, req)",
    },
    # KaraFinalValueStreamer's key (scheduler/output.py, 0002)
    "request_info": {
        f"{_STREAMER}.build_additional_customized_info": "(self, reqs)",
        f"{_STREAMER}.is_final_value_customized_info_key": "(self, key)",
    },
    # KaraPrefillAdder's reservation (scheduler/admission.py, 0010)
    "admission": {f"{_ADDER}.reserved_new_tokens": "(self, req, running)"},
    # ForwardContext's KaraObserver (scheduler/forward.py, 0006)
    "attention": {
        f"{_OBSERVER}.before_attention": "(self, layer, q, k, v, forward_batch)",
        f"{_OBSERVER}.after_attention": "(self, layer, q, output, forward_batch)",
    },
}
_FOUND: dict[str, bool] = {}


# Adapter functions that serve the extension points' side of a touch point only (used only where
# SGLang has them); the hooked side's are backends/hooked.py's. The rest serve both (a partial
# series is refused: backends.choose). tests/test_adapter_surface.py counts the names each side
# touches.
EXTENSION_PATH = {
    "release_kv_tails": "kv_tail",
    "run_cached_extend": "cached_extend_batch",
    "forward_view": "attention",
    "position_offsets": "positions",
}


def _resolve(path: str):
    """The module, or the class inside it, at a dotted path (None: not there)."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
            if obj is None:
                return None
        return obj
    return None


def _sglang_defines(owner, name: str) -> bool:
    """Does SGLang's own code define ``name`` on ``owner`` (a module, or a class: some class of
    SGLang's in its MRO must hold it -- sgl_kara's subclasses, which may stand in for SGLang's
    classes once a hook replaced them, do not count)?"""
    if owner is None:
        return False
    if not isinstance(owner, type):
        return hasattr(owner, name)
    return any(
        cls.__module__.startswith("sglang.")
        and (name in vars(cls) or name in getattr(cls, "__dataclass_fields__", {}))
        for cls in owner.__mro__
    )


def has_extension(point: str) -> bool:
    """Does the installed SGLang have this touch point's extension point?"""
    if point not in _FOUND:
        _, path, name = EXTENSION_POINTS[point]
        _FOUND[point] = _sglang_defines(_resolve(path), name)
    return _FOUND[point]


def register_custom_params_validator(key: str, validator) -> None:
    """SGLang's ``custom_params`` validator registry (0003), ``validator(value, params)`` run for
    every request (``value`` None where unset); a key registered already (a process whose
    plugin registered again) is left as it is."""
    from sglang.srt.sampling import sampling_params

    try:
        sampling_params.register_custom_params_validator(
            key, validator, every_request=True
        )
    except ValueError:
        pass


def retraction_policy_base():
    """SGLang's ``RetractionPolicy`` (0005)."""
    from sglang.srt.managers.retraction_policy import RetractionPolicy

    return RetractionPolicy


def registered_retraction_policies() -> list[str]:
    from sglang.srt.managers.retraction_policy import registered_retraction_policies

    return registered_retraction_policies()


def register_retraction_policy(name: str, policy) -> None:
    from sglang.srt.managers.retraction_policy import register_retraction_policy

    register_retraction_policy(name, policy)


def retraction_policy(name: str):
    """The retraction policy SGLang has registered as ``name``."""
    from sglang.srt.managers.retraction_policy import get_retraction_policy

    return get_retraction_policy(name)


# SGLang methods that sgl_kara's subclasses override (KaraScheduler, the output streamer and
# prefill adder it returns, the "kara" radix cache, sgl_kara.Engine), and the process function
# it wraps.
OVERRIDDEN = (
    _target("sglang.srt.entrypoints.engine.Engine.__init__", "(self, **kwargs)"),
    _target("sglang.srt.entrypoints.engine.Engine.shutdown", "(self)"),
    _target(f"{_SCHEDULER}.get_output_streamer_class", "(self)"),
    _target(f"{_SCHEDULER}.get_prefill_adder_class", "(self)"),
    _target(f"{_STREAMER}.build_additional_customized_info", "(self, reqs)"),
    _target(f"{_STREAMER}.is_request_level_customized_info_key", "(self, key)"),
    _target(f"{_ADDER}._get_running_request_total_token_offset", "(self, req)"),
    _target(
        f"{_ADDER}.add_one_req", "(self, req, has_chunked_req, truncation_align_size)"
    ),
    _target(
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint",
        "(self, req, *, up_to, **kwargs)",
    ),
    _target(
        "sglang.srt.managers.scheduler.run_scheduler_process",
        "(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer, "
        "display_tp_rank=None, display_dp_rank=None, display_moe_ep_rank=None)",
    ),
)


# ------------------------------------------------------------------------------- pins
def pins() -> dict[str, tuple[str, str]]:
    """What the core hooks and overrides on the installed SGLang: path -> (its pinned signature,
    "hook" or "override"). Every hook target and override in SIGNATURES, and the overrides on
    each extension point this SGLang has (EXTENSION_OVERRIDES)."""
    out = {
        path: (signature, "override" if path in OVERRIDDEN else "hook")
        for path, signature in SIGNATURES.items()
    }
    for point, overrides in EXTENSION_OVERRIDES.items():
        if has_extension(point):
            out.update({path: (sig, "override") for path, sig in overrides.items()})
    return out


def signature_text(fn) -> str:
    """Names, order, kinds and defaults of ``fn``'s parameters, without annotations: what
    SIGNATURES records."""
    sig = inspect.signature(fn, follow_wrapped=False)
    bare = [
        p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()
    ]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def _sglang_definition(cls: type, name: str):
    """``name`` as the first of SGLang's own classes in ``cls``'s MRO defines it (None: none
    does). sgl_kara's subclasses are skipped: once a hook replaced SGLang's class they stand in
    for it, and their own definition would hide SGLang's missing one."""
    for owner in cls.__mro__:
        if owner.__module__.startswith("sglang.") and name in vars(owner):
            return vars(owner)[name]
    return None


def installed_signature(path: str) -> str | None:
    """The signature the installed SGLang's own code gives the callable at ``path`` (a class:
    its ``__init__``), unwrapped from any plugin hook applied to it; None where it has none."""
    owner_path, _, name = path.rpartition(".")
    owner = _resolve(owner_path)
    if isinstance(owner, type):
        found = _sglang_definition(owner, name)
    else:
        found = getattr(owner, name, None)
    if isinstance(found, type):
        found = _sglang_definition(found, "__init__")
    if isinstance(found, (classmethod, staticmethod)):
        found = found.__func__
    if not callable(found):
        return None
    return signature_text(inspect.unwrap(found))


def _display_name(path: str) -> str:
    """``Class.method`` of a method's dotted path; a module-level function's whole path."""
    parts = path.split(".")
    first_class = next((i for i, p in enumerate(parts) if p[:1].isupper()), 0)
    return ".".join(parts[first_class:])


_KINDS = {"hook": "hook on", "override": "override of"}


def pin_problems(pinned: dict[str, tuple[str, str]]) -> list[str]:
    """Each entry of ``pinned`` (path -> (signature, "hook" | "override"): ``pins``) that the
    installed SGLang does not match, as a phrase naming it: missing (the hook or override would
    silently never run), or with another signature than the pinned one."""
    out = []
    for path, (want, kind) in pinned.items():
        got = installed_signature(path)
        name = _display_name(path)
        if got is None:
            out.append(
                f"SGLang's {name} is missing, and sgl_kara's {_KINDS[kind]} it would "
                "never run"
            )
        elif got != want:
            out.append(
                f"SGLang's {name} takes {got}, and sgl_kara's {_KINDS[kind]} it is made "
                f"for {want}"
            )
    return out


# Attributes of SGLang runtime objects read or written in this file, by owner: each checked to
# exist (class attribute, dataclass field, or ``self.<name>`` in the class source), and this
# list checked against the attributes this file's code touches.
ATTRIBUTES = {
    "sglang.srt.managers.schedule_batch.Req": [
        "kv",
        "rid",
        "origin_input_ids",
        "output_ids",
        "sampling_params",
        "finished",
        "to_finish",
    ],
    "sglang.srt.managers.schedule_batch.ReqKvInfo": [
        "kv_committed_len",
        "kv_allocated_len",
        "cache_protected_len",
        "req_pool_idx",
    ],
    "sglang.srt.sampling.sampling_params.SamplingParams": [
        "max_new_tokens",
        "custom_params",
    ],
    # the running batch's lengths after a compaction; the recompute pass's EXTEND batch, built
    # by ScheduleBatch.init_new and given the fields prepare_for_extend would set
    "sglang.srt.managers.schedule_batch.ScheduleBatch": [
        "init_new",
        "reqs",
        "seq_lens",
        "seq_lens_cpu",
        "orig_seq_lens",
        "seq_lens_sum",
        "batch_is_full",
        "forward_mode",
        "input_ids",
        "req_pool_indices",
        "out_cache_loc",
        "prefix_lens",
        "extend_lens",
        "extend_num_tokens",
        "extend_logprob_start_lens",
        "return_logprob",
        "sampling_info",
    ],
    "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo": [
        "from_schedule_batch",
        "has_watermark_candidates",
    ],
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch": [
        "init_new",
        "positions",
        "out_cache_loc",
        # an attention observer's view of a forward (patches/upstream 0006)
        "forward_mode",
        "req_pool_indices",
        "rids",
        "seq_lens_cpu",
    ],
    "sglang.srt.model_executor.forward_batch_info.ForwardMode": [
        "EXTEND",
        "is_decode",
        "is_idle",
    ],
    "sglang.srt.layers.radix_attention.RadixAttention": [
        "layer_id",
        "sliding_window_size",
    ],
    "sglang.srt.managers.scheduler.Scheduler": [
        "token_to_kv_pool_allocator",
        "req_to_token_pool",
        "tree_cache",
        "tp_worker",
        "model_config",
        "max_running_requests",
        "max_total_num_tokens",
        "waiting_queue",
        "enable_overlap",
        "forward_stream",
        "metrics_reporter",
        "run_cached_extend",  # patches/upstream 0008
        # runtime.py: the tensor-parallel group's CPU side (tp_lockstep.py, the eviction
        # record, startup.check_runtime_supported)
        "tp_cpu_group",
    ],
    "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter": [
        "num_retracted_reqs"
    ],
    "sglang.srt.managers.tp_worker.TpModelWorker": ["model_runner"],
    "sglang.srt.model_executor.model_runner.ModelRunner": [
        "model",
        "dtype",
        "forward",
        "prefill_cuda_graph_runner",
        "decode_cuda_graph_runner",
    ],
    "sglang.srt.mem_cache.memory_pool.ReqToTokenPool": [
        "req_to_token",
        "enable_position_offsets",  # patches/upstream 0008
    ],
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool": [
        "get_key_buffer",
        "get_value_buffer",
    ],
    "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator": [
        "alloc",
        "available_size",
        "get_all_free_pages",
        "get_kvcache",
        "page_size",
    ],
    # page ids freed as they are (no torch.unique on the device): both of SGLang's MHA allocators
    "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator": ["free_page_ids"],
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator": [
        "free_page_ids"
    ],
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache": ["evictable_size"],
    "sglang.srt.managers.io_struct.GetInternalStateReqOutput": ["internal_state"],
    "sglang.srt.configs.model_config.ModelConfig": ["vocab_size", "hf_config"],
    # engine.py: the engine's shutdown and the shut-down engine's event-loop tasks
    "sglang.srt.entrypoints.engine.Engine": ["shutdown", "tokenizer_manager", "loop"],
    # the recompute batch's (speculative decoding is refused with compression)
    "sglang.srt.speculative.spec_info.SpeculativeAlgorithm": ["NONE"],
    # this scheduler's data-parallel rank
    "sglang.srt.runtime_context.ParallelContext": ["dp_rank"],
    "sglang.srt.managers.tokenizer_manager.TokenizerManager": [
        "asyncio_tasks",
        "event_loop",
    ],
    "sglang.srt.plugins.hook_registry.HookRegistry": ["register", "apply_hooks"],
}

# ServerArgs fields (each a public CLI flag) the start-up reads, or sets where noted.
SERVER_ARGS = (
    # what the server is
    "model_path",
    "revision",
    "device",
    "dtype",
    "tp_size",
    "dp_size",
    "pp_size",
    "kv_cache_dtype",
    # memory and scheduling (mem_fraction_static and max_total_tokens may be set: the plan)
    "max_running_requests",
    "max_total_tokens",
    "mem_fraction_static",
    "chunked_prefill_size",
    "enable_metrics",
    # decode CUDA graphs (disable_decode_cuda_graph set where the hook must see every step)
    "cuda_graph_config",
    "cuda_graph_backend_decode",
    "disable_decode_cuda_graph",
    "disable_cuda_graph",
    # the radix backend (set to "kara"), the retraction policy (set to Kara's, where SGLang has
    # the registry: patches/upstream 0005)
    "radix_cache_backend",
    "retraction_policy",
    # features refused with compression (startup._UNSUPPORTED)
    "speculative_algorithm",
    "enable_dp_attention",
    "disaggregation_mode",
    "enable_hierarchical_cache",
    "enable_mixed_chunk",
    "enable_lmcache",
    "enable_flexkv",
    "enable_streaming_session",
    "enable_session_radix_cache",
    "enable_two_batch_overlap",
    "enable_unified_memory",
    "num_continuous_decode_steps",
    "enable_hisparse",
)


def register_hook(target: str, hook, hook_type) -> None:
    """SGLang's plugin hook registry: ``hook`` on ``target`` (applied by ``apply_hooks``)."""
    HookRegistry.register(target, hook, hook_type)


def apply_hooks() -> None:
    HookRegistry.apply_hooks()


def hf_config(server_args):
    """The transformers config SGLang resolved for these (resolved) server args."""
    return model_config_of(server_args).hf_config


def server_arg(server_args, name: str, default=None):
    """A ServerArgs field (declared in SERVER_ARGS)."""
    assert name in SERVER_ARGS, f"ServerArgs.{name} is not declared in SERVER_ARGS"
    return getattr(server_args, name, default)


def set_server_arg(server_args, name: str, value) -> None:
    assert name in SERVER_ARGS, f"ServerArgs.{name} is not declared in SERVER_ARGS"
    setattr(server_args, name, value)


# ------------------------------------------------------------------------------- requests
def rid(req) -> str:
    return req.rid


def row_index(req) -> int:
    """The request's row in ``req_to_token``."""
    return int(req.kv.req_pool_idx)


def kv_length(req) -> int:
    """Rows of KV the request's row holds (committed: written by a finished forward)."""
    return int(req.kv.kv_committed_len)


def kv_settled(req) -> bool:
    """Is every allocated row of the request committed (no forward in flight writes it)?"""
    return int(req.kv.kv_committed_len) == int(req.kv.kv_allocated_len)


def tree_prefix_length(req) -> int:
    """Rows at the start of the request's row that the radix tree owns (shared, protected)."""
    return int(req.kv.cache_protected_len)


def prompt_ids(req) -> list[int]:
    return req.origin_input_ids


def output_length(req) -> int:
    return len(req.output_ids)


def token_ids(req, lo: int, hi: int) -> list[int]:
    """The request's tokens [lo, hi) (prompt, then output)."""
    prompt = req.origin_input_ids
    return (list(prompt) + list(req.output_ids))[lo:hi]


def known_tokens(req) -> int:
    return len(req.origin_input_ids) + len(req.output_ids)


def max_new_tokens(req) -> int:
    return int(req.sampling_params.max_new_tokens)


def custom_params(sampling_params_or_req):
    """``custom_params`` of a request's (or a SamplingParams') sampling params."""
    params = getattr(sampling_params_or_req, "sampling_params", sampling_params_or_req)
    return getattr(params, "custom_params", None)


def sampling_params(req):
    return req.sampling_params


def finishing(req) -> bool:
    """Has the request finished, or is it set to finish at this step?"""
    return bool(req.finished()) or req.to_finish is not None


def finished(req) -> bool:
    return bool(req.finished())


def abort(req, message: str, status_code: int) -> None:
    """Finish the request with an error at this step (SGLang frees its row as usual)."""
    req.to_finish = FINISH_ABORT(message, status_code=status_code)


# ------------------------------------------------------------------------------- batches
def running_requests(batch) -> list:
    return [] if batch is None or not batch.reqs else list(batch.reqs)


def batch_requests(batch) -> list | None:
    """A ScheduleBatch's requests (None: not a batch of requests)."""
    return getattr(batch, "reqs", None)


def batch_device_tensors(batch) -> list:
    """The running batch's device tensors (the sync check's: what a GPU would hold)."""
    return [
        t
        for t in (batch.seq_lens, batch.orig_seq_lens, batch.req_pool_indices)
        if isinstance(t, torch.Tensor)
    ]


def reopen_admission(batch) -> None:
    """Freed slots admit waiting requests at once: SGLang's prefill otherwise skips admission
    while the running batch is marked full, until a request ends."""
    batch.batch_is_full = False


@dataclass
class ExtendRows:
    """An EXTEND forward over rows whose K/V are already cached: per request its row, the
    ``prefix`` rows before the extended ones and their token ids; ``positions`` [sum] logical."""

    reqs: list
    rows: torch.Tensor  # [B] device
    prefix: list[int]
    input_ids: torch.Tensor  # [B * n] device
    seq_lens: list[int]
    device_seq_lens: torch.Tensor  # [B] device
    positions: torch.Tensor  # [B * n] device
    out_cache_loc: torch.Tensor  # [B * n] device: where the forward may write K/V

    @property
    def per_request(self) -> int:
        """n: the tokens extended for each request."""
        return self.input_ids.numel() // max(1, len(self.reqs))


# ------------------------------------------------------------------------------- forwards
def attention_layer(layer) -> int:
    """The layer_id of a RadixAttention layer (its heads and head dim: SchedulerParts)."""
    return layer.layer_id


def attention_layers(model) -> list[int]:
    """The layer ids of the model's attention layers, in order."""
    return sorted(
        layer.layer_id for layer in model.modules() if isinstance(layer, RadixAttention)
    )


def sliding_windows(model) -> list[int]:
    """Sliding windows the model's attention layers apply (empty: global attention)."""
    return sorted(
        {
            layer.sliding_window_size
            for layer in model.modules()
            if isinstance(layer, RadixAttention)
            and (layer.sliding_window_size or -1) >= 0
        }
    )


# ------------------------------------------------------------------------------- the scheduler
def built_model(scheduler) -> tuple[object, object, object]:
    """(KV pool, model runner, model) of a scheduler whose model has loaded."""
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    runner = scheduler.tp_worker.model_runner
    return pool, runner, runner.model


def standard_kv_pool(pool) -> bool:
    """SGLang's multi-head / GQA pool (not MLA, hybrid, sliding-window or quantized)?"""
    return type(pool) is MHATokenToKVPool


def tensor_parallel(scheduler) -> tuple[int, int, object]:
    """(rank, ranks, CPU process group) of the scheduler's tensor-parallel group: the gloo group
    SGLang's scheduler itself uses for host-side agreement ((0, 1, None): no group)."""
    group = getattr(scheduler, "tp_cpu_group", None)
    if group is None or not torch.distributed.is_initialized():
        return 0, 1, None
    rank = torch.distributed.get_rank(group)
    return rank, torch.distributed.get_world_size(group), group


def model_hf_config(scheduler):
    """The transformers config of the scheduler's model (all ranks' heads)."""
    return scheduler.model_config.hf_config


def _text_config(config):
    """The text model's transformers config (a multimodal model nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decode_graphs_captured(model_runner) -> bool:
    return getattr(model_runner, "decode_cuda_graph_runner", None) is not None


@dataclass
class SchedulerParts:
    """What Kara's runtime uses of an SGLang scheduler, read once at start-up."""

    scheduler: object
    allocator: object
    kv_pool: object
    req_to_token: torch.Tensor  # [rows, max context] int32 (device)
    page_size: int
    layer_ids: list[int]
    model_runner: object
    model: object
    dtype: torch.dtype
    q_heads: int  # query heads of an attention layer on this rank
    head_dim: int  # of queries and keys (an MHA pool: refused otherwise)
    forward_stream: object | None  # the overlapped forward's stream (CUDA, overlap on)
    overlap: bool
    max_running: int
    pool_tokens: int
    recompute_tokens: (
        int  # tokens per recompute forward (SGLang's chunked-prefill budget)
    )
    metrics: bool
    server_args: object
    tp_rank: int = 0  # this scheduler's tensor-parallel rank, of tp_size
    tp_size: int = 1
    tp_group: object | None = None  # the TP group's CPU (gloo) side

    @classmethod
    def of(cls, scheduler, server_args, recompute_tokens_of) -> SchedulerParts:
        """``server_args``: the scheduler's (its constructor's argument);
        ``recompute_tokens_of(chunked_prefill_size)``: tokens per recompute forward."""
        allocator = scheduler.token_to_kv_pool_allocator
        kv_pool = allocator.get_kvcache()
        runner = scheduler.tp_worker.model_runner
        req_to_token = scheduler.req_to_token_pool.req_to_token
        args = server_args
        overlap = bool(getattr(scheduler, "enable_overlap", False))
        stream = None
        if overlap and req_to_token.device.type == "cuda":
            stream = scheduler.forward_stream
        chunk = server_arg(args, "chunked_prefill_size")
        tp_rank, tp_size, tp_group = tensor_parallel(scheduler)
        layer_ids = attention_layers(runner.model)
        return cls(
            scheduler=scheduler,
            allocator=allocator,
            kv_pool=kv_pool,
            req_to_token=req_to_token,
            page_size=int(allocator.page_size),
            layer_ids=layer_ids,
            model_runner=runner,
            model=runner.model,
            dtype=runner.dtype,
            # the model's query heads split over the ranks; the head dim the pool stores
            q_heads=_text_config(model_hf_config(scheduler)).num_attention_heads
            // tp_size,
            head_dim=int(kv_pool.get_key_buffer(layer_ids[0]).shape[-1]),
            forward_stream=stream,
            overlap=overlap,
            max_running=int(scheduler.max_running_requests),
            pool_tokens=int(scheduler.max_total_num_tokens),
            recompute_tokens=recompute_tokens_of(chunk),
            metrics=bool(server_arg(args, "enable_metrics", False)),
            server_args=args,
            tp_rank=tp_rank,
            tp_size=tp_size,
            tp_group=tp_group,
        )

    # -- the pool
    def keys(self, layer_id: int) -> torch.Tensor:
        return self.kv_pool.get_key_buffer(layer_id)

    def values(self, layer_id: int) -> torch.Tensor:
        return self.kv_pool.get_value_buffer(layer_id)

    def available(self) -> int:
        return int(self.allocator.available_size())

    def evictable(self) -> int:
        return int(self.scheduler.tree_cache.evictable_size())

    def reserve(self, n: int) -> None:
        """Evict from the radix tree until ``n`` slots are free, or nothing evictable is left
        (SGLang's eviction frees with the allocator's ``free``: at page size > 1 a
        ``torch.unique`` on the device, so a Kara step calls this before its fence)."""
        if n > 0:
            evict_from_tree_cache(self.scheduler.tree_cache, n)

    def alloc(self, n: int):
        """``n`` slots from the allocator (None: not free; nothing is evicted here)."""
        return self.allocator.alloc(n)

    def free_page_ids(self, pages: torch.Tensor) -> None:
        """Free exactly these pages (a slot each at page size 1): no deduplication on the device
        (the allocator's ``free`` runs ``torch.unique`` at page size > 1, a host wait)."""
        self.allocator.free_page_ids(pages)

    def free_pages(self) -> torch.Tensor:
        return self.allocator.get_all_free_pages()

    def waiting(self) -> int:
        return len(self.scheduler.waiting_queue)

    def run_cached_extend(self, extend: ExtendRows) -> None:
        """SGLang's own forward over the rows' cached K/V (patches/upstream 0008): it builds
        the EXTEND batch and runs it as the cached extend of 0007 does."""
        self.scheduler.run_cached_extend(
            extend.reqs,
            extend.rows,
            extend.input_ids,
            extend.out_cache_loc,
            list(extend.prefix),
            [extend.per_request] * len(extend.reqs),
            extend.device_seq_lens,
        )

    def position_offsets(self) -> torch.Tensor:
        """[rows] int64: SGLang's per-row position offsets, which ForwardBatch.init_new adds to
        every forward's positions (patches/upstream 0008)."""
        return self.scheduler.req_to_token_pool.enable_position_offsets()


def release_kv_tails(batch, ranges) -> list[int]:
    """SGLang's batched tail release (patches/upstream 0008): per (batch index, start, slots,
    stop), row positions [start, stop) of that request (stop None: the whole tail) become
    ``slots``, the old ones freed, the rest moved down; the request's and the batch's lengths
    shrink and the row's position offset grows by the drop. Returns the drops."""
    from sglang.srt.mem_cache.kv_compaction import KvRelease, release_kv_tails

    releases = [
        KvRelease(index, start, slots.numel(), stop)
        for index, start, slots, stop in ranges
    ]
    return release_kv_tails(batch, releases, [slots for _, _, slots, _ in ranges])


def attention_observer_base():
    """SGLang's ``AttentionObserver`` (patches/upstream 0006)."""
    from sglang.srt.layers.radix_attention import AttentionObserver

    return AttentionObserver


def register_attention_observer(observer):
    """Call ``observer`` around every eager attention layer; returns its removal."""
    from sglang.srt.layers import radix_attention

    return radix_attention.register_attention_observer(observer)


def forward_view(forward_batch) -> tuple[str, torch.Tensor, torch.Tensor, list, object]:
    """(kind, rows [B] device, positions [T] device, request ids, host lengths [B] or None) of
    a forward batch, as an attention observer reads it."""
    mode = forward_batch.forward_mode
    kind = "idle" if mode.is_idle() else "decode" if mode.is_decode() else "extend"
    return (
        kind,
        forward_batch.req_pool_indices,
        forward_batch.positions,
        forward_batch.rids,
        forward_batch.seq_lens_cpu,
    )


def shutdown_engine(engine) -> None:
    """SGLang's own shutdown of an Engine."""
    engine.shutdown()


def dp_rank() -> int | None:
    """This scheduler's data-parallel rank (None: one replica)."""
    return get_parallel().dp_rank


def scheduler_trace(scheduler, batch) -> dict:
    """What a decode step's trace line reads of SGLang's scheduler."""
    reqs = running_requests(batch)
    lens = batch.seq_lens_cpu if reqs else None
    reporter = getattr(scheduler, "metrics_reporter", None)
    return {
        "rows": 0 if lens is None else int(lens.sum()),
        "running": len(reqs),
        "waiting": len(scheduler.waiting_queue),
        "free": int(scheduler.token_to_kv_pool_allocator.available_size()),
        "retracted": int(getattr(reporter, "num_retracted_reqs", 0) or 0),
    }
