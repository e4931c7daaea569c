"""sgl_kara on SGLang's own extension points where they exist, its hooks where they do not
(patches/upstream: one PR each; sgl_kara/_sglang.py ``EXTENSION_POINTS``), decided by feature at
start-up, never by version string.

- Detection: every extension point is absent from the installed SGLang 0.5.23 and present in the
  patched tree (tests/patched_sglang.py), found in a fresh interpreter of each.
- The hooks: on plain 0.5.23 the serving part registers a hook for every touch point; with the
  whole series applied it registers none (the scheduler's class replacement, for which SGLang has
  no other way in, is the one hook left).
- The engine says which it runs on: /server_info's ``touch_points`` and ``hooks`` of a running
  scheduler, read from that process. Run on plain SGLang in the default suite and, with
  ``KARA_TEST_PATCHED_SGLANG=1`` (the patched tier, docs/TESTING.md), on the patched one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sgl_kara import _sglang as adapter

# the tier run on SGLang with the upstream series applied too (docs/TESTING.md)
pytestmark = pytest.mark.patched

PATCHED = os.environ.get("KARA_TEST_PATCHED_SGLANG") == "1"
# The hooks Kara registers, each standing in for one extension point.
HOOKED = {
    adapter.TARGET_UPDATE_RUNNING_BATCH: "decode_step",
    adapter.TARGET_GET_INTERNAL_STATE: "decode_step",
    adapter.TARGET_INIT_NEW: "positions",
    adapter.TARGET_ATTENTION: "attention",
    adapter.TARGET_RESET_FOR_RETRACT: "retraction",
    adapter.TARGET_RETRACTION_ORDER: "retraction",
    adapter.TARGET_META_INFO: "request_info",
    adapter.TARGET_SAMPLING_VERIFY: "custom_params",
    adapter.TARGET_VALIDATE_REQUEST: "input_ids",
}


def test_this_session_runs_on_the_sglang_it_says():
    import sglang

    patched_tree = "sgl_kara_patched_sglang" in sglang.__file__
    assert patched_tree is PATCHED, sglang.__file__
    found = {p: adapter.has_extension(p) for p in adapter.EXTENSION_POINTS}
    assert all(found.values()) if PATCHED else not any(found.values()), found


def test_the_serving_hooks_are_exactly_the_missing_extension_points():
    from sgl_kara import plugin

    targets = [target for target, _, _ in plugin.serving_hooks()]
    assert len(targets) == len(set(targets))
    assert set(targets) <= set(HOOKED)
    if PATCHED:
        assert targets == [], targets
    else:
        assert set(targets) == set(HOOKED), set(HOOKED) - set(targets)


# One engine for the engine tests: small windows so 48 tokens compress, queries recomputed so the
# recompute pass runs (by SGLang where it has 0008)
KARA = dict(kara_window=32, kara_buffer=4, kara_period=8, kara_query_source="recompute")


def test_the_engine_reports_its_touch_points_and_hooks(tiny_llama, engines):
    engine = engines("kara", tiny_llama, **KARA)
    out = engine.generate(
        input_ids=[[10, 11, 12, 13, 14, 15, 16, 17]],
        sampling_params={"max_new_tokens": 48, "temperature": 0, "ignore_eos": True},
    )
    assert out[0]["meta_info"]["kara"]["compressions"] >= 1, out[0]["meta_info"]["kara"]
    stats = engine.get_server_info()["internal_states"][0]["kara"]
    assert stats["backend"] == ("extension points" if PATCHED else "hooks")
    points = stats["touch_points"]
    assert set(points) == set(adapter.EXTENSION_POINTS)
    want = "extension point" if PATCHED else "hook"
    assert all(v.startswith(want) for v in points.values()), points
    # the recompute pass: SGLang builds and runs it where it can (0008), else sgl_kara
    forwards = stats["recompute_forwards"]
    by, other = ("sglang", "sgl_kara") if PATCHED else ("sgl_kara", "sglang")
    assert forwards[by] >= 1 and forwards[other] == 0, forwards
    hooks = set(stats["hooks"])
    assert adapter.TARGET_SCHEDULER in hooks  # no extension point stands in for it
    if PATCHED:
        assert hooks == {adapter.TARGET_SCHEDULER}, hooks
    else:
        assert set(HOOKED) <= hooks, set(HOOKED) - hooks


def test_the_other_backend_is_never_imported():
    """In a fresh interpreter on this SGLang, a scheduler's modules loaded and the backend
    chosen: the hooked backend exists only without the series, the patched one only with it."""
    probe = (
        "import sys; from sgl_kara import plugin, startup; "
        "from sgl_kara.scheduler import runtime, events, output; "
        "startup.check_backend(); "
        "print(sorted(m for m in sys.modules if m.startswith('sgl_kara.backends.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=os.environ
    )
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout.strip().splitlines()[-1]
    want = "patched" if PATCHED else "hooked"
    assert loaded == f"['sgl_kara.backends.{want}']", loaded


@pytest.mark.integration  # builds the patched tree and starts two interpreters
def test_each_extension_point_is_found_only_where_its_patch_is():
    """In a fresh interpreter of each SGLang: none found on 0.5.23 as installed, every one with
    the series applied (each patch's public name)."""
    import patched_sglang

    tree = patched_sglang.build()
    probe = (
        "import json; from sgl_kara import _sglang as a; "
        "print(json.dumps({p: a.has_extension(p) for p in a.EXTENSION_POINTS}))"
    )
    plain_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    runs = {}
    for name, env in (
        ("plain", plain_env),
        ("patched", patched_sglang.env(tree, plain_env)),
    ):
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-2000:]
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any(runs["plain"].values()), runs["plain"]
    assert all(runs["patched"].values()), runs["patched"]


def test_requests_are_refused_alike_on_hooks_and_extension_points(tiny_llama, engines):
    """A bad ``custom_params.kara`` and beam search under compression are refused before they
    are scheduled, with the field named, whichever serves the check (the verify hook, or
    SGLang's validator registry run for every request)."""
    engine = engines("kara", tiny_llama, **KARA)
    with pytest.raises(ValueError, match=r"custom_params.kara.retention must be"):
        engine.generate(
            input_ids=[10, 11, 12],
            sampling_params={
                "max_new_tokens": 4,
                "custom_params": {"kara": {"retention": 2}},
            },
        )
    with pytest.raises(
        ValueError, match=r"beam_width=2 \(beam search\) is not supported"
    ):
        engine.generate(
            input_ids=[10, 11, 12],
            sampling_params={"max_new_tokens": 4, "beam_width": 2},
        )
    out = engine.generate(input_ids=[10, 11, 12], sampling_params={"max_new_tokens": 4})
    assert out["meta_info"]["completion_tokens"] == 4  # still serving
