"""Any registered policy as a benchmark configuration, its KV matched to Kara's. No engine.

The harnesses (bench/reasoning/long_answers.py, bench/quality/real_lm.py) name policies as the
registry does (``sgl_kara.policies``: ``@register``), so a policy registered anywhere runs without
editing a list here. What a policy gets depends on what it declares:

    "budget" in request_options    a budget-taking baseline, matched to Kara at equal trajectory:
                                   per request ``custom_params.kara.match_kara`` with Kara's W, U,
                                   r, delta, R (sgl_kara/policies/trajectory.py; every
                                   ThresholdPolicy takes it); server-wide, its observation window
                                   min(its own default, U) and a budget that only needs to be valid
    any other policy               the Kara window settings its Options declares (window, buffer,
                                   retention, period, recent)

Every compressing policy runs with ``--kara-spread off``, a large ``--kara-max-seqs`` and captured
queries. ``--policy-file FILE`` imports the file (its ``@register``) in the harness process and,
through ``POLICY_FILES`` in the environment, in the engine's scheduler process: SGLang starts it by
spawn, which imports the harness's main module and so this module, which imports the files.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

POLICY_FILES = (
    "KARA_BENCH_POLICY_FILES"  # os.pathsep-separated files with @register'd policies
)

WINDOW_FIELDS = ("window", "buffer", "retention", "period", "recent")
WHOLE_EVENTS = {"kara_spread": "off"}  # each event whole at its due step
MAX_SEQS = 65536  # events never left waiting for max_seqs


def load_policy_files(paths=None) -> list[str]:
    """Import each policy file once per process (``paths``, else ``POLICY_FILES``); returns the
    module names."""
    if paths is None:
        paths = [p for p in os.environ.get(POLICY_FILES, "").split(os.pathsep) if p]
    names = []
    for path in paths:
        path = os.path.abspath(path)
        if not os.path.isfile(path):
            raise SystemExit(f"--policy-file {path}: no such file")
        name = "kara_bench_policy_" + os.path.splitext(os.path.basename(path))[0]
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        names.append(name)
    return names


def use_policy_files(paths: list[str]) -> None:
    """Import ``paths`` here and list them for the engine processes this process starts."""
    if not paths:
        return
    full = [os.path.abspath(p) for p in paths]
    known = [p for p in os.environ.get(POLICY_FILES, "").split(os.pathsep) if p]
    os.environ[POLICY_FILES] = os.pathsep.join(dict.fromkeys(known + full))
    load_policy_files(full)


load_policy_files()  # a spawned engine process: the files its harness listed


def registry():
    from sgl_kara.policies import base

    return base


def names() -> list[str]:
    """Every registered policy's name, registration order."""
    return registry().names()


def takes(name: str, option: str) -> bool:
    return option in registry().policy_class(name).request_options


def budget_policies() -> list[str]:
    """The registered policies that take a per-request budget (matched to Kara's trajectory)."""
    return [n for n in names() if takes(n, "budget")]


def option_fields(name: str) -> dict:
    """{field: default} of a registered policy's Options."""
    cls = registry().policy_class(name).Options
    return {
        f.name: (
            f.default
            if f.default is not dataclasses.MISSING
            else f.default_factory()  # type: ignore[misc]
            if f.default_factory is not dataclasses.MISSING
            else None
        )
        for f in dataclasses.fields(cls)
    }


def schedule(
    window: int, buffer: int, retention: float, period: int, recent: int = 0
) -> dict:
    """Kara's window settings as ``custom_params.kara.match_kara`` takes them."""
    return dict(
        window=window, buffer=buffer, retention=retention, period=period, recent=recent
    )


def engine_options(name: str, kara: dict) -> tuple[dict, dict | None]:
    """(sgl_kara.Engine keywords, the per-request ``custom_params.kara`` or None) of the
    registered policy ``name`` (or ``none``: full KV) with Kara's settings ``kara``
    (``schedule(...)``)."""
    if name in ("none", "full"):
        return {"kara_policy": "none"}, None
    cls = registry().policy_class(name)  # ValueError naming the known policies
    opts = {
        "kara_policy": name,
        "kara_max_seqs": MAX_SEQS,
        "kara_query_source": "capture",
        **WHOLE_EVENTS,
    }
    fields = option_fields(name)
    prefix = f"kara_{cls.prefix}"
    if "budget" in cls.request_options:
        if "match_kara" not in cls.request_options:
            raise ValueError(
                f"policy {name!r} takes a budget but not custom_params.kara.match_kara: it "
                "cannot follow Kara's trajectory (derive it from ThresholdPolicy)"
            )
        default_w = fields.get("window")
        w = kara["buffer"] if not isinstance(default_w, int) else default_w
        w = max(1, min(w, kara["buffer"]))
        floor = w + 8
        opts.update(
            {
                prefix + "window": w,
                prefix + "budget": floor,
                prefix + "threshold": floor + kara["window"] - kara["buffer"],
            }
        )
        return opts, {"match_kara": dict(kara)}
    for f in WINDOW_FIELDS:
        if f in fields and (f != "recent" or kara.get("recent")):
            opts[prefix + f] = kara[f]
    return opts, None
