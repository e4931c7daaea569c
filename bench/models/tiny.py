"""Write tiny, seeded, random-weight Llama / Qwen3 / Qwen2 models with a real tokenizer to a folder.

Used by the tests (fixtures).
The tokenizer is a byte-level BPE trained here on a fixed corpus, so any text round-trips and
nothing is downloaded. Imports nothing from SGLang.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = """\
Reasoning models write long chains of thought. Each step looks back at values computed earlier.
Let x = 3. Let y = x + 4, so y = 7. Then z = y - 2 = 5. The answer is 5.
The key value cache grows with every generated token until memory limits concurrency.
Kara compresses the recent window of generated tokens with bidirectional attention scores,
keeps the top entries and flexible chunks, and runs on a periodic schedule.
Question: what is 12 plus 30? Answer: 42. What is the capital of France? Paris.
a b c d e f g h i j k l m n o p q r s t u v w x y z A B C D E F G H I J K L M N O P Q R S T U V W X Y Z
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) [ ] { } < > , . ; : ! ? ' "
The quick brown fox jumps over the lazy dog. Hello, world! Once upon a time there was a server.
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = (
    "<|bos|> <|eos|> <|pad|> <|system|> <|user|> <|assistant|> <|end|>"
).split()


def write_tokenizer(path: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE on CORPUS and save it in Hugging Face format; returns vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 20
    fast.save_pretrained(str(path))
    return len(fast)


def write_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 8192,
    vocab_size: int = 512,
    seed: int = 0,
    init_std: float = 0.5,
    rope_theta: float | None = None,
) -> Path:
    """Write a random-weight causal LM (``arch`` in {"llama", "qwen3", "qwen2"}) plus tokenizer to ``path``.

    ``rope_theta``: default 10000 (llama, qwen3) and 50000 (qwen2: a non-default base, so a checkpoint
    whose RoPE base does not reach the runtime fails the exactness oracle). Qwen2 has q/k/v biases
    (random here, like every weight).

    ``init_std`` is large on purpose: with near-zero weights every logit ties and greedy decoding
    of a random model would be degenerate; larger weights give varied, seed-determined tokens.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    real_vocab = write_tokenizer(path, vocab_size)
    head_dim = head_dim or hidden_size // num_heads
    common = dict(
        vocab_size=real_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta or (50000.0 if arch == "qwen2" else 10000.0),
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="float32",
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen3":
        config = Qwen3Config(**common, use_sliding_window=False)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    else:
        raise ValueError(f"arch must be 'llama', 'qwen3' or 'qwen2', got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, init_std / max(1.0, param.shape[-1] ** 0.5) * 4)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    )
    return path
