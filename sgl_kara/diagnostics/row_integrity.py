"""``KARA_CHECK_INTEGRITY=1`` (a diagnostic the tests run at every event): the protected
prefix of every running row unchanged, each row's own slots named once and never free,
the capture ring and the device offsets consistent, the token count agreeing with
SGLang's. The checks themselves are mem_cache/integrity.py's; this step observer reads
the rows they judge, and keeps what it needs per request (the prefix snapshots, the
checks passed) in its own tables."""

from __future__ import annotations

import torch

from sgl_kara import _sglang as adapter
from sgl_kara.mem_cache.integrity import check_prefix_unchanged, check_row_ownership
from sgl_kara.scheduler.observers import StepObserver
from sgl_kara.scheduler.plan import decoded_tokens
from sgl_kara.scheduler.state import SideTable


class RowIntegrity(StepObserver):
    """``parts``: the pools (_sglang.SchedulerParts); ``table``: Kara's request states;
    ``ring`` / ``forward``: the capture ring and the device offsets."""

    def __init__(self, parts, table, ring, forward):
        self.parts = parts
        self.table = table
        self.ring = ring
        self.forward = forward
        # per request: its prefix's slots and first and last layers' K/V, once fixed
        self.snapshots = SideTable(row=True)
        self.checks = SideTable()  # per request: the checks its row passed

    def prefix_view(self, req, state):
        parts = self.parts
        slots = (
            parts.req_to_token[adapter.row_index(req), : state.protected]
            .to(torch.int64)
            .clone()
        )
        first, last = parts.layer_ids[0], parts.layer_ids[-1]
        kv = [parts.keys(layer_id)[slots].clone() for layer_id in (first, last)]
        kv += [parts.values(layer_id)[slots].clone() for layer_id in (first, last)]
        return slots, kv

    def protected(self, req, state) -> None:
        """A request's P was just fixed: what its prefix holds now."""
        self.snapshots.set(state, self.prefix_view(req, state))

    def after_event(self, reqs) -> None:
        """Every running row: protected prefix unchanged (slots and K/V bytes); the rows' own
        slots [P, L) named by one row only and none free; ring rows and device offsets agree;
        the request's token count from its rows agrees with SGLang's (one ahead under
        overlap)."""
        owned = []
        lag = (0, 1) if self.parts.overlap else (0,)
        for req in reqs:
            state = self.table.get(req)
            if state is not None and (
                decoded_tokens(req, state) - adapter.output_length(req) not in lag
            ):
                raise AssertionError(
                    f"Kara integrity: {adapter.rid(req)} counts {decoded_tokens(req, state)} "
                    f"tokens from its KV rows, SGLang {adapter.output_length(req)} (overlap "
                    f"scheduler: {len(lag) > 1})"
                )
            if state is None or state.protected < 0:
                continue
            snapshot = self.snapshots.get(state)
            if snapshot is None:
                continue
            slots, kv = self.prefix_view(req, state)
            check_prefix_unchanged(
                adapter.rid(req), slots, kv, *snapshot, state.protected
            )
            owned.append(
                self.parts.req_to_token[
                    adapter.row_index(req), state.protected : adapter.kv_length(req)
                ]
            )
            self.checks.set(state, self.checks.get(state, 0) + 1)
        if self.ring is not None:
            self.ring.check()
        self.forward.check_offsets(reqs)
        check_row_ownership(owned, self.parts.free_pages(), self.parts.page_size)

    def meta(self, state, meta: dict) -> None:
        meta["integrity_checks"] = self.checks.get(state, 0)
