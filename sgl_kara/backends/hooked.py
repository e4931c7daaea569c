"""Kara on SGLang 0.5.23 as released: the plugin's hooks stand in for the series' extension
points (plugin.serving_hooks), and what SGLang's own calls would do is done here. Imported only
where SGLang has none of the series (backends.choose).

The one module besides the adapter (``_sglang.py``) that reads SGLang's internals, and the only
one for what the series replaces: what a hook reads and writes of a forward (its kind, rows,
positions, where its K/V go), the recompute forward sgl_kara builds and runs itself, the rows and
lengths a compaction shrinks, admission's ``max_new_tokens`` presented as the charge, and what
SGLang's shutdown leaves. The names it touches are declared in the adapter's ``ATTRIBUTES``
(tests/test_adapter_surface.py counts them as the hooked side's).
"""

from __future__ import annotations

import contextlib

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sgl_kara import _sglang as adapter
from sgl_kara.backends import Backend


class Hooks(Backend):
    name = "hooks"
    hooked = True
    runs_recompute = (
        False  # sgl_kara builds the recompute batch; the attention hook ends it
    )
    asks_admission = False  # the charge presented as max_new_tokens (admission.py)

    def touch_points(self) -> dict[str, str]:
        return {point: "hook" for point in adapter.EXTENSION_POINTS}

    def configure(self, server_args) -> None:
        pass  # the retraction order hook reorders SGLang's own policy

    def position_offsets(self, parts):
        return (
            None  # the init_new hook adds each row's offset to the forward's positions
        )

    def observe_attention(self, forward):
        return None  # the attention hook calls the forward context itself

    def release_tail(self, batch, jobs, prepared, step) -> int:
        """Rows rewritten and the old slots freed by id, then the requests' and the batch's
        lengths shrunk and their rows' position offsets raised by what was dropped."""
        dropped = prepared.commit(step.parts.req_to_token, step.parts.free_page_ids)
        if dropped:
            for job in jobs:
                drop_rows(job.req, dropped)
            index = [job.index for job in jobs]
            shrink_lengths(batch, index, dropped, step.staging.to_device(index))
            step.forward.add_offset(step.rows, dropped)
        return dropped

    def release_loop_tasks(self, engine) -> None:
        """Cancel a shut-down Engine's TokenizerManager tasks left on the process's event
        loop."""
        manager = getattr(engine, "tokenizer_manager", None)
        tasks = [t for t in getattr(manager, "asyncio_tasks", ()) if not t.done()]
        for task in tasks:
            task.cancel()
        loop = getattr(engine, "loop", None)
        if (
            tasks
            and loop is not None
            and not loop.is_running()
            and not loop.is_closed()
        ):
            import asyncio

            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        if manager is not None:
            manager.asyncio_tasks.clear()
            manager.event_loop = None

    # -- what the hooks read and write of a forward (scheduler/forward.py) ---------------------
    @staticmethod
    def batch_kind(batch) -> str:
        """ "decode", "extend" or "idle": the kind of forward a ScheduleBatch runs (its
        ForwardBatch aliases the batch's mode, rows and host lengths: ``init_new``)."""
        mode = batch.forward_mode
        if mode.is_idle():
            return "idle"
        return "decode" if mode.is_decode() else "extend"

    @staticmethod
    def batch_rows(batch) -> torch.Tensor:
        """[B] the batch's req_to_token rows (device)."""
        return batch.req_pool_indices

    @staticmethod
    def host_lengths(batch) -> torch.Tensor | None:
        """[B] the batch's row lengths on the host (None: SGLang keeps none)."""
        return batch.seq_lens_cpu

    @staticmethod
    def positions(forward_batch) -> torch.Tensor:
        return forward_batch.positions

    @staticmethod
    def set_positions(forward_batch, value: torch.Tensor) -> None:
        forward_batch.positions = value

    @staticmethod
    @contextlib.contextmanager
    def kv_writes_to(forward_batch, slots: torch.Tensor):
        """The forward's ``out_cache_loc`` is ``slots`` for the duration (the recompute pass's
        attention call sees the window's real slots)."""
        saved, forward_batch.out_cache_loc = forward_batch.out_cache_loc, slots
        try:
            yield
        finally:
            forward_batch.out_cache_loc = saved

    # -- the recompute forward (scheduler/scoring.py) ------------------------------------------
    @staticmethod
    def recompute_batch(scheduler, extend):
        """A ScheduleBatch for Kara's recompute pass over ``extend`` (adapter.ExtendRows): built
        by SGLang's own constructor (``ScheduleBatch.init_new``, every field at its default),
        given the fields ``prepare_for_extend`` would set for an extend of these rows (nothing
        allocated)."""
        batch = ScheduleBatch.init_new(
            extend.reqs,
            scheduler.req_to_token_pool,
            scheduler.token_to_kv_pool_allocator,
            scheduler.tree_cache,
            scheduler.model_config,
            False,  # enable_overlap: the pass runs synchronously on the schedule stream
            SpeculativeAlgorithm.NONE,  # refused with compression (startup._UNSUPPORTED)
        )
        n, count = extend.per_request, len(extend.reqs)
        batch.forward_mode = ForwardMode.EXTEND
        batch.input_ids = extend.input_ids
        batch.req_pool_indices = extend.rows
        batch.seq_lens = extend.device_seq_lens
        batch.seq_lens_cpu = torch.tensor(extend.seq_lens, dtype=torch.int64)
        batch.orig_seq_lens = batch.seq_lens.to(torch.int32)
        batch.seq_lens_sum = int(sum(extend.seq_lens))
        batch.out_cache_loc = extend.out_cache_loc
        batch.prefix_lens = list(extend.prefix)
        batch.extend_lens = [n] * count
        batch.extend_num_tokens = n * count
        batch.extend_logprob_start_lens = [n] * count
        # no logits are wanted, whatever the requests asked of their own forwards
        batch.return_logprob = False
        # Nothing is sampled (the pass stops at the last layer's queries), but SGLang reads the
        # batch's sampling info while it prepares a forward: its own, with no watermark state.
        batch.sampling_info = SamplingBatchInfo.from_schedule_batch(
            batch, scheduler.model_config.vocab_size
        )
        batch.sampling_info.has_watermark_candidates = False
        return batch

    @staticmethod
    def run_eager(model_runner, batch, stop) -> None:
        """One forward of ``batch``, an extend over rows whose K/V are cached, outside any CUDA
        graph: the prefill graph runner held back (a replayed graph would never call the
        attention hook, and was recorded with K/V writes on); the forward ended early by
        ``stop`` (an exception the attention hook raises once the pass has what it needs)."""
        runner = model_runner
        graphs, runner.prefill_cuda_graph_runner = (
            runner.prefill_cuda_graph_runner,
            None,
        )
        try:
            forward_batch = ForwardBatch.init_new(
                batch, runner, return_hidden_states_before_norm=False
            )
            with torch.inference_mode():
                runner.forward(forward_batch)
        except stop:
            pass
        finally:
            runner.prefill_cuda_graph_runner = graphs

    # -- admission, /server_info and the tokenizer (admission.py, plugin.py) ------------------
    @staticmethod
    @contextlib.contextmanager
    def max_new_tokens_as(req, value: int):
        """Present ``value`` as the request's ``max_new_tokens`` for the duration (admission
        charges the compressed footprint through SGLang's own accounting)."""
        params = req.sampling_params
        saved = params.max_new_tokens
        params.max_new_tokens = value
        try:
            yield
        finally:
            params.max_new_tokens = saved

    @staticmethod
    def add_internal_state(result, key: str, value) -> None:
        """An entry of this scheduler's /server_info internal state."""
        result.internal_state[key] = value

    @staticmethod
    def vocab_size(tokenizer_manager) -> int:
        return int(tokenizer_manager.model_config.vocab_size)


def drop_rows(req, dropped: int) -> None:
    """The request's row is ``dropped`` rows shorter (a compaction moved its tail down)."""
    req.kv.kv_committed_len -= dropped
    req.kv.kv_allocated_len -= dropped


def shrink_lengths(batch, index: list[int], dropped: int, device_index) -> None:
    """The batch's requests at ``index`` hold ``dropped`` rows fewer: SGLang's device and host
    lengths follow (``device_index``: ``index`` on the batch's device)."""
    batch.seq_lens = batch.seq_lens.clone()
    batch.seq_lens[device_index] -= dropped
    batch.orig_seq_lens = batch.orig_seq_lens.clone()
    batch.orig_seq_lens[device_index] -= dropped
    if batch.seq_lens_cpu is not None:
        batch.seq_lens_cpu = batch.seq_lens_cpu.clone()
        batch.seq_lens_cpu[torch.tensor(index, dtype=torch.int64)] -= dropped
    batch.seq_lens_sum = None
