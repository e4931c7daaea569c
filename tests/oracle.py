"""An exactness oracle for compressed decoding that knows nothing about slots or rows.

The reference is the Hugging Face model (transformers) run once over a request's whole token
sequence (prompt + generated) at its original positions 0..T-1, with an attention mask per layer
and KV head that hides exactly the entries sgl_kara evicted, from the moment it evicted them:

    query at position t sees key j  <=>  j <= t  and  j not in evicted_e[layer][head]
                                         for any event e with logical_len_e <= t

(an event with logical length L ran before the forward of position L, so positions < L were
computed with the full window). Row t of the reference's log-softmax is then what sgl_kara's
decode step that processed position t must have produced. The evictions come from the runtime's
``KARA_RECORD_EVICTIONS`` file; everything else (positions, kept-slot mapping, RoPE offsets,
page layout, query source) is left to the runtime under test.

``run_and_check`` runs an sgl_kara engine with the evictions recorded and checks every decode step
of every request against that reference (tests/test_oracle.py, test_policy_matrix.py, ...).
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict

import torch

ATTN_NAME = "sgl_kara_oracle"


def read_evictions(path: str) -> dict[str, list[dict]]:
    """rid -> its events in order. A tensor-parallel engine's ranks each record their own KV
    heads to ``path.tp<r>`` (scheduler/evictions.py): their records of one event are merged,
    the heads concatenated in the model's order (``first_kv_head``)."""
    ranks = sorted(
        glob.glob(glob.escape(path) + ".tp*"), key=lambda p: int(p.rsplit("tp", 1)[1])
    )
    if not ranks:
        out: dict[str, list[dict]] = defaultdict(list)
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out[rec["rid"]].append(rec)
        return dict(out)
    per_rank = [read_evictions(p) for p in ranks]
    merged = {}
    for rid, events in per_rank[0].items():
        merged[rid] = []
        for n, first in enumerate(events):
            parts = sorted(
                (rank[rid][n] for rank in per_rank), key=lambda r: r["first_kv_head"]
            )
            assert all(
                (p["event"], p["logical_len"]) == (first["event"], first["logical_len"])
                for p in parts
            ), f"the ranks recorded different events for {rid}: {parts}"
            merged[rid].append(
                {
                    "rid": rid,
                    "event": first["event"],
                    "logical_len": first["logical_len"],
                    "evicted": [
                        [h for p in parts for h in p["evicted"][layer]]
                        for layer in range(len(first["evicted"]))
                    ],
                }
            )
    assert all(set(rank) == set(merged) for rank in per_rank)
    return merged


def visibility(
    events: list[dict], length: int, layers: int, kv_heads: int
) -> torch.Tensor:
    """[layers, kv_heads, T, T] bool: query t may attend key j."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    vis = causal.expand(layers, kv_heads, length, length).clone()
    for ev in events:
        start = ev["logical_len"]
        for layer_id, heads in enumerate(ev["evicted"]):
            for h, positions in enumerate(heads):
                if positions:
                    vis[layer_id, h, start:, torch.tensor(positions)] = False
    return vis


def _masked_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """Eager float32 attention with the per-(layer, kv head) visibility set on the module."""
    vis = module._sgl_kara_visibility  # [H_kv, T, T]
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query.float(), k.float().transpose(2, 3)) * (
        scaling if scaling is not None else d**-0.5
    )
    allowed = vis.repeat_interleave(group, dim=0)[None]  # [1, H_q, T, T]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), probs


def load_reference(model_path: str):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(ATTN_NAME, _masked_attention)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=ATTN_NAME
    )
    return model.eval()


def _attention_modules(model):
    mods = [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")
    ]
    return sorted(mods, key=lambda m: m.layer_idx)


@torch.no_grad()
def reference_logprobs(model, tokens: list[int], events: list[dict]) -> torch.Tensor:
    """[T, V] float32 log-probabilities of the token after each position, with the evictions."""
    mods = _attention_modules(model)
    cfg = (
        model.config.get_text_config()
        if hasattr(model.config, "get_text_config")
        else model.config
    )
    vis = visibility(events, len(tokens), len(mods), cfg.num_key_value_heads)
    for m in mods:
        m._sgl_kara_visibility = vis[m.layer_idx]
    try:
        ids = torch.tensor([tokens])
        logits = (
            model(input_ids=ids, position_ids=torch.arange(len(tokens))[None])
            .logits[0]
            .float()
        )
    finally:
        for m in mods:
            del m._sgl_kara_visibility
    return torch.log_softmax(logits, dim=-1)


def engine_step_logprobs(out: dict) -> list[dict[int, float]]:
    """Per generated token (from the second one on), {token id: logprob} of the engine's top
    logprobs plus the sampled token: SGLang's output_top_logprobs / output_token_logprobs."""
    meta = out["meta_info"]
    steps = []
    for (lp, tok, _), top in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"]
    ):
        d = {int(t): float(v) for v, t, _ in top}
        d[int(tok)] = float(lp)
        steps.append(d)
    return steps


def compare(ref: torch.Tensor, prompt_len: int, out: dict) -> torch.Tensor:
    """Per generated token i: max |engine logprob - reference logprob| over the engine's top ids.

    Generated token i was sampled from the forward of position prompt_len - 1 + i."""
    errs = []
    for i, step in enumerate(engine_step_logprobs(out)):
        row = ref[prompt_len - 1 + i]
        errs.append(max(abs(v - float(row[t])) for t, v in step.items()))
    return torch.tensor(errs)


# ------------------------------------------------------------------- an engine against the oracle
KARA = dict(kara_window=40, kara_buffer=8, kara_max_chunk=6, kara_period=4)
TOL = 2e-3  # float32: observed errors are ~1e-5 (tiny models) / ~1e-4 (SmolLM2)
GEN = {"max_new_tokens": 150, "temperature": 0.0, "ignore_eos": True}
# Text prompts the runtime tests greedily answer in 300 tokens on the shared engines: with W 40 and
# U 8 (32 compressible, r 0.25 -> K 8), many events each (tests/test_oracle.py, test_runtime.py).
TEXT_PROMPTS = [
    "Hello world",
    "The answer is",
    "Let x = 3. Let y = x + 4, so y = 7. Then z",
    "Once upon a time there was a server",
]
TEXT_GEN = 300
TEXT_GREEDY = {"max_new_tokens": TEXT_GEN, "temperature": 0.0, "ignore_eos": True}


def _prompts(vocab: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(10, vocab, (13 + 9 * i,), generator=g).tolist() for i in range(n)
    ]


def engine_options(
    policy: str, query_source: str, page: int, extra: dict | None = None
) -> dict:
    """The ``kara_*`` and page options of an oracle run: ``KARA`` at r 0.25 for Kara, ``extra`` on top."""
    opts = dict(kara_policy=policy, kara_query_source=query_source, page_size=page)
    if policy == "kara":
        opts.update(KARA, kara_retention=0.25)
    opts.update(extra or {})
    return opts


def record_path(model_path: str, opts: dict, env_extra: dict | None = None) -> str:
    """The evictions file of a shared engine's configuration (one per configuration and session)."""
    import hashlib
    import tempfile

    ident = json.dumps(
        [model_path, sorted(opts.items()), sorted((env_extra or {}).items())],
        default=str,
    )
    digest = hashlib.sha1(ident.encode()).hexdigest()[:12]
    return os.path.join(
        tempfile.gettempdir(), f"kara_evictions_{os.getpid()}_{digest}.jsonl"
    )


def shared_engine(
    engines,
    model_path: str,
    page: int,
    query_source: str,
    policy: str = "kara",
    extra: dict | None = None,
    env_extra: dict | None = None,
):
    """(engine, evictions file) of the session's shared engine for this configuration (tests/conftest.py
    ``engines``): evictions recorded to a file of its own, integrity checks at every event, and with
    ``capture`` the query cross-check (capture vs recompute scores on first windows). Tests that run
    the same configuration share it (tests/test_runtime.py, test_policy_matrix.py)."""
    opts = engine_options(policy, query_source, page, extra)
    record = record_path(model_path, opts, env_extra)
    env = {
        "KARA_RECORD_EVICTIONS": record,
        "KARA_CHECK_INTEGRITY": "1",
        **(env_extra or {}),
    }
    if query_source == "capture":
        env["KARA_CROSSCHECK_QUERIES"] = "1"
    return engines("kara", model_path, env=env, **opts), record


def run_and_check(
    model_path: str,
    tmp_path,
    page: int,
    query_source: str,
    policy: str = "kara",
    extra: dict | None = None,
    gen: dict | None = None,
    integrity: bool = False,
    keep_engine: bool = False,
    tol: float = TOL,
    env_extra: dict | None = None,
    margin: float | None = None,
    engines=None,
):
    """Generate with evictions recorded, then compare every step with the masked reference.
    ``margin`` (default 20 x tol): how far the unmasked reference must be off, so that the check
    is not vacuous; it measures the evictions' effect, not the engine's precision, so a bf16 run
    (wide tol) keeps the float32 margin. ``engines``: run on the session's shared engine of this
    configuration (``shared_engine``: integrity checks always on; the caller must not shut it
    down); else on an engine of its own, shut down unless ``keep_engine``. Returns (outputs, the
    engine if shared or ``keep_engine`` else None, worst error, smallest unmasked gap)."""
    if engines is not None:
        engine, record = shared_engine(
            engines, model_path, page, query_source, policy, extra, env_extra
        )
        keep_engine = shared = True
    else:
        shared = False
        record = str(tmp_path / f"evictions_{policy}_{page}_{query_source}.jsonl")
        env = {"KARA_RECORD_EVICTIONS": record}  # read by the spawned scheduler
        if integrity:
            env["KARA_CHECK_INTEGRITY"] = "1"
        env.update(env_extra or {})
        from support import engine_env, start_engine

        with engine_env(**env):
            engine = start_engine(
                "kara", model_path, **engine_options(policy, query_source, page, extra)
            )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    prompts = _prompts(vocab)
    try:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params=gen or GEN,
            return_logprob=True,
            top_logprobs_num=5,
        )
        if not keep_engine:
            engine.shutdown()
        worst, control = _check_against_reference(
            model_path,
            prompts,
            outs,
            read_evictions(record),
            policy,
            page,
            query_source,
            tol,
            margin,
        )
    except BaseException:
        if keep_engine and not shared:
            engine.shutdown()
        raise
    return outs, engine if keep_engine else None, worst, control


def check_policy_through_engine(
    model_path: str, tmp_path, page: int, name: str, engines
) -> None:
    """One registered policy on the session's shared engine (capture, its small options): the oracle's
    step-by-step check, then several events per request, physical KV below logical, integrity checks
    at every event, and every slot free afterwards (tests/test_policy_matrix.py, page 16:
    tests/test_contract_engine.py)."""
    from support import flush_when_idle

    outs, engine, _, _ = run_and_check(
        model_path,
        tmp_path,
        page,
        "capture",
        policy=name,
        extra=small_options(name),
        engines=engines,
    )
    for out in outs:
        kara = out["meta_info"]["kara"]
        assert kara["compressions"] >= 2, kara
        assert kara["kv_physical_len"] < kara["kv_logical_len"], kara
        assert kara["integrity_checks"] >= kara["compressions"] - 1, kara
    assert flush_when_idle(engine), "slots still held after every request finished"


def _check_against_reference(
    model_path, prompts, outs, events, policy, page, query_source, tol=TOL, margin=None
):
    """Returns (worst |dlogprob| vs the masked reference, smallest gap of the unmasked control)."""
    model = load_reference(model_path)
    worst, controls = 0.0, []
    for prompt, out in zip(prompts, outs):
        rid_events = events.get(out["meta_info"]["id"], [])
        assert len(rid_events) >= 3, (
            f"only {len(rid_events)} events: the test needs several (pos_offset > 0)"
        )
        assert rid_events[-1]["logical_len"] > rid_events[0]["logical_len"]
        tokens = prompt + out["output_ids"]
        err = compare(reference_logprobs(model, tokens, rid_events), len(prompt), out)
        worst = max(worst, float(err.max()))
        assert float(err.max()) < tol, (
            f"engine vs masked HF reference: max |dlogprob| {err.max():.2e} at step {int(err.argmax())}"
        )
        # The oracle can fail: without the evictions the reference is far off after the first event.
        full = compare(reference_logprobs(model, tokens, []), len(prompt), out)
        first = (
            rid_events[0]["logical_len"] - len(prompt) + 1
        )  # first generated step after an event
        assert float(full[:first].max()) < tol  # identical before any eviction
        controls.append(float(full[first:].max()))
    margin = 20 * tol if margin is None else margin
    assert min(controls) > margin, (
        f"evictions barely change the output here ({controls}); the check would be vacuous"
    )
    print(
        f"\nORACLE {os.path.basename(model_path)} policy={policy} page={page} {query_source}: "
        f"max err {worst:.2e}, unmasked reference off by >= {min(controls):.2e}"
    )
    return worst, min(controls)


# Small options per registered policy, so that a 150-token answer goes through several events.
SMALL = {
    "kara": dict(KARA, kara_retention=0.25),
    # Kara's, under its own prefix
    "kara_numerals": {
        "kara_numerals_" + k[len("kara_") :]: v
        for k, v in dict(KARA, kara_retention=0.25).items()
    },
    "random": dict(
        kara_random_window=40,
        kara_random_buffer=8,
        kara_random_period=4,
        kara_random_retention=0.25,
        kara_random_seed=5,
    ),
}


def small_options(name: str) -> dict:
    """``SMALL[name]``, or the threshold trio (threshold 48 / budget 32 / window 8) for the others."""
    from sgl_kara.policies import base

    if name in SMALL:
        return SMALL[name]
    prefix = "kara_" + base.policy_class(name).prefix
    return {prefix + "threshold": 48, prefix + "budget": 32, prefix + "window": 8}
