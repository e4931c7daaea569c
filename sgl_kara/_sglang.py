"""Every SGLang 0.5.23 internal sgl_kara touches, imported or named in one place.

A version bump is one file to review: each name below is listed in patches/ with why it is used,
and ``ATTRIBUTES`` names every attribute of SGLang objects that sgl_kara (and its tests) read or
write; tests/test_layering.py checks they all still exist. Import this module only from runtime
glue (plugin, engine, launcher, scheduler, mem_cache), never from sgl_kara.policies /
sgl_kara.kernels / sgl_kara.config.
"""

from sglang.srt.entrypoints.engine import Engine as SGLangEngine  # noqa: F401
from sglang.srt.entrypoints.http_server import launch_server as sglang_launch_server  # noqa: F401
from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method  # noqa: F401
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: F401
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch  # noqa: F401
from sglang.srt.managers.scheduler import Scheduler, run_scheduler_process  # noqa: F401
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer  # noqa: F401
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
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: F401
from sglang.srt.runtime_context import get_parallel  # noqa: F401
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: F401
from sglang.srt.utils.common import get_cpu_ids_by_node, use_intel_amx_backend  # noqa: F401

# Hook targets (dotted paths), one per touch point; see patches/*.md.
TARGET_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
TARGET_ATTENTION = "sglang.srt.layers.radix_attention.RadixAttention.forward"
TARGET_RESET_FOR_RETRACT = "sglang.srt.managers.schedule_batch.Req.reset_for_retract"
TARGET_RETRACTION_ORDER = "sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order"
TARGET_META_INFO = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"
TARGET_SAMPLING_VERIFY = "sglang.srt.sampling.sampling_params.SamplingParams.verify"
TARGET_UPDATE_RUNNING_BATCH = "sglang.srt.managers.scheduler.Scheduler.update_running_batch"
TARGET_VALIDATE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
TARGET_SET_ENVS = "sglang.srt.entrypoints.engine._set_envs_and_config"
TARGET_TORCH_NATIVE_DECODE = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode")
TARGET_TORCH_NATIVE_EXTEND = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend")
TARGET_LINEAR_APPLY = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
TARGET_LINEAR_APPLY_INTO = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply_into"
TARGET_LINEAR_PROCESS_WEIGHTS = (
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.process_weights_after_loading")
TARGET_LINEAR_RESTORE_WEIGHTS = (
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.restore_weights_before_loading")
TARGET_WEIGHT_EXPORTS = tuple(
    f"sglang.srt.model_executor.model_runner_components.weight_exporter.WeightExporter.{name}"
    for name in ("get_weights_by_name", "save_sharded_model", "save_remote_model", "send_weights_to_remote_instance"))
TARGET_LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
TARGET_TORCH_NATIVE_METADATA = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.init_forward_metadata")
ROTARY_BASE_MODULE = "sglang.srt.layers.rotary_embedding.base"

# Attributes of SGLang objects read or written by sgl_kara (and by its tests), by owner, with
# where: checked to exist (class attribute, dataclass field, or ``self.<name>`` in the class source).
ATTRIBUTES = {
    # cpu/linear.py: the lm_head hook takes SGLang's plain matmul branch only
    "sglang.srt.layers.logits_processor.LogitsProcessor": [
        "_compute_lm_head", "use_fp32_lm_head", "rl_on_policy_target"],
    "sglang.srt.model_executor.model_runner_components.weight_exporter.WeightExporter": [
        "get_model", "get_weights_by_name", "save_sharded_model", "save_remote_model",
        "send_weights_to_remote_instance"],
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod": [
        "apply", "apply_into", "process_weights_after_loading", "restore_weights_before_loading"],
    # request KV bookkeeping: scheduler/jobs.py, events.py, runtime.py; mem_cache/radix.py
    "sglang.srt.managers.schedule_batch.Req": [
        "kv", "rid", "origin_input_ids", "output_ids", "sampling_params", "finished", "to_finish",
        "reset_for_retract", "retraction_count"],
    "sglang.srt.managers.schedule_batch.ReqKvInfo": [
        "kv_committed_len", "kv_allocated_len", "cache_protected_len", "req_pool_idx"],
    # events.py shrinks lengths in the running batch; queries.py builds a recompute EXTEND batch
    "sglang.srt.managers.schedule_batch.ScheduleBatch": [
        "reqs", "is_empty", "seq_lens", "orig_seq_lens", "seq_lens_cpu", "seq_lens_sum", "forward_mode",
        "input_ids", "req_pool_indices", "req_pool_indices_cpu", "out_cache_loc", "prefix_lens", "extend_lens",
        "extend_num_tokens", "extend_logprob_start_lens", "return_logprob", "top_logprobs_nums",
        "token_ids_logprobs", "decoding_reqs", "multimodal_inputs", "sampling_info", "spec_info", "input_embeds",
        "extend_input_logprob_token_ids", "_get_decode_retraction_order"],
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch": [
        "init_new", "positions", "forward_mode", "batch_size", "req_pool_indices", "seq_lens", "seq_lens_cpu",
        "out_cache_loc"],
    "sglang.srt.layers.radix_attention.RadixAttention": ["forward", "layer_id", "tp_q_head_num", "qk_head_dim"],
    # events.py: the recompute forward runs eagerly (prefill CUDA graph runner set aside)
    "sglang.srt.model_executor.model_runner.ModelRunner": [
        "forward", "prefill_cuda_graph_runner", "model", "dtype"],
    # scheduler/kara_scheduler.py, runtime.py; plugin trace hook
    "sglang.srt.managers.scheduler.Scheduler": [
        "update_running_batch", "get_prefill_adder_class", "get_output_streamer_class",
        "token_to_kv_pool_allocator", "req_to_token_pool", "tp_worker", "tree_cache", "max_running_requests",
        "server_args", "metrics_reporter", "waiting_queue", "get_internal_state", "max_total_num_tokens"],
    "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter": ["num_retracted_reqs"],
    "sglang.srt.managers.schedule_policy.PrefillAdder": ["add_one_req", "_get_running_request_total_token_offset"],
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer": [
        "build_additional_customized_info", "is_request_level_customized_info_key"],
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool": [
        "get_key_buffer", "get_value_buffer", "start_layer", "layer_num", "head_num"],
    "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator": [
        "alloc", "free", "available_size", "get_all_free_pages", "get_kvcache", "page_size"],
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache": ["checkpoint", "evictable_size"],
    "sglang.srt.sampling.sampling_params.SamplingParams": ["verify", "max_new_tokens", "custom_params"],
    # engine.py (shutdown): the engine's watchdog and event-loop tasks
    "sglang.srt.entrypoints.engine.Engine": ["shutdown", "run_scheduler_process_func", "tokenizer_manager"],
    "sglang.srt.managers.tokenizer_manager.TokenizerManager": [
        "update_request_meta_info", "_validate_one_request", "asyncio_tasks", "event_loop", "_subprocess_watchdog",
        "model_config"],
    "sglang.srt.utils.watchdog.SubprocessWatchdog": ["_stop_event", "_processes", "_names"],
    # kara_scheduler.py: the replica's Kara stats in /server_info
    "sglang.srt.managers.io_struct.GetInternalStateReqOutput": ["internal_state"],
    # module attributes: launcher fork hook, CPU RoPE flag, the tests' kill_process_tree guard
    "sglang.srt.entrypoints.engine": ["_set_envs_and_config", "kill_process_tree"],
    "sglang.srt.managers.tokenizer_manager": ["kill_process_tree"],
    ROTARY_BASE_MODULE: ["_is_cpu"],
}
