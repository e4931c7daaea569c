"""Server arguments of a compressing server, before the model loads: SGLang features and models
Kara cannot serve refused with a message naming the flag or the model, never ignored
(``_UNSUPPORTED``, ``check_model``); ``--kara-query-source auto`` resolved to capture or recompute
(``resolve_query_source``); decode CUDA graphs kept off where the attention hook must run at
every decode step (``keep_decode_eager``); Kara's memory beside the pool taken from the KV pool's
share of a GPU (``reserve_device_memory``). The scheduler checks the built model again
(``check_runtime_supported``). Before any of it, the installed SGLang is the release sgl_kara is
made for (``check_sglang_version``), with every callable sgl_kara hooks or overrides there under
its pinned signature (``check_pins``). Device-independent: the CPU serving kit adds its own settings and
RAM check (``sgl_kara/cpu/server.py``) where the server runs on a CPU."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

from sgl_kara import env
from sgl_kara.config import KaraConfig
from sgl_kara.memory_plan import (
    CPU_RING_SHARE,
    CUDA_RING_SHARE,
    KaraFootprint,
    NoPoolLeft,
    available_ram_bytes,
    device_share,
    plan_text,
    recompute_tokens,
    sglang_max_running,
)
from sgl_kara.model_shape import ModelShape, ring_rows
from sgl_kara.vocabulary import load_tokenizer

logger = logging.getLogger(__name__)

# (ServerArgs field, predicate "is enabled", CLI flag, why)
_UNSUPPORTED = [
    (
        "speculative_algorithm",
        lambda v: v not in (None, "", "NONE"),
        "--speculative-algorithm",
        "speculative decoding verifies several tokens per step; Kara's positions assume one",
    ),
    (
        "enable_dp_attention",
        bool,
        "--enable-dp-attention",
        "DP attention is not supported yet",
    ),
    (
        "pp_size",
        lambda v: (v or 1) > 1,
        "--pp-size",
        "pipeline parallelism is not supported yet",
    ),
    (
        "disaggregation_mode",
        lambda v: v not in (None, "null"),
        "--disaggregation-mode",
        "PD disaggregation is not supported yet",
    ),
    (
        "enable_hierarchical_cache",
        bool,
        "--enable-hierarchical-cache",
        "HiCache is not supported yet",
    ),
    (
        "enable_mixed_chunk",
        bool,
        "--enable-mixed-chunk",
        "mixed chunks re-derive decode prefixes from token counts, which compression changes",
    ),
    ("enable_lmcache", bool, "--enable-lmcache", "LMCache is not supported"),
    ("enable_flexkv", bool, "--enable-flexkv", "FlexKV is not supported"),
    (
        "enable_streaming_session",
        bool,
        "--enable-streaming-session",
        "streaming sessions are not supported",
    ),
    (
        "enable_session_radix_cache",
        bool,
        "--enable-session-radix-cache",
        "session radix cache is not supported",
    ),
    (
        "enable_two_batch_overlap",
        bool,
        "--enable-two-batch-overlap",
        "two-batch overlap is not supported",
    ),
    (
        "enable_unified_memory",
        bool,
        "--enable-unified-memory",
        "unified memory pools are not supported",
    ),
    (
        "num_continuous_decode_steps",
        lambda v: (v or 1) > 1,
        "--num-continuous-decode-steps",
        "compression runs between decode steps; continuous steps skip it",
    ),
    ("enable_hisparse", bool, "--enable-hisparse", "HiSparse is not supported"),
    (
        "kv_cache_dtype",
        lambda v: (
            str(v) not in ("auto", "bfloat16", "float16", "float32", "bf16", "fp16")
        ),
        "--kv-cache-dtype",
        "quantized (fp8) KV caches are not supported: scoring reads keys as floats",
    ),
]
# SGLang environment switches that change the KV layout Kara's kernels index.
_UNSUPPORTED_ENV = [
    (
        "SGLANG_USE_HND_KVCACHE",
        "the HND KV layout is not supported: compaction and scoring index NHD slot rows",
    ),
]


class UnsupportedFeature(ValueError):
    pass


# The SGLang release this sgl_kara is made for (pyproject.toml pins it): the internals its
# adapters name, hook and override are this release's (sgl_kara/_sglang.py,
# sgl_kara/cpu/_sglang.py; tests/test_layering.py and tests/test_adapter_surface.py check them).
SGLANG_VERSION = "0.5.23"


class UnsupportedSGLang(UnsupportedFeature):
    """sgl_kara started to serve under another SGLang release than SGLANG_VERSION."""


def installed_sglang_version() -> str | None:
    """The installed SGLang's version, from its distribution's metadata (SGLang is not imported);
    None when SGLang is not installed."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_sglang_version() -> None:
    """Refuse (UnsupportedSGLang, one line: the supported release and what to do) to serve under
    another SGLang than SGLANG_VERSION; a local build tag (``+cu128``) is the same release. Run
    by the launcher, ``sgl_kara.Engine`` and Kara's scheduler process function before anything of
    SGLang is touched; the plugin never runs it, so plain SGLang with sgl_kara installed starts
    whatever its version."""
    installed = installed_sglang_version()
    if installed is not None and installed.split("+")[0] == SGLANG_VERSION:
        return
    if installed is None:
        raise UnsupportedSGLang(
            f"sgl_kara serves with SGLang {SGLANG_VERSION}, which is not installed: "
            f"pip install 'sglang=={SGLANG_VERSION}'"
        )
    raise UnsupportedSGLang(
        f"sgl_kara supports SGLang {SGLANG_VERSION} only, and SGLang {installed} is "
        f"installed: pip install 'sglang=={SGLANG_VERSION}', or an sgl_kara release made "
        f"for SGLang {installed}"
    )


def check_backend() -> None:
    """Choose this process's SGLang backend (sgl_kara.backends): refused (UnsupportedSGLang, one
    line) where SGLang has only part of the upstream series."""
    from sgl_kara import backends

    try:
        backends.choose()
    except backends.PartialSeries as e:
        raise UnsupportedSGLang(str(e)) from None


def check_pins(pinned: dict[str, tuple[str, str]]) -> None:
    """Refuse (UnsupportedSGLang, one line naming the first, and how many more) where the
    installed SGLang lacks a callable sgl_kara hooks or overrides, or gives it another signature
    than the pinned one (``pinned``: the adapters' ``pins``): such a hook or override would
    silently never run, or run with parameters it was not made for."""
    from sgl_kara import _sglang as adapter

    problems = adapter.pin_problems(pinned)
    if not problems:
        return
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise UnsupportedSGLang(
        f"{problems[0]}{more}: pip install 'sglang=={SGLANG_VERSION}'"
    )


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def device_memory_bytes(device: str) -> int | None:
    """The serving device's total memory (None: unknown), as SGLang's own resolution reads it
    (on CUDA ``nvidia-smi``: no CUDA context in this process)."""
    from sgl_kara._sglang import get_device_memory_capacity

    mib = get_device_memory_capacity(device)
    return int(mib * (1 << 20)) if mib else None


def decode_graphs_requested(server_args) -> tuple[str, str | None]:
    """(backend, flag): the decode CUDA-graph backend SGLang 0.5.23 resolves from the user's flags,
    by its precedence (``arg_groups/cuda_graph_hook.py`` ``parse_cuda_graph_config``): the
    ``--cuda-graph-config`` JSON, then ``--cuda-graph-backend-decode``, then
    ``--disable-decode-cuda-graph``, then ``--disable-cuda-graph``; and the flag that decided it
    (None: SGLang's default, ``full``)."""
    raw = getattr(server_args, "cuda_graph_config", None)
    explicit = raw.to_dict() if hasattr(raw, "to_dict") else (raw or {})
    decode = explicit.get("decode") if isinstance(explicit, dict) else None
    if isinstance(decode, dict) and "backend" in decode:
        return str(decode["backend"]), "--cuda-graph-config"
    backend = getattr(server_args, "cuda_graph_backend_decode", None)
    if backend is not None:
        return str(backend), "--cuda-graph-backend-decode"
    if getattr(server_args, "disable_decode_cuda_graph", False):
        return "disabled", "--disable-decode-cuda-graph"
    if getattr(server_args, "disable_cuda_graph", False):
        return "disabled", "--disable-cuda-graph"
    return "full", None


def hooks_every_decode_step(cfg: KaraConfig) -> str | None:
    """Why this configuration needs Kara's attention hook at every decode step (a replayed CUDA
    graph never calls it), naming the flag; None when it does not."""
    if cfg.policy_class.observes_decode:
        return f"--kara-policy {cfg.policy} (its observer adds each decode query's attention to its scores)"
    if cfg.query_source == "capture" and cfg.query_ring_capacity:
        return "--kara-query-source capture (each decode query is written to the capture ring)"
    return None


def keep_decode_eager(server_args, cfg: KaraConfig) -> bool:
    """Decode CUDA graphs off where the attention hook must run at every decode step: refused
    (naming the flag) when the user asked for decode graphs, turned off
    (``--disable-decode-cuda-graph``; prefill graphs stay as SGLang sets them) otherwise. Returns
    whether it turned them off."""
    why = hooks_every_decode_step(cfg)
    if why is None:
        return False
    backend, flag = decode_graphs_requested(server_args)
    if flag is not None and backend != "disabled":
        alternative = (
            "--kara-query-source recompute"
            if not cfg.policy_class.observes_decode
            else "a policy without a decode observer"
        )
        raise UnsupportedFeature(
            f"{flag} asks for decode CUDA graphs ({backend}), which {why} cannot use: a replayed graph never calls "
            f"Kara's attention hook. Drop {flag} (decode graphs are then turned off for it) or use {alternative}"
        )
    from sgl_kara import _sglang as adapter

    adapter.set_server_arg(server_args, "disable_decode_cuda_graph", True)
    return True


def choose_query_source(
    device: str, ring_bytes: int | None, available_ram: int, device_memory: int | None
) -> str:
    """``--kara-query-source auto`` by memory: capture (no extra forward per event) on CPU, where
    compute is the bottleneck, while its ring needs at most CPU_RING_SHARE of the available RAM
    (the ring sits beside a pool whose size is set, and saves each window's recompute
    forwards); on CUDA while the ring is known and within CUDA_RING_SHARE of the device memory
    (it is then taken from the pool). ``resolve_query_source`` asks only where capture would
    cost no decode CUDA graph."""
    if ring_bytes is None:
        return "recompute"
    if device == "cpu":
        return (
            "capture" if ring_bytes <= CPU_RING_SHARE * available_ram else "recompute"
        )
    if device_memory is None:
        return "recompute"
    return "capture" if ring_bytes <= CUDA_RING_SHARE * device_memory else "recompute"


def planned_ring_rows(server_args, cfg: KaraConfig) -> int:
    """Rows a capture ring would get under these server args (model_shape.ring_rows, as the scheduler
    allocates it); 0 when the policy keeps no queries or neither the request limit nor
    ``--kara-query-ring-rows`` bounds the rows yet."""
    capacity = cfg.query_ring_capacity
    running = getattr(server_args, "max_running_requests", None)
    if not capacity:
        return 0
    if not running:
        return cfg.query_ring_rows
    return ring_rows(
        running,
        getattr(server_args, "max_total_tokens", None),
        capacity,
        cfg.query_ring_rows,
    )


def serving_device(server_args) -> str:
    return server_args.device or ("cuda" if cuda_available() else "cpu")


def resolve_query_source(
    cfg: KaraConfig, server_args, shape: ModelShape | None
) -> KaraConfig:
    """``auto`` -> capture or recompute (choose_query_source), for the ring ``--kara-query-ring-rows``
    leaves. A ring over budget is not shrunk to fit (a request without a ring row is scored from
    a recompute forward). ``auto``
    never trades decode CUDA graphs away (capture turns them off, ``keep_decode_eager``): on CUDA
    it considers capture only where they are off anyway, and decode graphs the user asked for keep
    it at recompute on any device."""
    if cfg.query_source != "auto":
        return cfg
    capacity = cfg.query_ring_capacity
    rows = planned_ring_rows(server_args, cfg)
    ring = None
    if shape is not None and rows:
        ring = shape.ring_bytes(rows, capacity, shape.itemsize(server_args.dtype))
    device = serving_device(server_args)
    backend, flag = decode_graphs_requested(server_args)
    if backend != "disabled" and (flag is not None or device != "cpu"):
        ring = None  # decode graphs asked for, or SGLang's default on CUDA: capture would turn them off
    device_memory = (
        device_memory_bytes(device) if device != "cpu" and ring is not None else None
    )
    source = choose_query_source(device, ring, available_ram_bytes(), device_memory)
    rows_cap = (
        cfg.query_ring_rows if source == "capture" else 0
    )  # a cap is refused with recompute
    return dataclasses.replace(cfg, query_source=source, query_ring_rows=rows_cap)


def model_shape(server_args) -> ModelShape | None:
    """The shape one tensor-parallel rank of this server holds (None: no config readable)."""
    shape = ModelShape.from_model_path(
        server_args.model_path, getattr(server_args, "revision", None)
    )
    tp = int(getattr(server_args, "tp_size", None) or 1)
    return shape.per_rank(tp) if shape is not None else None


def prepare_server_args(
    server_args, cfg: KaraConfig, shape: ModelShape | None = None
) -> KaraConfig:
    """Refuse unsupported features and models; select Kara's radix backend; resolve ``auto``
    options; keep decode CUDA graphs off where the attention hook must see every decode step;
    on a GPU, take Kara's memory from the KV pool's share. ``shape``: the model's, per rank
    (read here when not given). Returns the resolved config."""
    if not cfg.enabled:
        if cfg.query_source == "auto":
            return dataclasses.replace(cfg, query_source="recompute")
        return cfg
    _refuse_unsupported(server_args, cfg)
    _select_sglang_parts(server_args)
    # SGLang's overlap scheduler stays as the user set it (on by default): events are ordered
    # after the overlapped forward (scheduler/runtime.py) and count a request's tokens the same
    # way under both schedulers (scheduler/plan.py decoded_tokens).
    if shape is None:
        shape = model_shape(server_args)
    if shape is not None:
        check_model(shape, server_args.model_path, cfg.policy)
    check_tensor_parallel(server_args, cfg)
    check_vocabulary(server_args, cfg)
    cfg = resolve_query_source(cfg, server_args, shape)
    keep_decode_eager(server_args, cfg)
    device = serving_device(server_args)
    if device != "cpu":
        check_ring_planned(server_args, cfg, device)
        reserve_device_memory(server_args, cfg, shape)
    return cfg


def _refuse_unsupported(server_args, cfg: KaraConfig) -> None:
    """The SGLang features, environment variables and radix backends Kara cannot serve with."""
    for name, enabled, flag, why in _UNSUPPORTED:
        value = getattr(server_args, name, None)
        if value is not None and enabled(value):
            raise UnsupportedFeature(
                f"{flag} is not supported with --kara-policy {cfg.policy}: {why}"
            )
    for var, why in _UNSUPPORTED_ENV:
        if env.flag(var, False):
            raise UnsupportedFeature(
                f"{var}={os.environ[var]} is not supported with --kara-policy "
                f"{cfg.policy}: {why}"
            )
    backend = getattr(server_args, "radix_cache_backend", None)
    if backend not in (None, "", "kara"):
        raise UnsupportedFeature(
            f"--radix-cache-backend {backend} is not supported with --kara-policy "
            f"{cfg.policy}: Kara needs its own backend ('kara') so compressed KV never "
            "enters the tree"
        )


def _select_sglang_parts(server_args) -> None:
    """Kara's radix backend; with the upstream series, Kara's retraction order over the policy
    the user chose (SGLang's registry, patches/upstream 0005: the backend's ``configure``)."""
    from sgl_kara import _sglang as adapter
    from sgl_kara import backends

    adapter.set_server_arg(server_args, "radix_cache_backend", "kara")
    backends.current().configure(server_args)


def check_ring_planned(server_args, cfg: KaraConfig, device: str) -> None:
    """On a GPU the capture ring is taken from the KV pool's share at start-up: its rows must
    be known."""
    if (
        cfg.query_source == "capture"
        and cfg.query_ring_capacity
        and not planned_ring_rows(server_args, cfg)
    ):
        raise UnsupportedFeature(
            f"--kara-query-source capture with --kara-policy {cfg.policy} on {device} "
            "needs --max-running-requests or --kara-query-ring-rows: the capture ring (one "
            "row per running request) is taken from the KV pool's share of the GPU at "
            "start-up, so its rows must be known; or use --kara-query-source recompute"
        )


def footprint(
    server_args, cfg: KaraConfig, shape: ModelShape, pool_tokens: int
) -> KaraFootprint:
    """What bounds Kara's memory for a pool of ``pool_tokens``: the request limit (the user's,
    or the one SGLang sets from the pool), the policy's region and query window, the recompute
    token budget, the capture ring's rows."""
    running = server_args.max_running_requests or sglang_max_running(
        pool_tokens, shape.context_len, int(getattr(server_args, "dp_size", None) or 1)
    )
    chunk = getattr(server_args, "chunked_prefill_size", None)
    rows = planned_ring_rows(server_args, cfg) if cfg.query_source == "capture" else 0
    policy = cfg.policy_class
    return KaraFootprint(
        pool_tokens=pool_tokens,
        running=int(running),
        region_tokens=region_tokens(cfg),
        query_tokens=query_tokens(cfg),
        recompute_tokens=recompute_tokens(chunk),
        ring_rows=rows,
        ring_capacity=cfg.query_ring_capacity,
        spread=spreads(cfg) or (policy.needs_queries and not policy.observes_decode),
        recomputes=policy.needs_queries,
    )


def check_vocabulary(server_args, cfg: KaraConfig) -> None:
    """A policy that reads token ids (``needs_tokens``) needs the model's tokenizer: refused at
    start-up when none loads from the model path (the scheduler reads the vocabulary itself)."""
    if not cfg.policy_class.needs_tokens:
        return
    try:
        load_tokenizer(server_args.model_path, getattr(server_args, "revision", None))
    except ValueError as e:
        raise UnsupportedFeature(f"--kara-policy {cfg.policy}: {e}") from None


def check_model(shape: ModelShape, model_path: str, policy: str) -> None:
    """Refuse, naming the model and what it uses, attention Kara's compaction would get wrong,
    from its config (before it loads): M-RoPE, local (sliding-window / chunked) attention, MLA,
    layers other than attention. The scheduler checks the built model and pool again
    (``check_runtime_supported``)."""
    name = f"--model-path {model_path}" + (
        f" ({shape.architecture})" if shape.architecture else ""
    )
    if shape.mrope:
        raise UnsupportedFeature(
            f"--model-path {model_path} uses M-RoPE (multimodal rotary positions), which is not "
            f"supported with --kara-policy {policy}: its position offsets would not reach mrope_positions"
        )
    if shape.local_layers:
        raise UnsupportedFeature(
            f"{name} uses sliding-window attention (a {shape.local_window}-token window on {shape.local_layers} "
            f"of {shape.layers} layers), which is not supported with --kara-policy {policy}: compaction moves kept "
            "entries to lower rows and the attention backends apply a layer's window to row positions, so its "
            "local layers would attend to entries past their window"
        )
    if shape.mla_rank:
        raise UnsupportedFeature(
            f"{name} uses multi-head latent attention (MLA, kv_lora_rank {shape.mla_rank}), which is not supported "
            f"with --kara-policy {policy}: Kara scores and compacts per-head K/V (MHA / GQA pools only)"
        )
    if shape.other_layers:
        raise UnsupportedFeature(
            f"{name} has {', '.join(shape.other_layers)} layers (a hybrid model), which is not supported with "
            f"--kara-policy {policy}: Kara compacts attention KV, and these layers' state follows the tokens"
        )


def replicated_kv_heads(
    kv_heads: int, tp_size: int, cfg: KaraConfig, model: str
) -> str | None:
    """Why ``--tp-size`` cannot serve this policy on a model with ``kv_heads`` KV heads (None: it
    can). SGLang splits the KV heads evenly over the ranks; with fewer heads than ranks it
    replicates each head on ``tp_size / kv_heads`` ranks, each with its own share of the head's
    query heads. A policy that scores a KV head from attention (queries or decode observations)
    would score each replica from that share only, so the replicas of one head would keep
    different entries: refused. Positional policies keep the same entries on every replica."""
    if tp_size <= 1 or kv_heads >= tp_size:
        return None
    policy = cfg.policy_class
    if not (policy.needs_queries or policy.observes_decode):
        return None
    return (
        f"--tp-size {tp_size} is not supported with --kara-policy {cfg.policy} for {model}, "
        f"which has {kv_heads} KV head{'s' if kv_heads != 1 else ''}: SGLang then replicates "
        f"each KV head on {tp_size // max(1, kv_heads)} ranks, each holding part of the "
        "head's query heads, and each replica would keep the entries its own query heads "
        "score highest (Kara scores a KV head from its whole GQA group). Use a --tp-size "
        f"of at most {kv_heads} (with --dp-size for more replicas), or a positional policy "
        "(--kara-policy streaming / random)"
    )


def check_tensor_parallel(server_args, cfg: KaraConfig) -> None:
    """Refuse (``replicated_kv_heads``) a ``--tp-size`` larger than the model's KV heads for a
    policy that scores from attention; the scheduler checks the built model again
    (``check_runtime_supported``)."""
    tp = int(getattr(server_args, "tp_size", None) or 1)
    if tp <= 1:
        return
    full = ModelShape.from_model_path(
        server_args.model_path, getattr(server_args, "revision", None)
    )
    if full is None:
        return
    why = replicated_kv_heads(
        full.kv_heads, tp, cfg, f"--model-path {server_args.model_path}"
    )
    if why:
        raise UnsupportedFeature(why)


def region_tokens(cfg: KaraConfig) -> int:
    """The most entries one request's region of this policy holds at an event: a window W (Kara,
    random) or C_max + 1 generated entries (the threshold policies)."""
    options = cfg.options
    threshold = getattr(options, "threshold", None)
    return threshold + 1 if threshold else options.window


def query_tokens(cfg: KaraConfig) -> int:
    """Queries that score one region: the window (Kara, random) or the observation window of
    the threshold policies (their own ``window`` option)."""
    return max(1, int(getattr(cfg.options, "window", 0) or 1))


def spreads(cfg: KaraConfig) -> bool:
    """Does this configuration keep spread scoring jobs (``--kara-spread even``)?"""
    policy = cfg.policy_class
    return cfg.spread == "even" and policy.needs_queries and policy.additive


def observer_bytes(cfg: KaraConfig):
    """The policy's decode-observer memory bound (``observer_bytes(shape, itemsize, pool_tokens,
    running)``), or None."""
    return (
        getattr(cfg.policy_class, "observer_bytes", None)
        if cfg.policy_class.observes_decode
        else None
    )


def sglang_resolution(server_args):
    """A resolved copy of these server args (SGLang 0.5.23's own resolution: its memory fraction,
    its model config); the server args themselves stay unresolved."""
    probe = copy.deepcopy(server_args)
    probe.resolve_once()
    return probe


def reserve_device_memory(
    server_args, cfg: KaraConfig, shape: ModelShape | None
) -> dict:
    """On a GPU, take Kara's memory beside the pool (memory_plan.kara_memory) from the KV
    pool's share: ``--mem-fraction-static`` (the user's, or the one SGLang's own resolution
    picks) lowered by that memory over the GPU's. SGLang sizes the pool from free memory minus
    (1 - fraction) x the memory before the model loads, so the pool shrinks by it and the
    headroom SGLang keeps for activations and CUDA graphs stays whole. Refused, naming the
    flags, when no pool would be left. Returns the plan (bytes by what holds them)."""
    from sgl_kara import _sglang as adapter

    device = serving_device(server_args)
    total = device_memory_bytes(device)
    if total is None:
        logger.warning(
            "sgl_kara: the %s memory is unknown; Kara's memory beside the pool is not "
            "reserved",
            device,
        )
        return {}
    probe = sglang_resolution(server_args)
    resolved = adapter.resolving_view(probe)
    if shape is None:
        tp = int(getattr(server_args, "tp_size", None) or 1)
        shape = ModelShape.from_config(adapter.hf_config(probe)).per_rank(tp)
        check_model(shape, server_args.model_path, cfg.policy)
    fraction = float(resolved.mem_fraction_static)
    itemsize = shape.itemsize(server_args.dtype)
    args = server_args
    if getattr(resolved, "chunked_prefill_size", None):
        args = copy.copy(server_args)
        adapter.set_server_arg(
            args, "chunked_prefill_size", resolved.chunked_prefill_size
        )

    def plan_for(pool_tokens: int) -> KaraFootprint:
        if server_args.max_total_tokens:
            pool_tokens = min(pool_tokens, int(server_args.max_total_tokens))
        return footprint(args, cfg, shape, pool_tokens)

    try:
        sizes, share, _ = device_share(
            shape, itemsize, total, fraction, plan_for, observer_bytes(cfg)
        )
    except NoPoolLeft as e:
        raise UnsupportedFeature(
            f"{e}: lower --max-running-requests, --kara-query-ring-rows or --kara-window, "
            "use --kara-query-source recompute, raise --mem-fraction-static, or serve with "
            "a larger --tp-size"
        ) from None
    lowered = round(fraction - share, 3)
    adapter.set_server_arg(server_args, "mem_fraction_static", lowered)
    logger.info(
        "sgl_kara memory plan: %s beside the KV pool: --mem-fraction-static %s -> %s",
        plan_text(sizes),
        fraction,
        lowered,
    )
    return sizes


def check_runtime_supported(scheduler, cfg: KaraConfig) -> None:
    """Checks of the built model, pool and CUDA graphs (run in the scheduler process, after the
    model loads): the second line behind ``check_model`` and ``keep_decode_eager``."""
    from sgl_kara import _sglang as adapter

    pool, runner, model = adapter.built_model(scheduler)
    if not adapter.standard_kv_pool(pool):
        raise UnsupportedFeature(
            "Kara supports standard multi-head/GQA attention KV pools only; this model "
            f"uses {type(pool).__name__} (MLA, hybrid, sliding-window or quantized pools "
            "are not supported yet)"
        )
    windows = adapter.sliding_windows(model)
    if windows:
        raise UnsupportedFeature(
            f"{type(model).__name__} applies a sliding window "
            f"({', '.join(map(str, windows))} tokens) on some attention layers, which Kara "
            "does not support: compaction moves kept entries to lower rows and the window "
            "applies to row positions"
        )
    tp = adapter.tensor_parallel(scheduler)[1]
    if cfg.enabled and tp > 1:
        heads = ModelShape.from_config(adapter.model_hf_config(scheduler)).kv_heads
        why = replicated_kv_heads(heads, tp, cfg, type(model).__name__)
        if why:
            raise UnsupportedFeature(why)
    why = hooks_every_decode_step(cfg) if cfg.enabled else None
    if why is not None and adapter.decode_graphs_captured(runner):
        raise UnsupportedFeature(
            f"decode CUDA graphs were captured, but {why} needs the attention hook at every "
            "decode step: run with --disable-decode-cuda-graph"
        )
