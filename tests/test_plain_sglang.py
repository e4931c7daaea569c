"""Installing sgl_kara leaves plain SGLang as it was, but for its CPU start-up fixes: RoPE's CPU
path (without it SGLang 0.5.23 does not start on a CPU without vLLM) and tensor parallelism's
start (no PyNccl communicator, the cores split among ranks); the CPU kernels are one switch plain SGLang can opt
into; sgl_kara's own Engine gets all its hooks in every process it starts.

tests/plain_sglang_probe.py runs in a fresh interpreter (nothing an earlier test did here counts)
and starts, one after the other on the tiny Llama: plain ``sglang.Engine`` with no ``KARA_*``
variable; plain ``sglang.Engine`` with ``KARA_CPU_KERNELS=1``; ``sgl_kara.Engine(kara_policy=
"none")``. In the main, scheduler and detokenizer process of each it reads, from SGLang's own
objects, which sgl_kara hooks SGLang's HookRegistry applied and which SGLang callables wrap a
function of sgl_kara; the scheduler's is read while it serves (the probe's hook on SGLang's
internal-state request). Expected: plain, the two tensor-parallel start-up hooks only, though
SGLang loaded the plugin in every process; with the switch, those and exactly the CPU kernels (and their /server_info report) in the
scheduler; sgl_kara's Engine, every hook in every process. ~2 min (three engine starts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
_TORCH_NATIVE = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
)
_LINEAR = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod"
_EXPORTER = (
    "sglang.srt.model_executor.model_runner_components.weight_exporter.WeightExporter"
)
CPU_KERNEL_HOOKS = {  # written out here, not read from sgl_kara: the CPU speed-ups and their report
    f"{_TORCH_NATIVE}._run_sdpa_forward_decode <- sgl_kara.cpu.attention.run_sdpa_forward_decode",
    f"{_TORCH_NATIVE}._run_sdpa_forward_extend <- sgl_kara.cpu.hooks._recompute_extend_hook",
    f"{_TORCH_NATIVE}.init_forward_metadata <- sgl_kara.cpu.attention.reset_metadata_hook",
    "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head <- sgl_kara.cpu.linear.lm_head_hook",
    f"{_LINEAR}.apply <- sgl_kara.cpu.linear.linear_apply_hook",
    f"{_LINEAR}.apply_into <- sgl_kara.cpu.linear.linear_apply_into_hook",
    f"{_LINEAR}.process_weights_after_loading <- sgl_kara.cpu.linear.process_weights_hook",
    f"{_LINEAR}.restore_weights_before_loading <- sgl_kara.cpu.linear.restore_weights_hook",
    *(
        f"{_EXPORTER}.{name} <- sgl_kara.cpu.linear.weight_export_hook"
        for name in (
            "get_weights_by_name",
            "save_sharded_model",
            "save_remote_model",
            "send_weights_to_remote_instance",
        )
    ),
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state <- sgl_kara.cpu.hooks._internal_state_hook",
}
PARALLEL_HOOKS = {  # written out here: tensor parallelism's start on a CPU
    "sglang.srt.distributed.parallel_state.init_model_parallel_group"
    " <- sgl_kara.cpu.parallel.model_parallel_group_hook",
    "sglang.srt.utils.numa_utils.init_threads_binding"
    " <- sgl_kara.cpu.parallel.threads_binding_hook",
}
SERVING_HOOKS = {
    "sglang.srt.managers.scheduler.Scheduler.update_running_batch <- sgl_kara.plugin._decode_step_hook",
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state <- sgl_kara.plugin._kara_state_hook",
    "sglang.srt.layers.radix_attention.RadixAttention.forward <- sgl_kara.plugin._attention_hook",
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new <- sgl_kara.plugin._init_new_hook",
    "sglang.srt.managers.schedule_batch.Req.reset_for_retract <- sgl_kara.plugin._reset_for_retract_hook",
    "sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order"
    " <- sgl_kara.plugin._retraction_order_hook",
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"
    " <- sgl_kara.scheduler.output.unwrap_meta_hook",
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
    " <- sgl_kara.plugin._validate_input_ids_hook",
    "sglang.srt.sampling.sampling_params.SamplingParams.verify <- sgl_kara.plugin._verify_hook",
}
PROCESSES = ("main", "scheduler", "detokenizer")

pytestmark = pytest.mark.integration  # engines of their own (docs/TESTING.md, tiers)


def _targets(hooks) -> set[str]:
    return {h.split(" <- ")[0] for h in hooks}


@pytest.fixture(scope="module")
def probes(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain_sglang")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KARA_", "SGLANG_PLUGINS")) and k != "TRITON_INTERPRET"
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "plain_sglang_probe.py"), tiny_llama, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        case: json.loads((out / f"{case}.json").read_text())
        for case in ("plain", "plain_cpu_kernels", "sgl_kara")
    }


def test_plain_sglang_runs_only_the_cpu_start_up_fixes(probes):
    run = probes["plain"]
    assert run["completion_tokens"] == [8, 8, 8, 8]
    pids = {run[p]["pid"] for p in PROCESSES}
    assert len(pids) == 3  # three processes, each read in itself
    for p in PROCESSES:
        state = run[p]
        assert state["plugin_loaded"], (
            p
        )  # SGLang loaded sgl_kara's plugin there: it chose to add nothing
        assert set(state["sgl_kara_hooks"]) == PARALLEL_HOOKS, (p, state)
        assert set(state["wrapped"]) == _targets(PARALLEL_HOOKS), (p, state)
        assert not state["kara_radix_backend"] and state["KARA_SERVE"] is None, (
            p,
            state,
        )
        assert state["rope_cpu"], p  # and RoPE's CPU path (this machine has no CUDA)
    assert run["kara_cpu_kernels"] is None  # and /server_info is SGLang's own


def test_plain_sglang_opts_into_the_cpu_kernels_with_one_switch(probes, tiny_llama):
    run = probes["plain_cpu_kernels"]
    scheduler = run["scheduler"]
    assert set(scheduler["sgl_kara_hooks"]) == CPU_KERNEL_HOOKS | PARALLEL_HOOKS
    assert set(scheduler["wrapped"]) == _targets(
        CPU_KERNEL_HOOKS | PARALLEL_HOOKS
    )  # SGLang's objects say the same
    assert not scheduler["kara_radix_backend"] and scheduler["KARA_SERVE"] is None
    layers = json.loads((Path(tiny_llama) / "config.json").read_text())[
        "num_hidden_layers"
    ]
    kernels = run["kara_cpu_kernels"]
    assert kernels == {
        "enabled": True,
        "decode_attention": "batched",
        "window_extend": True,
        "packed_linear": True,
        "packed_weights": 4 * layers + 1,
    }  # qkv, o, gate_up, down per layer + the lm_head's copy
    assert run["completion_tokens"] == [8, 8, 8, 8]


def test_sgl_kara_engine_serves_with_every_hook_in_every_process(probes):
    run = probes["sgl_kara"]
    for p in PROCESSES:
        state = run[p]
        every = SERVING_HOOKS | CPU_KERNEL_HOOKS | PARALLEL_HOOKS
        assert set(state["sgl_kara_hooks"]) == every, p
        assert set(state["wrapped"]) == _targets(every), p
        assert state["kara_radix_backend"], p
    assert (
        run["scheduler"]["KARA_SERVE"] == "1"
        and run["detokenizer"]["KARA_SERVE"] == "1"
    )
    assert (
        run["main"]["KARA_SERVE"] is None
    )  # set while the engine started its processes only
    assert (
        run["kara_cpu_kernels"]["enabled"]
        and run["kara_cpu_kernels"]["decode_attention"] == "batched"
    )
