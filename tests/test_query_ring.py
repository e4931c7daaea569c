"""QueryRing (sgl_kara/scheduler/ring.py) on its own: rows handed out last-in first-out, the
integrity check, poisoned buffers in integrity mode, and -- on Linux CPU -- resident memory that
follows the rows written rather than the rows allocated (a 32-row ring where at most 11
requests ran). The engine-level guarantee that no unwritten query is ever read is the oracle
tests' (test_oracle.py: capture runs in integrity mode, i.e. on a NaN-poisoned ring, match the
masked HF forward)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from support import FakeReq

from sgl_kara.scheduler.ring import QueryRing, make_ring


def test_rows_are_reused_last_in_first_out():
    ring = QueryRing(
        {0: (2, 4)}, rows=3, capacity=8, req_slots=6, dtype=torch.float32, device="cpu"
    )
    a, b, c, d = (FakeReq(i) for i in range(4))
    assert (
        ring.assign(a, a.kv.req_pool_idx)
        and ring.assign(b, b.kv.req_pool_idx)
        and ring.assign(c, c.kv.req_pool_idx)
    )
    assert not ring.assign(d, d.kv.req_pool_idx)  # every row held
    ring.check()
    rows = {
        r.kv.req_pool_idx: int(ring.rows_for(torch.tensor([r.kv.req_pool_idx])))
        for r in (a, b, c)
    }
    assert sorted(rows.values()) == [0, 1, 2] and rows[0] == 0
    ring.sweep({0, 2})  # b left the batch: its row is the next one handed out
    assert (
        ring.assign(d, d.kv.req_pool_idx)
        and int(ring.rows_for(torch.tensor([3]))) == rows[1]
    )
    ring.check()
    assert (
        int(ring.rows_for(torch.tensor([1]))) == 3
    )  # b's slot points at the trash row


def test_poisoned_ring_is_nan_until_written():
    ring = QueryRing(
        {0: (2, 4), 1: (2, 4)},
        rows=2,
        capacity=8,
        req_slots=4,
        dtype=torch.float32,
        device="cpu",
        poison=True,
    )
    assert all(torch.isnan(b).all() for b in ring.buffers.values())
    ring.assign(FakeReq(0), 0)
    q = torch.randn(3, 2, 4)
    rows = ring.rows_for(torch.tensor([0, 0, 0]))
    ring.write(0, q, rows, torch.tensor([5, 6, 7]))
    assert torch.equal(
        ring.read(0, ring.rows_for(torch.tensor([0])), torch.tensor([5]), 3)[0], q
    )
    assert torch.isnan(
        ring.read(0, ring.rows_for(torch.tensor([0])), torch.tensor([2]), 3)
    ).all()  # never written


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/statm"
)
def test_resident_memory_follows_the_rows_written():
    """An 8-row ring of 64 MB per row (one layer; well above glibc's mmap threshold, so its pages
    come from the kernel untouched): allocating it makes almost nothing resident, and writing two
    rows' queries makes about two rows resident."""
    capacity, hq, d = 2048, 64, 128  # 2,048 x 64 x 128 x 4 B = 64 MiB per row
    row_bytes = capacity * hq * d * 4
    before = _rss()
    ring = QueryRing(
        {0: (hq, d)},
        rows=8,
        capacity=capacity,
        req_slots=8,
        dtype=torch.float32,
        device="cpu",
    )
    allocated = _rss() - before
    assert ring.nbytes == 9 * row_bytes
    assert allocated < row_bytes / 4, (allocated, row_bytes)
    q = torch.ones(256, hq, d)
    for slot in (0, 1):
        ring.assign(FakeReq(slot), slot)
        rows = ring.rows_for(torch.full((256,), slot))
        for start in range(0, capacity, 256):
            ring.write(0, q, rows, torch.arange(start, start + 256))
    written = _rss() - before - q.numel() * 4
    assert 1.8 * row_bytes < written < 3 * row_bytes, written / row_bytes


@pytest.mark.parametrize(
    "running,pool,limit", [(8, 8192, 0), (64, 1000, 0), (8, 8192, 3)]
)
def test_start_up_plan_and_allocated_ring_agree(
    tiny_llama, monkeypatch, running, pool, limit
):
    """The memory plan the CPU kit checks at start-up (rows and bytes of the ring)
    is the ring the scheduler allocates (scheduler/ring.py make_ring over the model's attention layers),
    and both are (rows + 1) x capacity x layers x H_q x D x 4 bytes with rows = the request limit,
    bounded by the pool's requests of ``capacity`` tokens and by --kara-query-ring-rows."""
    from sgl_kara import startup as support
    from sgl_kara._sglang import RadixAttention
    from sgl_kara.config import KaraConfig
    from sgl_kara.cpu import server as cpu_server
    from sgl_kara.model_shape import ModelShape
    from sgl_kara.server_setup import prepare

    shape = ModelShape.from_model_path(tiny_llama)
    cfg = KaraConfig(policy="kara", query_source="capture", query_ring_rows=limit)
    args = types.SimpleNamespace(
        model_path=tiny_llama,
        device="cpu",
        dtype="float32",
        max_running_requests=running,
        max_total_tokens=pool,
        radix_cache_backend=None,
        disable_overlap_schedule=False,
        disable_cuda_graph=False,
        chunked_prefill_size=None,
        dp_size=1,
        tp_size=1,
        pp_size=1,
    )
    plan = {}

    def spy(*a, **kw):
        plan["rows"], plan["sizes"] = a[3], real(*a, **kw)
        return plan["sizes"]

    real = cpu_server.check_cpu_fit
    monkeypatch.setattr(cpu_server, "check_cpu_fit", spy)
    monkeypatch.setattr(cpu_server, "available_ram_bytes", lambda: 1 << 40)
    monkeypatch.setattr(support, "available_ram_bytes", lambda: 1 << 40)
    resolved = prepare(args, cfg)

    # the scheduler side, on a model of the same shape (SGLang's own attention layers, read as
    # the adapter reads them)
    from sgl_kara import _sglang as adapter

    model = torch.nn.ModuleList(
        RadixAttention(shape.q_heads, shape.head_dim, 1.0, shape.kv_heads, layer_id=i)
        for i in range(shape.layers)
    )
    parts = types.SimpleNamespace(
        max_running=running,
        pool_tokens=pool,
        dtype=torch.float32,
        server_args=args,
        layer_ids=adapter.attention_layers(model),
        q_heads=shape.q_heads,
        head_dim=shape.head_dim,
        req_to_token=torch.zeros(running + 1, 8, dtype=torch.int32),
    )
    capacity = resolved.make_policy().schedule.query_capacity()
    ring = make_ring(parts, resolved, capacity)

    rows = min(running, -(-pool // capacity))
    rows = min(rows, limit) if limit else rows
    assert capacity == resolved.query_ring_capacity > 0
    assert ring.rows == plan["rows"] == rows
    assert (
        ring.nbytes
        == plan["sizes"]["capture_ring"]
        == (rows + 1) * capacity * shape.layers * shape.q_heads * shape.head_dim * 4
    )
