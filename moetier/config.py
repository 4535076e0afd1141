"""Engine-wide settings shared by the offline API, the CLI and the server."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, default: torch.dtype = torch.bfloat16) -> torch.dtype:
    """Turn a user-facing dtype name ('bf16', 'float32', ...) into a torch dtype."""
    if value is None or value == "auto":
        return default
    if isinstance(value, torch.dtype):
        if value not in DTYPES.values():
            raise ConfigError(f"unsupported dtype {value}; use one of bf16, fp16, fp32")
        return value
    try:
        return DTYPES[value.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {value!r}; use one of bf16, fp16, fp32") from None


# How routed experts are kept in the home copy: "dense" dequantises them to the compute dtype at load;
# "fp8" keeps an fp8-block checkpoint's float8 bytes and scales (half the host RAM and PCIe bytes);
# "fp4" keeps DeepSeek-V4's packed FP4 experts and their scales (about 0.27x of bf16 with ue8m0 scales).
EXPERT_FORMATS = ("dense", "fp8", "fp4")


def check_expert_format(value: str) -> str:
    """``value`` if it names an expert format, else a one-line :class:`ConfigError`."""
    if value not in EXPERT_FORMATS:
        raise ConfigError(f"expert_format must be one of {', '.join(EXPERT_FORMATS)}, got {value!r}")
    return value


# The backbone's linears: "fp8" keeps those a checkpoint stores fp8-block (moetier.models.fp8_linear), "dense"
# dequantises them at load.
BACKBONE_FORMATS = ("auto", "fp8", "dense")


def check_backbone_format(value: str) -> str:
    """``value`` if it names a backbone format, else a one-line ConfigError listing them."""
    if value not in BACKBONE_FORMATS:
        raise ConfigError(f"backbone_format must be one of {', '.join(BACKBONE_FORMATS)}, got {value!r}")
    return value


def resolve_backbone_format(value: str, device: torch.device | str) -> str:
    """``fp8`` or ``dense`` for a load on ``device``: ``auto`` is ``fp8`` on CUDA (half the VRAM and decode bytes of
    bf16) and ``dense`` elsewhere, where an fp8 linear dequantises its weight every call (a 4096 x 4096 linear at
    one token: 104.5 ms against 1.53 ms dense on the 2-core dev machine, results/devvm-20261207-3976e52-fp8-linear-cpu);
    ``fp8`` and ``dense`` are kept."""
    if check_backbone_format(value) != "auto":
        return value
    return "fp8" if torch.device(device).type == "cuda" else "dense"


def check_seconds(name: str, value: object, zero: str = "") -> None:
    """Raise a one-line :class:`ConfigError` unless ``value`` is a finite number of seconds >= 0 (``zero``: what 0
    means, for the message)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
        raise ConfigError(f"{name} must be a number >= 0{f' ({zero})' if zero else ''}, got {value!r}")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class ModelLoadConfig:
    """How to load a checkpoint: compute dtype, device and the longest sequence the caches must hold.

    ``expert_format``: ``"dense"`` (routed experts dequantised to ``dtype`` at load), ``"fp8"`` (an
    fp8-block checkpoint's experts stay float8 + scales in the home copy) or ``"fp4"`` (DeepSeek-V4's
    FP4 experts stay packed + scales); see :data:`EXPERT_FORMATS`. ``backbone_format``: ``"fp8"`` (backbone
    linears the checkpoint stores fp8-block stay so, half the VRAM of bf16; a no-op on other checkpoints),
    ``"dense"`` (dequantised at load) or ``"auto"`` (fp8 on CUDA, dense elsewhere: :func:`resolve_backbone_format`).
    """

    dtype: torch.dtype = torch.bfloat16
    device: torch.device | str = "cpu"
    max_model_len: int | None = None
    expert_format: str = "dense"
    backbone_format: str = "auto"

    def __post_init__(self) -> None:
        check_expert_format(self.expert_format)
        check_backbone_format(self.backbone_format)
        self.dtype = parse_dtype(self.dtype)
        self.device = torch.device(self.device)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
