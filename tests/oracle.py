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
"""

from __future__ import annotations

import json
from collections import defaultdict

import torch

ATTN_NAME = "sgl_kara_oracle"


def read_evictions(path: str) -> dict[str, list[dict]]:
    """rid -> its events in order."""
    out: dict[str, list[dict]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["rid"]].append(rec)
    return dict(out)


def visibility(events: list[dict], length: int, layers: int, kv_heads: int) -> torch.Tensor:
    """[layers, kv_heads, T, T] bool: query t may attend key j."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    vis = causal.expand(layers, kv_heads, length, length).clone()
    for ev in events:
        start = ev["logical_len"]
        for l, heads in enumerate(ev["evicted"]):
            for h, positions in enumerate(heads):
                if positions:
                    vis[l, h, start:, torch.tensor(positions)] = False
    return vis


def _masked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager float32 attention with the per-(layer, kv head) visibility set on the module."""
    vis = module._sgl_kara_visibility  # [H_kv, T, T]
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query.float(), k.float().transpose(2, 3)) * (scaling if scaling is not None else d ** -0.5)
    allowed = vis.repeat_interleave(group, dim=0)[None]  # [1, H_q, T, T]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), probs


def load_reference(model_path: str):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(ATTN_NAME, _masked_attention)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=ATTN_NAME)
    return model.eval()


def _attention_modules(model):
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    return sorted(mods, key=lambda m: m.layer_idx)


@torch.no_grad()
def reference_logprobs(model, tokens: list[int], events: list[dict]) -> torch.Tensor:
    """[T, V] float32 log-probabilities of the token after each position, with the evictions."""
    mods = _attention_modules(model)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vis = visibility(events, len(tokens), len(mods), cfg.num_key_value_heads)
    for m in mods:
        m._sgl_kara_visibility = vis[m.layer_idx]
    try:
        ids = torch.tensor([tokens])
        logits = model(input_ids=ids, position_ids=torch.arange(len(tokens))[None]).logits[0].float()
    finally:
        for m in mods:
            del m._sgl_kara_visibility
    return torch.log_softmax(logits, dim=-1)


def engine_step_logprobs(out: dict) -> list[dict[int, float]]:
    """Per generated token (from the second one on), {token id: logprob} of the engine's top
    logprobs plus the sampled token: SGLang's output_top_logprobs / output_token_logprobs."""
    meta = out["meta_info"]
    steps = []
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
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
