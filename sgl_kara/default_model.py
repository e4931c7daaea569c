"""The model served when no --model-path is given: a small model shipped inside the package."""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "default_model"


def default_model_path() -> str:
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"embedded default model missing at {DEFAULT_MODEL_DIR}; run scripts/make_default_model.py"
        )
    return str(DEFAULT_MODEL_DIR)
