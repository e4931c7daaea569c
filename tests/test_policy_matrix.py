"""Every registered policy through the same engine checks (tiny Llama, CPU, strict memory checks):

- several compression events per request, physical KV below logical, integrity checks at every
  event (protected prefix, slot ownership, ring, device offsets: KARA_CHECK_INTEGRITY=1);
- exactness: each decode step equals the Hugging Face reference with exactly the evicted entries
  masked (tests/oracle.py), and the unmasked reference is far off (the check can fail);
- afterwards every slot is free (SGLang's strict idle check, and a successful flush).

A new policy joins the matrix by being registered; tests/oracle.py ``SMALL`` gives it small
options when the threshold trio (threshold / budget / window) does not fit it.
"""

from __future__ import annotations

import pytest
from oracle import check_policy_through_engine, shared_engine, small_options

from sgl_kara.policies import base

# the tier run on SGLang with the upstream series applied too (docs/TESTING.md)
pytestmark = pytest.mark.patched


# Kara first: its engine is the oracle's Llama capture engine, still in the session's pool after
# tests/test_oracle.py.
@pytest.mark.parametrize("name", sorted(base.names(), key=lambda n: n != "kara"))
def test_policy_through_the_engine(name, tiny_llama, tmp_path, engines):
    check_policy_through_engine(tiny_llama, tmp_path, 1, name, engines)


@pytest.mark.parametrize("policy", ["snapkv", "streaming"])
def test_threshold_baselines_bound_generated_kv(policy, tiny_llama, tmp_path, engines):
    """SnapKV-threshold and StreamingLLM share the compaction machinery: generated KV grows to
    C_max (48 here), then is compacted back to N (32; the last w = 8 entries always kept), on the
    matrix's engines."""
    opts = small_options(policy)
    threshold, budget = opts[f"kara_{policy}_threshold"], opts[f"kara_{policy}_budget"]
    engine, _ = shared_engine(
        engines, tiny_llama, 1, "capture", policy=policy, extra=opts
    )
    outs = engine.generate(
        ["Hello world", "The answer is"],
        {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True},
    )
    for out in outs:
        meta, kara = out["meta_info"], out["meta_info"]["kara"]
        assert meta["completion_tokens"] == 200
        generated_held = kara["kv_physical_len"] - meta["prompt_tokens"]
        assert budget <= generated_held <= threshold
        # every event drops (threshold + 1) - budget entries
        assert kara["compressions"] >= (200 - threshold) // (threshold + 1 - budget)
        assert kara["kv_logical_len"] == meta["prompt_tokens"] + 199
