"""What the forward hooks do: logical positions, query capture, recompute scoring, decode observers.

One ``ForwardContext`` per runtime owns the hooks' state (no module globals). SGLang's runners
forward a ``dataclasses.replace()`` copy of the ForwardBatch: declared fields such as positions
carry over, extra attributes would not, so the per-forward side data lives here:

    on_forward_batch (after ForwardBatch.init_new)   decode: positions += pos_offset of each row
                                                     (a device gather from ``offsets``, no host
                                                     copy), capture rows; recompute: positions
    on_attention (around RadixAttention.forward)     recompute: queries -> scoring, no KV write,
                                                     stop after the last layer's (ScoringComplete);
                                                     decode: queries -> ring; observer -> policy

Where SGLang has the extension points (patches/upstream) the same work runs through them and no
hook is registered (plugin.serving_hooks): SGLang adds each row's offset to positions itself
(0008: ``offsets`` is then SGLang's tensor, which its tail release raises by each drop);
``KaraObserver`` (0006) is called before each eager attention layer (recompute: the layer's
queries scored) and after it (decode: queries to the ring, the policy's observer), reading the
forward's rows, positions and requests from the forward batch; the recompute forward is SGLang's
cached extend (0007: no K/V written, no exception, it runs to its end).

Inside a recompute forward nothing of Kara's raises through the model but ``ScoringComplete``
at the last scored layer: a scoring failure (device memory, a kernel) is kept on the pass and
raised once the forward has left the model. Under tensor parallelism the forward all-reduces
at every layer, so a rank that left it early would leave the others waiting in a collective;
every rank instead runs it to the same layer, and the ranks then agree on the failure before
any commit (tp_lockstep.FailureAgreement), which names the rank that failed.

``offsets`` [req slots] (device) mirrors every running request's ``state.pos_offset`` at its row:
``sync_offset`` writes it when a request is first seen in a row (a new request, or one
re-prefilled after a retraction: ``state.offset_row`` is reset with its row) and the event code
adds each compaction's drop count; the integrity check compares the two.
"""

from __future__ import annotations

import contextlib

import torch

from sgl_kara import _sglang as adapter
from sgl_kara import backends
from sgl_kara.policies.base import ObserveInput
from sgl_kara.scheduler.recompute import ScoringComplete


class ForwardContext:
    def __init__(
        self,
        policy,
        ring,
        req_to_token: torch.Tensor,
        keys_of,
        start_layer,
        table,
        offsets: torch.Tensor | None = None,
        heads: tuple[int, int] = (1, 1),
    ):
        self.policy = policy
        self.q_heads, self.head_dim = heads  # of every attention layer on this rank
        self.ring = ring
        self.req_to_token = req_to_token
        self.keys_of = keys_of
        self.start_layer = start_layer
        self.table = table
        # SGLang's own per-row offsets, which it adds to positions (patches/upstream 0008), or
        # Kara's, which the init_new hook adds
        self.sglang_offsets = offsets is not None
        self.offsets = (
            offsets
            if offsets is not None
            else torch.zeros(
                req_to_token.shape[0], dtype=torch.int64, device=req_to_token.device
            )
        )
        # (ring rows [T], logical positions [T]) of the decode forward
        self.capture = None
        self.observed = None  # (row slots per request, states) for a decode observer
        self.scoring = None  # the ScoringPass of a recompute forward in flight
        self.scoring_batch = None  # ... and its batch
        # the forward being run: its batch's kind (init_new precedes it)
        self.kind = None

    # -- offsets --------------------------------------------------------------------------
    def sync_offset(self, row: int, state) -> None:
        """Make ``offsets[row]`` the request's offset (once per request and row)."""
        if state.offset_row != row:
            self.offsets[row] = state.pos_offset
            state.mirrored_at(row)

    def add_offset(self, rows: torch.Tensor, d: int) -> None:
        self.offsets[rows] += d

    def check_offsets(self, reqs) -> None:
        for req in reqs:
            state = self.table.get(req)
            if state is not None and state.offset_row == adapter.row_index(req):
                have = int(self.offsets[state.offset_row])
                if have != state.pos_offset:
                    raise AssertionError(
                        f"Kara integrity: device offset {have} != pos_offset "
                        f"{state.pos_offset} of {adapter.rid(req)}"
                    )

    # -- the recompute pass ---------------------------------------------------------------
    @contextlib.contextmanager
    def scoring_pass(self, scoring, batch):
        """A recompute forward of ``batch`` (None: one SGLang builds, patches/upstream 0008)
        feeds ``scoring`` for the duration."""
        self.scoring, self.scoring_batch = scoring, batch
        try:
            yield
        finally:
            self.scoring = self.scoring_batch = None

    # -- hooks ----------------------------------------------------------------------------
    def on_forward_batch(self, batch, forward_batch) -> None:
        """The init_new hook's: what the hooked backend reads and writes of the forward."""
        hooks = backends.current()
        self.capture = self.observed = self.kind = None
        if self.scoring is not None and batch is self.scoring_batch:
            self.kind = "recompute"
            pos = hooks.positions(forward_batch)
            hooks.set_positions(forward_batch, self.scoring.positions.to(pos.dtype))
            return
        reqs = adapter.batch_requests(batch)
        if not reqs:
            return
        kind = self.kind = hooks.batch_kind(batch)
        if kind == "idle":
            return
        states = [self.table.get(r) for r in reqs]
        if kind == "decode":
            rows = hooks.batch_rows(batch).to(torch.int64)
            if len(reqs) != rows.shape[0]:
                # Extra decode rows (beam search: refused per request, a 400).
                assert not any(s is not None and s.pos_offset for s in states), (
                    "Kara offsets with extra decode rows"
                )
                return
            pos = hooks.positions(forward_batch)
            if not self.sglang_offsets:
                pos = pos + self.offsets[rows].to(pos.dtype)
                hooks.set_positions(forward_batch, pos)
            self._decode_side_data(rows, pos, hooks.host_lengths(batch), states)
        else:
            # Only requests never compressed (or reset by retraction) are ever extended.
            assert not any(s is not None and s.pos_offset for s in states), (
                "extend of a compressed request"
            )

    def _score_layer(self, scoring, layer_id: int, q, heads: int, head_dim: int):
        qv = q.reshape(scoring.B, q.shape[0] // scoring.B, heads, head_dim)
        scoring.score_layer(layer_id, qv)

    def _decode_side_data(self, rows, pos, host_lengths, states) -> None:
        """A decode forward's capture rows and, for a decode observer, each request's slots:
        lengths from the host (the batch's CPU lengths: reading the device ones would make the
        host wait at every decode step), the rows in one gather, each request's slots a view of
        it (every layer's observer gets the same list)."""
        if self.ring is not None:
            self.capture = (self.ring.rows_for(rows), pos.to(torch.int64))
        if self.policy is not None and self.policy.observes_decode:
            lens = host_lengths.tolist()
            table = self.req_to_token[rows, : max(lens)].to(torch.int64)
            self.observed = ([table[i, :n] for i, n in enumerate(lens)], states)

    # -- SGLang's attention observers (patches/upstream 0006 / 0007) -----------------------
    def observer(self):
        """An AttentionObserver of SGLang's calling this context around every eager attention
        layer."""
        context = self

        class KaraObserver(adapter.attention_observer_base()):
            def before_attention(self, layer, q, k, v, forward_batch):
                context.before_attention(layer, q, forward_batch)

            def after_attention(self, layer, q, output, forward_batch):
                context.after_attention(layer, q)

        return KaraObserver()

    def before_attention(self, layer, q, forward_batch) -> None:
        layer_id, heads, head_dim = self._layer(layer)
        scoring = self.scoring
        if scoring is not None:  # Kara's recompute forward: this layer's queries scored
            self.kind = "recompute"
            if scoring.error is None:
                try:
                    self._score_layer(scoring, layer_id, q, heads, head_dim)
                except Exception as e:  # noqa: BLE001 - raised once the forward is left
                    scoring.error = e
            return
        if layer_id == self.start_layer:  # a new forward: its side data
            self.capture = self.observed = None
            kind, rows, pos, rids, host_lengths = adapter.forward_view(forward_batch)
            self.kind = kind
            if kind == "decode":
                states = [self.table.by_rid(rid) for rid in rids]
                rows = rows.to(torch.int64)
                self._decode_side_data(rows, pos, host_lengths, states)

    def after_attention(self, layer, q) -> None:
        if self.scoring is None and self.kind == "decode":
            self._after_decode_attention(*self._layer(layer), q=q)

    def _layer(self, layer) -> tuple[int, int, int]:
        """(layer_id, query heads, head dim) of an attention layer."""
        return adapter.attention_layer(layer), self.q_heads, self.head_dim

    def _after_decode_attention(self, layer_id: int, heads: int, head_dim: int, q):
        q3 = q.reshape(q.shape[0], heads, head_dim)
        cap = self.capture
        if cap is not None and q.shape[0] == cap[0].shape[0]:
            self.ring.write(layer_id, q3, *cap)
        if self.observed is not None and q.shape[0] == len(self.observed[0]):
            slots, states = self.observed
            self.policy.observe(
                ObserveInput(
                    layer_id - self.start_layer,
                    q3,
                    self.keys_of(layer_id),
                    slots,
                    states,
                )
            )

    def on_attention(self, original, layer, q, k, v, forward_batch, save_kv_cache):
        """``original(layer, q, k, v, fb, save_kv_cache)``: SGLang's attention call."""
        layer_id, heads, head_dim = self._layer(layer)
        scoring = self.scoring
        if scoring is not None:
            if scoring.error is None:
                try:
                    self._score_layer(scoring, layer_id, q, heads, head_dim)
                except Exception as e:  # noqa: BLE001 - raised once the forward is left
                    scoring.error = e
            if layer_id == scoring.last_layer:
                raise ScoringComplete  # the rest of the forward feeds no score
            # The attention itself sees the window's real slots (a backend that reads the
            # extend tokens' K/V back from the pool finds them there); the rest of the layer,
            # a fused RoPE + KV write included, sees the scratch slot (recompute.py).
            with backends.current().kv_writes_to(forward_batch, scoring.window_slots):
                return original(layer, q, k, v, forward_batch, False)
        out = original(layer, q, k, v, forward_batch, save_kv_cache)
        if self.kind == "decode":
            self._after_decode_attention(layer_id, heads, head_dim, q)
        return out
