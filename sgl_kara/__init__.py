"""sgl_kara: Kara sliding-window KV-cache compression as an SGLang 0.5.23 extension.

``sgl_kara.Engine`` is ``sglang.Engine`` plus ``kara_*`` options; ``python -m
sgl_kara.launch_server`` is SGLang's server plus ``--kara-*`` flags. The algorithm
(``sgl_kara.policies``) and kernels (``sgl_kara.kernels``) import nothing from SGLang.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "Engine":
        from sgl_kara.engine import Engine

        return Engine
    if name == "KaraConfig":
        from sgl_kara.config import KaraConfig

        return KaraConfig
    raise AttributeError(f"module 'sgl_kara' has no attribute {name!r}")
