"""Kara: sliding-window bidirectional-attention scoring + Token2Chunk selection.

Idea
    Compress only the trailing window of |W| freshly decoded tokens. Every query in
    the window attends (no causal mask) to the keys of the compressible region
    W \\ U (the window minus a protected buffer U of the newest |U| tokens); the
    attention each key receives, summed over the queries, is its importance A
    (Eq. 4). The top ceil(r*M) - alpha keys are kept as discrete candidates I
    (Eq. 5). Token2Chunk then treats every two consecutive kept indices as the
    end points of a candidate chunk, keeps the chunks shorter than gamma, ranks
    them by R_k = (A[I[k]] + A[I[k+1]]) * (I[k+1] - I[k] - 1) (Eq. 6), adds the
    interiors of the top floor(alpha / (gamma - 2)) chunks (Eq. 7-8), and fills
    whatever is left of the budget with the best-scored positions not yet kept
    (App. C.3), so exactly K = ceil(r*M) positions survive.

Paper
    "Kara" (sliding-window KV cache compression for reasoning models, with
    KvLLM), Section 4.1-4.2, Eq. 4-8, App. C.2-C.3.

Parameters
    retention (r)      fraction of the compressible region kept, in (0, 1].
    chunk_budget (alpha) positions reserved for Token2Chunk; 0 disables it.
    max_chunk (gamma)  maximum chunk length including both end points, >= 3;
                       a chunk between kept indices i < j qualifies iff
                       1 < j - i < gamma (so it adds j - i - 1 <= gamma - 2).

Tie-breaking everywhere: higher score first, then lower index (stable sorts).
Scores are assumed finite. Nothing here syncs with the host, so `select` can run
on GPU tensors inside the server step.
"""

from __future__ import annotations

import math

import torch

# Upper bound on the elements of one [B, H_q, w_chunk, M] logits block.
_SCORE_BLOCK_ELEMS = 1 << 24


def kept_count(m: int, retention: float) -> int:
    """K = ceil(retention * m), robust to float error (0.3 * 100 -> 30); >= 1 if m >= 1."""
    if not 0.0 < retention <= 1.0:
        raise ValueError(f"retention must be in (0, 1], got {retention}")
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    if m == 0:
        return 0
    return max(1, min(m, math.ceil(round(retention * m, 6))))


def _check_select_args(m: int, retention: float, chunk_budget: int, max_chunk: int) -> int:
    k = kept_count(m, retention)
    if max_chunk < 3:
        raise ValueError(f"max_chunk (gamma) must be >= 3, got {max_chunk}")
    if chunk_budget < 0:
        raise ValueError(f"chunk_budget must be >= 0, got {chunk_budget}")
    if chunk_budget > 0 and chunk_budget >= k:
        raise ValueError(
            f"chunk_budget ({chunk_budget}) must be < kept count K={k} "
            f"(M={m}, retention={retention})"
        )
    return k


def window_scores(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Bidirectional window attention received by each compressible key (Eq. 4).

    q: [B, W, H_q, D]  queries of every window token.
    k: [B, M, H_kv, D] keys of the compressible region (M = W - U).
    Returns A: [B, H_kv, M] float32 = sum over the W queries and the H_q / H_kv
    query heads of kv head h (query head j -> kv head j // (H_q // H_kv)) of
    softmax_M(q . k * scale). No causal mask. scale defaults to 1/sqrt(D).
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D, got {tuple(q.shape)} and {tuple(k.shape)}")
    b, w, hq, d = q.shape
    bk, m, hkv, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B or D")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"H_q ({hq}) must be a multiple of H_kv ({hkv})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = hq // hkv
    out = torch.zeros(b, hkv, m, dtype=torch.float32, device=q.device)
    if m == 0 or w == 0:
        return out
    kf = k.float()
    step = max(1, _SCORE_BLOCK_ELEMS // max(1, b * hq * m))
    for w0 in range(0, w, step):
        qc = q[:, w0 : w0 + step].float().reshape(b, -1, hkv, g, d)
        logits = torch.einsum("bwhgd,bmhd->bhgwm", qc, kf) * scale
        out += torch.softmax(logits, dim=-1).sum(dim=(2, 3))
    return out


def select(scores: torch.Tensor, retention: float, chunk_budget: int, max_chunk: int) -> torch.Tensor:
    """Kara selection (Eq. 5-8 + App. C.3), vectorised over all leading dims.

    scores: [..., M] importance A (any float dtype; assumed finite).
    Returns sorted kept indices, int64 [..., K] with K = kept_count(M, retention),
    the same K for every row. chunk_budget == 0 is plain TopK(K).
    """
    *lead, m = scores.shape
    k = _check_select_args(m, retention, chunk_budget, max_chunk)
    dev = scores.device
    a = scores.reshape(-1, m)
    n = a.shape[0]
    if k == m:
        return torch.arange(m, device=dev).expand(*lead, m).contiguous()
    # Ranking by score: descending, ties -> lower index (stable sort).
    order = torch.sort(a, dim=1, descending=True, stable=True).indices  # [N, M]
    if chunk_budget == 0:
        return torch.sort(order[:, :k], dim=1).values.reshape(*lead, k)

    # kept has a dump column at index M that absorbs masked-out scatters.
    kept = torch.zeros(n, m + 1, dtype=torch.bool, device=dev)
    k0 = k - chunk_budget
    idx = torch.sort(order[:, :k0], dim=1).values  # (a)+(b): I, ascending [N, K0]
    kept.scatter_(1, idx, True)

    n_chunks = min(chunk_budget // (max_chunk - 2), k0 - 1)
    if n_chunks > 0:
        #   I[k]   I[k]+1 ... I[k+1]-1   I[k+1]
        #    ^     '--- interior ---'      ^       gap = I[k+1] - I[k]
        left, right = idx[:, :-1], idx[:, 1:]  # [N, K0-1]
        gap = right - left
        cand = (gap > 1) & (gap < max_chunk)
        a64 = a.double()
        r = (a64.gather(1, left) + a64.gather(1, right)) * (gap - 1).double()  # Eq. 6
        # Rank chunks: candidates first, then higher R, then lower k (two stable sorts).
        by_r = torch.sort(r, dim=1, descending=True, stable=True).indices
        by_c = torch.sort(cand.gather(1, by_r).int(), dim=1, descending=True, stable=True).indices
        top = by_r.gather(1, by_c)[:, :n_chunks]  # [N, n_chunks] chunk ids, Eq. 7
        top_ok = cand.gather(1, top)
        top_left, top_gap = left.gather(1, top), gap.gather(1, top)
        off = torch.arange(1, max_chunk - 1, device=dev)  # interior offsets 1..gamma-2
        pos = top_left[..., None] + off  # [N, n_chunks, gamma-2]
        ok = top_ok[..., None] & (off < top_gap[..., None])
        kept.scatter_(1, torch.where(ok, pos, m).reshape(n, -1), True)  # Eq. 8

    # (c) fill the rest of the budget with the best-scored positions not yet kept.
    body = kept[:, :m]
    free = ~body.gather(1, order)  # [N, M] in score order
    need = k - body.sum(dim=1, keepdim=True)
    take = free & (torch.cumsum(free.int(), dim=1) <= need)
    kept.scatter_(1, torch.where(take, order, m), True)
    out = torch.sort((~kept[:, :m]).int(), dim=1, stable=True).indices[:, :k]
    return out.reshape(*lead, k)


def select_ref(scores_1d: torch.Tensor, retention: float, chunk_budget: int, max_chunk: int) -> list[int]:
    """Plain-Python Kara selection for one row [M], written straight from the paper."""
    a = [float(x) for x in scores_1d.reshape(-1).tolist()]
    m = len(a)
    k = _check_select_args(m, retention, chunk_budget, max_chunk)
    order = sorted(range(m), key=lambda j: (-a[j], j))
    ids = sorted(order[: k - chunk_budget])  # Eq. 5, ascending
    if chunk_budget == 0:
        return ids
    chunks = []
    for c in range(len(ids) - 1):
        gap = ids[c + 1] - ids[c]
        if 1 < gap < max_chunk:  # Eq. 7 constraint; gap 1 has no interior
            chunks.append(((a[ids[c]] + a[ids[c + 1]]) * (gap - 1), c))  # Eq. 6
    chunks.sort(key=lambda rc: (-rc[0], rc[1]))
    kept = set(ids)
    for _, c in chunks[: chunk_budget // (max_chunk - 2)]:
        kept.update(range(ids[c] + 1, ids[c + 1]))  # Eq. 8
    for j in order:  # App. C.3 budget fill
        if len(kept) >= k:
            break
        kept.add(j)
    return sorted(kept)
