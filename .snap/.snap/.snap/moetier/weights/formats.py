"""Stored weight formats: how a checkpoint tensor (plus companions such as scales) becomes dense."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from moetier.weights.checkpoint import Checkpoint


class WeightFormat(ABC):
    """One storage format of a weight tensor.

    Contract: ``claims(name, ckpt)`` is True when the stored tensor ``name`` is in this format;
    ``companions(name)`` lists the other stored tensors needed to decode it (e.g. block scales),
    which the loader then never treats as weights of their own; ``dequantize`` returns the dense
    tensor in ``dtype``. Formats are tried in registry order; :class:`PlainFormat` is the fallback.
    """

    name: str = "abstract"

    @abstractmethod
    def claims(self, name: str, ckpt: Checkpoint) -> bool: ...

    def companions(self, name: str) -> list[str]:
        return []

    @abstractmethod
    def dequantize(self, stored: torch.Tensor, companions: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor: ...

    def bind(self, ckpt: Checkpoint) -> WeightFormat:
        """This format specialised to ``ckpt`` (e.g. a block size from its ``quantization_config``).

        :func:`format_for` returns the bound format. Default: the format itself.
        """
        return self


class PlainFormat(WeightFormat):
    """bf16 / fp16 / fp32 (and integer buffers): copied as stored, cast to the target dtype."""

    name = "plain"

    def claims(self, name: str, ckpt: Checkpoint) -> bool:
        return True

    def dequantize(self, stored: torch.Tensor, companions: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return stored.to(dtype) if stored.is_floating_point() else stored


# Quantised formats register themselves ahead of the plain fallback.
WEIGHT_FORMATS: list[WeightFormat] = []
# Modules whose import registers a format; imported on first use because they import this module.
FORMAT_MODULES: list[str] = ["moetier.weights.fp8", "moetier.weights.fp4"]


def register_format(fmt: WeightFormat) -> WeightFormat:
    WEIGHT_FORMATS.append(fmt)
    return fmt


def format_for(name: str, ckpt: Checkpoint) -> WeightFormat:
    for module in FORMAT_MODULES:
        importlib.import_module(module)
    for fmt in WEIGHT_FORMATS:
        if fmt.claims(name, ckpt):
            return fmt.bind(ckpt)
    return _PLAIN


_PLAIN = PlainFormat()
