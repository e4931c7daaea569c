"""Every SGLang 0.5.23 internal sgl_kara touches, imported in one place.

A version bump is one file to review: each name below is listed in patches/ with why it is used.
Import this module only from runtime glue (plugin, scheduler, mem_cache), never from
sgl_kara.policies / sgl_kara.kernels / sgl_kara.config.
"""

from sglang.srt.entrypoints.engine import Engine as SGLangEngine  # noqa: F401
from sglang.srt.entrypoints.http_server import launch_server as sglang_launch_server  # noqa: F401
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
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: F401

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
ROTARY_BASE_MODULE = "sglang.srt.layers.rotary_embedding.base"
