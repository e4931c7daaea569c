"""Randomised fuzz of KV compaction and the row rewrite (``sgl_kara.mem_cache.compaction``).

No model and no SGLang: a small simulated world drives ``compact_rows`` directly through
random sequences of operations on several requests sharing one KV pool:

    admit     a new request (prompt); optionally shares a prompt prefix held by a simulated
              radix "tree" (refcounted entries that own their slots) and optionally inserts
              its own page-aligned prompt into the tree (as SGLang's cache_unfinished_req)
    readmit   re-prefill of a retracted request: exact KV for all its tokens, state reset
    decode    one token for each of a random subset of running requests (page 1: any free
              slot; page 16: SGLang's paged rule, a new page when the row length is a
              multiple of the page size, otherwise the next slot of the last page)
    compress  a Kara window at each chosen request's frontier f (rows [f, f+W-U) -> K kept
              per (layer, kv-head), sorted), batched over requests sharing (M, K); sometimes
              K == M (retention 1.0), sometimes the SnapKV shape (region [P, L-w)); the
              allocator is sometimes the runtime's evict-and-retry wrapper
    oom       a compress whose allocation fails (forced, or a genuinely full pool):
              OutOfSlots and nothing changes
    fault     a compress with a kept index out of range (bad input), or whose kernel
              (compact_kv / copy_slots) raises after writing: the error propagates and
              nothing changes (the fresh slots go back to the allocator)
    retract   the request frees all its own slots; the tree keeps the shared prefix
    finish    the request frees its own slots; the shared prefix stays in the tree
    evict     the tree frees entries whose refcount is 0

K/V buffers are int64 and every element is a tag naming (token, k/v, layer, row-in-D, head);
a token id names (request that wrote it, logical position). A plain model of each request
(per layer and head: prefix tokens, kept tokens in order, tail) is compared with the pool
after every step, together with ownership (each page is free, the tree's, or one request's),
the protected prefix, lengths and position offsets. Free pages are poisoned (-1) when freed,
so a write into a free slot is detected too. See docs/RELIABILITY.md.

Default: 2,000 operations per page size (1 and 16), in episodes of EPISODE_OPS with
different random shapes. Longer runs: ``KARA_FUZZ_OPS=200000`` (operations per page
size), ``KARA_FUZZ_SEED`` (base seed), ``KARA_FUZZ_REPORT=path`` (append the
counts as JSON lines); add ``-s`` to see the printed counts.
"""

from __future__ import annotations

import collections
import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import pytest
import torch

import sgl_kara.mem_cache.compaction as compaction_mod
from sgl_kara.mem_cache.compaction import (
    CompactionPlan,
    OutOfSlots,
    compact_rows,
    prepare_compaction,
)

OPS = int(os.environ.get("KARA_FUZZ_OPS", "2000"))
BASE_SEED = int(os.environ.get("KARA_FUZZ_SEED", "0"))
REPORT = os.environ.get("KARA_FUZZ_REPORT", "")
EPISODE_OPS = 500
POISON = -1
POS_BITS = 20  # token id = request id << POS_BITS | logical position

# Every kind must run at least this often per page size in the default suite.
MUST_RUN = (
    "admit",
    "admit_shared",
    "tree_insert",
    "readmit",
    "decode",
    "compress",
    "compress_batched",
    "compress_identity",
    "compress_snapkv",
    "oom_forced",
    "fault_bad_kept",
    "fault_kernel",
    "fault_after_copy",
    "retract",
    "finish",
    "evict",
)


class FuzzFailure(AssertionError):
    pass


# --------------------------------------------------------------------------- allocator


class SimAllocator:
    """SGLang's ``alloc(n)`` / ``free(slots)`` / ``free_page_ids(pages)`` contract over a pool
    of ``num_pages`` pages.

    page 1: token allocator, alloc(n) returns n free slots (any order).
    page > 1: page allocator, alloc(n) needs n page aligned (SGLang floors n // page and
    asserts alignment in debug mode; here it is an error), returns every slot of n // page
    whole free pages, contiguous within a page, pages in random order; free(slots) frees
    every page that contains one of ``slots``.
    Page 0 (slot 0 at page 1) is SGLang's padded dummy slot: never handed out.
    Stricter than SGLang: a double free, or freeing page 0, raises. Freed slots are poisoned.
    """

    def __init__(
        self, num_pages: int, page: int, kv: torch.Tensor, rng: np.random.Generator
    ):
        self.page, self.num_pages, self.kv, self.rng = page, num_pages, kv, rng
        self.is_free = np.ones(num_pages, dtype=bool)
        self.is_free[0] = False
        self.fail_next = 0  # forced out-of-memory: the next n calls return None

    def available_pages(self) -> int:
        return int(self.is_free.sum())

    def alloc(self, n: int):
        if n < 0 or n % self.page:
            raise FuzzFailure(f"alloc({n}) is not page aligned (page {self.page})")
        if self.fail_next:
            self.fail_next -= 1
            return None
        k = n // self.page
        free = np.flatnonzero(self.is_free)
        if k > free.size:
            return None
        pages = self.rng.choice(free, k, replace=False)
        self.is_free[pages] = False
        slots = (pages[:, None] * self.page + np.arange(self.page)).reshape(-1)
        return torch.from_numpy(slots.astype(np.int64))

    def free(self, slots):
        s = torch.as_tensor(slots).reshape(-1).to(torch.int64).cpu().numpy()
        if s.size == 0:
            return
        if s.min() < 0 or s.max() >= self.num_pages * self.page:
            raise FuzzFailure(f"free of slots outside the pool: {s.tolist()}")
        if self.page == 1 and np.unique(s).size != s.size:
            raise FuzzFailure(
                f"free of a slot twice in one call: {np.sort(s).tolist()}"
            )
        pages = np.unique(s // self.page)
        if (pages == 0).any():
            raise FuzzFailure("free of the reserved page 0")
        if self.is_free[pages].any():
            raise FuzzFailure(
                f"double free of pages {pages[self.is_free[pages]].tolist()}"
            )
        self._release(pages)

    def free_page_ids(self, page_ids):
        """SGLang's ``free_page_ids``: exactly these pages, no deduplication (stricter: a page
        named twice, page 0, or a page already free raises)."""
        pages = torch.as_tensor(page_ids).reshape(-1).to(torch.int64).cpu().numpy()
        if pages.size == 0:
            return
        if pages.min() < 0 or pages.max() >= self.num_pages:
            raise FuzzFailure(f"free of pages outside the pool: {pages.tolist()}")
        if np.unique(pages).size != pages.size:
            raise FuzzFailure(f"free_page_ids names a page twice: {pages.tolist()}")
        if (pages == 0).any():
            raise FuzzFailure("free of the reserved page 0")
        if self.is_free[pages].any():
            raise FuzzFailure(
                f"double free of pages {pages[self.is_free[pages]].tolist()}"
            )
        self._release(pages)

    def _release(self, pages) -> None:
        self.is_free[pages] = True
        poison = torch.from_numpy(
            (pages[:, None] * self.page + np.arange(self.page)).reshape(-1)
        )
        self.kv.index_fill_(2, poison, POISON)


# --------------------------------------------------------------------------- world model


@dataclass
class Entry:
    """A tree node: owns slots full[own_start:]; full[:own_start] belong to its ancestors."""

    eid: int
    parent: Entry | None
    full_slots: np.ndarray
    full_uids: np.ndarray
    own_start: int
    refs: int = 0  # requests sharing it + child entries


@dataclass
class Req:
    rid: int
    prompt_len: int
    max_logical: int
    uids: list  # token id of every logical position so far
    row: int = -1
    entry: Entry | None = None
    n_shared: int = 0  # rows [0, n_shared) are tree slots
    protected: int = 0  # P
    frontier: int = 0  # f
    pos_offset: int = 0
    length: int = 0  # physical
    # [L, cap, H] expected token id of each row per (layer, head)
    exp: torch.Tensor | None = None
    prefix_slots: list = field(
        default_factory=list
    )  # slots of rows [0, min(length, P))
    compressions: int = 0


class World:
    def __init__(
        self, seed: int, page: int, use_triton=False, weights=None, small=False
    ):
        self.seed, self.page, self.use_triton = seed, page, use_triton
        self.rng = rng = np.random.default_rng(seed)
        self.L = int(rng.integers(1, 4)) if not small else 2
        self.H = int(rng.choice([1, 2, 4])) if not small else 2
        self.D = int(rng.choice([1, 2])) if not small else 2
        if page == 1:
            self.cap = 160
            self.num_pages = int(rng.integers(40, 400)) if not small else 400
            self.max_window = 40
        else:
            self.cap = 256
            self.num_pages = int(rng.integers(6, 40)) if not small else 40
            self.max_window = 64
        self.max_reqs = int(rng.integers(2, 7))
        self.n_rows = self.max_reqs + 2
        S = self.num_pages * page
        self.kv = torch.full((2, self.L, S, self.H, self.D), POISON, dtype=torch.int64)
        self.k_bufs = [self.kv[0, layer_id] for layer_id in range(self.L)]
        self.v_bufs = [self.kv[1, layer_id] for layer_id in range(self.L)]
        # stale garbage outside live rows, as in SGLang (rows are never cleared)
        self.req_to_token = torch.from_numpy(
            rng.integers(0, S, (self.n_rows, self.cap)).astype(np.int32)
        )
        self.alloc = SimAllocator(self.num_pages, page, self.kv, rng)
        self.free_rows = list(range(self.n_rows))
        self.running: list[Req] = []
        self.waiting: list[Req] = []  # retracted
        self.tree: dict[int, Entry] = {}
        self.next_rid = 1
        self.next_eid = 1
        self.counts = collections.Counter()
        self.log = collections.deque(maxlen=25)
        self.weights = weights or {}
        self.evicted_now: list[np.ndarray] = []
        self._l = torch.arange(self.L).view(1, self.L, 1, 1, 1)
        self._h = torch.arange(self.H).view(1, 1, 1, self.H, 1)
        self._kv = torch.arange(2).view(2, 1, 1, 1, 1)
        self._d = torch.arange(self.D).view(1, 1, 1, 1, self.D)

    # ------------------------------------------------------------------ helpers
    def tags(self, uid: torch.Tensor) -> torch.Tensor:
        """uid [L or 1, n, H or 1] -> expected pool content [2, L, n, H, D]."""
        return (
            ((uid[None, ..., None] * self.L + self._l) * self.H + self._h) * 2
            + self._kv
        ) * self.D + self._d

    def write_tokens(self, slots: np.ndarray, uids: np.ndarray):
        """The model's forward pass: exact KV of these tokens into these slots."""
        u = torch.from_numpy(np.asarray(uids, dtype=np.int64)).view(1, -1, 1)
        self.kv[:, :, torch.from_numpy(np.asarray(slots, dtype=np.int64))] = self.tags(
            u
        )

    def fail(self, msg: str):
        raise FuzzFailure(
            f"{msg}\n  seed={self.seed} page={self.page} L={self.L} H={self.H} D={self.D} "
            f"pool_pages={self.num_pages} use_triton={self.use_triton}\n  "
            f"failed in op #{self.counts['ops']} (0-based); reproduce: "
            f"run_episode(seed={self.seed}, page={self.page}, n_ops={self.counts['ops'] + 1})\n  last ops:\n    "
            + "\n    ".join(self.log)
        )

    def row_np(self, r: Req) -> np.ndarray:
        return self.req_to_token[r.row, : r.length].numpy().astype(np.int64)

    def round_up(self, n: int) -> int:
        return -(-n // self.page) * self.page

    def evict(self, k: int | None = None) -> int:
        """Free up to k (all if None) zero-ref entries, leaves first; returns how many."""
        done = 0
        while k is None or done < k:
            cands = [e for e in self.tree.values() if e.refs == 0]
            if not cands:
                break
            e = cands[int(self.rng.integers(len(cands)))]
            own = e.full_slots[e.own_start :]
            self.alloc.free(torch.from_numpy(own))
            self.evicted_now.append(own)
            del self.tree[e.eid]
            if e.parent is not None:
                e.parent.refs -= 1
            done += 1
        return done

    def alloc_or_evict(self, n: int):
        slots = self.alloc.alloc(n)
        if slots is None and self.evict():
            slots = self.alloc.alloc(n)
        return slots

    def alloc_rows(self, r: Req, start: int, n: int):
        """Slots for rows [start, start + n) of a row whose rows below start are filled
        (prefill of an extend; start is page aligned at page > 1). None when out of memory."""
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if self.page > 1 and start % self.page:
            self.fail(f"extend from unaligned row {start}")
        slots = self.alloc_or_evict(self.round_up(n))
        return None if slots is None else slots.numpy()[:n]

    # ------------------------------------------------------------------ requests
    def place(self, r: Req, entry: Entry | None, n_shared: int) -> bool:
        """Prefill all of r.uids into a fresh row, sharing tree entry's first n_shared slots."""
        own = len(r.uids) - n_shared
        if entry is not None:
            # lock the prefix before allocating (allocation may evict the tree)
            entry.refs += 1
        slots = self.alloc_rows(r, n_shared, own)
        if slots is None:
            if entry is not None:
                entry.refs -= 1
            return False
        if entry is not None and not all(self.entry_alive(entry)):
            self.fail("sharing an evicted entry")
        row = self.free_rows.pop(int(self.rng.integers(len(self.free_rows))))
        r.row, r.entry, r.n_shared = row, entry, n_shared
        full = np.concatenate(
            [entry.full_slots[:n_shared] if entry else np.zeros(0, np.int64), slots]
        )
        self.write_tokens(slots, np.asarray(r.uids[n_shared:], dtype=np.int64))
        self.req_to_token[row, : full.size] = torch.from_numpy(full.astype(np.int32))
        r.length = full.size
        r.protected = self.round_up(max(n_shared, r.prompt_len))
        r.frontier, r.pos_offset, r.compressions = r.protected, 0, 0
        r.exp = torch.zeros(self.L, self.cap, self.H, dtype=torch.int64)
        r.exp[:, : r.length, :] = torch.tensor(r.uids, dtype=torch.int64).view(1, -1, 1)
        r.prefix_slots = full[: min(r.length, r.protected)].tolist()
        self.running.append(r)
        return True

    def entry_alive(self, e: Entry):
        while e is not None:
            yield e.eid in self.tree
            e = e.parent

    def op_admit(self):
        rng = self.rng
        entry, n_shared, prefix_uids = None, 0, []
        if self.tree and rng.random() < 0.7:
            entries = list(self.tree.values())
            entry = entries[int(rng.integers(len(entries)))]
            full = entry.full_slots.size
            most = (
                min(full, self.cap // 2) // self.page
            )  # prompts stay well below the row capacity
            n_shared = int(rng.integers(1, most + 1)) * self.page
            prefix_uids = entry.full_uids[:n_shared].tolist()
        rid = self.next_rid
        self.next_rid += 1
        own = int(rng.integers(1, 49))
        prompt = n_shared + own
        max_logical = int(rng.integers(min(prompt + 8, self.cap), self.cap + 1))
        uids = prefix_uids + [(rid << POS_BITS) | p for p in range(n_shared, prompt)]
        r = Req(rid, prompt, max_logical, uids)
        if not self.place(r, entry, n_shared):
            self.counts["admit_oom"] += 1
            self.log.append(
                f"admit rid={rid} prompt={prompt} shared={n_shared}: out of memory"
            )
            return
        self.counts["admit"] += 1
        self.counts["admit_shared"] += entry is not None
        msg = f"admit rid={rid} row={r.row} prompt={prompt} shared={n_shared} P={r.protected}"
        # insert the page-aligned part of the prompt into the tree (request keeps a ref)
        end = prompt // self.page * self.page
        if end > n_shared and rng.random() < 0.5:
            full = self.row_np(r)[:end]
            child = Entry(
                self.next_eid,
                entry,
                full.copy(),
                np.asarray(r.uids[:end], np.int64),
                n_shared,
                refs=1,
            )
            self.next_eid += 1
            # the request's ref on `entry` becomes the child's
            self.tree[child.eid] = child
            r.entry, r.n_shared = child, end
            self.counts["tree_insert"] += 1
            msg += f" -> tree entry {child.eid} rows [{n_shared},{end})"
        self.log.append(msg)

    def op_readmit(self):
        r = self.waiting.pop(int(self.rng.integers(len(self.waiting))))
        entry, n_shared = r.entry, r.n_shared
        if entry is None or not all(self.entry_alive(entry)):
            entry, n_shared = None, 0
        if not self.place(r, entry, n_shared):
            self.waiting.append(r)
            self.counts["readmit_oom"] += 1
            self.log.append(f"readmit rid={r.rid}: out of memory")
            return
        self.counts["readmit"] += 1
        self.log.append(
            f"readmit rid={r.rid} row={r.row} len={r.length} shared={n_shared} P={r.protected}"
        )

    def release(self, r: Req):
        """Free the request's own slots (every page past its shared prefix), drop its tree ref."""
        own = self.req_to_token[r.row, r.n_shared : r.length].to(torch.int64)
        self.alloc.free(own)
        if r.entry is not None:
            r.entry.refs -= 1
        self.running.remove(r)
        self.free_rows.append(r.row)
        r.row = -1

    def op_retract(self, r: Req | None = None, why="retract"):
        r = r or self.running[int(self.rng.integers(len(self.running)))]
        self.log.append(f"{why} rid={r.rid} len={r.length} logical={len(r.uids)}")
        self.release(r)
        self.waiting.append(r)
        self.counts["retract"] += 1

    def op_finish(self, r: Req | None = None, why="finish"):
        r = r or self.running[int(self.rng.integers(len(self.running)))]
        self.log.append(f"{why} rid={r.rid} len={r.length} logical={len(r.uids)}")
        self.release(r)
        self.counts["finish"] += 1

    def op_evict(self):
        n = self.evict(int(self.rng.integers(1, 4)))
        self.counts["evict"] += 1
        self.counts["evicted_entries"] += n
        self.log.append(f"evict {n} entries")

    def op_decode(self):
        rng = self.rng
        reqs = [r for r in self.running if rng.random() < 0.6] or [
            self.running[int(rng.integers(len(self.running)))]
        ]
        self.counts["decode"] += 1
        for r in reqs:
            if r.row < 0:
                continue  # retracted earlier in this step
            pos = len(r.uids)
            L = r.length
            if self.page == 1 or L % self.page == 0:
                got = self.alloc_or_evict(self.page)
                if got is None:
                    self.counts["decode_oom"] += 1
                    self.op_retract(r, why="retract (decode out of memory)")
                    continue
                slot = int(got[0])
            else:
                slot = int(self.req_to_token[r.row, L - 1]) + 1
            if slot % self.page != L % self.page:
                self.fail(
                    f"decode slot {slot} for row pos {L} breaks the page invariant"
                )
            uid = (r.rid << POS_BITS) | pos
            self.write_tokens(np.array([slot]), np.array([uid]))
            self.req_to_token[r.row, L] = slot
            r.uids.append(uid)
            r.exp[:, L, :] = uid
            r.length += 1
            if L < r.protected:
                r.prefix_slots.append(slot)
            self.counts["decode_tokens"] += 1
            if len(r.uids) >= r.max_logical:
                self.op_finish(r, why="finish (max tokens)")

    # ------------------------------------------------------------------ compression
    def compress_candidates(self):
        """Requests whose row reached P, with the rows available at their frontier."""
        return [
            (r, r.length - r.frontier) for r in self.running if r.length >= r.protected
        ]

    def op_compress(self, force_oom=False, fault=None):
        """fault: None, "bad_kept" (an index == M: bad input), "kernel" (a kernel raises after
        writing): compact_rows must raise and change nothing; or "after_copy" (the kept K/V sit in
        fresh slots, then the event fails before its commit: the policy's re-layout, the eviction
        record or the commit itself raised): the prepared compaction is aborted and nothing a
        request owns changed, the fresh slots are free again."""
        rng = self.rng
        cands = [(r, a) for r, a in self.compress_candidates() if a >= 2]
        if not cands:
            return False
        snapkv = rng.random() < 0.15
        if snapkv:
            # SnapKV shape: region [P, L - w) with L - w >= f, M > K.
            opts = [r for r, _ in cands if r.length - r.protected >= 3]
            if not opts:
                return False
            r = opts[int(rng.integers(len(opts)))]
            w = int(
                rng.integers(
                    1, min(r.length - r.frontier, r.length - r.protected - 2) + 1
                )
            )
            M = r.length - w - r.protected
            K = int(rng.integers(1, M))
            group, starts, W, U = [r], [r.protected], None, None
        else:
            top = max(a for _, a in cands)
            hi = min(top, self.max_window)
            W = hi if rng.random() < 0.3 else int(rng.integers(2, hi + 1))
            U = (
                int(rng.integers(0, W))
                if rng.random() < 0.3
                else int(rng.integers(0, min(W, 4)))
            )
            M = W - U
            K = M if M == 1 or rng.random() < 0.1 else int(rng.integers(1, M))
            elig = [r for r, a in cands if a >= W]
            rng.shuffle(elig)
            group = elig[: int(rng.integers(1, min(len(elig), 4) + 1))]
            starts = [r.frontier for r in group]
        B = len(group)
        kept = np.sort(
            np.argsort(rng.random((B, self.L, self.H, M)), axis=-1)[..., :K], axis=-1
        )
        if fault == "bad_kept":
            kept = kept.copy()
            kept[
                int(rng.integers(B)),
                int(rng.integers(self.L)),
                int(rng.integers(self.H)),
                -1,
            ] = M
        plan = CompactionPlan(
            rows=torch.tensor([r.row for r in group], dtype=torch.int64),
            starts=list(starts),
            lengths=[r.length for r in group],
            region=M,
            kept=torch.from_numpy(kept.astype(np.int64)),
        )
        evict_retry = rng.random() < 0.5
        if force_oom:
            self.alloc.fail_next = 1 + int(
                evict_retry
            )  # the retry after eviction fails too
        desc = (
            f"compress {'snapkv ' if snapkv else ''}rids={[r.rid for r in group]} rows={[r.row for r in group]} "
            f"starts={starts} lengths={plan.lengths} W={W} U={U} M={M} K={K} "
            f"evict_retry={evict_retry} force_oom={force_oom} fault={fault}"
        )
        self.log.append(desc)

        rtt0, kv0, free0 = (
            self.req_to_token.clone(),
            self.kv.clone(),
            self.alloc.is_free.copy(),
        )
        self.evicted_now = []
        alloc = self.alloc_or_evict if evict_retry else self.alloc.alloc
        inject = nullcontext()
        if fault == "kernel":
            name = (
                "copy_slots" if self.page > 1 and rng.random() < 0.5 else "compact_kv"
            )
            real = getattr(compaction_mod, name)

            def broken(*args, **kwargs):
                real(*args, **kwargs)  # the kernel writes, then the launch "fails"
                raise RuntimeError(f"injected {name} fault")

            inject = mock.patch.object(compaction_mod, name, broken)
        try:
            with inject:
                if fault == "after_copy":
                    prepared = prepare_compaction(
                        plan,
                        self.req_to_token,
                        self.k_bufs,
                        self.v_bufs,
                        alloc,
                        self.alloc.free_page_ids,
                        page_size=self.page,
                        use_triton=self.use_triton,
                    )
                    # ``fresh`` names pages (a slot each at page size 1)
                    if prepared.fresh.numel() and bool(
                        self.alloc.is_free[prepared.fresh.numpy()].any()
                    ):
                        self.fail(
                            "prepare_compaction handed out fresh slots that are still free"
                        )
                    prepared.abort(self.alloc.free_page_ids)
                    with pytest.raises(AssertionError, match="twice"):
                        prepared.commit(self.req_to_token, self.alloc.free_page_ids)
                    raise RuntimeError("injected fault after the K/V copy")
                d = compact_rows(
                    plan,
                    self.req_to_token,
                    self.k_bufs,
                    self.v_bufs,
                    alloc,
                    self.alloc.free_page_ids,
                    page_size=self.page,
                    use_triton=self.use_triton,
                )
        except OutOfSlots:
            self.alloc.fail_next = 0
            self.check_unchanged_after_oom(rtt0, kv0, free0, plan, force_oom)
            self.counts["oom_forced" if force_oom else "oom_natural"] += 1
            self.log[-1] += " -> OutOfSlots"
            return True
        except FuzzFailure:
            raise
        except Exception as e:  # noqa: BLE001
            if fault is None:
                self.fail(f"compact_rows raised {type(e).__name__}: {e}")
            self.check_unchanged_after_oom(
                rtt0, kv0, free0, plan, True, what=f"{type(e).__name__} ({fault})"
            )
            self.counts[f"fault_{fault}"] += 1
            self.log[-1] += f" -> {type(e).__name__}"
            return True
        if force_oom or fault:
            self.fail(
                f"compact_rows succeeded despite force_oom={force_oom} fault={fault}"
            )
        if d != M - K:
            self.fail(f"compact_rows returned d={d}, expected M-K={M - K}")
        self.check_rewrite(rtt0, plan, group, K)
        for r, a, b in zip(group, starts, range(B)):
            self.model_compress(r, a, M, K, torch.from_numpy(kept[b]))
        self.counts["compress"] += 1
        self.counts["compress_batched"] += B > 1
        self.counts["compress_identity"] += K == M
        self.counts["compress_snapkv"] += snapkv
        self.counts["compress_evict_retry"] += evict_retry
        self.counts["compress_evicted"] += bool(self.evicted_now)
        self.counts["compress_requests"] += B
        self.counts["region_rows"] += B * M
        self.counts["dropped_rows"] += B * d
        if self.page > 1:
            self.counts["compress_unaligned_start"] += sum(
                a % self.page != 0 for a in starts
            )
        self.log[-1] += f" -> d={d}"
        return True

    def model_compress(self, r: Req, a: int, M: int, K: int, kept: torch.Tensor):
        """The model: per (layer, head) keep kept[l, h] of rows [a, a+M), shift the tail down."""
        d, L = M - K, r.length
        region = r.exp[:, a : a + M, :].clone()
        r.exp[:, a : a + K, :] = torch.gather(region, 1, kept.permute(0, 2, 1))
        r.exp[:, a + K : L - d, :] = r.exp[:, a + M : L, :].clone()
        r.length -= d
        r.pos_offset += d
        r.frontier = a + K
        r.compressions += 1

    def check_unchanged_after_oom(
        self, rtt0, kv0, free0, plan, forced, what="OutOfSlots"
    ):
        if not torch.equal(rtt0, self.req_to_token):
            self.fail(f"{what} but req_to_token changed")
        evicted = np.zeros_like(free0)
        for own in self.evicted_now:
            evicted[np.unique(own // self.page)] = True
        if not np.array_equal(self.alloc.is_free, free0 | evicted):
            self.fail(
                f"{what} but the free list changed (beyond tree eviction): "
                f"{int((self.alloc.is_free != (free0 | evicted)).sum())} pages differ"
            )
        live = torch.from_numpy(
            np.flatnonzero(~np.repeat(self.alloc.is_free, self.page))
        )
        if not torch.equal(kv0.index_select(2, live), self.kv.index_select(2, live)):
            self.fail(f"{what} but K/V of live slots changed")
        if not forced:  # a natural failure must be real
            need = (
                sum(
                    self.round_up(layer_id - plan.dropped - (a - a % self.page))
                    for a, layer_id in zip(plan.starts, plan.lengths)
                )
                if self.page > 1
                else len(plan.starts) * plan.keep
            )
            if self.alloc.available_pages() * self.page >= need:
                self.fail(
                    f"OutOfSlots with {self.alloc.available_pages()} free pages for {need} slots"
                )

    def check_rewrite(self, rtt0, plan, group, K):
        """Rows outside the plan untouched; rows below the rewritten part and entries past
        the old length untouched; at page 1 the tail keeps its slots (shifted, no copy)."""
        rows = set(plan.rows.tolist())
        for i in range(self.n_rows):
            if i not in rows and not torch.equal(rtt0[i], self.req_to_token[i]):
                self.fail(f"req_to_token row {i} (not in the plan) changed")
        M, d = plan.region, plan.dropped
        for r, a, L in zip(group, plan.starts, plan.lengths):
            old, new = rtt0[r.row], self.req_to_token[r.row]
            keep_below = a if self.page == 1 else a - a % self.page
            if not torch.equal(old[:keep_below], new[:keep_below]):
                self.fail(f"rid={r.rid}: rows below {keep_below} changed")
            if not torch.equal(old[L:], new[L:]):
                self.fail(f"rid={r.rid}: entries past the old length {L} changed")
            if self.page == 1 and not torch.equal(old[a + M : L], new[a + K : L - d]):
                self.fail(f"rid={r.rid}: tail slots not shifted down by d={d}")

    # ------------------------------------------------------------------ invariants
    def check(self):
        page, rtt = self.page, self.req_to_token.numpy()
        # 1. ownership: every page (but page 0) is exactly one of free / tree entry / request
        groups, names = [], []
        free_pages = np.flatnonzero(self.alloc.is_free)
        groups.append(free_pages)
        names.append("free")
        for e in self.tree.values():
            own = e.full_slots[e.own_start :]
            if own.size % page or (page > 1 and (own[::page] % page).any()):
                self.fail(f"tree entry {e.eid} does not own whole pages")
            groups.append(np.unique(own // page))
            names.append(f"tree entry {e.eid}")
            if e.refs < 0:
                self.fail(f"tree entry {e.eid} refcount {e.refs}")
        for r in self.running:
            row = rtt[r.row, : r.length].astype(np.int64)
            if page > 1:
                pos = np.arange(r.length)
                if ((row % page) != (pos % page)).any():
                    self.fail(
                        f"rid={r.rid}: slot offset in page != row position mod page: {row.tolist()}"
                    )
                pg = row // page
                if (pg[1:][pos[1:] % page != 0] != pg[:-1][pos[1:] % page != 0]).any():
                    self.fail(
                        f"rid={r.rid}: a row page spans two pool pages: {row.tolist()}"
                    )
            own = row[r.n_shared :]
            if np.unique(own).size != own.size:
                self.fail(
                    f"rid={r.rid}: a slot appears twice in its row: {row.tolist()}"
                )
            groups.append(np.unique(own // page))
            names.append(f"rid={r.rid}")
        allp = np.concatenate(groups)
        uniq, cnt = np.unique(allp, return_counts=True)
        if (cnt > 1).any() or (uniq == 0).any():
            bad = uniq[(cnt > 1) | (uniq == 0)][:5]
            owners = {int(p): [n for n, g in zip(names, groups) if p in g] for p in bad}
            self.fail(
                f"pages with more than one owner (or page 0 handed out): {owners}"
            )
        if uniq.size != self.num_pages - 1:
            lost = np.setdiff1d(np.arange(1, self.num_pages), uniq)[:10]
            self.fail(
                f"slots not conserved: {self.num_pages - 1 - uniq.size} pages neither free nor owned, e.g. {lost.tolist()}"
            )
        # 2. per-request structure and the content model
        slot_parts, uid_parts = [], []
        for r in self.running:
            row = rtt[r.row, : r.length].astype(np.int64)
            logical = len(r.uids)
            if logical != r.length + r.pos_offset:
                self.fail(
                    f"rid={r.rid}: logical {logical} != physical {r.length} + offset {r.pos_offset}"
                )
            if r.n_shared:
                if not all(self.entry_alive(r.entry)):
                    self.fail(f"rid={r.rid}: shares an evicted tree entry")
                if not np.array_equal(
                    row[: r.n_shared], r.entry.full_slots[: r.n_shared]
                ):
                    self.fail(
                        f"rid={r.rid}: shared prefix slots differ from the tree's"
                    )
            pfx = min(r.length, r.protected)
            if (
                not np.array_equal(
                    row[:pfx], np.asarray(r.prefix_slots[:pfx], np.int64)
                )
                or len(r.prefix_slots) != pfx
            ):
                self.fail(f"rid={r.rid}: protected prefix slots changed")
            exp = r.exp[:, : r.length, :]
            pos = exp & ((1 << POS_BITS) - 1)
            rows = torch.arange(r.length).view(1, -1, 1)
            f = min(r.frontier, r.length)
            if not torch.equal(pos[:, :pfx], rows[:, :pfx].expand_as(pos[:, :pfx])):
                self.fail(f"rid={r.rid}: model: prefix positions")
            tail_uids = torch.tensor(r.uids[f + r.pos_offset :], dtype=torch.int64)
            if not torch.equal(
                exp[:, f:], tail_uids.view(1, -1, 1).expand_as(exp[:, f:])
            ):
                self.fail(
                    f"rid={r.rid}: model: tail is not tokens [f + offset, logical)"
                )
            mid = pos[:, pfx:f]
            if mid.shape[1] and (
                (mid[:, 1:] <= mid[:, :-1]).any()
                or (mid < r.protected).any()
                or (mid >= f + r.pos_offset).any()
            ):
                self.fail(
                    f"rid={r.rid}: model: kept positions not increasing in [P, f + offset)"
                )
            slot_parts.append(torch.from_numpy(row))
            uid_parts.append(exp)
        for e in self.tree.values():
            own = e.full_slots[e.own_start :]
            slot_parts.append(torch.from_numpy(own))
            uid_parts.append(
                torch.from_numpy(e.full_uids[e.own_start :])
                .view(1, -1, 1)
                .expand(self.L, -1, self.H)
            )
        if slot_parts:
            slots, uids = torch.cat(slot_parts), torch.cat(uid_parts, dim=1)
            got, want = self.kv.index_select(2, slots), self.tags(uids)
            if not torch.equal(got, want):
                self.fail(self.describe_mismatch(got, want, slots))
        # 3. free pages hold the poison written when they were freed: nothing wrote there
        if free_pages.size:
            fs = torch.from_numpy(
                (free_pages[:, None] * page + np.arange(page)).reshape(-1)
            )
            if not bool((self.kv.index_select(2, fs) == POISON).all()):
                self.fail("a free slot was written after it was freed")

    def describe_mismatch(self, got, want, slots):
        bad = (got != want).any(-1).any(-1)  # [2, L, n]
        kv, layer_id, n = [int(x) for x in bad.nonzero()[0]]
        owner = "tree"
        off = 0
        for r in self.running:
            if n < off + r.length:
                owner = f"rid={r.rid} row pos {n - off}"
                break
            off += r.length
        g = int(got[kv, layer_id, n, 0, 0])
        w = int(want[kv, layer_id, n, 0, 0])
        return (
            f"K/V content mismatch ({'kv'[kv]}, layer {layer_id}, {owner}, slot {int(slots[n])}): "
            f"got tag {g} (token {g // (self.D * 2 * self.H * self.L)}), expected {w} "
            f"(token {w // (self.D * 2 * self.H * self.L)}); {int(bad.sum())} rows differ"
        )

    # ------------------------------------------------------------------ driver
    def step(self):
        rng = self.rng
        can_compress = any(a >= 2 for _, a in self.compress_candidates())
        w = {
            "admit": 1.5
            if len(self.running) < self.max_reqs and self.free_rows
            else 0.0,
            "readmit": 1.0
            if self.waiting and len(self.running) < self.max_reqs and self.free_rows
            else 0.0,
            "decode": 6.0 if self.running else 0.0,
            "compress": 2.0 if can_compress else 0.0,
            "oom": 0.3 if can_compress else 0.0,
            "fault": 0.3 if can_compress else 0.0,
            "retract": 0.3 if self.running else 0.0,
            "finish": 0.4 if self.running else 0.0,
            "evict": 0.5 if any(e.refs == 0 for e in self.tree.values()) else 0.0,
        }
        for k, v in self.weights.items():
            w[k] = v if w[k] else 0.0
        kinds = list(w)
        p = np.array([w[k] for k in kinds])
        kind = kinds[int(rng.choice(len(kinds), p=p / p.sum()))]
        if kind == "compress":
            self.op_compress()
        elif kind == "oom":
            self.op_compress(force_oom=True)
        elif kind == "fault":
            self.op_compress(
                fault=("bad_kept", "kernel", "after_copy")[int(rng.integers(3))]
            )
        else:
            getattr(self, f"op_{kind}")()
        self.counts["ops"] += 1
        self.check()


def run_episode(
    seed: int, page: int, n_ops: int, use_triton=False, weights=None, small=False
) -> collections.Counter:
    world = World(seed, page, use_triton=use_triton, weights=weights, small=small)
    world.check()
    for _ in range(n_ops):
        world.step()
    # drain: every request leaves, the tree is evicted, the whole pool is free again
    for r in list(world.running):
        world.op_finish(r, why="drain")
    world.evict()
    world.check()
    if world.tree or world.alloc.available_pages() != world.num_pages - 1:
        world.fail(
            f"pool not whole after draining: {world.alloc.available_pages()} of {world.num_pages - 1} pages free"
        )
    return world.counts


def run_fuzz(page: int, total_ops: int, base_seed: int):
    counts = collections.Counter()
    tic = time.perf_counter()
    episodes = 0
    done = 0
    while done < total_ops:
        n = min(EPISODE_OPS, total_ops - done)
        counts += run_episode(base_seed * 1_000_003 + page * 7919 + episodes, page, n)
        done += n
        episodes += 1
    return counts, episodes, time.perf_counter() - tic


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("page", [1, 16])
def test_compaction_fuzz(page, record_property):
    counts, episodes, seconds = run_fuzz(page, OPS, BASE_SEED)
    summary = {
        "page_size": page,
        "ops": OPS,
        "base_seed": BASE_SEED,
        "episodes": episodes,
        "seconds": round(seconds, 2),
        "counts": dict(sorted(counts.items())),
    }
    print(f"\ncompaction fuzz: {json.dumps(summary)}")
    record_property("compaction_fuzz", summary)
    if REPORT:
        with open(REPORT, "a") as fh:
            fh.write(json.dumps(summary) + "\n")
    assert counts["ops"] == OPS
    least = max(3, OPS // 1000)
    missing = {k: counts[k] for k in MUST_RUN if counts[k] < least}
    assert not missing, (
        f"fuzz degenerated: these kinds ran fewer than {least} times: {missing}"
    )
    if page > 1:
        assert counts["compress_unaligned_start"] >= least


@pytest.mark.parametrize("page", [1, 16])
def test_compaction_fuzz_triton_kernels(page):
    """A short episode with use_triton=None, i.e. through the Triton kernels in the CPU
    interpreter (the world's tensors live on the CPU, so this needs TRITON_INTERPRET=1, which
    tests/conftest.py sets on machines without CUDA)."""
    from sgl_kara.kernels._dispatch import want_triton

    if not want_triton(None, torch.zeros(1)):
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    counts = run_episode(
        1234 + page,
        page,
        60,
        use_triton=None,
        small=True,
        weights={"compress": 6.0, "oom": 0.5, "fault": 0.5, "admit": 3.0},
    )
    print(
        f"\ncompaction fuzz (triton, page {page}): {json.dumps(dict(sorted(counts.items())))}"
    )
    assert counts["compress"] >= 5, dict(counts)


def test_fuzz_detects_a_broken_compaction(monkeypatch):
    """The checks are live: a compaction that forgets to free the old region is caught."""
    import sgl_kara.mem_cache.compaction as compaction

    real = compaction.compact_rows

    def leaky(
        plan,
        req_to_token,
        k_buffers,
        v_buffers,
        alloc,
        free_pages,
        page_size=1,
        use_triton=None,
    ):
        return real(
            plan,
            req_to_token,
            k_buffers,
            v_buffers,
            alloc,
            lambda slots: None,
            page_size,
            use_triton,
        )

    monkeypatch.setitem(globals(), "compact_rows", leaky)
    with pytest.raises(FuzzFailure, match="not conserved"):
        run_episode(5, 1, 400)
