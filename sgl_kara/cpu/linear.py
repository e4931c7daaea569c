"""CPU serving (one of the CPU kernels, ``KARA_CPU_KERNELS``; ``KARA_PACKED_CPU_LINEAR=0`` leaves it
out): float32 weight matmuls through oneDNN on weights reordered once, after loading, to its
blocked layout -- in place, as SGLang's AMX path does for bfloat16 -- instead of ``F.linear``
(MKL sgemm), which streams the weights once for 1-2 rows but not for the few rows of a decode
batch, so each running request would add a weight read to a decode step (bench/results/kernels.md
has both measured). Not bit-identical (float summation order).

    linear layers (UnquantizedLinearMethod)  layer.weight replaced after loading by a Parameter
        holding oneDNN's opaque packed tensor (``is_mkldnn``; same shape and dtype, the
        loader's attributes copied over); no second copy. ``restore_weights_before_loading``
        (SGLang's hook before a weight update) turns it back into a dense Parameter, and the
        update's ``process_weights_after_loading`` packs it again.
    the lm_head                               a packed *copy* (``_copies``), made on first use:
        its weight is usually tied to the input embedding, whose lookup needs the dense tensor.
        Only for decode-sized rows (``LM_HEAD_ROWS``), renewed when the weight is written in place.

Hooks (plugin.py, patches/cpu_linear.md): the linear method's weight processing and ``apply`` /
``apply_into``, the lm_head's plain matmul branch only (LoRA, quantized or AMX heads, float32
upcast and ``out=`` run SGLang's code), and ``WeightExporter``'s methods, run on dense weights.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

# Rows (tokens in the forward) for which the lm_head's packed copy is used: decode batches. One or
# two rows stream the weights once in MKL already; prefill computes logits of a few rows only.
LM_HEAD_ROWS = (3, 64)

# oneDNN picks the packed layout for a batch-size hint; 16 is the hint measured
# best (bench/results/kernels.md) across decode row counts.
PACK_HINT_ROWS = 16

# id(weight) -> (weak reference to the weight, packed copy, the weight's version); an entry leaves with its
# weight (a finalizer), so a model replaced in this process does not keep its old lm_head alive.
_copies: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, int]] = {}
_packed_layers: weakref.WeakSet[torch.nn.Module] = (
    weakref.WeakSet()
)  # layers whose weight is packed in place


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


def packable(weight: torch.Tensor) -> bool:
    """A dense float32 2-D CPU weight that takes no gradient."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not weight.is_mkldnn
        and not weight.requires_grad
        and weight.numel() > 0
    )


def packed_count() -> int:
    """Weights held packed in this process: linear layers packed in place + lm_head copies."""
    return len(_packed_layers) + len(_copies)


def _replace_weight(layer: torch.nn.Module, data: torch.Tensor) -> None:
    """``layer.weight`` becomes a Parameter over ``data``, keeping the loader's attributes
    (``weight_loader``, ``input_dim``, ``output_dim``, ... set by SGLang's ``set_weight_attrs``)."""
    old = layer.weight
    new = torch.nn.Parameter(data, requires_grad=False)
    for name, value in vars(old).items():
        setattr(new, name, value)
    layer.weight = new


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(
        weight.detach(), batch_size=PACK_HINT_ROWS
    )


def pack_in_place(layer: torch.nn.Module) -> bool:
    """Replace a packable ``layer.weight`` [out, in] by its oneDNN packed form; True if it was."""
    from sgl_kara.cpu._sglang import use_intel_amx_backend

    weight = getattr(layer, "weight", None)
    if (
        not isinstance(weight, torch.Tensor)
        or not packable(weight)
        or use_intel_amx_backend(layer)
    ):
        return False
    _replace_weight(layer, _reorder(weight))
    _packed_layers.add(layer)
    return True


def unpack_in_place(layer: torch.nn.Module) -> bool:
    """Undo ``pack_in_place`` (exact: the packed form is a reordering); True if it was packed."""
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_mkldnn:
        return False
    _replace_weight(layer, weight.to_dense())
    _packed_layers.discard(layer)
    return True


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` with a packed weight: x [..., in] (any rows, any leading dims) -> [..., out]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]) if x.dim() != 2 else x
    dtype = x2.dtype
    if dtype != torch.float32:
        x2 = x2.float()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    if x2.shape[0] == 0:
        out = x2.new_empty((0, packed.shape[0]))
    else:
        out = torch.ops.mkldnn._linear_pointwise(
            x2.contiguous(), packed, bias, "none", [], ""
        )
    if dtype != torch.float32:
        out = out.to(dtype)
    return out.reshape(*shape[:-1], packed.shape[0]) if x.dim() != 2 else out


def packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a dense ``weight`` [out, in], made on first use and kept while the
    weight lives (a weight written in place -- a reload -- gets a new copy: identity and version
    are checked)."""
    key = id(weight)
    hit = _copies.get(key)
    if hit is None or hit[0]() is not weight or weight._version != hit[2]:
        if hit is None or hit[0]() is not weight:
            weakref.finalize(weight, _copies.pop, key, None)
        hit = (weakref.ref(weight), _reorder(weight), weight._version)
        _copies[key] = hit
    return hit[1]


def lm_head_takes_copy(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and LM_HEAD_ROWS[0] <= x.shape[0] <= LM_HEAD_ROWS[1]
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and packable(weight)
    )


# --- hooks (plugin.py) --------------------------------------------------------------------------


def process_weights_hook(original, method, layer, **kwargs):
    """AROUND ``UnquantizedLinearMethod.process_weights_after_loading``: SGLang's own processing
    (AMX packing where the CPU has AMX), then the float32 packing if the weight is still dense."""
    result = original(method, layer=layer, **kwargs)
    pack_in_place(layer)
    return result


@contextlib.contextmanager
def dense_weights(model: torch.nn.Module):
    """The model's packed linear weights dense for the duration (exact both ways)."""
    layers = [m for m in model.modules() if m in _packed_layers]
    for layer in layers:
        unpack_in_place(layer)
    try:
        yield
    finally:
        for layer in layers:
            pack_in_place(layer)


def weight_export_hook(original, exporter, *args, **kwargs):
    """AROUND ``WeightExporter.get_weights_by_name`` / ``save_sharded_model`` / ``save_remote_model``
    / ``send_weights_to_remote_instance``: they read the weights' values. The call is passed on as
    SGLang made it (one hook for four signatures)."""
    with dense_weights(exporter.get_model()):
        return original(exporter, *args, **kwargs)


def restore_weights_hook(original, method, layer, **kwargs):
    """AROUND ``restore_weights_before_loading``: a weight update loads into a dense weight."""
    unpack_in_place(layer)
    return original(method, layer=layer, **kwargs)


def linear_apply_hook(original, method, layer, x, bias=None, **kwargs):
    """AROUND ``UnquantizedLinearMethod.apply(layer, x, bias)``."""
    weight = layer.weight
    if weight.is_mkldnn:
        return packed_linear(x, weight, bias)
    return original(method, layer=layer, x=x, bias=bias, **kwargs)


def linear_apply_into_hook(original, method, layer, x, output, bias=None, **kwargs):
    """AROUND ``UnquantizedLinearMethod.apply_into(layer, x, output, bias)`` (caller-owned output)."""
    weight = layer.weight
    if weight.is_mkldnn:
        out = packed_linear(x, weight, bias)
        if output.shape != out.shape:
            raise ValueError(
                f"linear output has shape {tuple(output.shape)}, expected {tuple(out.shape)}"
            )
        return output.copy_(out)
    return original(method, layer=layer, x=x, output=output, bias=bias, **kwargs)


def lm_head_hook(
    original,
    processor,
    hidden_states,
    lm_head,
    embedding_bias=None,
    *,
    out=None,
    **kwargs,
):
    """AROUND ``LogitsProcessor._compute_lm_head``: its plain ``hidden @ lm_head.weight.T`` branch."""
    from sgl_kara.cpu._sglang import (
        should_apply_lm_head_quant_method,
        use_intel_amx_backend,
    )

    weight = getattr(lm_head, "weight", None)
    plain = (  # the row check first: prefill and 1-2-row steps skip SGLang's branch conditions
        weight is not None
        and lm_head_takes_copy(hidden_states, weight)
        and not kwargs
        and out is None
        and embedding_bias is None
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and not should_apply_lm_head_quant_method(
            lm_head, getattr(lm_head, "quant_method", None)
        )
        and not processor.use_fp32_lm_head
        and processor.rl_on_policy_target is None
        and not use_intel_amx_backend(lm_head)
    )
    if plain:
        return packed_linear(hidden_states, packed_copy(weight))
    return original(
        processor,
        hidden_states=hidden_states,
        lm_head=lm_head,
        embedding_bias=embedding_bias,
        out=out,
        **kwargs,
    )
