"""sgl_kara.env: the one boolean parser (SGLang's spellings) and the ``KARA_*`` names; the
plugin's choice of the CPU kernels by ``KARA_SERVE``, ``KARA_CPU_KERNELS`` and the device."""

from __future__ import annotations

import os
import warnings

import pytest

from sgl_kara import env

# (variable without prefix, reader, a value to set, what the reader returns for it, its default)
VARIABLES = [
    ("SERVE", env.serving, "1", lambda v: v is True, False),
    ("CPU_KERNELS", env.cpu_kernels_requested, "1", lambda v: v is True, None),
    (
        "CACHE",
        env.cache_dir,
        "/tmp/kara-cache",
        lambda v: str(v) == "/tmp/kara-cache",
        None,
    ),
    ("FORK", env.fork_workers, "0", lambda v: v is False, True),
    ("CHECK_INTEGRITY", env.check_integrity, "1", lambda v: v is True, False),
    ("CHECK_SYNC", env.check_sync, "1", lambda v: v is True, False),
    ("CROSSCHECK_QUERIES", env.crosscheck_queries, "1", lambda v: v is True, False),
    (
        "RECORD_EVICTIONS",
        env.record_evictions,
        "/tmp/ev.jsonl",
        lambda v: v == "/tmp/ev.jsonl",
        None,
    ),
    ("TRACE", env.trace, "/tmp/trace.jsonl", lambda v: v == "/tmp/trace.jsonl", None),
    (
        "INJECT_FAULT_RID_PREFIX",
        env.inject_fault_rid_prefix,
        "faulty",
        lambda v: v == "faulty",
        "",
    ),
    (
        "INJECT_FAULT_AT",
        env.inject_fault_stage,
        "commit",
        lambda v: v == "commit",
        "score",
    ),
    ("CHECK_TP_PLAN", env.check_tp_plan, "1", lambda v: v is True, False),
    (
        "INJECT_TP_DIVERGENCE",
        env.inject_tp_divergence,
        "1:late",
        lambda v: v == (1, "late"),
        (None, ""),
    ),
    ("INJECT_FAULT_TP_RANK", env.inject_fault_tp_rank, "1", lambda v: v == 1, None),
    ("FAST_CPU_DECODE", env.fast_cpu_decode, "0", lambda v: v is False, True),
    ("BATCHED_CPU_DECODE", env.batched_cpu_decode, "0", lambda v: v is False, True),
    ("PACKED_CPU_LINEAR", env.packed_cpu_linear, "0", lambda v: v is False, True),
]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No KARA_* variable from the caller's environment, and fresh one-time warnings."""
    for key in list(os.environ):
        if key.startswith(env.PREFIX):
            monkeypatch.delenv(key)
    monkeypatch.setattr(env, "_warned", set())


def test_every_reader_is_listed_here():
    readers = {
        name
        for name, value in vars(env).items()
        if callable(value)
        and not name.startswith("_")
        and getattr(value, "__module__", "") == env.__name__
    }
    assert readers - {"parse_bool", "flag"} == {r.__name__ for _, r, *_ in VARIABLES}


@pytest.mark.parametrize(
    "name,reader,value,check,default", VARIABLES, ids=[v[0] for v in VARIABLES]
)
def test_new_name_is_read_without_warning(
    monkeypatch, name, reader, value, check, default
):
    if default is not None:
        assert reader() == default
    monkeypatch.setenv("KARA_" + name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check(reader())


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("serve", [None, "1", "0"])
@pytest.mark.parametrize("kernels", [None, "1", "0", ""])
def test_cpu_kernels_follow_serving_on_a_cpu(monkeypatch, cuda, serve, kernels):
    """The plugin's CPU parts: RoPE's CPU path wherever there is no CUDA; the CPU kernels where
    KARA_CPU_KERNELS asks for them, else on sgl_kara's server on a machine without CUDA."""
    from sgl_kara import plugin

    for name, value in (("KARA_SERVE", serve), ("KARA_CPU_KERNELS", kernels)):
        if value is not None:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(plugin, "cuda_available", lambda: cuda)
    parts = plugin.wanted_parts()
    assert env.serving() is (serve == "1")
    want_kernels = kernels == "1" if kernels else (serve == "1" and not cuda)
    assert ("cpu_kernels" in parts) is want_kernels
    assert ("rope" in parts) is (not cuda)
    assert ("parallel" in parts) is (not cuda)
    assert ("serving" in parts) is (serve == "1")
    assert (env.SERVE, env.CPU_KERNELS) == ("KARA_SERVE", "KARA_CPU_KERNELS")


def _sglang_bool(value: str, default: bool) -> bool:
    """SGLang's own reading of a boolean variable (EnvBool), the reference for ours."""
    from sglang.srt.environ import EnvBool

    try:
        return EnvBool(default).parse(value)
    except ValueError:
        return default


@pytest.mark.parametrize(
    "value",
    [
        "1",
        "0",
        "true",
        "false",
        "True",
        "FALSE",
        "yes",
        "no",
        "Y",
        "n",
        "",
        " 1 ",
        "2",
        "on",
        "off",
        "maybe",
    ],
)
@pytest.mark.parametrize("default", [False, True])
def test_booleans_are_read_as_sglang_reads_them(value, default):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert env.parse_bool("X", value, default) is _sglang_bool(
            value.strip(), default
        )


def test_an_unrecognised_boolean_warns_once_naming_the_variable_and_the_spellings(
    monkeypatch,
):
    monkeypatch.setenv("KARA_FORK", "maybe")
    with pytest.warns(
        UserWarning,
        match=r"KARA_FORK='maybe' is not a boolean \(true: 1, true, yes, y; false: "
        r"0, false, no, n\); using the default, 1",
    ):
        assert env.fork_workers() is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert env.fork_workers() is True


def test_sglang_does_not_rewrite_the_prefix(monkeypatch):
    """SGLang renames SGL_* variables to SGLANG_* and warns at import; KARA_* it leaves alone."""
    from sglang.srt import environ

    saved = dict(os.environ)
    try:
        os.environ["KARA_TRACE"] = "/tmp/t.jsonl"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            environ._handle_deprecated_envs()
        assert not [w for w in caught if "KARA" in str(w.message)]
        assert os.environ["KARA_TRACE"] == "/tmp/t.jsonl"
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_refused_sglang_switch_uses_the_same_parser(monkeypatch):
    from sgl_kara.config import KaraConfig
    from sgl_kara.startup import UnsupportedFeature, prepare_server_args

    class Args:
        model_path = "/nonexistent"
        device = "cpu"

    for value, refused in (
        ("1", True),
        ("yes", True),
        ("0", False),
        ("no", False),
        ("n", False),
        ("", False),
    ):
        monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", value)
        args = Args()
        if refused:
            with pytest.raises(UnsupportedFeature, match="SGLANG_USE_HND_KVCACHE"):
                prepare_server_args(args, KaraConfig(policy="kara"))
        else:
            prepare_server_args(args, KaraConfig(policy="kara"))
