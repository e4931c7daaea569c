"""Word-level Hugging Face tokenizer for the variable-tracking task (see task.py).

Whitespace-split words, one id per word of ``task.WORDS``; ``<bos>`` is prepended on encode
(template post-processor) and decode joins words with single spaces. The chat template is the
plain concatenation of message contents after ``<bos>`` (the prompt text already ends with the
``solve`` marker the solution follows).
"""

from __future__ import annotations

import os
import sys

from bench.quality.task import WORDS

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]  # ids 0..3
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }} {% endfor %}"
)


def build_tokenizer(words: list[str] | None = None):
    """A PreTrainedTokenizerFast over SPECIALS + words (default task.WORDS; ids in that order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + (WORDS if words is None else words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(
        prefix="##", cleanup=False
    )  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 16
    return fast


def save_tokenizer(out_dir: str | os.PathLike):
    tok = build_tokenizer()
    tok.save_pretrained(str(out_dir))
    return tok


if __name__ == "__main__":
    save_tokenizer(sys.argv[1] if len(sys.argv) > 1 else ".")
