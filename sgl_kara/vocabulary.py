"""The model's vocabulary as text, for a policy that reads token ids (``Policy.needs_tokens``).

Read once per process from the tokenizer at the model path (transformers, as the model's own
files define it). No SGLang, nothing else of sgl_kara.
"""

from __future__ import annotations

import functools


def load_tokenizer(model_path: str, revision: str | None = None):
    """The model's tokenizer. Raises ValueError naming the path when none loads from it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, revision=revision)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"no tokenizer loads from --model-path {model_path}: the policy reads token ids "
            f"and needs the model's tokenizer there ({e})"
        ) from None


@functools.lru_cache(maxsize=4)
def token_pieces(model_path: str, revision: str | None = None) -> tuple[str, ...]:
    """Every token id's text, decoded alone (index: the id); ValueError as ``load_tokenizer``."""
    tok = load_tokenizer(model_path, revision)
    n = max(len(tok), int(getattr(tok, "vocab_size", 0) or 0))
    return tuple(tok.batch_decode([[i] for i in range(n)]))
