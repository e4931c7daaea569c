"""Server args of a sgl_kara server, as the launcher and ``sgl_kara.Engine`` build them:
sgl_kara's defaults where the user set none, the refusals and resolved KaraConfig of start-up
(startup.py), and, where the server runs on a CPU, the CPU serving kit's settings, RAM check and
thread binding (sgl_kara/cpu/server.py). A server on a GPU imports nothing of the kit."""

from __future__ import annotations

from sgl_kara import startup
from sgl_kara.config import KaraConfig


def default_model_path() -> str:
    """The model served without ``--model-path``: SmolLM2-135M-Instruct, converted once
    (sgl_kara/cpu/smollm2.py; raises its DefaultModelMissing, one line: the install command)."""
    from sgl_kara.cpu.smollm2 import default_model_path as smollm2

    return smollm2()


def server_defaults(model_path: str, given: dict, compressing: bool = False) -> dict:
    """Server args sgl_kara sets when the user did not (``given``: the ServerArgs fields the
    user set, with their values): on a CPU the kit's (cpu/server.py; ``compressing``: a
    compressing server); on a GPU none, SGLang's own defaults apply."""
    device = given.get("device") or ("cuda" if startup.cuda_available() else "cpu")
    if device != "cpu":
        return {}
    from sgl_kara.cpu.server import server_defaults as cpu_server_defaults

    return cpu_server_defaults(model_path, given, compressing)


def prepare(server_args, cfg: KaraConfig) -> KaraConfig:
    """Refusals and resolution (startup.prepare_server_args), then on a CPU the RAM check and
    the cores of each scheduler rank. Returns the resolved config."""
    cfg = startup.prepare_server_args(server_args, cfg)
    if startup.serving_device(server_args) == "cpu":
        from sgl_kara.cpu import server as cpu_server

        cpu_server.check_memory(server_args, cfg)
        cpu_server.threads_bind(server_args)
    return cfg
