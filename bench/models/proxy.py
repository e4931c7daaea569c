"""The reasoning proxy: a 3.5M-parameter Llama with a word-level tokenizer, trained (once;
its weights are committed) on the pointer-chain task of bench/quality/task.py. It is the quality
benchmark's task model and the tests' fast real-weight model: prompts in that task's format get a
real chain of thought (hundreds of tokens); other text maps to <unk>."""

from pathlib import Path

PROXY_MODEL_DIR = Path(__file__).parent / "reasoning_proxy"


def proxy_model_path() -> str:
    if not (PROXY_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(f"reasoning proxy missing at {PROXY_MODEL_DIR}")
    return str(PROXY_MODEL_DIR)
