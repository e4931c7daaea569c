"""The model served when no --model-path is given, shipped inside the package: the reasoning proxy
(3.5M-parameter Llama, word-level tokenizer) trained by bench/quality/train.py on the
variable-tracking task of bench/quality/task.py. Prompts in that task's format get a real chain of
thought (hundreds of tokens, so Kara compresses several windows); other text maps to <unk>."""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "default_model"


def default_model_path() -> str:
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"embedded default model missing at {DEFAULT_MODEL_DIR}; reinstall sgl_kara (the package data holds it) "
            "or retrain it with bench/quality/train.py"
        )
    return str(DEFAULT_MODEL_DIR)
