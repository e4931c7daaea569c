"""Diagnostics and injected faults: what a Kara runtime runs only when an environment variable
asks for it (tests, and a user chasing a problem), kept out of the production modules. The
runtime reaches all of it through one seam, ``Diagnostics`` (None when nothing is asked for):

    step(runtime, batch)   KARA_CHECK_SYNC: the step run under the sync check (sync_check.py)
    fenced()               the step's fence: waits after it are violations
    fault(stage, reqs)     KARA_INJECT_FAULT_*: raise where a fault is injected (faults.py)
    planned(jobs)          KARA_INJECT_TP_DIVERGENCE: this rank's plan made to differ
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from sgl_kara import env

if (
    TYPE_CHECKING
):  # faults.py reads the adapter, imported only where faults are asked for
    from sgl_kara.diagnostics.faults import Divergence, Faults


class Diagnostics:
    def __init__(
        self, sync: bool, faults: Faults | None, divergence: Divergence | None
    ):
        self.sync = sync
        self.faults = faults
        self.divergence = divergence
        self.check = None  # the sync check of the step being run

    @classmethod
    def from_env(cls, tp_rank: int = 0, tp_size: int = 1) -> Diagnostics | None:
        from sgl_kara.diagnostics.faults import Divergence, Faults

        sync = env.check_sync()
        faults = Faults.from_env(tp_rank)
        divergence = Divergence.from_env(tp_rank, tp_size)
        if not sync and faults is None and divergence is None:
            return None
        return cls(sync, faults, divergence)

    # ------------------------------------------------------------------ injected faults
    def fault(self, stage: str, reqs) -> None:
        if self.faults is not None:
            self.faults.check(stage, reqs)

    def planned(self, jobs: list) -> list:
        return jobs if self.divergence is None else self.divergence.planned(jobs)

    # ------------------------------------------------------------------ the sync check
    def fenced(self) -> None:
        if self.check is not None:
            self.check.fenced()

    @contextlib.contextmanager
    def step(self, runtime, batch):
        """The step under the sync check when asked for; its counts into ``runtime.stats``."""
        if not self.sync:
            yield
            return
        from sgl_kara.diagnostics.sync_check import EXAMPLES, SyncCheck

        check = self.check = SyncCheck(_device_tensors(runtime, batch))
        runtime.staging.on_copy = check.staged
        try:
            with check:
                yield
        finally:
            runtime.staging.on_copy = None
            self.check = None
            stats = runtime.stats
            stats.sync_violations += check.violations
            stats.sync_examples += check.examples[
                : max(0, EXAMPLES - len(stats.sync_examples))
            ]
            stats.sync_pre_fence_waits += check.pre_fence
            room = EXAMPLES - len(stats.sync_pre_fence_examples)
            stats.sync_pre_fence_examples += check.pre_fence_examples[: max(0, room)]


def _device_tensors(runtime, batch) -> list:
    """What a GPU would hold of the step's inputs: the pools, rows and offsets, the batch's
    device lengths, the ring, Kara's per-request device state."""
    from sgl_kara import _sglang as adapter

    parts = runtime.parts
    device = [parts.req_to_token, runtime.forward.offsets]
    device += [parts.keys(i) for i in parts.layer_ids]
    device += [parts.values(i) for i in parts.layer_ids]
    device += adapter.batch_device_tensors(batch)
    if runtime.ring is not None:
        device += [*runtime.ring.buffers.values(), runtime.ring.row_of]
    for req in adapter.running_requests(batch):
        state = runtime.table.get(req)
        if state is not None:
            device += _tensors_in(state.policy_state)
            scores = getattr(state.scoring, "scores", None)
            if scores is not None:
                device.append(scores)
    return device


def _tensors_in(d) -> list:
    """Tensors in nested dicts (a policy's per-request state)."""
    out = []
    for v in d.values():
        if isinstance(v, dict):
            out += _tensors_in(v)
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out
