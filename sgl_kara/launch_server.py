"""``python -m sgl_kara.launch_server [SGLang server flags] [--kara-* flags]``.

Starts SGLang's HTTP server (OpenAI-compatible API, /generate, /metrics) with Kara's scheduler and
sgl_kara's hooks (``KARA_SERVE=1`` for every process it starts; sgl_kara/plugin.py).
Without CUDA, CPU defaults apply and with no --model-path the CPU serving kit's default model is
served; on a GPU --model-path is required.
Invalid Kara flags or unsupported combinations exit with status 2 before any model loads, and so
does another SGLang release than the one sgl_kara is made for, or one where a callable sgl_kara
hooks or overrides is missing or has another signature (server_setup.check_sglang).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

if not glob.glob("/dev/nvidia[0-9]*"):
    # A CPU server: OpenMP's wait policy is read once, when torch loads (sgl_kara.config
    # imports it), and the workers fork from here.
    from sgl_kara.cpu.threads import prefer_passive_omp

    prefer_passive_omp()

from sgl_kara.config import KaraConfigError, add_cli_args, from_cli_namespace  # noqa: E402


def _kara_parser(add_help: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_kara.launch_server", add_help=add_help
    )
    add_cli_args(parser)
    return parser


# ServerArgs fields whose user-given values decide sgl_kara's defaults (server_setup.server_defaults).
USER_SIZING_FIELDS = (
    "device",
    "dtype",
    "attention_backend",
    "page_size",
    "max_total_tokens",
    "max_running_requests",
    "mem_fraction_static",
)


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` (``--flag v`` or ``--flag=v``; the last one wins), else None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1 :]
    return value


def parse(argv: list[str]):
    """Returns (KaraConfig, ServerArgs); exits 2 with a message naming the flag on bad input."""
    if "-h" in argv or "--help" in argv:
        _kara_parser(add_help=False).print_help()
        print("\nAll SGLang server flags are accepted as well:\n")
    kara_ns, rest = _kara_parser(add_help=False).parse_known_args(argv)
    try:
        cfg = from_cli_namespace(kara_ns)
    except KaraConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from sgl_kara.plugin import serving

    with (
        serving()
    ):  # the hooks and the "kara" radix backend, before SGLang validates the flags
        return _resolve(cfg, rest)


def _resolve(cfg, rest: list[str]):
    from sgl_kara.server_setup import (
        default_model_path,
        device_of,
        prepare,
        server_defaults,
    )
    from sgl_kara.startup import UnsupportedFeature

    given = {
        field: _flag_value(rest, _flag(field))
        for field in USER_SIZING_FIELDS
        if _has_flag(rest, _flag(field))
    }
    if not _has_flag(rest, "--model-path") and not _has_flag(rest, "--model"):
        try:
            rest = ["--model-path", default_model_path(device_of(given))] + rest
        except UnsupportedFeature as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    model_path = _flag_value(rest, "--model-path") or _flag_value(rest, "--model")
    for key, value in server_defaults(model_path, given, cfg.enabled).items():
        rest += [_flag(key), str(value)]
    from sgl_kara._sglang import prepare_server_args as sglang_prepare

    server_args = sglang_prepare(rest)
    try:
        cfg = prepare(server_args, cfg)
    except UnsupportedFeature as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return cfg, server_args


def main(argv: list[str] | None = None) -> None:
    from sgl_kara import env
    from sgl_kara.server_setup import check_sglang
    from sgl_kara.startup import UnsupportedSGLang

    try:  # the release before anything of SGLang is imported, then the pinned callables
        check_sglang()
    except UnsupportedSGLang as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    # this process and every SGLang process it starts serve with sgl_kara
    os.environ[env.SERVE] = "1"
    cfg, server_args = parse(
        sys.argv[1:] if argv is None else argv
    )  # registers and applies the hooks
    from sgl_kara._sglang import kill_process_tree, sglang_launch_server
    from sgl_kara.plugin import set_serving_policy

    set_serving_policy(cfg.policy)
    kwargs = {}
    if cfg.enabled:
        from sgl_kara.server_setup import scheduler_process

        kwargs["run_scheduler_process_func"] = scheduler_process(cfg)
    server_args.resolve_once()
    if server_args.device == "cpu" and env.fork_workers():
        from sgl_kara.cpu.hooks import fork_server_processes

        fork_server_processes()
    try:
        sglang_launch_server(server_args, **kwargs)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
