"""Per-request options (sgl_kara/request_options.py): the 400 for a malformed ``custom_params.kara``
names each field with its range and the policies that take it, as the policies declare it
(``request_options``), not a hard-coded list: today ``budget`` is every threshold baseline's
(snapkv, streaming, h2o, rkv), ``retention`` Kara's and random's; a policy registered later is
named too."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from sgl_kara import request_options
from sgl_kara.policies import base


def _message(opts) -> str:
    with pytest.raises(ValueError) as e:
        request_options.validate({"kara": opts})
    return str(e.value)


def _named(message: str, field: str) -> set[str]:
    m = re.search(rf"'{field}': '[^']*\(([^)]*)\)'", message)
    assert m, message
    return set(m.group(1).split("/"))


def test_unknown_field_names_the_policies_taking_each_option():
    message = _message({"window": 64})
    assert "unknown field(s) ['window']" in message
    takes = {
        name: {p.name for p in base.policies() if name in p.request_options}
        for name in ("budget", "retention")
    }
    assert takes["budget"] == {"snapkv", "streaming", "h2o", "rkv"} and takes[
        "retention"
    ] == {"kara", "kara_numerals", "random"}
    assert (
        _named(message, "budget") == takes["budget"]
        and _named(message, "retention") == takes["retention"]
    )
    assert (
        "'enable': 'bool'" in message
        and "int in [2, 10000000]" in message
        and "float in (0, 1]" in message
    )
    assert (
        _named(_message_for_type(), "budget") == takes["budget"]
    )  # a non-object says the same


def _message_for_type() -> str:
    with pytest.raises(ValueError) as e:
        request_options.validate({"kara": 3})
    return str(e.value)


def test_a_policy_registered_later_is_named(monkeypatch):
    class Budgeted:
        name = "newpolicy"
        request_options = ("budget",)

    monkeypatch.setitem(base._REGISTRY, Budgeted.name, Budgeted)
    assert "newpolicy" in _named(_message({"window": 64}), "budget")
    assert request_options.accepting("budget")[-1] == "newpolicy"
    assert "newpolicy" not in _named(_message({"window": 64}), "retention")


@pytest.mark.parametrize(
    "opts,field",
    [
        ({"retention": 0}, "retention"),
        ({"budget": 1}, "budget"),
        ({"enable": 1}, "enable"),
        ({"enable": False, "budget": 9}, "enable"),
    ],
)
def test_bad_values_name_the_field(opts, field):
    assert f"custom_params.kara.{field}" in _message(opts)


def test_valid_options_pass():
    assert request_options.validate({"kara": {"retention": 0.5}}) == {"retention": 0.5}
    assert request_options.validate({"kara": {"budget": 300, "enable": True}}) == {
        "budget": 300,
        "enable": True,
    }
    assert (
        request_options.validate(None) == {}
        and request_options.validate({"other": 1}) == {}
    )


class _Req:
    """What the runtime reads of a request: its id, sampling params, and where an abort goes."""

    def __init__(self, opts):
        self.rid, self.to_finish = "r0", None
        self.sampling_params = SimpleNamespace(
            custom_params={"kara": opts}, beam_width=None
        )


MATCH = {"window": 32, "buffer": 8, "retention": 0.25, "period": 4}


@pytest.mark.parametrize(
    "policy, opts, kept",
    [
        ("kara", {"retention": 0.5}, True),
        ("snapkv", {"budget": 30}, True),
        ("h2o", {"match_kara": MATCH}, True),
        ("snapkv", {"retention": 0.5}, False),
        ("kara", {"budget": 30}, False),
    ],
)
def test_the_runtime_keeps_a_requests_own_options_for_its_policy(policy, opts, kept):
    """``state.request`` holds the request's own options, validated; one the served policy does
    not take disables compression and aborts the request with a 400 naming who takes it."""
    from sgl_kara.scheduler.runtime import KaraRuntime
    from sgl_kara.scheduler.state import RequestTable

    cls = base.policy_class(policy)
    rt = KaraRuntime.__new__(KaraRuntime)
    rt.policy = cls(cls.Options())
    rt.table = RequestTable(rt.policy)
    req = _Req(opts)
    state = rt.state_of(req)
    assert state.request == request_options.validate({"kara": opts})
    assert state.enabled is kept and (req.to_finish is None) is kept
    if not kept:
        (name,) = opts
        takers = "/".join(request_options.accepting(name))
        assert f"custom_params.kara.{name} applies to --kara-policy {takers}," in str(
            vars(req.to_finish)
        )
