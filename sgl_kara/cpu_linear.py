"""CPU serving, opt-in (``SGL_KARA_PACKED_CPU_LINEAR=1``): decode-sized weight matmuls through
oneDNN with the weight reordered once to its blocked layout, instead of ``F.linear`` (MKL sgemm).

Why (bench/cpu_linear.py; one thread, float32, SmolLM2-135M's 30 layers of projections + MLP and
its lm_head, 540 MB of weights, more than the cache): MKL takes 37-42 ms for 1-2 rows -- the
weights streamed once -- but 72-127 ms for 4-12 rows, a kernel regime that does not reuse what it
streams, so on this CPU each running request adds ~10-19 ms to a decode step (bench/RESULTS.md,
session 12: the projections, MLP and lm_head are two thirds of that per-request cost). oneDNN on
the prepacked weight takes 49-64 ms from 4 to 12 rows. Outside ``PACKED_ROWS``
(one or two decode rows, prefill chunks) ``F.linear`` runs as before.

Not bit-identical to ``F.linear`` (float summation order; ~1e-6 on SmolLM2's logits), and the
packed copies double the memory of the weights they cover, which is why it is opt-in. Hooks
(registered by plugin.py only when the variable is set when the plugin loads):
``UnquantizedLinearMethod.apply`` and ``LogitsProcessor._compute_lm_head`` (its plain matmul
branch only: every other branch -- LoRA, quantized or AMX lm_head, float32 upcast, ``out=`` --
runs SGLang's own code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows (tokens in the forward) for which the packed call runs: from 3 (MKL's 1-2 row path streams
# the weights once already) to 64 (decode batches; larger prefill chunks keep MKL's GEMM).
PACKED_ROWS = (3, 64)

_packed: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id(weight) -> (weight, packed copy, its version)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def takes_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does this matmul take the packed path: float32 on CPU, 2-D input within ``PACKED_ROWS``."""
    return (x.dim() == 2 and PACKED_ROWS[0] <= x.shape[0] <= PACKED_ROWS[1] and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 2
            and not weight.requires_grad)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of ``weight`` [out, in], made on first use and kept while the weight
    lives (a weight written in place -- a reload -- gets a new copy: identity and version are checked)."""
    hit = _packed.get(id(weight))
    if hit is None or hit[0] is not weight or weight._version != hit[2]:
        hit = (weight, torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=None), weight._version)
        _packed[id(weight)] = hit
    return hit[1]


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; x [T, in], weight [out, in], bias [out] -> [T, out]."""
    return _packed_linear(x, weight, bias) if takes_packed(x, weight) else F.linear(x, weight, bias)


def linear_apply_hook(original, method, layer, x, bias=None, *args, **kwargs):
    """AROUND ``UnquantizedLinearMethod.apply(layer, x, bias)``."""
    if not args and not kwargs and takes_packed(x, layer.weight):
        return _packed_linear(x, layer.weight, bias)
    return original(method, layer, x, bias, *args, **kwargs)


def lm_head_hook(original, processor, hidden_states, lm_head, embedding_bias=None, *args, out=None, **kwargs):
    """AROUND ``LogitsProcessor._compute_lm_head``: its plain ``hidden @ lm_head.weight.T`` branch."""
    from sgl_kara._sglang import should_apply_lm_head_quant_method, use_intel_amx_backend

    weight = getattr(lm_head, "weight", None)
    plain = (  # the row check first: prefill and 1-2-row steps skip SGLang's branch conditions
        weight is not None and takes_packed(hidden_states, weight)
        and not args and not kwargs and out is None and embedding_bias is None
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
        and not processor.use_fp32_lm_head and processor.rl_on_policy_target is None
        and not use_intel_amx_backend(lm_head)
    )
    if plain:
        return _packed_linear(hidden_states, weight)
    return original(processor, hidden_states, lm_head, embedding_bias, *args, out=out, **kwargs)
