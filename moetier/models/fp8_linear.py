"""Backbone linears kept fp8-block as the checkpoint stores them (``backbone_format="fp8"``, the default).

DeepSeek's releases store the backbone's large linears (attention, shared experts; V4: "FP8 elsewhere") as
float8 with one scale per 128 x 128 tile. Dequantised at load they take twice the VRAM and a decode step reads
twice the bytes. :func:`keep_fp8_linears` swaps each such ``nn.Linear`` of a meta-device skeleton for an
:class:`Fp8BlockLinear` before the loader materialises it; the loader then copies the stored bytes and scales.
Linears whose weight a model reads directly (not through ``forward``) are named in ``CausalLM.dense_linears`` and
stay dense; tied linears stay dense too (their weight is another parameter's copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moetier.kernels.fp8_linear import fp8_linear
from moetier.models.fused_linears import FusedLinears
from moetier.weights.formats import format_for
from moetier.weights.fp8 import Fp8BlockFormat, scale_grid

if TYPE_CHECKING:
    from moetier.models.base import CausalLM
    from moetier.weights.checkpoint import Checkpoint

# safetensors' names of the float8 encodings an fp8-block weight may use.
_ENCODINGS = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class Fp8BlockLinear(nn.Module):
    """``nn.Linear``'s contract (``in_features``, ``out_features``, ``forward(x) = x @ W.T + bias``) with ``W`` kept
    as float8 ``weight`` ``[out, in]`` times float32 ``scale`` (one per ``tile``), each weight the bits a
    dequantised-at-load linear of the input's dtype holds (:mod:`moetier.kernels.fp8_linear`).

    ``weight`` and ``scale`` keep their dtypes when the loader materialises the module (:data:`stored_dtypes`).
    """

    stored_dtypes = ("weight", "scale")

    def __init__(
        self, in_features: int, out_features: int, tile: tuple[int, int], encoding: torch.dtype, bias: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.tile = in_features, out_features, tile
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=encoding), requires_grad=False)
        self.register_buffer("scale", torch.empty(scale_grid((out_features, in_features), tile), dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, self.tile, self.bias)

    def grouped(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """``x`` ``[T, groups * in_features]``: group ``g``'s inputs through rows ``g * out / groups`` on only."""
        return fp8_linear(x, self.weight, self.scale, self.tile, self.bias, groups=groups)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tile={self.tile}, fp8"


def materialized_dtype(
    model: CausalLM, module: nn.Module, name: str, full_name: str, tensor: torch.Tensor, dtype: torch.dtype
) -> torch.dtype:
    """The dtype the loader gives ``tensor``, called ``name`` in ``module`` (``full_name`` in ``model``): integer
    tensors and an fp8 linear's stored ones keep theirs, floating ones the model keeps in float32 (``keep_fp32``)
    take float32, the others the load ``dtype``."""
    if not tensor.is_floating_point() or name in getattr(module, "stored_dtypes", ()):
        return tensor.dtype
    return torch.float32 if any(pattern in full_name for pattern in model.keep_fp32) else dtype


def fp8_weights_of(model: CausalLM, ckpt: Checkpoint) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
    """Module name -> (tile, encoding) of each model linear whose ``.weight`` the checkpoint stores fp8-block."""
    found = {}
    for name in ckpt.names():
        fmt = format_for(name, ckpt)
        if not isinstance(fmt, Fp8BlockFormat):
            continue
        try:
            target = model.map_checkpoint_name(name)
        except KeyError:
            continue  # the loader names the stray tensor
        param = getattr(target, "name", None)
        if isinstance(param, str) and param.endswith(".weight"):
            found[param.removesuffix(".weight")] = (fmt.block, _ENCODINGS[ckpt.tensors[name].dtype])
    return found


def keep_fp8_linears(model: CausalLM, ckpt: Checkpoint) -> list[str]:
    """Swap every ``nn.Linear`` of the (meta-device) ``model`` whose weight ``ckpt`` stores fp8-block for an
    :class:`Fp8BlockLinear`, except the model's ``dense_linears`` and tied ones; fused groups
    (:class:`FusedLinears`) follow. Returns the swapped modules' names."""
    stored = fp8_weights_of(model, ckpt)
    tied = {name.removesuffix(".weight") for name in model.tied_parameters()}
    swapped: dict[int, Fp8BlockLinear] = {}
    names = []
    for module_name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or module_name not in stored or module_name in tied:
            continue
        if any(pattern in module_name for pattern in model.dense_linears):
            continue
        tile, encoding = stored[module_name]
        with torch.device("meta"):
            linear = Fp8BlockLinear(module.in_features, module.out_features, tile, encoding, module.bias is not None)
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)
        swapped[id(module)] = linear
        names.append(module_name)
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, FusedLinears):
                value.replace(swapped)
    return names
