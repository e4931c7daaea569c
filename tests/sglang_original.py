"""A stand-in for the SGLang function a hook wraps (its ``original``): it checks each call against
SGLang's real signature (the installed SGLang, unwrapped) -- the arguments bind, and every one
but ``self`` (a method's) comes by keyword, as sgl_kara's hooks pass them -- records the bound arguments and
returns a fixed value."""

from __future__ import annotations

import inspect
import pkgutil


def sglang_function(target: str):
    owner_path, _, name = target.rpartition(".")
    raw = inspect.getattr_static(pkgutil.resolve_name(owner_path), name)
    return inspect.unwrap(
        raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    )


def sglang_original(target: str, calls: list, value="sglang's own", side_effect=None):
    signature = inspect.signature(sglang_function(target))
    method = next(iter(signature.parameters), None) in (
        "self",
        "cls",
    )  # a staticmethod takes no self

    def original(*args, **kwargs):
        bound = signature.bind(
            *args, **kwargs
        )  # TypeError: not a call SGLang's function takes
        assert len(args) == int(method), (
            f"{target}: called with {len(args)} positional arguments"
        )
        calls.append(dict(bound.arguments))
        if side_effect is not None:
            side_effect(**bound.arguments)
        return value

    return original
