"""Window queries for scoring: a capture ring filled during decode (ring.py), or a recompute
forward (here), over a span of the window (all of it at an event, a few queries at a spread step).

Both end in the same per-layer call, ``ScoringPass.score_layer(layer_id, q)``, with ``q`` of
shape ``[B, W_q, H_q, D]`` (the policy's query window, post-RoPE), which asks the policy to score
the region's keys (read through the requests' slot indices).

The recompute forward (paper App. C.2) is an EXTEND batch over the requests' real rows: prefix =
rows [0, query_start), extend = the query window's tokens, whose KV is already cached at their
rows; positions are logical. The attention hook forces ``save_kv_cache=False`` and hands each
layer's queries to the scoring pass, so nothing in the pool changes. Models that write K/V inside
RoPE (SGLang's ``enable_fused_set_kv_buffer``: CUDA with a bf16 pool, e.g. Qwen3-MoE, GPT-OSS)
ignore ``save_kv_cache``, so the batch's ``out_cache_loc`` is SGLang's padding slot 0 (never
allocated, page 0 with pages; padded tokens write there) and only the attention call sees the
window's real slots (forward.py). Readers of ``out_cache_loc`` in an extend forward, SGLang 0.5.23:
torch_native, FlashInfer and fa3 read it only to save K/V (or for sliding-window pools, refused);
they read keys through ``req_to_token``; Triton's deterministic (unified) kernel and its
``k is None`` path read the extend tokens' K/V at ``out_cache_loc``, inside the attention call. Once the last layer's queries
are scored, the hook raises ``ScoringComplete`` and the forward stops there: that layer's
attention and MLP, the final norm and the logits are never needed (a quarter of the pass on a
4-layer model, ~3% on a 30-layer one).
"""

from __future__ import annotations

import copy

import torch

from sgl_kara.policies.base import ScoreInput

# SGLang's allocators never hand out slot 0 (page 0): padded tokens write their dummy K/V there.
PADDING_SLOT = 0


class ScoringComplete(Exception):
    """Raised inside a recompute forward once every layer's queries are scored (caught by the
    event code): nothing after that point feeds the scores."""


class ScoringPass:
    """Collects ``[B, L, H_kv, M]`` scores of one batch of jobs (all regions the same shape), one
    layer at a time, from ``policy.score``. ``slots``: ``[B, M]`` pool slots of the region keys."""

    def __init__(
        self,
        policy,
        kv_pool,
        layer_ids: list[int],
        slots: torch.Tensor,
        rows: list,
        regions: list,
    ):
        self.policy = policy
        self.kv_pool = kv_pool
        self.layer_index = {lid: i for i, lid in enumerate(layer_ids)}
        self.slots = slots
        self.rows, self.regions = rows, regions
        self.B, self.M = slots.shape
        self.scores: torch.Tensor | None = None
        self.seen: set[int] = set()
        # Set for a recompute forward: logical positions of the window tokens and their pool
        # slots, [B * W] each.
        self.positions: torch.Tensor | None = None
        self.window_slots: torch.Tensor | None = None

    def score_layer(self, layer_id: int, q: torch.Tensor | None) -> None:
        """q: [B, W, H_q, D] window queries of this layer (post-RoPE), or None."""
        inp = ScoreInput(
            self.layer_index[layer_id],
            q,
            self.kv_pool.get_key_buffer(layer_id),
            self.slots,
            self.rows,
            self.regions,
        )
        s = self.policy.score(inp)  # [B, H_kv, M]
        if self.scores is None:
            self.scores = torch.zeros(
                (self.B, len(self.layer_index), s.shape[1], self.M),
                dtype=torch.float32,
                device=s.device,
            )
        self.scores[:, self.layer_index[layer_id]] = s
        self.seen.add(layer_id)

    @property
    def complete(self) -> bool:
        return len(self.seen) == len(self.layer_index)

    def score_without_queries(self) -> torch.Tensor:
        for lid in self.layer_index:
            self.score_layer(lid, None)
        return self.result()

    def result(self) -> torch.Tensor:
        missing = set(self.layer_index) - self.seen
        if missing:
            raise RuntimeError(
                f"scoring pass saw no queries for layers {sorted(missing)}"
            )
        return self.scores


def recompute_batch(
    batch,
    jobs,
    rows: torch.Tensor,
    req_to_token: torch.Tensor,
    scoring: ScoringPass,
    q_lo: list[int] | None = None,
    n: int | None = None,
):
    """A copy of the running ScheduleBatch turned into an EXTEND batch over ``n`` query tokens of
    each job from its physical row ``q_lo`` (default: the jobs' whole query windows), at logical
    positions + pos_offset. Every field SGLang's ForwardBatch.init_new reads for an extend batch
    is set here, from host data (no device read)."""
    from sgl_kara._sglang import ForwardMode

    device = req_to_token.device
    if q_lo is None:
        q_lo = [j.region.query_start for j in jobs]
    W = jobs[0].region.query_len if n is None else n
    ids, positions, seq = [], [], []
    for j, lo_row in zip(jobs, q_lo):
        tokens = j.req.origin_input_ids + j.req.output_ids
        lo = lo_row + j.state.pos_offset
        if lo + W > len(tokens):
            raise AssertionError(
                f"recompute of {j.req.rid}: tokens [{lo}, {lo + W}) not all known ({len(tokens)})"
            )
        ids.extend(tokens[lo : lo + W])
        positions.extend(range(lo, lo + W))
        seq.append(lo_row + W)
    row_ids = [int(j.req.kv.req_pool_idx) for j in jobs]
    row_pos = (
        torch.tensor(q_lo, device=device)[:, None]
        + torch.arange(W, device=device)[None, :]
    )
    scoring.window_slots = (
        req_to_token[rows[:, None], row_pos].reshape(-1).to(torch.int64)
    )
    sb = copy.copy(batch)
    sb.reqs = [j.req for j in jobs]
    sb.forward_mode = ForwardMode.EXTEND
    sb.input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    sb.req_pool_indices = rows
    sb.req_pool_indices_cpu = torch.tensor(row_ids, dtype=torch.int64)
    sb.seq_lens = torch.tensor(seq, dtype=torch.int64, device=device)
    sb.seq_lens_cpu = torch.tensor(seq, dtype=torch.int64)
    sb.orig_seq_lens = sb.seq_lens.to(torch.int32)
    sb.seq_lens_sum = int(sum(seq))
    sb.out_cache_loc = torch.full(
        (W * len(jobs),), PADDING_SLOT, dtype=torch.int64, device=device
    )
    sb.prefix_lens = list(q_lo)
    sb.extend_lens = [W] * len(jobs)
    sb.extend_num_tokens = W * len(jobs)
    sb.extend_logprob_start_lens = [W] * len(jobs)
    sb.return_logprob = False
    sb.top_logprobs_nums = None
    sb.token_ids_logprobs = None
    sb.decoding_reqs = None
    sb.multimodal_inputs = [None] * len(jobs)
    sb.sampling_info = scoring_sampling_info(getattr(batch, "sampling_info", None))
    sb.spec_info = None
    sb.input_embeds = None
    sb.extend_input_logprob_token_ids = None
    scoring.positions = torch.tensor(positions, dtype=torch.int64, device=device)
    sb._kara_scoring = scoring
    return sb


def scoring_sampling_info(info):
    """The recompute batch samples nothing, but ForwardBatch.init_new and the model runner read
    its sampling info (grammars, watermark candidates: SGLang's ``--watermark-config``): a
    shallow copy of the running batch's with neither (None when it has none)."""
    if info is None:
        return None
    out = copy.copy(info)
    out.grammars = None
    out.has_watermark_candidates = False
    return out
