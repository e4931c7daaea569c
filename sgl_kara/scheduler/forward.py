"""What the forward hooks do: logical positions, query capture, scoring passes, decode observers.

One ``ForwardContext`` per runtime owns the hooks' state (no module globals). SGLang's runners
forward a ``dataclasses.replace()`` copy of the ForwardBatch: declared fields such as positions
carry over, extra attributes would not, so the per-forward side data lives here:

    on_forward_batch (after ForwardBatch.init_new)   decode: positions += pos_offset of each row
                                                     (a device gather from ``offsets``, no host
                                                     copy), capture rows; recompute: positions
    on_attention (around RadixAttention.forward)     recompute: queries -> scoring, no KV write,
                                                     stop after the last layer's (ScoringComplete);
                                                     decode: queries -> ring; observer -> policy

``offsets`` [req slots] (device) mirrors every running request's ``state.pos_offset`` at its
``req_pool_idx``: ``sync_offset`` writes it when a request is first seen in a row (a new request,
or one re-prefilled after a retraction: ``state.offset_row`` is reset with its row) and the
event code adds each compaction's drop count; the integrity check compares the two.
"""

from __future__ import annotations

import torch

from sgl_kara.policies.base import ObserveInput
from sgl_kara.scheduler.queries import ScoringComplete
from sgl_kara.scheduler.state import get_state


class ForwardContext:
    def __init__(self, policy, ring, req_to_token: torch.Tensor, kv_pool):
        self.policy = policy
        self.ring = ring
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool
        self.offsets = torch.zeros(
            req_to_token.shape[0], dtype=torch.int64, device=req_to_token.device
        )
        self.capture = None  # (ring rows [T], logical positions [T]) of the decode forward being built
        self.observed = None  # (row slots per request, states) for a decode observer
        self.scoring = None  # the ScoringPass of a recompute forward in flight

    # -- offsets ------------------------------------------------------------------------------
    def sync_offset(self, req, state) -> None:
        """Make ``offsets[req_pool_idx]`` this request's offset (once per request and row)."""
        idx = int(req.kv.req_pool_idx)
        if state.offset_row != idx:
            self.offsets[idx] = state.pos_offset
            state.offset_row = idx

    def add_offset(self, rows: torch.Tensor, d: int) -> None:
        self.offsets[rows] += d

    def check_offsets(self, reqs) -> None:
        for req in reqs:
            state = get_state(req)
            if state is not None and state.offset_row == int(req.kv.req_pool_idx):
                have = int(self.offsets[state.offset_row])
                if have != state.pos_offset:
                    raise AssertionError(
                        f"Kara integrity: device offset {have} != pos_offset {state.pos_offset} of {req.rid}"
                    )

    # -- hooks --------------------------------------------------------------------------------
    def on_forward_batch(self, batch, fb) -> None:
        self.capture = self.observed = None
        if (
            self.scoring is not None
            and getattr(batch, "_kara_scoring", None) is self.scoring
        ):
            fb.positions = self.scoring.positions.to(fb.positions.dtype)
            return
        reqs = batch.reqs
        if not reqs or fb.forward_mode.is_idle():
            return
        states = [get_state(r) for r in reqs]
        if fb.forward_mode.is_decode():
            if len(reqs) != fb.batch_size:
                # Extra decode rows (beam search: refused per request, a 400); nothing compressed here.
                assert not any(s is not None and s.pos_offset for s in states), (
                    "Kara offsets with extra decode rows"
                )
                return
            rows = fb.req_pool_indices.to(torch.int64)
            fb.positions = fb.positions + self.offsets[rows].to(fb.positions.dtype)
            if self.ring is not None:
                self.capture = (self.ring.rows_for(rows), fb.positions.to(torch.int64))
            if self.policy is not None and self.policy.observes_decode:
                # Lengths from the host (the batch's CPU lengths; reading the device tensors here
                # would sync the host at every decode step); the rows in one gather, each request's
                # slots a view of it (one list per forward: every layer's observer gets it).
                lens = (
                    fb.seq_lens_cpu
                    if fb.seq_lens_cpu is not None
                    else batch.seq_lens_cpu
                ).tolist()
                table = self.req_to_token[rows, : max(lens)].to(torch.int64)
                self.observed = ([table[i, :n] for i, n in enumerate(lens)], states)
        else:
            # Only requests never compressed (or reset by retraction) are ever extended.
            assert not any(s is not None and s.pos_offset for s in states), (
                "extend of a compressed request"
            )

    def on_attention(
        self, original, layer, q, k, v, fb, save_kv_cache, *args, **kwargs
    ):
        scoring = self.scoring
        if scoring is not None:
            qv = q.reshape(
                scoring.B,
                q.shape[0] // scoring.B,
                layer.tp_q_head_num,
                layer.qk_head_dim,
            )
            scoring.score_layer(layer.layer_id, qv)
            if scoring.complete:
                raise ScoringComplete  # the rest of the forward feeds no score (queries.py)
            # The attention itself sees the window's real slots (a backend that reads the extend
            # tokens' K/V back from the pool finds them there); the rest of the layer, a fused
            # RoPE + KV write included, sees the scratch slot (queries.py).
            scratch, fb.out_cache_loc = fb.out_cache_loc, scoring.window_slots
            try:
                return original(layer, q, k, v, fb, False, *args, **kwargs)
            finally:
                fb.out_cache_loc = scratch
        out = original(layer, q, k, v, fb, save_kv_cache, *args, **kwargs)
        if fb.forward_mode.is_decode():
            q3 = q.reshape(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim)
            cap = self.capture
            if cap is not None and q.shape[0] == cap[0].shape[0]:
                self.ring.write(layer.layer_id, q3, *cap)
            if self.observed is not None and q.shape[0] == len(self.observed[0]):
                slots, states = self.observed
                self.policy.observe(
                    ObserveInput(
                        layer.layer_id - self.kv_pool.start_layer,
                        q3,
                        self.kv_pool.get_key_buffer(layer.layer_id),
                        slots,
                        states,
                    )
                )
        return out
