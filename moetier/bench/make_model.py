"""``moetier make-bench-model``: write a random checkpoint with a real model's shapes, fast and streamed.

The folder holds ``config.json`` (loadable by transformers and by moetier), ``generation_config.json``,
safetensors shards of ~4.5 GB with ``model.safetensors.index.json``, ``bench_model.json`` (how it was
made and how fast), with ``--routing-skew`` ``routing_skew.json``, and (unless ``--no-tokenizer``)
``tokenizer.json`` + ``tokenizer_config.json``, so ``moetier serve --model`` can serve the folder.

The tokenizer covers the whole vocabulary (a random model samples any id): a byte-level BPE trained
on a built-in word list, DeepSeek's BOS/EOS at the ids ``config.json`` names, the chat, reasoning and
tool-call markers, and printable filler tokens for the remaining ids (see
:func:`moetier.tokenizer_training.full_vocabulary_tokenizer`). Prompts use the built-in DeepSeek
chat template.

Weights follow the reference init (normal with ``initializer_range`` for projections and
embeddings, ones for norms, zeros for biases, sinks and compressor offsets, mHC as transformers
initialises it). They are drawn on the GPU when there is one (a seeded CUDA generator per
tensor), a chunk at a time, copied to pinned buffers and written by a background thread; on a
CPU the same happens with torch's CPU generator. Nothing bigger than a chunk is held in memory.

Routed experts can be written quantised as a release stores them: ``--fp8-experts`` (float8 + 128x128
tile scales, DeepSeek-V3's, :mod:`moetier.bench.fp8_model`) or, for DeepSeek-V4 shapes,
``--fp4-experts`` (packed e2m1 + a ue8m0 scale per 32 inputs, DeepSeek-V4's, :mod:`moetier.bench.fp4_model`).

    python -m moetier.bench.make_model --shape deepseek-v4-flash --layers 4 --out /data/v4-4l
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from moetier.bench.common import key_json_value
from moetier.bench.fp4_model import (
    PACKED_DTYPE,
    SCALE_DTYPE,
    Fp4Codes,
    Ue8m0Scales,
    check_fp4_shape,
    fill_fp4_codes,
    fill_ue8m0,
    fp4_config,
    fp4_expert_specs,
)
from moetier.bench.fp8_model import (
    FP8_DTYPE,
    Fp8Normal,
    fill_fp8,
    fp8_backbone_specs,
    fp8_expert_specs,
    quantization_config,
)
from moetier.bench.routers import RouterFactory
from moetier.bench.safetensors_out import (
    INDEX_FILE,
    BufferPool,
    StoredTensor,
    plan_shards,
    shard_names,
    write_index,
    write_shard,
)
from moetier.bench.shapes import SHAPES, Fill, Normal, Router, TensorSpec, build_config, tensor_plan
from moetier.config import parse_dtype
from moetier.errors import ConfigError, MoetierError
from moetier.tokenizer_training import full_vocabulary_tokenizer, write_tokenizer_folder

DEFAULT_SHARD_BYTES = 4_500_000_000
DEFAULT_CHUNK_BYTES = 32 << 20
_POOL_BUFFERS = 3  # one being filled, up to two queued for the disk
_DISK_MARGIN = 64 << 20
_OUR_FILES = (
    "config.json",
    "generation_config.json",
    INDEX_FILE,
    "routing_skew.json",
    "bench_model.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# Routed experts' tensors (weights and their scales) in the three families' names; not shared experts.
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass
class WriteOptions:
    """How to write a benchmark checkpoint (validated on construction)."""

    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    device: str = "auto"
    routing_skew: float | None = None
    shard_bytes: int = DEFAULT_SHARD_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    force: bool = False
    progress: bool = True
    sync: bool = True  # fsync each shard, so throughput numbers include the disk
    tokenizer: bool = True  # write a full-vocabulary tokenizer, so the folder can be served
    fp8_experts: bool = False  # routed experts as float8 + 128x128 tile scales (moetier.bench.fp8_model)
    fp4_experts: bool = False  # routed experts as packed e2m1 + ue8m0 scales per 32 inputs (moetier.bench.fp4_model)
    fp8_backbone: bool = False  # attention / shared-expert linears as float8 + 128x128 tile scales, as releases do

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        if self.fp8_experts and self.fp4_experts:
            raise ConfigError("--fp8-experts and --fp4-experts are exclusive: routed experts have one stored format")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"--device must be auto, cuda or cpu, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but no CUDA device is available")
        if self.routing_skew is not None and self.routing_skew <= 0:
            raise ConfigError(f"--routing-skew must be > 0, got {self.routing_skew}")
        if self.shard_bytes < 1 or self.chunk_bytes < 4096:
            raise ConfigError("shard size must be positive and chunk size at least 4 KiB")

    @property
    def expert_format(self) -> str:
        """How routed experts are stored: "fp8", "fp4" or "dense" (the checkpoint's ``dtype``)."""
        return "fp8" if self.fp8_experts else "fp4" if self.fp4_experts else "dense"

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class WriteSummary:
    """What was written and how fast."""

    path: Path
    total_bytes: int
    tensors: int
    expert_bytes: int  # routed experts' weights and scales, as stored
    shards: list[str]
    seconds: float
    device: str
    skew: dict[str, Any] | None = field(default=None, repr=False)
    tokenizer: dict[str, Any] | None = None  # ids per kind and build seconds; None without a tokenizer

    @property
    def gb_per_s(self) -> float:
        return self.total_bytes / max(self.seconds, 1e-9) / 1e9


class RandomSource:
    """Seeded normal values, one independent generator per tensor name, drawn on ``device``."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device, self.seed = device, seed

    def seed_for(self, label: str) -> int:
        digest = hashlib.blake2b(f"{self.seed}/{label}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    def generator(self, label: str) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed_for(label))

    def tensor(self, name: str, shape: tuple[int, ...], std: float, dtype: torch.dtype) -> torch.Tensor:
        """A whole (small) tensor on ``device``."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        return out.normal_(0.0, std, generator=self.generator(name))


class ChunkFiller:
    """Turns tensor specs into filled pool buffers, ``chunk`` bytes at a time."""

    def __init__(self, source: RandomSource, routers: RouterFactory, pool: BufferPool) -> None:
        self.source, self.routers, self.pool = source, routers, pool
        self.scratch: torch.Tensor | None = None  # device-side staging for GPU draws
        self.on_bytes = lambda nbytes: None

    def chunks(self, spec: TensorSpec, stored: StoredTensor) -> Iterator[tuple[torch.Tensor, int]]:
        if isinstance(spec.init, Router):
            data = self.routers.take(spec.init.layer, spec.init.part, spec.name).to(stored.dtype)
            yield from self._copy_chunks(data.reshape(-1))
        elif isinstance(spec.init, Fill):
            yield from self._generated(stored, lambda view, gen: view.fill_(spec.init.value))
        elif isinstance(spec.init, Normal):
            std = spec.init.std
            yield from self._generated(stored, lambda view, gen: view.normal_(0.0, std, generator=gen))
        elif isinstance(spec.init, Fp8Normal):
            yield from self._generated(stored, lambda view, gen: fill_fp8(view, gen, spec.init))
        elif isinstance(spec.init, Fp4Codes):
            yield from self._generated(stored, fill_fp4_codes)
        elif isinstance(spec.init, Ue8m0Scales):
            yield from self._generated(stored, lambda view, gen: fill_ue8m0(view, gen, spec.init))
        else:
            raise TypeError(f"unknown init {spec.init!r}")

    def _elements_per_chunk(self, dtype: torch.dtype) -> int:
        return self.pool.nbytes // torch.empty((), dtype=dtype).element_size()

    def _generated(self, stored: StoredTensor, fill) -> Iterator[tuple[torch.Tensor, int]]:
        generator = self.source.generator(stored.name)
        step, itemsize = self._elements_per_chunk(stored.dtype), torch.empty((), dtype=stored.dtype).element_size()
        on_gpu = self.source.device.type == "cuda"
        for start in range(0, stored.numel, step):
            count = min(step, stored.numel - start)
            buffer = self.pool.get()
            host = buffer[: count * itemsize].view(stored.dtype)
            if on_gpu:
                staged = self._scratch()[: count * itemsize].view(stored.dtype)
                host.copy_(fill(staged, generator))  # device-to-pinned copy, synchronous
            else:
                fill(host, generator)
            self.on_bytes(count * itemsize)
            yield buffer, count * itemsize

    def _copy_chunks(self, flat: torch.Tensor) -> Iterator[tuple[torch.Tensor, int]]:
        raw = flat.contiguous().view(torch.uint8)
        for start in range(0, raw.numel(), self.pool.nbytes):
            piece = raw[start : start + self.pool.nbytes]
            buffer = self.pool.get()
            buffer[: piece.numel()].copy_(piece)
            self.on_bytes(piece.numel())
            yield buffer, piece.numel()

    def _scratch(self) -> torch.Tensor:
        if self.scratch is None:
            self.scratch = torch.empty(self.pool.nbytes, dtype=torch.uint8, device=self.source.device)
        return self.scratch


def _stored_dtype(spec: TensorSpec, model_dtype: torch.dtype) -> torch.dtype:
    fixed = {"F32": torch.float32, "I64": torch.int64, "F8": FP8_DTYPE, "I8": PACKED_DTYPE, "F8_E8M0": SCALE_DTYPE}
    return model_dtype if spec.dtype == "model" else fixed[spec.dtype]


@dataclass(frozen=True)
class BenchPlan:
    """What a checkpoint will hold, before anything is written: its ``config.json`` and its tensors."""

    cfg: dict[str, Any]  # with the expert format's declarations (quantization_config, expert_dtype)
    specs: list[TensorSpec]
    stored: list[StoredTensor]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.stored)

    @property
    def expert_bytes(self) -> int:
        """Routed experts' bytes as stored (weights plus scales)."""
        return sum(t.nbytes for t in self.stored if _ROUTED_EXPERT.search(t.name))


def plan_bench_model(cfg: dict[str, Any], options: WriteOptions | None = None) -> BenchPlan:
    """The tensors and sizes :func:`write_bench_model` writes for ``cfg`` (reads and writes nothing).

    Raises ConfigError when the expert format does not fit ``cfg`` (``--fp4-experts`` off DeepSeek-V4).
    """
    options = options or WriteOptions()
    specs = tensor_plan(cfg)
    if options.fp8_experts:
        specs = fp8_expert_specs(specs)
        cfg = {**cfg, "quantization_config": quantization_config()}
    elif options.fp4_experts:
        check_fp4_shape(cfg)
        specs = fp4_expert_specs(specs)
        cfg = fp4_config(cfg)
    if options.fp8_backbone:
        specs = fp8_backbone_specs(specs)
        cfg = {**cfg, "quantization_config": cfg.get("quantization_config", quantization_config())}
    stored = [StoredTensor(s.name, _stored_dtype(s, options.dtype), s.shape) for s in specs]
    return BenchPlan(cfg, specs, stored)


def _prepare_folder(out: Path, total_bytes: int, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ConfigError(f"{out}: folder is not empty (pass --force to replace a previous benchmark model)")
        for path in list(out.glob("*.safetensors")) + [out / name for name in _OUR_FILES]:
            path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if free < total_bytes + _DISK_MARGIN:
        raise ConfigError(f"{out}: needs {total_bytes / 1e9:.2f} GB but only {free / 1e9:.2f} GB is free")


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2) + "\n")


def _special_id(value: Any, default: int) -> int:
    """A config's ``bos_token_id`` / ``eos_token_id``: an int, the first of a list, else ``default``."""
    if isinstance(value, list) and value and isinstance(value[0], int):
        return value[0]
    return value if isinstance(value, int) else default


def build_bench_tokenizer(cfg: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """The full-vocabulary tokenizer for ``cfg`` (BOS/EOS at its ids) and a summary with build seconds.

    Raises ConfigError when the vocabulary is too small for a byte-level tokenizer.
    """
    started = time.perf_counter()
    bos, eos = _special_id(cfg.get("bos_token_id"), 0), _special_id(cfg.get("eos_token_id"), 1)
    try:
        tok, counts = full_vocabulary_tokenizer(cfg["vocab_size"], bos_id=bos, eos_id=eos)
    except ValueError as exc:
        raise ConfigError(f"{exc}; pass --no-tokenizer to write the checkpoint without one") from None
    summary = {"vocab_size": cfg["vocab_size"], "bos_token_id": bos, "eos_token_id": eos, **counts}
    return tok, summary | {"seconds": round(time.perf_counter() - started, 3)}


def write_bench_model(cfg: dict[str, Any], out: str | Path, options: WriteOptions | None = None) -> WriteSummary:
    """Write ``cfg``'s checkpoint (random weights, real names and shapes) into the folder ``out``."""
    options = options or WriteOptions()
    out, device = Path(out).expanduser(), options.torch_device
    plan = plan_bench_model(cfg, options)
    cfg, specs, stored, total = plan.cfg, plan.specs, plan.stored, plan.total_bytes
    # Built before anything is written: a vocabulary too small for it fails fast.
    tokenizer, tokenizer_summary = build_bench_tokenizer(cfg) if options.tokenizer else (None, None)
    _prepare_folder(out, total, options.force)
    started = time.perf_counter()

    cfg = {**cfg, "dtype": _DTYPE_NAMES[options.dtype]}
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")},
    )
    if tokenizer is not None:
        write_tokenizer_folder(out, tokenizer, model_max_length=cfg.get("max_position_embeddings", 4096))

    source = RandomSource(device, options.seed)
    routers = RouterFactory(
        cfg,
        device,
        lambda name, shape, std: source.tensor(name, shape, std, options.dtype),
        source.seed_for,
        options.routing_skew,
    )
    pool = BufferPool(_POOL_BUFFERS, options.chunk_bytes, pin=device.type == "cuda")
    filler = ChunkFiller(source, routers, pool)
    by_name = {s.name: s for s in specs}
    shards = plan_shards(stored, options.shard_bytes)
    names = shard_names(len(shards))
    metadata = {"format": "pt", "moetier_bench": json.dumps({"seed": options.seed, "device": device.type})}

    with tqdm(total=total, unit="B", unit_scale=True, disable=not options.progress, desc="writing") as bar:
        filler.on_bytes = bar.update
        for group, name in zip(shards, names, strict=True):
            chunks = (chunk for t in group for chunk in filler.chunks(by_name[t.name], t))
            write_shard(out / name, group, chunks, pool, metadata, sync=options.sync)
    if len(shards) > 1:
        write_index(out, shards, names)
    seconds = time.perf_counter() - started

    skew_summary = routers.skew_summary() if options.routing_skew is not None else None
    if skew_summary is not None:
        _write_json(out / "routing_skew.json", skew_summary)
    summary = WriteSummary(
        out, total, len(stored), plan.expert_bytes, names, seconds, device.type, skew_summary, tokenizer_summary
    )
    _write_json(out / "bench_model.json", _receipt(cfg, options, summary))
    return summary


def _receipt(cfg: dict[str, Any], options: WriteOptions, summary: WriteSummary) -> dict[str, Any]:
    return {
        "architecture": cfg["architectures"][0],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "dtype": _DTYPE_NAMES[options.dtype],
        "expert_format": options.expert_format,
        "seed": options.seed,
        "routing_skew": options.routing_skew,
        "generator_device": summary.device,
        "total_bytes": summary.total_bytes,
        "routed_expert_bytes": summary.expert_bytes,
        "tensors": summary.tensors,
        "shards": summary.shards,
        "seconds": round(summary.seconds, 3),
        "write_gb_per_s": round(summary.gb_per_s, 3),
        "tokenizer": summary.tokenizer,
        "torch": torch.__version__,
    }


# ----------------------------------------------------------------------------------------------
# Command line


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add ``make-bench-model``'s options to ``parser``."""
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES), help="published model to copy the shape of")
    parser.add_argument("--layers", required=True, type=int, help="decoder layers to write (the only scaled part)")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    parser.add_argument("--vocab-size", type=int, help="override the vocabulary size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="where to draw weights")
    parser.add_argument(
        "--routing-skew",
        type=float,
        metavar="ALPHA",
        help="per-layer expert popularity ~ Dirichlet(ALPHA); small = a few hot experts",
    )
    parser.add_argument("--experts-per-layer", type=int, help="override the routed-expert count (tiny tests)")
    parser.add_argument("--hidden-size", type=int, help="override hidden_size (tests only)")
    parser.add_argument("--moe-intermediate-size", type=int, help="override the expert width (tests only)")
    parser.add_argument(
        "--set",
        type=key_json_value,
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override any config field (tests only), e.g. --set num_attention_heads=4",
    )
    parser.add_argument("--shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 1e9, help="max shard size in GB")
    parser.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20, help="generation chunk (MiB)")
    parser.add_argument("--force", action="store_true", help="replace a previous benchmark model in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-tokenizer", dest="tokenizer", action="store_false", help="write no tokenizer (then it cannot be served)"
    )
    parser.add_argument(
        "--fp8-experts",
        action="store_true",
        help="routed experts as float8 e4m3 + 128x128 tile scales, as DeepSeek's fp8 releases store them",
    )
    parser.add_argument(
        "--fp4-experts",
        action="store_true",
        help="routed experts as packed FP4 e2m1 + a ue8m0 scale per 32 inputs, as DeepSeek-V4's release stores "
        "them (deepseek-v4 shapes only)",
    )
    parser.add_argument(
        "--fp8-backbone",
        action="store_true",
        help="attention, dense-layer and shared-expert linears as float8 e4m3 + 128x128 tile scales, as DeepSeek's "
        "releases store them (moetier keeps them fp8 in VRAM; --backbone-format dense dequantises them)",
    )


def run(args: argparse.Namespace) -> int:
    """Build the config, write the checkpoint and print a one-line summary; 2 on bad input."""
    try:
        cfg = build_config(
            args.shape,
            args.layers,
            vocab_size=args.vocab_size,
            experts=args.experts_per_layer,
            hidden_size=args.hidden_size,
            moe_intermediate_size=args.moe_intermediate_size,
            overrides=dict(args.set),
        )
        options = WriteOptions(
            dtype=args.dtype,
            seed=args.seed,
            device=args.device,
            routing_skew=args.routing_skew,
            shard_bytes=int(args.shard_gb * 1e9),
            chunk_bytes=int(args.chunk_mb * 2**20),
            force=args.force,
            progress=not args.quiet,
            tokenizer=args.tokenizer,
            fp8_experts=args.fp8_experts,
            fp4_experts=args.fp4_experts,
            fp8_backbone=args.fp8_backbone,
        )
        summary = write_bench_model(cfg, args.out, options)
    except MoetierError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {summary.total_bytes / 1e9:.2f} GB ({summary.tensors} tensors, {len(summary.shards)} shards) "
        f"to {summary.path} in {summary.seconds:.1f} s ({summary.gb_per_s:.2f} GB/s, weights drawn on {summary.device})"
    )
    stored_as = _DTYPE_NAMES[options.dtype] if options.expert_format == "dense" else options.expert_format
    print(f"routed experts: {summary.expert_bytes / 1e9:.2f} GB as stored ({stored_as})")
    if summary.tokenizer is not None:
        tok = summary.tokenizer
        print(
            f"tokenizer: {tok['vocab_size']} ids ({tok['trained']} trained, {tok['filler']} filler, "
            f"{tok['reserved']} special) in {tok['seconds']:.2f} s"
        )
    if summary.skew is not None:
        tv, rho = summary.skew["worst_total_variation"], summary.skew["worst_spearman"]
        print(
            f"routing skew alpha={args.routing_skew}: worst layer total variation {tv:.3f}, "
            f"worst Spearman {rho:.3f} (see routing_skew.json)"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moetier make-bench-model", description=__doc__.split("\n\n")[0])
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
