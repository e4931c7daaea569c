"""The shape of the model a server will load, read before SGLang loads it: what Kara's start-up
checks and memory plan need (layers, heads, head dim, context, weight bytes, attention kinds).

The config is read where SGLang would read it, without a download: a local checkpoint directory,
else the Hugging Face hub cache (a model not cached yet gets its shape from SGLang's own
resolution of the config, ``ModelShape.from_config``). Weight bytes come from the checkpoint's files (a local directory), else its safetensors
index (``metadata.total_size``), else the parameter count the config implies (dense and MoE
layers, embeddings, an untied lm_head) at the checkpoint's dtype. ``per_rank(tp)`` is the shape
one tensor-parallel rank holds. No SGLang import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

LOCAL_LAYER_KINDS = ("sliding_attention", "chunked_attention")
ITEMSIZE = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class ModelShape:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    context_len: int
    checkpoint_dtype: str
    # Bytes of the checkpoint's weight files at ``checkpoint_dtype`` (0: unknown, then
    # ``parameters`` x itemsize).
    weight_file_bytes: int
    parameters: int = 0  # implied by the config (``config_parameters``)
    mrope: bool = False  # multimodal rotary positions (Qwen2-VL style): refused
    lm_head_elements: int = 0  # vocab x hidden
    # Attention other than global MHA / GQA over every layer (refused before the model loads):
    # the architecture, local-attention layers (sliding or chunked) and their window, MLA's
    # latent rank, and layer kinds other than attention (linear attention, Mamba).
    architecture: str = ""
    local_layers: int = 0
    local_window: int = 0
    mla_rank: int = 0
    other_layers: tuple = ()
    tp_size: int = 1  # the tensor-parallel degree this shape is one rank of
    hidden: int = 0  # the residual stream's width (every rank holds it whole)
    intermediate: int = (
        0  # the MLP's width a token passes through on this rank (MoE: its experts')
    )

    @classmethod
    def from_model_path(
        cls, model_path: str, revision: str | None = None
    ) -> ModelShape | None:
        """The shape of the model at ``model_path`` (a directory, or a hub id already in the
        cache); None when no config can be read without a download."""
        directory = Path(model_path)
        try:
            if (directory / "config.json").is_file():
                config = _auto_config(str(directory))
                return cls.from_config(config, _local_weight_bytes(directory))
            config = _auto_config(model_path, revision)
        except (AttributeError, TypeError, ValueError, OSError, ImportError):
            return None
        try:
            return cls.from_config(config, _hub_weight_bytes(model_path, revision))
        except (AttributeError, TypeError, ValueError):
            return None

    @classmethod
    def from_config(cls, cfg, weight_file_bytes: int = 0) -> ModelShape:
        """From a transformers config (a checkpoint's, or SGLang's
        ``ModelConfig.hf_config``)."""
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        q_heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // q_heads)
        dtype = str(
            getattr(text, "dtype", None)
            or getattr(text, "torch_dtype", None)
            or "float32"
        )
        mrope = _uses_mrope(cfg, text)
        kinds = list(getattr(text, "layer_types", None) or [])
        local = [k for k in kinds if k in LOCAL_LAYER_KINDS]
        window = _local_window(text, local)
        vocab = int(getattr(text, "vocab_size", 0) or 0)
        hidden = int(getattr(text, "hidden_size", 0) or 0)
        others = {k for k in kinds if k not in ("full_attention", *LOCAL_LAYER_KINDS)}
        dense = int(getattr(text, "intermediate_size", 0) or 0)
        experts = int(getattr(text, "num_experts_per_tok", 0) or 0) * int(
            getattr(text, "moe_intermediate_size", 0) or 0
        )
        return cls(
            layers=int(text.num_hidden_layers),
            q_heads=q_heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or q_heads),
            head_dim=head_dim,
            context_len=int(getattr(text, "max_position_embeddings", 0) or 0),
            checkpoint_dtype=dtype.replace("torch.", ""),
            weight_file_bytes=int(weight_file_bytes),
            parameters=config_parameters(text, cfg),
            mrope=mrope,
            lm_head_elements=vocab * hidden,
            architecture=str((getattr(cfg, "architectures", None) or [""])[0]),
            local_layers=len(local),
            local_window=int(window or 0) if local else 0,
            mla_rank=int(getattr(text, "kv_lora_rank", 0) or 0),
            other_layers=tuple(sorted(others)),
            hidden=hidden,
            intermediate=max(dense, experts),
        )

    def per_rank(self, tp_size: int) -> ModelShape:
        """What one of ``tp_size`` tensor-parallel ranks holds: its query heads, its KV heads
        (SGLang replicates KV heads when there are fewer than ranks), its share of the weights."""
        if tp_size <= 1:
            return self
        return replace(
            self,
            q_heads=max(1, self.q_heads // tp_size),
            kv_heads=max(1, self.kv_heads // tp_size),
            weight_file_bytes=-(-self.weight_file_bytes // tp_size),
            parameters=-(-self.parameters // tp_size),
            lm_head_elements=-(-self.lm_head_elements // tp_size),
            tp_size=tp_size,
            intermediate=-(-self.intermediate // tp_size),
        )

    def itemsize(self, dtype: str | None) -> int:
        """Bytes per element when served with SGLang's --dtype ``dtype`` (auto: the
        checkpoint's)."""
        name = self.checkpoint_dtype if dtype in (None, "", "auto") else dtype
        return ITEMSIZE.get(str(name), 4)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize

    def ring_bytes(self, rows: int, capacity: int, itemsize: int) -> int:
        return ring_bytes(
            rows, capacity, [(self.q_heads, self.head_dim)] * self.layers, itemsize
        )

    def activation_elements_per_token(self) -> int:
        """Elements a token's forward holds at once through one layer on this rank: the
        residual, the hidden state and its norm (3 hidden), q, k and v and the attention output
        ((2 H_q + 2 H_kv) D), the MLP's gate and up and their product (3 intermediate)."""
        attention = (2 * self.q_heads + 2 * self.kv_heads) * self.head_dim
        return 3 * self.hidden + attention + 3 * self.intermediate

    def weight_bytes(self, itemsize: int) -> int:
        """Bytes of the weights served at ``itemsize`` per element."""
        if self.weight_file_bytes:
            stored = ITEMSIZE.get(self.checkpoint_dtype, 4)
            return self.weight_file_bytes * itemsize // stored
        return self.parameters * itemsize


def _uses_mrope(cfg, text) -> bool:
    """Multimodal RoPE (sections per modality), in either config's rope settings."""
    rope = [
        getattr(c, a, None)
        for c in (cfg, text)
        for a in ("rope_scaling", "rope_parameters")
    ]
    return any(
        isinstance(r, dict) and ("mrope_section" in r or r.get("type") == "mrope")
        for r in rope
    )


def _local_window(text, local: list[str]):
    """The window of the local layers. transformers derives ``layer_types`` for the interleaved
    local / global models (Gemma-2/3, Cohere2, Exaone4, GPT-OSS: sliding_attention; Llama-4:
    chunked_attention) and for hybrids (Qwen3-Next: linear_attention); a model without it
    attends globally on every layer in SGLang 0.5.23 (Mistral's sliding_window is not applied
    by its Llama model)."""
    chunk = (
        getattr(text, "attention_chunk_size", None)
        if "chunked_attention" in local
        else None
    )
    return (
        chunk
        or getattr(text, "sliding_window", None)
        or getattr(text, "sliding_window_size", None)
    )


def config_parameters(text, cfg=None) -> int:
    """Parameters a decoder-only config implies: attention (q, k, v, o), the MLP of every layer
    (gated: gate, up, down; MoE layers: every routed and shared expert and the router), the
    embedding and, unless tied, the lm_head. Norms and biases are left out (< 0.1%)."""
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    q_heads = int(getattr(text, "num_attention_heads", 0) or 0)
    if not (hidden and layers and q_heads):
        return 0
    kv_heads = int(getattr(text, "num_key_value_heads", None) or q_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // q_heads)
    attention = hidden * head_dim * (2 * q_heads + 2 * kv_heads)
    dense = 3 * hidden * int(getattr(text, "intermediate_size", 0) or 0)
    experts = int(
        getattr(text, "n_routed_experts", None)
        or getattr(text, "num_local_experts", None)
        or getattr(text, "num_experts", None)
        or 0
    )
    mlp = [dense] * layers
    if experts:
        expert = 3 * hidden * int(getattr(text, "moe_intermediate_size", None) or 0)
        shared = int(
            getattr(text, "n_shared_experts", 0) or 0
        ) * expert + 3 * hidden * int(
            getattr(text, "shared_expert_intermediate_size", 0) or 0
        )
        moe = experts * (expert or dense) + shared + experts * hidden
        first_dense = int(getattr(text, "first_k_dense_replace", 0) or 0)
        mlp = [dense] * first_dense + [moe] * (layers - first_dense)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    tied = bool(getattr(cfg if cfg is not None else text, "tie_word_embeddings", False))
    return layers * attention + sum(mlp) + vocab * hidden * (1 if tied else 2)


def ring_rows(
    max_running: int, pool_tokens: int | None, capacity: int, limit: int = 0
) -> int:
    """Rows of the capture query ring: one per request that can be decoding at once, and no
    more than the KV pool can hold requests of ``capacity`` tokens each (a row keeps
    ``capacity`` = window + period queries; a request whose window is scored holds at least that
    window in the pool, and Kara's admission reserves it). A request that finds no free row is
    scored from recomputed queries at its event, so the pool bound only trades a rare recompute
    for a ring that does not outgrow the pool it serves. ``limit`` (``--kara-query-ring-rows``;
    0: none) caps the rows further."""
    rows = max_running
    if pool_tokens is not None and pool_tokens > 0 and capacity > 0:
        rows = max(1, min(max_running, -(-pool_tokens // capacity)))
    return min(rows, limit) if limit else rows


def ring_bytes(rows: int, capacity: int, layer_heads, itemsize: int) -> int:
    """Bytes of a capture ring of ``rows`` rows (``ring_rows``) of ``capacity`` queries, for
    layers of ``layer_heads`` = (H_q, D) each: one more row than ``rows``, the trash row
    QueryRing keeps for requests that hold none."""
    return (rows + 1) * capacity * sum(hq * d for hq, d in layer_heads) * itemsize


def _auto_config(name: str, revision: str | None = None):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name, revision=revision, local_files_only=True)


def _local_weight_bytes(directory: Path) -> int:
    files = sum(
        f.stat().st_size
        for f in directory.iterdir()
        if f.suffix in (".safetensors", ".bin")
    )
    return files or _index_total(directory / INDEX_FILE)


def _hub_weight_bytes(model_path: str, revision: str | None) -> int:
    """The safetensors index's total size from the hub cache (0 when it is not cached: the
    config's parameter count is used instead; nothing is downloaded for it)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return 0
    found = try_to_load_from_cache(model_path, INDEX_FILE, revision=revision)
    return _index_total(Path(found)) if isinstance(found, str) else 0


def _index_total(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["metadata"]["total_size"])
    except (OSError, KeyError, TypeError, ValueError):
        return 0
