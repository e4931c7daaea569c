"""The runtime's integrity checks (``KARA_CHECK_INTEGRITY=1``, a diagnostic the tests run at every
event): the protected prefix unchanged, each row's own slots named once and never free, the ring
and the device offsets consistent, the token count agreeing with SGLang's. A mixin of KaraRuntime
(runtime.py), which owns the state it reads; the checks themselves are mem_cache/integrity.py's."""

from __future__ import annotations

import torch

from sgl_kara.mem_cache.integrity import check_prefix_unchanged, check_row_ownership
from sgl_kara.scheduler.jobs import decoded_tokens
from sgl_kara.scheduler.state import get_state


class RuntimeChecks:
    def _prefix_view(self, req, state):
        slots = (
            self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : state.protected]
            .to(torch.int64)
            .clone()
        )
        first, last = self.layer_ids[0], self.layer_ids[-1]
        kv = [
            self.kv_pool.get_key_buffer(layer_id)[slots].clone()
            for layer_id in (first, last)
        ]
        kv += [
            self.kv_pool.get_value_buffer(layer_id)[slots].clone()
            for layer_id in (first, last)
        ]
        return slots, kv

    def _snapshot_prefix(self, req, state) -> None:
        state.prefix_snapshot = self._prefix_view(req, state)

    def check_integrity(self, batch) -> None:
        """Every running row: protected prefix unchanged (slots and K/V bytes); the rows' own
        slots [P, L) named by one row only and none free; ring rows and device offsets agree; the
        request's token count from its rows agrees with SGLang's (one ahead under overlap)."""
        req_to_token = self.req_to_token_pool.req_to_token
        owned = []
        lag = (0, 1) if getattr(self.scheduler, "enable_overlap", False) else (0,)
        for req in batch.reqs:
            state = get_state(req)
            if (
                state is not None
                and decoded_tokens(req, state) - len(req.output_ids) not in lag
            ):
                raise AssertionError(
                    f"Kara integrity: {req.rid} counts {decoded_tokens(req, state)} tokens from its "
                    f"KV rows, SGLang {len(req.output_ids)} (overlap scheduler: {len(lag) > 1})"
                )
            if state is None or state.protected < 0 or state.prefix_snapshot is None:
                continue
            slots, kv = self._prefix_view(req, state)
            check_prefix_unchanged(
                req.rid, slots, kv, *state.prefix_snapshot, state.protected
            )
            owned.append(
                req_to_token[
                    req.kv.req_pool_idx, state.protected : int(req.kv.kv_committed_len)
                ]
            )
            state.integrity_checks += 1
        if self.ring is not None:
            self.ring.check()
        self.forward.check_offsets(batch.reqs)
        check_row_ownership(owned, self.allocator.get_all_free_pages(), self.page_size)
