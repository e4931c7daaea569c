"""The recompute pass (paper App. C.2): window queries for scoring from an extra forward.

An EXTEND forward over the requests' real rows: prefix = rows [0, q_lo), extend = the ``n`` query
tokens whose K/V are already cached at rows [q_lo, q_lo + n), positions logical (row + the
request's pos_offset). The batch is built by SGLang's own ``ScheduleBatch.init_new``
(backends/hooked.py, Hooks.recompute_batch). The attention hook (forward.py) hands each layer's
queries to the scoring pass, forces ``save_kv_cache=False`` and, once the last layer's queries
are scored, raises ``ScoringComplete``: the forward stops there (that layer's attention and MLP,
the final norm and the logits feed no score).

Models that write K/V inside RoPE (SGLang's ``enable_fused_set_kv_buffer``: CUDA with a bf16
pool) ignore ``save_kv_cache``, so the batch's ``out_cache_loc`` is SGLang's padding slot 0
(never allocated, page 0 with pages; padded tokens write there) and only the attention call sees
the window's real slots (forward.py). Readers of ``out_cache_loc`` in an extend forward, SGLang
0.5.23: torch_native, FlashInfer and fa3 read it only to save K/V; Triton's deterministic
(unified) kernel and its ``k is None`` path read the extend tokens' K/V at ``out_cache_loc``,
inside the attention call.

Where SGLang has an extend over already-cached K/V (patches/upstream 0007: ``kv_already_cached``)
none of this is needed: ``out_cache_loc`` is the window's own slots, SGLang writes no K/V and
replays no prefill graph, the attention observer (0006) scores each layer's queries, and the
forward runs to its end (about 1/L more work than stopping after the last scored layer).

Host to device: the token ids, positions and rows are staged (scheduler/staging.py); SGLang's
``ForwardBatch.init_new`` prepares the rest of the forward as it does for any extend.
"""

from __future__ import annotations

import torch

from sgl_kara import _sglang as adapter

# SGLang's allocators never hand out slot 0 (page 0): padded tokens write their dummy K/V there.
PADDING_SLOT = 0


class ScoringComplete(Exception):
    """Raised inside a recompute forward once every layer's queries are scored: nothing after
    that point feeds the scores."""


def extend_rows(
    jobs,
    rows: torch.Tensor,
    req_to_token,
    q_lo: list[int],
    n: int,
    staging,
    kv_cached: bool = False,
):
    """(``ExtendRows`` of ``n`` query tokens of each job from physical row ``q_lo[b]``, the
    window's pool slots [B * n]) -- from host data, staged to the device. ``kv_cached``: SGLang
    runs the extend over cached K/V and writes none (the series' 0007 / 0008)."""
    ids, positions, seq = [], [], []
    for j, lo_row in zip(jobs, q_lo):
        lo = lo_row + j.state.pos_offset
        if lo + n > adapter.known_tokens(j.req):
            raise AssertionError(
                f"recompute of {adapter.rid(j.req)}: tokens [{lo}, {lo + n}) not all known "
                f"({adapter.known_tokens(j.req)})"
            )
        ids.extend(adapter.token_ids(j.req, lo, lo + n))
        positions.extend(range(lo, lo + n))
        seq.append(lo_row + n)
    device = req_to_token.device
    starts = staging.to_device(q_lo)
    row_pos = starts[:, None] + torch.arange(n, device=device)[None, :]
    window_slots = req_to_token[rows[:, None], row_pos].reshape(-1).to(torch.int64)
    extend = adapter.ExtendRows(
        reqs=[j.req for j in jobs],
        rows=rows,
        prefix=list(q_lo),
        input_ids=staging.to_device(ids),
        seq_lens=seq,
        device_seq_lens=staging.to_device(seq),
        positions=staging.to_device(positions),
        # SGLang's cached extend (patches/upstream 0007) writes no K/V: the window's own slots;
        # else the padding slot, where a fused RoPE + K/V write lands harmlessly
        out_cache_loc=window_slots
        if kv_cached
        else torch.full(
            (n * len(jobs),), PADDING_SLOT, dtype=torch.int64, device=device
        ),
    )
    return extend, window_slots
