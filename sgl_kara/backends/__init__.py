"""The SGLang backend of this process: how Kara reaches SGLang at each touch point, chosen once
at start-up by what the installed SGLang offers (never by its version string), and the same for
the life of the process.

    every extension point of the upstream series (patches/upstream)  ->  patched.ExtensionPoints
    none of them (SGLang 0.5.23 as released)                          ->  hooked.Hooks
    some of them                                                       ->  refused (PartialSeries)

What differs between the two, and nothing else of Kara does:

| member | patched (extension points) | hooked (plain 0.5.23) |
|---|---|---|
| ``hooked`` | False: no serving hook; the overrides of the series' subclass points (``kara`` a final value, 0002) | True: the plugin's hooks stand in (``kara`` a list the meta hook unwraps) |
| ``runs_recompute`` | SGLang builds and runs the recompute forward over cached K/V, writing none (0007, 0008) | sgl_kara builds it, ends it early; K/V writes land in the padding slot |
| ``asks_admission`` | SGLang's adder asks each request's reservation (0010) | the charge presented as max_new_tokens |
| ``touch_points()`` | every point served by its patch | every point served by a hook |
| ``configure(server_args)`` | Kara's retraction order over the user's (0005) | nothing: the order hook |
| ``position_offsets(parts)`` | SGLang's per-row offsets (0008) | None: the ``init_new`` hook adds them |
| ``observe_attention(forward)`` | SGLang's attention observers (0006) | None: the attention hook calls the forward |
| ``release_tail(batch, jobs, prepared, step)`` | ``kv_compaction.release_kv_tails`` for every request at once, offsets included (0008) | rows, slots, lengths and offsets (``step.forward``) rewritten here |
| ``release_loop_tasks(engine)`` | nothing: SGLang's shutdown does it (0009) | the tasks SGLang's shutdown leaves |

``choose`` is called by the start-up checks (server_setup.check_sglang: the launcher,
``sgl_kara.Engine``, Kara's scheduler process) and ``current`` returns it from then on; a module
imported without those (a test, a plugin in a tokenizer process) chooses on first use. The hooked
implementation is imported only where SGLang has none of the series; it is also the one module
besides the adapter that reads SGLang's internals (what its hooks read and write of a forward, the
recompute batch it builds and runs itself), so nothing of plain 0.5.23's path sits in the adapter.
"""

from __future__ import annotations

import abc

from sgl_kara import _sglang as adapter

# Kara's retraction order registered in SGLang's registry (0005) over each of SGLang's policies
RETRACTION_PREFIX = "kara-"


def retraction_policy_name(base: str) -> str:
    """The registered name of Kara's order over SGLang's ``base`` retraction policy."""
    return base if base.startswith(RETRACTION_PREFIX) else RETRACTION_PREFIX + base


class PartialSeries(RuntimeError):
    """SGLang has some of the upstream series' extension points but not all."""


class Backend(abc.ABC):
    """What Kara does differently on each SGLang (the table above); one instance per process."""

    name = ""
    hooked = False
    runs_recompute = False
    asks_admission = False

    @abc.abstractmethod
    def touch_points(self) -> dict[str, str]: ...

    @abc.abstractmethod
    def configure(self, server_args) -> None: ...

    @abc.abstractmethod
    def position_offsets(self, parts): ...

    @abc.abstractmethod
    def observe_attention(self, forward): ...

    @abc.abstractmethod
    def release_tail(self, batch, jobs, prepared, step) -> int:
        """Apply ``prepared`` (its fresh slots filled) to ``jobs``' rows of ``batch``; ``step``:
        the event's ``parts``, ``staging``, ``forward`` and device ``rows``. Returns the rows
        dropped from each request."""

    @abc.abstractmethod
    def release_loop_tasks(self, engine) -> None: ...


_CHOSEN: list[Backend] = []


def choose() -> Backend:
    """The backend for the installed SGLang (PartialSeries, one line, where it has part of the
    series: half of Kara would run through hooks on an SGLang that changed under them)."""
    found = {point: adapter.has_extension(point) for point in adapter.EXTENSION_POINTS}
    if all(found.values()):
        from sgl_kara.backends.patched import ExtensionPoints

        backend = ExtensionPoints()
    elif not any(found.values()):
        from sgl_kara.backends.hooked import Hooks

        backend = Hooks()
    else:
        missing = [
            f"{adapter.EXTENSION_POINTS[p][0]} {p}" for p, ok in found.items() if not ok
        ]
        raise PartialSeries(
            f"the installed SGLang has {sum(found.values())} of the {len(found)} extension "
            f"points of sgl_kara's upstream series (missing: {', '.join(missing)}): apply "
            "the whole series (patches/upstream) or none"
        )
    _CHOSEN[:] = [backend]
    return backend


def current() -> Backend:
    """This process's backend (chosen now if start-up did not)."""
    return _CHOSEN[0] if _CHOSEN else choose()
