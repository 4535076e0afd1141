"""Build a model from a checkpoint folder, streaming tensors one by one into their final place.

Peak host memory stays near the model size: parameters are allocated once (from a meta-device
skeleton) and each stored tensor is read, decoded and copied into its destination before the
next one is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from moetier.config import ModelLoadConfig, resolve_backbone_format
from moetier.errors import CheckpointError, ConfigError
from moetier.models import CausalLM, model_class_for
from moetier.models.base import ExpertTarget, IgnoreTarget, ParamTarget
from moetier.models.fp8_linear import Fp8BlockLinear, keep_fp8_linears, materialized_dtype
from moetier.tiers.dispatcher import make_dispatcher
from moetier.tiers.experts import BlockAllocator, ExpertStore, device_allocator
from moetier.weights.checkpoint import Checkpoint, one_line
from moetier.weights.formats import PlainFormat, WeightFormat, format_for
from moetier.weights.fp4 import FP4Format, scale_to_float
from moetier.weights.fp8 import Fp8BlockFormat
from moetier.weights.quant_experts import copy_quant_expert, expert_layout_for

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A ready model plus what it was built from."""

    model: CausalLM
    store: ExpertStore
    checkpoint: Checkpoint
    hf_config: dict[str, Any]


def load_model(
    path: str | Path,
    load_config: ModelLoadConfig | None = None,
    dispatcher: str = "resident",
    expert_allocator: BlockAllocator | None = None,
    progress: bool = True,
    dispatcher_options: dict[str, Any] | None = None,
) -> LoadedModel:
    """Load ``path`` (a Hugging Face folder) into a model whose experts sit behind ``dispatcher``.

    ``dispatcher_options`` go to the dispatcher's constructor (e.g. the tiered dispatcher's cache
    size); once loaded, the dispatcher's ``prepare(device)`` runs (cache allocation, calibration).
    With ``load_config.expert_format`` ``"fp8"`` (``"fp4"``) the routed experts keep the checkpoint's float8
    (packed FP4) bytes and scales (an ``expert_allocator`` must size blocks for that layout:
    ``HostExpertArena.for_checkpoint`` with the same format). With ``load_config.backbone_format`` ``"fp8"`` (``"auto"``
    on CUDA) the backbone linears the checkpoint stores fp8-block stay so (:mod:`moetier.models.fp8_linear`).
    """
    cfg = load_config or ModelLoadConfig()
    ckpt = Checkpoint(path)
    cls = _model_class(ckpt)
    family_config = _family_config(cls, ckpt)
    layout = expert_layout_for(cls.expert_layout(family_config), ckpt.config, cfg.expert_format, str(ckpt.path))
    store = ExpertStore(layout, cfg.dtype, expert_allocator or device_allocator(cfg.device))
    with torch.device("meta"):
        model = cls(family_config, make_dispatcher(dispatcher, store, **(dispatcher_options or {})))
    fp8_backbone = resolve_backbone_format(cfg.backbone_format, cfg.device) == "fp8"
    if fp8_backbone and (kept := keep_fp8_linears(model, ckpt)):
        log.info("%d backbone linears stay fp8-block as stored (--backbone-format dense dequantises them)", len(kept))
    _materialize(model, cfg.dtype, cfg.device)
    _StreamingLoader(model, store, ckpt, cfg.dtype).run(progress)
    model.eval()
    model.post_load()
    model.dispatcher.prepare(cfg.device)
    return LoadedModel(model=model, store=store, checkpoint=ckpt, hf_config=ckpt.config)


def _model_class(ckpt: Checkpoint) -> type[CausalLM]:
    config_path = ckpt.path / "config.json"
    if not ckpt.architectures:
        raise CheckpointError(f"{config_path}: has no 'architectures' list naming the model class")
    try:
        return model_class_for(ckpt.architectures)
    except CheckpointError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None


def _family_config(cls: type[CausalLM], ckpt: Checkpoint) -> Any:
    where = f"{ckpt.path / 'config.json'}: invalid {cls.__name__} config"
    try:
        return cls.config_from_hf(ckpt.config)
    except KeyError as exc:
        raise CheckpointError(f"{where} (missing field {exc.args[0]!r})") from None
    except (TypeError, ValueError, ConfigError) as exc:
        raise CheckpointError(f"{where} ({one_line(exc)})") from None


def _materialize(model: CausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Replace meta tensors with real (uninitialised) ones of the load dtype, fp32 where the model asks, fp8
    linears' stored tensors in their own dtypes."""
    for module_name, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                full_name = f"{module_name}.{name}" if module_name else name
                target = materialized_dtype(model, module, name, full_name, tensor, dtype)
                real = torch.empty(tensor.shape, dtype=target, device=device)
                table[name] = nn.Parameter(real, requires_grad=False) if table is module._parameters else real


class _StreamingLoader:
    """Copies each checkpoint tensor into its model parameter or expert block, checking shapes."""

    def __init__(self, model: CausalLM, store: ExpertStore, ckpt: Checkpoint, dtype: torch.dtype) -> None:
        self.model, self.store, self.ckpt, self.dtype = model, store, ckpt, dtype
        self.params = dict(model.named_parameters()) | dict(model.named_buffers())
        self.loaded_params: set[str] = set()
        self.expert_parts: dict[tuple[int, int], set[str]] = {}
        self.staging = torch.empty(0, dtype=torch.uint8)

    def run(self, progress: bool) -> None:
        formats = {name: format_for(name, self.ckpt) for name in self.ckpt.names()}
        companions = {c for name, fmt in formats.items() for c in fmt.companions(name)}
        names = [n for n in self.ckpt.names() if n not in companions]
        total = sum(self.ckpt.tensors[n].nbytes for n in names)
        # One staging buffer for every stored tensor: a fresh allocation per tensor leaves the
        # allocator's freed holes between the long-lived expert blocks (measured: ~1.35x the model).
        self.staging = torch.empty(max((self.ckpt.tensors[n].nbytes for n in names), default=0), dtype=torch.uint8)
        with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not progress) as bar:
            for name in names:
                self._load_one(name, formats[name])
                bar.update(self.ckpt.tensors[name].nbytes)
        self._apply_ties()
        self._check_complete()

    def _load_one(self, name: str, fmt: WeightFormat) -> None:
        try:
            target = self.model.map_checkpoint_name(name)
        except KeyError:
            raise CheckpointError(
                f"{self.ckpt.path}: tensor {name} is not part of {type(self.model).__name__}; "
                "does config.json describe these weights?"
            ) from None
        if isinstance(target, IgnoreTarget):
            return
        missing = [c for c in fmt.companions(name) if not self.ckpt.has(c)]
        if missing:
            raise CheckpointError(f"{self.ckpt.path}: {name} is {fmt.name}-quantised but {missing[0]} is missing")
        stored = self.ckpt.get(name, out=self.staging)
        extra = [self.ckpt.get(c) for c in fmt.companions(name)]
        if isinstance(target, ParamTarget):
            self._copy_param(name, target.name, stored, extra, fmt)
        elif self.store.layout.quant is not None:
            self._copy_quant_expert(name, target, stored, extra, fmt)
        else:
            self._copy_expert(name, target, self._decode(name, stored, extra, fmt, self.store.dtype))

    def _decode(self, name: str, stored, extra, fmt: WeightFormat, dtype: torch.dtype) -> torch.Tensor:
        """The dense tensor; plain tensors stay as stored (``copy_`` casts them without a temporary)."""
        if isinstance(fmt, PlainFormat):
            return stored
        try:
            return fmt.dequantize(stored, extra, dtype)
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(
                f"{self.ckpt.path}: cannot decode {fmt.name} tensor {name} ({one_line(exc)})"
            ) from None

    def _copy_param(self, name: str, param_name: str, stored, extra, fmt: WeightFormat) -> None:
        dest = self.params.get(param_name)
        if dest is None:
            raise CheckpointError(f"{self.ckpt.path}: tensor {name} maps to unknown parameter {param_name}")
        owner = self.model.get_submodule(param_name.rpartition(".")[0])
        if isinstance(owner, Fp8BlockLinear) and dest is owner.weight:
            self._copy_fp8_linear(name, param_name, owner, stored, extra)
            return
        dense = self._decode(name, stored, extra, fmt, dest.dtype)
        _check_shape(self.ckpt, name, tuple(dense.shape), tuple(dest.shape))
        with torch.no_grad():
            dest.copy_(dense)
        self.loaded_params.add(param_name)

    def _copy_fp8_linear(self, name: str, param_name: str, linear: Fp8BlockLinear, stored, extra) -> None:
        """An fp8-block linear kept as stored: its float8 bytes and its scales (as float32)."""
        _check_shape(self.ckpt, name, tuple(stored.shape), tuple(linear.weight.shape))
        scale = scale_to_float(extra[0])
        _check_shape(self.ckpt, f"{name}'s scale", tuple(scale.shape), tuple(linear.scale.shape))
        with torch.no_grad():
            linear.weight.copy_(stored.view(linear.weight.dtype))
            linear.scale.copy_(scale)
        stem = param_name.removesuffix(".weight")
        self.loaded_params.update((param_name, stem + ".scale"))

    def _copy_expert(self, name: str, target: ExpertTarget, dense: torch.Tensor) -> None:
        layout = self.store.layout
        experts = range(layout.num_experts) if target.expert is None else [target.expert]
        for index, expert in enumerate(experts):
            piece = dense[index] if target.expert is None else dense
            try:
                weights = self.store.block_for_loading(target.layer, expert)
            except KeyError as exc:
                raise CheckpointError(f"{self.ckpt.path}: tensor {name}: {exc.args[0]}") from None
            inter = layout.intermediate_size
            dest = {
                "gate": weights.gate_up[:inter],
                "up": weights.gate_up[inter:],
                "gate_up": weights.gate_up,
                "down": weights.down,
            }[target.part]
            expected = (len(experts), *dest.shape) if target.expert is None else tuple(dest.shape)
            _check_shape(self.ckpt, name, tuple(dense.shape), expected)
            dest.copy_(piece)
            parts = self.expert_parts.setdefault((target.layer, expert), set())
            parts.update(("gate", "up") if target.part == "gate_up" else (target.part,))

    def _copy_quant_expert(self, name: str, target: ExpertTarget, stored, extra, fmt: WeightFormat) -> None:
        """Keep an fp8-block or FP4 expert matrix as stored: its bytes and scales go into the quantised block."""
        quant = self.store.layout.quant
        assert quant is not None  # _load_one routes here for a quantised layout only
        short = "fp4" if quant.packed else "fp8"
        if not _format_matches(fmt, quant.kind, quant.tile):
            stored_as = (
                f"{fmt.name} in {fmt.block[0]}x{fmt.block[1]} tiles" if isinstance(fmt, Fp8BlockFormat) else fmt.name
            )
            raise CheckpointError(
                f"{self.ckpt.path}: routed expert tensor {name} is stored {stored_as} ({stored.dtype}), not as the "
                f"{quant.kind} experts expert_format '{short}' keeps; load it with --expert-format dense"
            )
        if target.expert is None:
            raise CheckpointError(
                f"{self.ckpt.path}: tensor {name} holds all experts fused; expert_format '{short}' reads per-expert "
                "gate_proj/up_proj/down_proj tensors only: load it with --expert-format dense"
            )
        try:
            weights = self.store.block_for_loading(target.layer, target.expert)
            copy_quant_expert(weights, target.part, stored, extra[0])
        except KeyError as exc:
            raise CheckpointError(f"{self.ckpt.path}: tensor {name}: {exc.args[0]}") from None
        except ValueError as exc:
            raise CheckpointError(f"{self.ckpt.path}: {short} expert tensor {name} {one_line(exc)}") from None
        self.expert_parts.setdefault((target.layer, target.expert), set()).add(target.part)

    def _apply_ties(self) -> None:
        for target, source in self.model.tied_parameters().items():
            if target not in self.loaded_params and source in self.loaded_params:
                with torch.no_grad():
                    self.params[target].copy_(self.params[source])
                self.loaded_params.add(target)

    def _check_complete(self) -> None:
        missing = sorted(set(self.params) - self.loaded_params)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{self.ckpt.path}: checkpoint has no tensor for {missing[0]}{more}")
        all_parts = {"gate", "up", "down"}
        incomplete = sorted(
            [(key, all_parts) for key in self.store.missing()]
            + [(key, all_parts - parts) for key, parts in self.expert_parts.items() if parts != all_parts]
        )
        if incomplete:
            (layer, expert), lacking = incomplete[0]
            raise CheckpointError(
                f"{self.ckpt.path}: checkpoint has no {'/'.join(sorted(lacking))} weights for routed expert {expert} "
                f"of layer {layer} ({len(incomplete)} experts affected)"
            )


def _format_matches(fmt: WeightFormat, kind: str, tile: tuple[int, int]) -> bool:
    """Whether a stored tensor's format is the one a quantised expert block keeps."""
    if kind == "fp4-block":
        return isinstance(fmt, FP4Format)  # its scale grid is checked against the block's at copy time
    return isinstance(fmt, Fp8BlockFormat) and fmt.block == tile


def _check_shape(ckpt: Checkpoint, name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if got != expected:
        raise CheckpointError(
            f"{ckpt.path}: tensor {name} has shape {list(got)} but the config implies {list(expected)}"
        )
