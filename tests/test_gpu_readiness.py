"""What SGLang's GPU paths need of the runtime, checked on CPU: the recompute pass writes no K/V
even when the model writes the cache inside RoPE, decode observers turn decode CUDA graphs off and
sync nothing, a KV cache dtype other than the model's scores correctly, events keep up with any
number of running requests, and the start-up warm-up compiles what the first event launches."""

from __future__ import annotations

import types

import pytest
import torch
from kernel_launches import Allocator, Launches, Pool

from sgl_kara import startup as support
from sgl_kara.config import KaraConfig
from sgl_kara.kernels.window_score import window_scores_paged, window_scores_paged_ref
from sgl_kara.policies.base import Region, RowView
from sgl_kara.policies.kara import KaraOptions, KaraPolicy
from sgl_kara.scheduler.forward import ForwardContext
from sgl_kara.scheduler.plan import Job
from sgl_kara.scheduler.staging import DeviceStaging
from sgl_kara.scheduler.state import KaraReqState, RequestTable

D, HQ, HKV, LAYERS = 16, 4, 2, 2  # tests/kernel_launches.Pool's defaults


def _request(pool_idx: int, length: int, prompt: int = 8):
    tokens = list(range(100, 100 + length))
    kv = types.SimpleNamespace(
        req_pool_idx=pool_idx, kv_committed_len=length, kv_allocated_len=length
    )
    req = _Req()
    req.origin_input_ids, req.output_ids = tokens[:prompt], tokens[prompt:]
    req.kv, req.rid = kv, str(pool_idx)
    return req


class _Req:
    """What the scheduler reads of an SGLang request (a class: Kara's table holds it weakly)."""


# ------------------------------------------------------------------ recompute pass: no K/V write
class FusedRopeModel:
    """A model runner whose rotary embedding (SGLang's own ``RotaryEmbedding``) is followed by a
    K/V write at ``forward_batch.out_cache_loc``, whatever ``save_kv_cache`` says: what SGLang's
    ``enable_fused_set_kv_buffer`` path does (CUDA with a bf16 pool; its fused kernel has no CPU
    build, so the write is this class's). It runs SGLang's real ``ForwardBatch``, built from the
    real recompute ``ScheduleBatch``, through the forward hooks; its attention records the slots
    it was shown."""

    def __init__(self, ctx: ForwardContext, pool: Pool):
        from sglang.srt.layers.rotary_embedding import get_rope

        from sgl_kara.cpu.hooks import apply_rope_shim

        apply_rope_shim()  # what the plugin does in a process without CUDA

        self.ctx, self.pool = ctx, pool
        self.rope = get_rope(D, rotary_dim=D, max_position=4096, base=10000)
        self.attention_saw: list[torch.Tensor] = []
        self.fused_wrote: list[torch.Tensor] = []
        self.batches: list = []

    def run_eager(self, batch, stop):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        self.batches.append(batch)
        fb = ForwardBatch(
            forward_mode=batch.forward_mode,
            batch_size=len(batch.reqs),
            input_ids=batch.input_ids,
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            out_cache_loc=batch.out_cache_loc,
            seq_lens_sum=batch.seq_lens_sum,
            positions=torch.zeros_like(batch.input_ids),
        )
        try:
            self.forward(batch, fb)
        except stop:
            pass

    def forward(self, batch, fb):
        self.ctx.on_forward_batch(batch, fb)
        self.positions = fb.positions.clone()
        n = fb.out_cache_loc.shape[0]
        g = torch.Generator().manual_seed(1)
        for lid in range(LAYERS):
            q = torch.randn(n, HQ * D, generator=g)
            k = torch.randn(n, HKV * D, generator=g)
            v = torch.randn(n, HKV, D, generator=g)
            q, k = self.rope(fb.positions, q, k)
            k = k.view(n, HKV, D)
            self.pool.k[lid][fb.out_cache_loc] = k  # the fused RoPE + set_kv_buffer
            self.pool.v[lid][fb.out_cache_loc] = v
            self.fused_wrote.append(fb.out_cache_loc.clone())
            layer = types.SimpleNamespace(layer_id=lid, tp_q_head_num=HQ, qk_head_dim=D)
            self.ctx.on_attention(self._attention, layer, q, k, v, fb, True)

    def _attention(self, layer, q, k, v, fb, save_kv_cache):
        self.attention_saw.append(fb.out_cache_loc.clone())
        if save_kv_cache:
            self.pool.k[layer.layer_id][fb.out_cache_loc] = k
        return q


@pytest.fixture(scope="module")
def sglang_context(tiny_llama):
    """SGLang's runtime context for a CPU server of the tiny Llama (ScheduleBatch.init_new and
    SamplingBatchInfo read it), as a scheduler process has it."""
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=tiny_llama,
        device="cpu",
        attention_backend="torch_native",
        page_size=1,
        dtype="float32",
    )
    with use_context(create_context(args, role="scheduler")) as context:
        yield context


def _real_request(row: int, length: int, prompt: int = 8):
    """An SGLang ``Req`` decoded to ``length`` tokens, in request row ``row``."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=1000, temperature=0)
    params.normalize(None)
    tokens = list(range(100, 100 + length))
    req = Req(f"r{row}", "", tokens[:prompt], params)
    req.output_ids = tokens[prompt:]
    req.kv.req_pool_idx, req.kv.kv_committed_len = row, length
    req.kv.kv_allocated_len = length
    return req


def _FakeRunnerHooks():
    """The hooked backend with the recompute forward handed to the fake model runner."""
    from sgl_kara.backends.hooked import Hooks

    class FakeRunnerHooks(Hooks):
        @staticmethod
        def run_eager(model_runner, batch, stop):
            model_runner.run_eager(batch, stop)

    return FakeRunnerHooks()


def test_recompute_pass_writes_no_kv_with_fused_rope_write(sglang_context):
    """SGLang's ScheduleBatch (init_new) and ForwardBatch over real requests: each layer's fused
    write lands in the padding slot; the window's K/V bytes (and every other real slot's) are
    unchanged; the attention itself still sees the window's real slots; positions are logical."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from sgl_kara.scheduler.scoring import Scorer
    from sgl_kara.scheduler.shared import StepShared

    pool = Pool()
    req_to_token = torch.zeros(4, 64, dtype=torch.int32)
    req_to_token[1] = torch.arange(1, 65)  # row 1: slots 1..64
    req_to_token[2] = torch.arange(101, 165)  # row 2: slots 101..164
    policy = KaraPolicy(KaraOptions(window=16, buffer=4, period=4))
    table = RequestTable()
    ctx = ForwardContext(
        policy, None, req_to_token, pool.get_key_buffer, 0, table, heads=(HQ, D)
    )
    mr = FusedRopeModel(ctx, pool)
    scheduler = types.SimpleNamespace(
        req_to_token_pool=types.SimpleNamespace(
            device="cpu", req_to_token=req_to_token
        ),
        token_to_kv_pool_allocator=None,
        tree_cache=None,
        model_config=types.SimpleNamespace(vocab_size=1000),
    )
    parts = types.SimpleNamespace(
        scheduler=scheduler,
        model_runner=mr,
        req_to_token=req_to_token,
        keys=pool.get_key_buffer,
        layer_ids=list(range(LAYERS)),
        recompute_tokens=8192,
    )
    jobs = []
    for i, (row, length) in enumerate(((1, 40), (2, 36))):
        req = _real_request(row, length)
        state = table.add(req, KaraReqState(protected=8, frontier=8, pos_offset=5 * i))
        jobs.append(Job(i, req, state, Region(8, 12, 3, 8, 16)))
    rows = torch.tensor([1, 2])
    region = req_to_token[rows[:, None], 8 + torch.arange(12)].to(torch.int64)
    before = [t.clone() for t in pool.k + pool.v]
    scorer = Scorer(
        StepShared(policy, parts, DeviceStaging("cpu"), backend=_FakeRunnerHooks()),
        ctx,
        None,
    )
    scores = scorer._recompute_scores(jobs, rows, region, [8, 8], 16)
    (batch,) = mr.batches
    assert isinstance(batch, ScheduleBatch) and batch.forward_mode.is_extend()
    assert batch.extend_lens == [16, 16] and batch.prefix_lens == [8, 8]
    assert batch.sampling_info.has_watermark_candidates is False
    assert scores.shape == (2, LAYERS, HKV, 12) and bool(torch.isfinite(scores).all())
    assert (
        len(mr.fused_wrote) == LAYERS
    )  # the last layer's rotary runs before ScoringComplete
    assert all(bool((w == 0).all()) for w in mr.fused_wrote), (
        "fused write not sent to the padding slot"
    )
    for t, b in zip(pool.k + pool.v, before):
        assert torch.equal(t[1:], b[1:]), "the recompute pass rewrote cached K/V"
    window = torch.cat([req_to_token[1, 8:24], req_to_token[2, 8:24]]).to(torch.int64)
    assert len(mr.attention_saw) == LAYERS - 1  # the last layer stops at its queries
    assert all(torch.equal(s, window) for s in mr.attention_saw)
    logical = torch.cat([torch.arange(8, 24), torch.arange(13, 29)])  # row + pos_offset
    assert torch.equal(mr.positions, logical)


# ------------------------------------------------------------------ decode observers
def _cuda_args(model, **kw):
    base = dict(
        model_path=model,
        device="cuda",
        dtype="bfloat16",
        max_running_requests=None,
        max_total_tokens=None,
        radix_cache_backend=None,
        disable_overlap_schedule=False,
        disable_cuda_graph=False,
        disable_decode_cuda_graph=False,
        kv_cache_dtype="auto",
    )
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "policy, graphs_off", [("h2o", True), ("kara", False), ("snapkv", False)]
)
def test_decode_observers_turn_decode_cuda_graphs_off(
    monkeypatch, tiny_llama, policy, graphs_off
):
    """A replayed decode graph never calls the attention hook, so H2O's observer would see nothing:
    its decode graphs are turned off (prefill graphs and the legacy switch left as they were);
    tests/test_gpu_resolution.py resolves every such configuration with SGLang itself."""
    monkeypatch.setattr(support, "cuda_available", lambda: False)
    monkeypatch.setattr(support, "device_memory_bytes", lambda device: None)
    args = _cuda_args(tiny_llama)
    cfg = support.prepare_server_args(
        args, KaraConfig.build(policy=policy, query_source="recompute")
    )
    assert cfg.query_source == "recompute"
    assert (
        args.disable_decode_cuda_graph is graphs_off
        and args.disable_cuda_graph is False
    )


def test_decode_observer_reads_rows_from_the_host():
    """The observer's rows and lengths come from the requests and the batch's CPU lengths: every
    device tensor of SGLang's real ScheduleBatch and ForwardBatch here is on the meta device,
    where a host read (.tolist(), int()) raises."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from sgl_kara.policies.h2o import H2OOptions, H2OPolicy

    req_to_token = torch.empty(8, 64, dtype=torch.int32, device="meta")
    table = RequestTable()
    ctx = ForwardContext(
        H2OPolicy(H2OOptions(threshold=40, budget=20)),
        None,
        req_to_token,
        None,
        0,
        table,
    )
    reqs = [_real_request(3, 20), _real_request(5, 30)]
    states = [table.add(r, KaraReqState()) for r in reqs]
    meta = dict(dtype=torch.int64, device="meta")
    batch = ScheduleBatch(
        reqs=reqs,
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=torch.empty(2, **meta),
        seq_lens=torch.empty(2, **meta),
        seq_lens_cpu=torch.tensor([21, 31]),
    )
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=2,
        input_ids=torch.empty(2, **meta),
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        out_cache_loc=torch.empty(2, **meta),
        seq_lens_sum=52,
        positions=torch.empty(2, **meta),
    )
    ctx.on_forward_batch(batch, fb)
    slots, seen = ctx.observed
    assert [s.shape[0] for s in slots] == [21, 31] and seen == states


# ------------------------------------------------------------------ KV cache dtype != model dtype
MIXED = [
    (torch.bfloat16, torch.float16),
    (torch.float16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("q_dtype, k_dtype", MIXED)
@pytest.mark.parametrize("use_triton", [True, False])
def test_scores_with_a_kv_dtype_other_than_the_model_dtype(
    q_dtype, k_dtype, use_triton
):
    """Kernel (interpreted) and torch reference against an fp32 reference of the same values."""
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(2, 24, 8, 32, generator=g) * 2).to(q_dtype)
    kb = (torch.randn(80, 2, 32, generator=g) * 2).to(k_dtype)
    slots = torch.stack([torch.randperm(80, generator=g)[:20] for _ in range(2)])
    want = window_scores_paged_ref(q.float(), kb.float(), slots)
    got = window_scores_paged(q, kb, slots, use_triton=use_triton)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_every_policy_scores_and_observes_with_mixed_dtypes():
    """Each policy's score (and H2O's observe) with bf16 queries against an fp16 key pool."""
    from sgl_kara.policies.base import ObserveInput, ScoreInput, policies

    g = torch.Generator().manual_seed(4)
    kb = torch.randn(64, 2, 32, generator=g).to(torch.float16)
    q = torch.randn(1, 8, 4, 32, generator=g).to(torch.bfloat16)
    slots = torch.arange(10, 50).view(1, 40)
    for cls in policies():
        policy = cls(cls.Options())
        state = KaraReqState(protected=0, frontier=0)
        row = types.SimpleNamespace(state=state, pos_offset=0)
        if cls.observes_decode:
            policy.observe(
                ObserveInput(0, q[0, :1].reshape(1, 4, 32), kb, [slots[0]], [state])
            )
        inp = ScoreInput(
            0,
            q if cls.needs_queries else None,
            kb,
            slots,
            [row],
            [Region(0, 40, 10, 40, 8)],
        )
        s = policy.score(inp)
        assert s.shape == (1, 2, 40) and bool(torch.isfinite(s).all()), cls.name


def test_kv_cache_dtype_other_than_the_model_dtype_is_accepted(monkeypatch, tiny_llama):
    monkeypatch.setattr(support, "cuda_available", lambda: False)
    monkeypatch.setattr(support, "device_memory_bytes", lambda device: None)
    for kv in ("float16", "bfloat16", "float32"):
        support.prepare_server_args(
            _cuda_args(tiny_llama, kv_cache_dtype=kv), KaraConfig()
        )
    with pytest.raises(support.UnsupportedFeature, match="--kv-cache-dtype"):
        support.prepare_server_args(
            _cuda_args(tiny_llama, kv_cache_dtype="fp8_e4m3"), KaraConfig()
        )


# ------------------------------------------------------------------ warm-up compiles what events launch
def _event_launches(policy, pool, q_dtype, page: int, tails: list[int], prompt: int):
    """What one event launches for rows of these lengths: queries read from a capture ring, scores
    per layer (all rows at once, and one by one as a recompute split would), one compaction."""
    from sgl_kara.mem_cache.compaction import CompactionPlan, compact_rows
    from sgl_kara.scheduler.ring import QueryRing
    from sgl_kara.scheduler.scoring import ScoringPass

    protected = -(-prompt // page) * page
    lengths = [protected + t for t in tails]
    alloc = Allocator(pool.k[0].shape[0], page)
    alloc.alloc(
        3 * page
    )  # an odd offset into the free list, as after earlier allocations
    req_to_token = torch.zeros(len(lengths) + 1, 192, dtype=torch.int32)
    for i, n in enumerate(lengths):
        need = -(-n // page) * page
        req_to_token[i + 1, :need] = alloc.alloc(need).to(torch.int32)
    state = KaraReqState(protected=protected, frontier=protected)
    regions = [
        policy.region(RowView(protected, protected, n, 0, state)) for n in lengths
    ]
    groups: dict = {}
    for i, r in enumerate(regions):
        groups.setdefault(r.shape, []).append(i)
    ring = QueryRing(
        {layer: (HQ, D) for layer in range(LAYERS)}, 4, 256, 8, q_dtype, "cpu"
    )
    for buf in ring.buffers.values():
        buf.normal_()
    for idx in groups.values():
        rows = torch.tensor([i + 1 for i in idx])
        regs = [regions[i] for i in idx]
        M = regs[0].length
        slots = req_to_token[rows[:, None], regs[0].start + torch.arange(M)].to(
            torch.int64
        )
        for part in [list(range(len(idx)))] + [[b] for b in range(len(idx))]:
            sp = ScoringPass(
                policy,
                pool.get_key_buffer,
                list(range(LAYERS)),
                slots[part],
                [None] * len(part),
                [regs[b] for b in part],
            )
            for lid in range(LAYERS):
                q = None
                if policy.needs_queries:
                    q = ring.read(
                        lid,
                        torch.zeros(len(part), dtype=torch.int64),
                        torch.full((len(part),), regs[0].query_start),
                        regs[0].query_len,
                    )
                sp.score_layer(lid, q)
        kept = policy.select(torch.rand(len(idx), LAYERS, HKV, M), regs[0].keep)
        plan = CompactionPlan(
            rows=rows,
            starts=[r.start for r in regs],
            lengths=[lengths[i] for i in idx],
            region=M,
            kept=kept,
        )
        compact_rows(
            plan, req_to_token, pool.k, pool.v, alloc.alloc, alloc.free_page_ids, page
        )


@pytest.mark.parametrize(
    "policy_name, page, q_dtype, kv_dtype",
    [
        ("kara", 1, torch.bfloat16, torch.bfloat16),
        ("kara", 16, torch.float16, torch.bfloat16),
        ("snapkv", 1, torch.float32, torch.float32),
    ],
)
def test_warm_up_compiles_every_specialisation_an_event_launches(
    monkeypatch, policy_name, page, q_dtype, kv_dtype
):
    from sgl_kara.policies.snapkv import SnapKVOptions, SnapKVPolicy
    from sgl_kara.scheduler.warm_up import warm_up_kernels

    if policy_name == "kara":
        policy = KaraPolicy(KaraOptions(window=32, buffer=4, period=8))
        tails = [32 + i for i in (0, 3, 8, 11)]
    else:
        policy = SnapKVPolicy(SnapKVOptions(threshold=40, budget=20, window=4))
        tails = [41 + i for i in (0, 1, 6, 7, 13, 20)]  # region lengths of both classes
    log = Launches(monkeypatch)
    pool = Pool(kv_dtype, slots=1024)
    warm_up_kernels(
        pool.get_key_buffer, list(range(LAYERS)), policy, [HQ], q_dtype, page
    )
    warm = log.take()
    _event_launches(policy, pool, q_dtype, page, tails, prompt=8)
    event = log.take()
    assert event, "the event launched no Triton kernel"
    assert event <= warm, sorted(event - warm)


def test_captured_scores_are_read_in_bounded_chunks():
    """An event may hold every running request: the ring is read for at most recompute_tokens
    window tokens at a time, and the scores are those of one read of all of them."""
    from sgl_kara.kernels.window_score import window_scores_paged_ref
    from sgl_kara.scheduler.ring import QueryRing
    from sgl_kara.scheduler.scoring import Scorer
    from sgl_kara.scheduler.shared import StepShared

    pool = Pool()
    policy = KaraPolicy(KaraOptions(window=16, buffer=4, period=4))
    ring = QueryRing(
        {layer: (HQ, D) for layer in range(LAYERS)}, 5, 64, 8, torch.float32, "cpu"
    )
    for buf in ring.buffers.values():
        buf.normal_(generator=torch.Generator().manual_seed(5))
    reads = []
    read = ring.read
    ring.read = lambda lid, rr, st, n: reads.append(rr.numel()) or read(lid, rr, st, n)
    reqs = [_request(i + 1, 40) for i in range(5)]
    states = [KaraReqState(protected=8, frontier=8, capture_from=0) for _ in reqs]
    for r in reqs:
        ring.assign(r, r.kv.req_pool_idx)
    jobs = [Job(i, r, states[i], Region(8, 12, 3, 8, 16)) for i, r in enumerate(reqs)]
    rows = torch.tensor([r.kv.req_pool_idx for r in reqs])
    region = torch.stack([torch.arange(12) + 20 * i for i in range(5)])
    parts = types.SimpleNamespace(
        keys=pool.get_key_buffer, layer_ids=list(range(LAYERS)), recompute_tokens=32
    )
    scorer = Scorer(StepShared(policy, parts, DeviceStaging("cpu")), None, ring)
    got = scorer._captured_scores(jobs, rows, region, [8] * 5, 16)
    assert reads and max(reads) <= 2, reads  # 32 tokens / 16 per window
    for lid in range(LAYERS):
        q = ring.read(lid, ring.rows_for(rows), torch.full((5,), 8), 16)
        torch.testing.assert_close(
            got[:, lid],
            window_scores_paged_ref(q, pool.k[lid], region),
            rtol=1e-4,
            atol=1e-5,
        )
