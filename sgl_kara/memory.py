"""Memory sizing on CPU: the request limit, KV pool and capture ring a server can hold, checked at
start-up. SGLang sizes its KV pool from free memory (~11 GB of float32 KV for a 14 MB model on a
24 GB machine, OOM-killed at the first request), so unless the user sets them (or
``--mem-fraction-static``) sgl_kara sets the two below, and refuses, naming the flags, weights +
KV pool + ring + PROCESS_FLOOR_BYTES that do not fit in the available memory (docs/CONFIGURATION.md,
"CPU defaults and memory sizing"). No SGLang import; shapes come from the model's config.json.

    --max-running-requests  CPU_RUNNING_REQUESTS (8 unless the user sets it; SmolLM2 decodes
                            82.9 tok/s in all with 8 concurrent requests on a 2-core VM,
                            bench/RESULTS.md "Default server")
    --max-total-tokens      min(CPU_KV_SHARE (5%) of physical RAM / KV bytes per token,
                                max(context length, max_running_requests * CPU_TOKENS_PER_REQUEST))
                            (SmolLM2, float32, 24 GB: 8,192 tokens, 0.35 GiB: one full-context
                            request, or 8 of ~1k tokens uncompressed)
    capture ring bytes      (rows + 1) * capacity * layers * H_q * D * itemsize   (ring_rows, ring_bytes;
                            one row per running request, +1: QueryRing's trash row)

Kara's own memory beside the pool (``kara_memory``), on CPU and CUDA alike: the capture ring, an
event's scores and selection (EVENT_BYTES_PER_SCORE per region entry, layer and KV head, for at
most every running request's region, at most the pool), and a decode observer's state and
workspace (H2O: ``policies/h2o.py`` ``observer_bytes``). On CPU it is part of the RAM check; on
CUDA support.py takes it from the KV pool (a lower ``--mem-fraction-static``, docs/CONFIGURATION.md
"Kara's memory on CUDA").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CPU_RUNNING_REQUESTS = 8
CPU_KV_SHARE = 0.05
CPU_TOKENS_PER_REQUEST = 1024
MIN_TOKENS = 4096
# Measured on a 2-core 24 GB VM: importing torch + SGLang costs ~0.9 GB of private memory in each of
# the launcher (tokenizer manager), scheduler and detokenizer processes.
PROCESS_FLOOR_BYTES = 3 * 900 * (1 << 20)
# auto query source: capture on CPU while the ring needs at most this share of available RAM;
# on CUDA only when the running-request limit is known and the ring fits this share of the GPU.
CPU_RING_SHARE = 0.25
CUDA_RING_SHARE = 0.05
# An event's scores [B, layers, H_kv, M] and their selection, per score: the float32 score (4), its
# sort's float32 values and int64 order (12), Token2Chunk's float64 copy (8) and masks: <= 32 bytes
# (policies/base.py top_k, policies/kara.py select).
EVENT_BYTES_PER_SCORE = 32

LOCAL_LAYER_KINDS = ("sliding_attention", "chunked_attention")
_ITEMSIZE = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


class MemoryConfigError(ValueError):
    """A memory configuration that cannot work; the message names the flags to change."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    context_len: int
    checkpoint_dtype: str
    weight_file_bytes: int
    mrope: bool = (
        False  # multimodal rotary positions (Qwen2-VL style): refused by support.py
    )
    lm_head_elements: int = (
        0  # vocab x hidden: the lm_head's packed copy on CPU (cpu/linear.py)
    )
    # Attention other than global MHA / GQA over every layer (refused by support.py, before the
    # model loads): the architecture, local-attention layers (sliding or chunked) and their
    # window, MLA's latent rank, and layer kinds other than attention (linear attention, Mamba).
    architecture: str = ""
    local_layers: int = 0
    local_window: int = 0
    mla_rank: int = 0
    other_layers: tuple = ()

    @classmethod
    def from_model_path(cls, model_path: str) -> ModelShape | None:
        """None when the path is not a local checkpoint directory or its config is unusual."""
        path = Path(model_path)
        if not (path / "config.json").is_file():
            return None
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(path)
            weights = sum(
                f.stat().st_size
                for f in path.iterdir()
                if f.suffix in (".safetensors", ".bin")
            )
            return cls.from_config(cfg, weights)
        except (AttributeError, TypeError, ValueError, OSError):
            return None

    @classmethod
    def from_config(cls, cfg, weight_file_bytes: int = 0) -> ModelShape:
        """From a transformers config (a local checkpoint's, or SGLang's ``ModelConfig.hf_config``)."""
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        q_heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // q_heads)
        dtype = str(
            getattr(text, "dtype", None)
            or getattr(text, "torch_dtype", None)
            or "float32"
        )
        rope = [
            getattr(c, a, None)
            for c in (cfg, text)
            for a in ("rope_scaling", "rope_parameters")
        ]
        mrope = any(
            isinstance(r, dict) and ("mrope_section" in r or r.get("type") == "mrope")
            for r in rope
        )
        # transformers derives layer_types for the interleaved local / global models (Gemma-2/3,
        # Cohere2, Exaone4, GPT-OSS: sliding_attention; Llama-4: chunked_attention) and for hybrids
        # (Qwen3-Next: linear_attention); a model without it attends globally on every layer in
        # SGLang 0.5.23 (Mistral's sliding_window is not applied by its Llama model).
        kinds = list(getattr(text, "layer_types", None) or [])
        local = [k for k in kinds if k in LOCAL_LAYER_KINDS]
        window = (
            getattr(text, "attention_chunk_size", None)
            if "chunked_attention" in local
            else None
        )
        window = (
            window
            or getattr(text, "sliding_window", None)
            or getattr(text, "sliding_window_size", None)
        )
        return cls(
            layers=int(text.num_hidden_layers),
            q_heads=q_heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or q_heads),
            head_dim=head_dim,
            context_len=int(getattr(text, "max_position_embeddings", 0) or 0),
            checkpoint_dtype=dtype.replace("torch.", ""),
            weight_file_bytes=int(weight_file_bytes),
            mrope=mrope,
            lm_head_elements=int(getattr(text, "vocab_size", 0) or 0)
            * int(getattr(text, "hidden_size", 0) or 0),
            architecture=str((getattr(cfg, "architectures", None) or [""])[0]),
            local_layers=len(local),
            local_window=int(window or 0) if local else 0,
            mla_rank=int(getattr(text, "kv_lora_rank", 0) or 0),
            other_layers=tuple(
                sorted(
                    {
                        k
                        for k in kinds
                        if k not in ("full_attention", *LOCAL_LAYER_KINDS)
                    }
                )
            ),
        )

    def itemsize(self, dtype: str | None) -> int:
        """Bytes per element when served with SGLang's --dtype ``dtype`` (auto: the checkpoint's)."""
        name = self.checkpoint_dtype if dtype in (None, "", "auto") else dtype
        return _ITEMSIZE.get(str(name), 4)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize

    def ring_bytes(self, rows: int, capacity: int, itemsize: int) -> int:
        return ring_bytes(
            rows, capacity, [(self.q_heads, self.head_dim)] * self.layers, itemsize
        )

    def weight_bytes(self, itemsize: int) -> int:
        stored = _ITEMSIZE.get(self.checkpoint_dtype, 4)
        return self.weight_file_bytes * itemsize // stored


def ring_rows(
    max_running: int, pool_tokens: int | None, capacity: int, limit: int = 0
) -> int:
    """Rows of the capture query ring: one per request that can be decoding at once, and no
    more than the KV pool can hold requests of ``capacity`` tokens each (a row keeps ``capacity``
    = window + period queries; a request whose window is scored holds at least that window in the
    pool, and Kara's admission reserves it). A request that finds no free row is scored from
    recomputed queries at its event (runtime: the ring's ``assign`` fails), so the pool bound
    only trades a rare recompute for a ring that does not outgrow the pool it serves (a grid with
    ``--max-running 256`` and a 4k-token pool sized 257 rows, which pushed ``auto`` to recompute).
    ``limit`` (``--kara-query-ring-rows``; 0: none) caps the rows further."""
    rows = max_running
    if pool_tokens is not None and pool_tokens > 0 and capacity > 0:
        rows = max(1, min(max_running, -(-pool_tokens // capacity)))
    return min(rows, limit) if limit else rows


def ring_bytes(rows: int, capacity: int, layer_heads, itemsize: int) -> int:
    """Bytes of a capture ring of ``rows`` rows (``ring_rows``) of ``capacity`` queries, for layers
    of ``layer_heads`` = (H_q, D) each: one more row than ``rows``, the trash row QueryRing keeps
    for requests that hold none."""
    return (rows + 1) * capacity * sum(hq * d for hq, d in layer_heads) * itemsize


def cpu_ring_budget(available_ram: int) -> int:
    """Bytes a CPU capture ring may take: CPU_RING_SHARE of the available RAM. On CPU the ring sits
    beside the KV pool (the pool's size is set, not taken from what is left), and it saves each
    window's recompute forwards: with 8 concurrent requests on the default server, recompute
    stalled every request for 9.7-10.0 s at the event scored whole, and spread over the steps still
    cost 15% of throughput with 4x-median stalls, where capture ran at 0.98x plain SGLang with
    2x-median stalls (bench/RESULTS.md, "Events that do not stop the server")."""
    return int(CPU_RING_SHARE * available_ram)


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_ram_bytes()


def cpu_memory_defaults(
    shape: ModelShape | None, itemsize: int, total_ram: int, given
) -> dict:
    """SGLang server args for a CPU server that the user did not set (names as ServerArgs fields).
    ``given``: the ServerArgs fields the user set, with their values (a mapping; a set of names
    means values unknown); a given ``max_running_requests`` sizes the pool like the default does."""
    given = given if isinstance(given, dict) else dict.fromkeys(given)
    out = {}
    if "max_running_requests" not in given:
        out["max_running_requests"] = CPU_RUNNING_REQUESTS
    if shape is not None and not given.keys() & {
        "max_total_tokens",
        "mem_fraction_static",
    }:
        running = int(
            given.get("max_running_requests")
            or out.get("max_running_requests")
            or CPU_RUNNING_REQUESTS
        )
        by_ram = int(CPU_KV_SHARE * total_ram) // shape.kv_bytes_per_token(itemsize)
        by_work = max(shape.context_len, running * CPU_TOKENS_PER_REQUEST)
        out["max_total_tokens"] = max(MIN_TOKENS, min(by_ram, by_work))
    return out


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def check_cpu_fit(
    shape: ModelShape,
    itemsize: int,
    max_total_tokens: int,
    ring_rows: int,
    ring_capacity: int,
    available: int,
    packed_linear: bool = False,
    max_running_requests: int | None = None,
    replicas: int = 1,
    kara_workspace: int = 0,
) -> dict:
    """Raise MemoryConfigError when weights (+ the lm_head's packed copy when ``packed_linear``
    and float32: cpu/linear.py packs the other weights in place) + KV pool + ring + Kara's event
    and observer memory (``kara_workspace``: ``kara_memory`` less the ring) (+ the processes'
    floor) exceed ``available``; returns the byte counts (for the start-up log). ``replicas``
    (``--dp-size``): each replica's scheduler holds its own weights, pool, ring and workspace, and
    adds a process (the DP controller one more)."""
    sizes = {
        "weights": replicas * shape.weight_bytes(itemsize),
        "packed_lm_head": replicas * shape.lm_head_elements * 4
        if packed_linear and itemsize == 4
        else 0,
        "kv_pool": replicas * max_total_tokens * shape.kv_bytes_per_token(itemsize),
        "capture_ring": replicas * shape.ring_bytes(ring_rows, ring_capacity, itemsize)
        if ring_rows
        else 0,
        "kara_workspace": replicas * kara_workspace,
        "processes": PROCESS_FLOOR_BYTES
        + (replicas * PROCESS_FLOOR_BYTES // 3 if replicas > 1 else 0),
    }
    need = sum(sizes.values())
    if need > available:
        running = (
            f"--max-running-requests ({max_running_requests})"
            if max_running_requests
            else "--max-running-requests"
        )
        raise MemoryConfigError(
            f"this server needs {gib(need)} ({plan_text(sizes, max_total_tokens, ring_rows, ring_capacity)}) but "
            f"{gib(available)} of RAM is available: lower --max-total-tokens ({max_total_tokens}) or {running}, "
            "or shrink the capture ring with a smaller --kara-window / --kara-period, --kara-query-ring-rows or "
            "--kara-query-source recompute"
            + (f", or --dp-size ({replicas} replicas)" if replicas > 1 else "")
        )
    return sizes


def plan_text(
    sizes: dict, max_total_tokens: int, ring_rows: int, ring_capacity: int
) -> str:
    """``check_cpu_fit``'s sizes, each named by what it holds (the start-up log and the refusal)."""
    what = {
        "weights": "weights",
        "packed_lm_head": "lm_head packed copy",
        "kv_pool": f"KV pool ({max_total_tokens} tokens)",
        "capture_ring": f"capture ring ({ring_rows} rows x {ring_capacity} queries)",
        "kara_workspace": "Kara's event and observer memory",
        "processes": "SGLang's processes",
    }
    return ", ".join(f"{what.get(k, k)} {gib(v)}" for k, v in sizes.items() if v)


def kara_memory(
    shape: ModelShape,
    itemsize: int,
    pool_tokens: int,
    running: int | None,
    region_tokens: int,
    ring_rows: int = 0,
    ring_capacity: int = 0,
    observer=None,
) -> dict:
    """Bytes Kara holds beside the KV pool, by what holds them (per replica):

        capture_ring     ring_bytes(ring_rows, ring_capacity): allocated at start-up
        event_scores     the largest event's scores and selection: EVENT_BYTES_PER_SCORE x layers
                         x H_kv per region entry, for every running request's region (``running``
                         x ``region_tokens``, the policy's largest region) and at most the pool's
                         entries (``running`` None: SGLang sizes the request limit, the pool binds)
        observer         a decode observer's state and workspace: ``observer(shape, itemsize,
                         pool_tokens, running)`` (H2O: policies/h2o.py ``observer_bytes``)

    Every term is an upper bound for these settings; the CPU check adds them to the RAM a server
    needs, the CUDA start-up takes them from the pool's share of the GPU (support.py)."""
    entries = (
        pool_tokens if running is None else min(pool_tokens, running * region_tokens)
    )
    return {
        "capture_ring": shape.ring_bytes(ring_rows, ring_capacity, itemsize)
        if ring_rows
        else 0,
        "event_scores": entries * shape.layers * shape.kv_heads * EVENT_BYTES_PER_SCORE,
        "observer": observer(shape, itemsize, pool_tokens, running)
        if observer is not None
        else 0,
    }
