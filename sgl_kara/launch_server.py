"""``python -m sgl_kara.launch_server [SGLang server flags] [--kara-* flags]``.

Starts SGLang's HTTP server (OpenAI-compatible API, /generate, /metrics) with Kara's scheduler.
With no --model-path the embedded default model is served; without CUDA, CPU defaults apply.
Invalid Kara flags or unsupported combinations exit with status 2 before any model loads.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from sgl_kara.config import KaraConfigError, add_cli_args, from_cli_namespace


def _kara_parser(add_help: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sgl_kara.launch_server", add_help=add_help)
    add_cli_args(parser)
    return parser


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


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
        raise SystemExit(2)
    from sgl_kara.default_model import default_model_path
    from sgl_kara.plugin import register
    from sgl_kara.support import UnsupportedFeature, cpu_defaults, prepare_server_args

    register()
    if not _has_flag(rest, "--model-path") and not _has_flag(rest, "--model"):
        rest = ["--model-path", default_model_path()] + rest
    for key, value in cpu_defaults().items():
        flag = "--" + key.replace("_", "-")
        if not _has_flag(rest, flag):
            rest += [flag, str(value)]
    from sgl_kara._sglang import prepare_server_args as sglang_prepare

    server_args = sglang_prepare(rest)
    try:
        prepare_server_args(server_args, cfg)
    except UnsupportedFeature as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    return cfg, server_args


def main(argv: list[str] | None = None) -> None:
    cfg, server_args = parse(sys.argv[1:] if argv is None else argv)
    from sgl_kara._sglang import sglang_launch_server

    kwargs = {}
    if cfg.enabled:
        from sgl_kara.scheduler.kara_scheduler import run_kara_scheduler_process

        kwargs["run_scheduler_process_func"] = functools.partial(
            run_kara_scheduler_process, kara_config=cfg.to_dict()
        )
    server_args.resolve_once()
    try:
        sglang_launch_server(server_args, **kwargs)
    finally:
        from sglang.srt.utils import kill_process_tree

        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
