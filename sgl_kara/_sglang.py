"""Every SGLang 0.5.23 internal sgl_kara touches, imported or named in one place.

A version bump is one file to review: no other file of the package imports ``sglang``; each name
below is listed in patches/ with why it is used; ``SIGNATURES`` records the signature of every
SGLang callable that sgl_kara hooks or overrides, and ``ATTRIBUTES`` every attribute of SGLang
objects that sgl_kara (and its tests) read or write; tests/test_layering.py checks all of it
against the installed SGLang. Import this module only from runtime glue (plugin, engine,
launcher, scheduler, mem_cache, cpu), never from sgl_kara.policies / sgl_kara.kernels /
sgl_kara.config.
"""

from sglang.srt.arg_groups.overrides import model_config_of, resolving_view  # noqa: F401
from sglang.srt.entrypoints.engine import Engine as SGLangEngine  # noqa: F401
from sglang.srt.entrypoints.http_server import launch_server as sglang_launch_server  # noqa: F401
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: F401
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch  # noqa: F401
from sglang.srt.managers.scheduler import Scheduler, run_scheduler_process  # noqa: F401
from sglang.srt.managers.scheduler_components.output_streamer import (  # noqa: F401
    SchedulerOutputStreamer,
)
from sglang.srt.mem_cache.common import evict_from_tree_cache  # noqa: F401
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: F401
from sglang.srt.mem_cache.registry import (  # noqa: F401
    TreeCacheBuildContext,
    create_unified_radix_cache,
    register_radix_cache_backend,
    registered_radix_cache_backends,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: F401
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: F401
from sglang.srt.plugins import load_plugins  # noqa: F401
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: F401
from sglang.srt.runtime_context import get_parallel  # noqa: F401
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: F401
from sglang.srt.utils import kill_process_tree  # noqa: F401
from sglang.srt.utils.common import get_device_memory_capacity  # noqa: F401

# Hook targets (dotted paths), one per touch point (see patches/*.md), each with its signature in
# SGLang 0.5.23: parameter names, order, kinds and defaults, as ``str(inspect.signature)`` prints
# them without annotations (a class: its ``__init__``). ``SIGNATURES`` also holds the SGLang
# methods that sgl_kara's subclasses override. tests/test_layering.py checks every one against the
# installed SGLang, and that each hook and override takes the same parameters under the same
# names (so SGLang may pass any of them by position or by keyword); hooks call the original with
# keywords wherever SGLang's parameters allow it.
SIGNATURES: dict[str, str] = {}


def _target(path: str, signature: str) -> str:
    SIGNATURES[path] = signature
    return path


_FB = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"

TARGET_INIT_NEW = _target(
    f"{_FB}.init_new",
    "(cls, batch, model_runner, *, capture_hidden_mode=None, return_hidden_states_before_norm, "
    "extend_position_info=None, spec_mrope_positions=None, kv_loc_plan=None, write_cols=None)",
)
TARGET_ATTENTION = _target(
    "sglang.srt.layers.radix_attention.RadixAttention.forward",
    "(self, q, k, v, forward_batch, save_kv_cache=True, key_value_num_tokens=None, **kwargs)",
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

# SGLang methods that sgl_kara's subclasses override (KaraScheduler, the output streamer and
# prefill adder it returns, the "kara" radix cache), and the process function it wraps.
OVERRIDDEN = (
    _target(f"{_SCHEDULER}.get_output_streamer_class", "(self)"),
    _target(f"{_SCHEDULER}.get_prefill_adder_class", "(self)"),
    _target(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
        ".build_additional_customized_info",
        "(self, reqs)",
    ),
    _target(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
        ".is_request_level_customized_info_key",
        "(self, key)",
    ),
    _target(
        "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset",
        "(self, req)",
    ),
    _target(
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        "(self, req, has_chunked_req, truncation_align_size)",
    ),
    _target(
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint",
        "(self, req, *, up_to, **kwargs)",
    ),
    _target(
        "sglang.srt.managers.scheduler.run_scheduler_process",
        "(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer, display_tp_rank=None, "
        "display_dp_rank=None, display_moe_ep_rank=None)",
    ),
)

# Attributes of SGLang objects read or written by sgl_kara (and by its tests), by owner, with
# where: checked to exist (class attribute, dataclass field, or ``self.<name>`` in the class source).
ATTRIBUTES = {
    # request KV bookkeeping: scheduler/jobs.py, events.py, runtime.py; mem_cache/radix.py
    "sglang.srt.managers.schedule_batch.Req": [
        "kv",
        "rid",
        "origin_input_ids",
        "output_ids",
        "sampling_params",
        "finished",
        "to_finish",
        "reset_for_retract",
        "retraction_count",
    ],
    "sglang.srt.managers.schedule_batch.ReqKvInfo": [
        "kv_committed_len",
        "kv_allocated_len",
        "cache_protected_len",
        "req_pool_idx",
    ],
    # events.py shrinks lengths in the running batch; queries.py builds a recompute EXTEND batch
    "sglang.srt.managers.schedule_batch.ScheduleBatch": [
        "reqs",
        "is_empty",
        "seq_lens",
        "orig_seq_lens",
        "seq_lens_cpu",
        "seq_lens_sum",
        "forward_mode",
        "input_ids",
        "req_pool_indices",
        "req_pool_indices_cpu",
        "out_cache_loc",
        "prefix_lens",
        "extend_lens",
        "extend_num_tokens",
        "extend_logprob_start_lens",
        "return_logprob",
        "top_logprobs_nums",
        "token_ids_logprobs",
        "decoding_reqs",
        "multimodal_inputs",
        "sampling_info",
        "spec_info",
        "input_embeds",
        "extend_input_logprob_token_ids",
        "_get_decode_retraction_order",
        # runtime.py: freed slots reopen admission
        "batch_is_full",
    ],
    # queries.py: a recompute batch's sampling info carries no grammars or watermark candidates
    "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo": [
        "grammars",
        "has_watermark_candidates",
    ],
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch": [
        "init_new",
        "positions",
        "forward_mode",
        "batch_size",
        "req_pool_indices",
        "seq_lens",
        "seq_lens_cpu",
        "out_cache_loc",
    ],
    "sglang.srt.layers.radix_attention.RadixAttention": [
        "forward",
        "layer_id",
        "tp_q_head_num",
        "qk_head_dim",
    ],
    # events.py: the recompute forward runs eagerly (prefill CUDA graph runner set aside)
    "sglang.srt.model_executor.model_runner.ModelRunner": [
        "forward",
        "prefill_cuda_graph_runner",
        "model",
        "dtype",
        "forward_stream",
    ],
    # scheduler/kara_scheduler.py, runtime.py; plugin trace hook
    "sglang.srt.managers.scheduler.Scheduler": [
        "update_running_batch",
        "get_prefill_adder_class",
        "get_output_streamer_class",
        "token_to_kv_pool_allocator",
        "req_to_token_pool",
        "tp_worker",
        "tree_cache",
        "max_running_requests",
        "server_args",
        "metrics_reporter",
        "waiting_queue",
        "get_internal_state",
        "max_total_num_tokens",
        # runtime.py: events ordered after the overlapped forward (its stream), checks.py
        "enable_overlap",
        "forward_stream",
    ],
    "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter": [
        "num_retracted_reqs"
    ],
    "sglang.srt.managers.schedule_policy.PrefillAdder": [
        "add_one_req",
        "_get_running_request_total_token_offset",
    ],
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer": [
        "build_additional_customized_info",
        "is_request_level_customized_info_key",
    ],
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool": [
        "get_key_buffer",
        "get_value_buffer",
        "start_layer",
        "layer_num",
        "head_num",
    ],
    "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator": [
        "alloc",
        "free",
        "available_size",
        "get_all_free_pages",
        "get_kvcache",
        "page_size",
    ],
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache": [
        "checkpoint",
        "evictable_size",
    ],
    "sglang.srt.sampling.sampling_params.SamplingParams": [
        "verify",
        "max_new_tokens",
        "custom_params",
    ],
    # engine.py (shutdown): the engine's event-loop tasks
    "sglang.srt.entrypoints.engine.Engine": [
        "shutdown",
        "run_scheduler_process_func",
        "tokenizer_manager",
    ],
    "sglang.srt.managers.tokenizer_manager.TokenizerManager": [
        "update_request_meta_info",
        "_validate_one_request",
        "asyncio_tasks",
        "event_loop",
        "model_config",
    ],
    # kara_scheduler.py: the replica's Kara stats in /server_info
    "sglang.srt.managers.io_struct.GetInternalStateReqOutput": ["internal_state"],
    # plugin.py registers and applies hooks; tests/test_plain_sglang.py reads what is registered
    "sglang.srt.plugins.hook_registry.HookRegistry": [
        "register",
        "apply_hooks",
        "_hooks",
        "_patched",
    ],
    # module attributes: the tests' kill_process_tree guard
    "sglang.srt.entrypoints.engine": ["kill_process_tree"],
    "sglang.srt.managers.tokenizer_manager": ["kill_process_tree"],
}
