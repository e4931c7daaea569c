"""Every SGLang 0.5.23 internal the CPU serving kit touches, imported or named in one place (the
core's are in ``sgl_kara/_sglang.py``). ``SIGNATURES`` records the signature of every SGLang
callable the kit hooks, pinned (the start-up checks them where the kit's hooks are registered:
``pins``); ``ATTRIBUTES`` every attribute of SGLang objects it reads or writes;
tests/test_layering.py checks both against the installed SGLang."""

from sglang.srt.distributed import bootstrap as parallel_bootstrap  # noqa: F401
from sglang.srt.layers.logits_processor import (  # noqa: F401
    should_apply_lm_head_quant_method,
)
from sglang.srt.layers.rotary_embedding import base as rotary_embedding_base  # noqa: F401
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: F401
from sglang.srt.utils.common import (  # noqa: F401
    get_cpu_ids_by_node,
    use_intel_amx_backend,
)

SIGNATURES: dict[str, str] = {}


def _target(path: str, signature: str) -> str:
    SIGNATURES[path] = signature
    return path


_TORCH_NATIVE = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
)
_SDPA = (
    "(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, "
    "{}encoder_lens=None, scaling=None, enable_gqa=False, causal=False, "
    "is_cross_attn=False, sliding_window_size=None)"
)
_LINEAR = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod"
_WEIGHT_EXPORTER = (
    "sglang.srt.model_executor.model_runner_components.weight_exporter.WeightExporter"
)
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"

TARGET_TORCH_NATIVE_DECODE = _target(
    f"{_TORCH_NATIVE}._run_sdpa_forward_decode", _SDPA.format("")
)
TARGET_TORCH_NATIVE_EXTEND = _target(
    f"{_TORCH_NATIVE}._run_sdpa_forward_extend",
    _SDPA.format("extend_prefix_lens, extend_seq_lens, "),
)
TARGET_TORCH_NATIVE_METADATA = _target(
    f"{_TORCH_NATIVE}.init_forward_metadata", "(self, forward_batch)"
)
TARGET_LINEAR_APPLY = _target(f"{_LINEAR}.apply", "(self, layer, x, bias=None)")
TARGET_LINEAR_APPLY_INTO = _target(
    f"{_LINEAR}.apply_into", "(self, layer, x, output, bias=None)"
)
TARGET_LINEAR_PROCESS_WEIGHTS = _target(
    f"{_LINEAR}.process_weights_after_loading", "(self, layer)"
)
TARGET_LINEAR_RESTORE_WEIGHTS = _target(
    f"{_LINEAR}.restore_weights_before_loading", "(self, layer)"
)
TARGET_WEIGHT_EXPORTS = (
    _target(
        f"{_WEIGHT_EXPORTER}.get_weights_by_name", "(self, name, truncate_size=100)"
    ),
    _target(
        f"{_WEIGHT_EXPORTER}.save_sharded_model",
        "(self, path, pattern=None, max_size=None)",
    ),
    _target(f"{_WEIGHT_EXPORTER}.save_remote_model", "(self, url)"),
    _target(
        f"{_WEIGHT_EXPORTER}.send_weights_to_remote_instance",
        "(self, master_address, ports, group_name)",
    ),
)
TARGET_LM_HEAD = _target(
    "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head",
    "(self, hidden_states, lm_head, embedding_bias=None, *, out=None)",
)
TARGET_GET_INTERNAL_STATE = _target(
    f"{_SCHEDULER}.get_internal_state", "(self, recv_req)"
)
TARGET_SET_ENVS = _target(
    "sglang.srt.entrypoints.engine._set_envs_and_config", "(server_args)"
)
ROTARY_BASE_MODULE = "sglang.srt.layers.rotary_embedding.base"
# parallel.py: tensor parallelism on a CPU (patches/cpu_parallel.md)
TARGET_MODEL_PARALLEL_GROUP = _target(
    "sglang.srt.distributed.parallel_state.init_model_parallel_group",
    "(group_ranks, local_rank, backend, use_pynccl=None, use_custom_allreduce=None, "
    "use_message_queue_broadcaster=False, group_name=None, use_mscclpp=None, "
    "use_torch_symm_mem_allreduce=None, recovered_rank=False, rank_offset=0, "
    "max_world_size=None)",
)
TARGET_THREADS_BINDING = _target(
    "sglang.srt.utils.numa_utils.init_threads_binding", "(*, numa_index, world_size)"
)

# Attributes of SGLang objects the kit reads or writes, by owner.
ATTRIBUTES = {
    # linear.py: the lm_head hook takes SGLang's plain matmul branch only
    "sglang.srt.layers.logits_processor.LogitsProcessor": [
        "_compute_lm_head",
        "use_fp32_lm_head",
        "rl_on_policy_target",
    ],
    "sglang.srt.model_executor.model_runner_components.weight_exporter.WeightExporter": [
        "get_model",
        "get_weights_by_name",
        "save_sharded_model",
        "save_remote_model",
        "send_weights_to_remote_instance",
    ],
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod": [
        "apply",
        "apply_into",
        "process_weights_after_loading",
        "restore_weights_before_loading",
    ],
    # hooks.py: which CPU kernels a scheduler runs, in /server_info
    "sglang.srt.managers.io_struct.GetInternalStateReqOutput": ["internal_state"],
    # hooks.py: RoPE's CPU path (a module flag, patches/cpu.md), the launcher's fork
    ROTARY_BASE_MODULE: ["_is_cpu"],
    "sglang.srt.entrypoints.engine": ["_set_envs_and_config"],
    "sglang.srt.plugins.hook_registry.HookRegistry": ["register", "apply_hooks"],
    # parallel.py: whether SGLang binds a CPU rank's threads itself
    "sglang.srt.distributed.bootstrap": ["_is_cpu_amx_available", "_is_cpu_arm64"],
}


def pins() -> dict[str, tuple[str, str]]:
    """Every SGLang callable the kit hooks: path -> (its pinned signature, "hook"), as the
    core's ``_sglang.pins`` gives the core's."""
    return {path: (signature, "hook") for path, signature in SIGNATURES.items()}


def register_hook(target: str, hook, hook_type) -> None:
    """SGLang's plugin hook registry: ``hook`` on ``target`` (applied by ``apply_hooks``)."""
    HookRegistry.register(target, hook, hook_type)


def apply_hooks() -> None:
    HookRegistry.apply_hooks()
