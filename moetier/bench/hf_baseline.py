"""``moetier bench hf``: comparison point (c), decode tok/s of transformers + accelerate ``device_map="auto"``.

What a Python user tries first with a model bigger than their GPU: ``AutoModelForCausalLM.from_pretrained(
dir, dtype=..., device_map="auto", max_memory={0: gpu_budget, "cpu": host_budget})``. accelerate puts whole
decoder layers on the GPU until the budget is spent and the rest in host RAM; the weights of every
host-placed layer are copied to the GPU by accelerate's hooks at every forward.

Decode is measured the way ``moetier bench decode`` does it: the same seeded random prompts
(:func:`bench_prompts`), ``streams`` sequences batched, greedy steps with transformers' own KV cache,
the device synchronised before each clock read. Offloaded transformers decode can be ~1 tok/s on big
models, so the defaults are small (8 steps, 1 repeat) and ``max_seconds`` stops a run early (the
receipt says how many steps were timed).

A forward that fails in the requested dtype (transformers' DeepSeek-V4 keeps its norms in fp32 and then
feeds their fp32 output into bf16 linears) is recorded and retried per ``fallback``: reloaded in fp32,
or run under ``torch.autocast``. Nothing here raises past :func:`run_hf_bench`: a failed baseline is a
receipt with ``"error"``.

``moetier bench decode --hf-baseline`` runs this in a subprocess before loading its own model (the two
host copies of a big checkpoint must not be alive at once) and merges the result
(:func:`merge_into_decode`, :func:`add_hf_ratios`).
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetier.bench.common import fmt, parse_int_list, stats, sync_device, write_receipt_files
from moetier.bench.environment import environment
from moetier.config import parse_dtype
from moetier.errors import ConfigError

KIND = "hf-decode"
MODE = "hf-accelerate"
FALLBACKS = ("fp32", "autocast", "none")
SUBPROCESS_TIMEOUT_S = 1800
_ERROR_CHARS = 2000
_PLACEMENT_NOTES = {
    False: "accelerate copies the weights of host-placed modules to the GPU at every forward (its hooks)",
    True: "CPU-only run: device_map={'': 'cpu'}, not accelerate's GPU offload path",
}


@dataclass
class HFBenchConfig:
    """What to measure; validated on construction. ``device="cpu"`` (or no CUDA) loads everything on the CPU."""

    model: Path
    streams: list[int] = field(default_factory=lambda: [1, 2, 4])
    prompt_len: int = 64
    warmup: int = 1
    steps: int = 8
    repeats: int = 1
    max_seconds: float | None = 60.0  # cap on the timed steps of one stream count
    dtype: str = "bf16"
    gpu_memory: str = "24GiB"
    host_memory: str | None = None  # default: what accelerate finds available
    device: str | None = None
    fallback: str = "fp32"
    seed: int = 0

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        parse_dtype(self.dtype)
        if not self.streams or min(self.streams) < 1:
            raise ConfigError(f"--streams must be positive integers, got {self.streams}")
        if min(self.prompt_len, self.steps, self.repeats) < 1 or self.warmup < 0:
            raise ConfigError("--prompt-len, --steps and --repeats must be >= 1 and --warmup >= 0")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ConfigError(f"--max-seconds must be positive, got {self.max_seconds}")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"--fallback must be one of {list(FALLBACKS)}, got {self.fallback!r}")
        self.budgets()  # reject a bad size before minutes of loading

    def budgets(self) -> dict[str, int]:
        """``{"gpu": bytes, "cpu": bytes}`` (cpu absent when not given)."""
        from moetier.units import parse_size

        out = {"gpu": parse_size(self.gpu_memory, "--gpu-memory", _gpu_total())}
        if self.host_memory is not None:
            out["cpu"] = parse_size(self.host_memory, "--host-memory")
        return out


def _gpu_total() -> int | None:
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def bench_prompts(seed: int, streams: int, prompt_len: int, vocab: int) -> list[torch.Tensor]:
    """The ``streams`` random prompts of ``prompt_len`` ids every decode benchmark feeds (seeded by stream count)."""
    generator = torch.Generator().manual_seed(seed + streams)
    return [torch.randint(0, vocab, (prompt_len,), generator=generator) for _ in range(streams)]


def _compute_device(cfg: HFBenchConfig) -> torch.device:
    if cfg.device is not None and torch.device(cfg.device).type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device(cfg.device or "cuda:0")


def _device_map_request(cfg: HFBenchConfig, device: torch.device) -> dict[str, Any]:
    """The ``from_pretrained`` placement arguments: accelerate's "auto" on CUDA, everything on the CPU otherwise."""
    if device.type == "cpu":
        return {"device_map": {"": "cpu"}}
    from accelerate.utils import get_max_memory

    budgets = cfg.budgets()
    host = budgets.get("cpu", get_max_memory()["cpu"])
    return {"device_map": "auto", "max_memory": {device.index or 0: budgets["gpu"], "cpu": host}}


def _module_bytes(module: torch.nn.Module, seen: set[int]) -> int:
    """Bytes of ``module``'s parameters and buffers not counted yet (meta tensors of offloaded layers count too)."""
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def placement(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """``{device: {"modules": n, "bytes": b}}`` from ``model.hf_device_map`` (one entry when there is none)."""
    device_map = getattr(model, "hf_device_map", None) or {"": str(next(model.parameters()).device)}
    seen: set[int] = set()
    out: dict[str, dict[str, int]] = {}
    for name, where in device_map.items():
        entry = out.setdefault(str(where), {"modules": 0, "bytes": 0})
        entry["modules"] += 1
        entry["bytes"] += _module_bytes(model.get_submodule(name), seen)
    return out


def _load(cfg: HFBenchConfig, dtype: torch.dtype, device: torch.device, offload_dir: str) -> tuple[Any, dict]:
    """The model as transformers + accelerate place it, and what the placement was."""
    from transformers import AutoModelForCausalLM

    request = _device_map_request(cfg, device)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype, offload_folder=offload_dir, **request)
    model.eval()
    sync_device(device)
    return model, {
        "mode": "accelerate device_map=auto" if device.type == "cuda" else "cpu-only: device_map={'': 'cpu'}",
        "max_memory": {str(k): v for k, v in request.get("max_memory", {}).items()},
        "per_device": placement(model),
        "load_seconds": time.perf_counter() - start,
        "dtype": str(dtype).removeprefix("torch."),
    }


class ForwardError(RuntimeError):
    """The model loaded but a forward pass failed (the case a dtype fallback may fix)."""


class _Stopwatch:
    """Timed decode of one stream count: prefill, warm-up, then repeats of ``steps`` steps under a time cap."""

    def __init__(self, model: Any, device: torch.device, cfg: HFBenchConfig, streams: int, autocast) -> None:
        self.model, self.device, self.cfg, self.streams, self.autocast = model, device, cfg, streams, autocast
        vocab = model.config.get_text_config().vocab_size
        self.ids = torch.stack(bench_prompts(cfg.seed, streams, cfg.prompt_len, vocab)).to(device)
        self.past = None
        self.tokens: list[int] = []  # the first stream's greedy tokens, from the prefill on

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        context = torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else nullcontext()
        with context:
            out = self.model(ids, past_key_values=self.past, use_cache=True, logits_to_keep=1)
        self.past = out.past_key_values
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens.append(int(next_ids[0, 0]))
        return next_ids

    def _out_of_time(self, spent: float) -> bool:
        return self.cfg.max_seconds is not None and spent >= self.cfg.max_seconds

    @torch.inference_mode()
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        sync_device(self.device)
        start = time.perf_counter()
        ids = self._forward(self.ids)
        sync_device(self.device)
        prefill_seconds = time.perf_counter() - start
        for _ in range(cfg.warmup):
            ids = self._forward(ids)
        seconds, steps_done, spent = [], [], 0.0
        for _ in range(cfg.repeats):
            sync_device(self.device)
            start, done = time.perf_counter(), 0
            while done < cfg.steps:  # at least one timed step, however small the cap
                ids = self._forward(ids)
                sync_device(self.device)
                done += 1
                if self._out_of_time(spent + time.perf_counter() - start):
                    break
            seconds.append(time.perf_counter() - start)
            steps_done.append(done)
            spent += seconds[-1]
            if done < cfg.steps or self._out_of_time(spent):
                break
        return _result(self.streams, prefill_seconds, seconds, steps_done, cfg, self.tokens)


def _result(streams, prefill_seconds, seconds, steps_done, cfg, tokens) -> dict[str, Any]:
    tok_s = [streams * n / s for n, s in zip(steps_done, seconds, strict=True) if n]
    timed = sum(steps_done)
    return {
        "mode": MODE,
        "streams": streams,
        "tok_s": stats(tok_s),
        "seconds": seconds,
        "steps_per_repeat": steps_done,
        "timed_steps": timed,
        "stopped_early": timed < cfg.steps * cfg.repeats,
        "prefill_seconds": prefill_seconds,
        "tokens": tokens,
    }


def _measure(model: Any, device: torch.device, cfg: HFBenchConfig, autocast=None) -> list[dict[str, Any]]:
    results = []
    for streams in cfg.streams:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            result = _Stopwatch(model, device, cfg, streams, autocast).run()
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ForwardError(f"forward at {streams} stream(s): {_one_line(exc)}") from exc
        if device.type == "cuda":
            result["peak_vram_bytes"] = torch.cuda.max_memory_allocated(device)
        results.append(result)
    return results


def _one_line(exc: BaseException) -> str:
    text = " ".join((str(exc).strip() or type(exc).__name__).split())
    return f"{type(exc).__name__}: {text}"[:_ERROR_CHARS]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _attempts(receipt: dict[str, Any], cfg: HFBenchConfig, device: torch.device, offload_dir: str) -> None:
    """Load and measure in the requested dtype; on a failed forward, fall back as ``cfg.fallback`` says."""
    dtype = parse_dtype(cfg.dtype)
    receipt["stage"] = "load"
    model, receipt["placement"] = _load(cfg, dtype, device, offload_dir)
    receipt["stage"] = "decode"
    try:
        receipt["results"] = _measure(model, device, cfg)
        receipt["dtype_used"] = cfg.dtype
        return
    except ForwardError as exc:
        if cfg.fallback == "none" or dtype == torch.float32:
            raise
        receipt["fallback_reason"] = str(exc)
    if cfg.fallback == "autocast":
        receipt["autocast"] = True
        receipt["results"] = _measure(model, device, cfg, autocast=dtype)
        receipt["dtype_used"] = f"{cfg.dtype} (torch.autocast)"
        return
    del model
    _free(device)
    receipt["stage"] = "load fp32"
    model, receipt["placement"] = _load(cfg, torch.float32, device, offload_dir)
    receipt["stage"] = "decode fp32"
    receipt["results"] = _measure(model, device, cfg)
    receipt["dtype_used"] = "fp32"


def run_hf_bench(cfg: HFBenchConfig) -> dict[str, Any]:
    """Load, measure every stream count and return the receipt; never raises for a failed load or forward."""
    started = time.time()
    device = _compute_device(cfg)
    receipt: dict[str, Any] = {
        "kind": KIND,
        "environment": environment(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "compute_device": str(device),
        "dtype_requested": cfg.dtype,
        "dtype_used": None,
        "fallback_reason": None,
        "autocast": False,
        "placement": None,
        "results": [],
        "error": None,
        "notes": [_PLACEMENT_NOTES[device.type == "cpu"]],
    }
    try:
        with tempfile.TemporaryDirectory(prefix="moetier-hf-offload-") as offload_dir:
            _attempts(receipt, cfg, device, offload_dir)
        receipt.pop("stage")
    except Exception as exc:  # noqa: BLE001 - a failed baseline is a receipt, never a crash
        message = str(exc) if isinstance(exc, ForwardError) else _one_line(exc)
        receipt["error"] = f"{receipt.pop('stage', 'setup')}: {message}"
        receipt["traceback"] = traceback.format_exc(limit=-8)
    receipt["wall_seconds"] = time.time() - started
    return receipt


def _gb(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 1e9


def placement_summary(place: dict[str, Any]) -> str:
    """``"0: 12 modules 20.10 GB, cpu: 31 modules 22.40 GB"``."""
    per_device = place.get("per_device", {})
    return ", ".join(f"{d}: {v['modules']} modules {v['bytes'] / 1e9:.2f} GB" for d, v in per_device.items())


def markdown_table(receipt: dict[str, Any]) -> str:
    """A Markdown summary of an ``hf-decode`` receipt."""
    place = receipt.get("placement") or {}
    lines = [
        f"transformers + accelerate decode ({place.get('mode', 'not loaded')}; {placement_summary(place) or '-'}), "
        f"dtype {receipt['dtype_requested']} -> {receipt['dtype_used'] or '-'}, "
        f"load {fmt(place.get('load_seconds'), 1)} s, git {receipt['environment']['git_sha']}",
        "",
        "| mode | streams | tok/s (median [min-max]) | timed steps | prefill s | peak VRAM GB |",
        "|---|---|---|---|---|---|",
    ]
    for r in receipt["results"]:
        t = r["tok_s"]
        early = " (stopped at time cap)" if r["stopped_early"] else ""
        lines.append(
            f"| {r['mode']} | {r['streams']} | {t['median']:.2f} [{t['min']:.2f}-{t['max']:.2f}] "
            f"| {r['timed_steps']}{early} | {r['prefill_seconds']:.2f} | {fmt(_gb(r.get('peak_vram_bytes')))} |"
        )
    if receipt.get("fallback_reason"):
        lines.append(
            f"- {receipt['dtype_requested']} failed ({receipt['fallback_reason']}); measured {receipt['dtype_used']}"
        )
    if receipt.get("error"):
        lines.append(f"- ERROR: {receipt['error']}")
    lines += [f"- {note}" for note in receipt["notes"]]
    return "\n".join(lines) + "\n"


def write_receipt(receipt: dict[str, Any], out_dir: Path) -> Path:
    return write_receipt_files(receipt, out_dir, markdown_table)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="checkpoint folder transformers can load")
    parser.add_argument("--gpu-memory", default="24GiB", help="accelerate's GPU budget (max_memory[0]): 24GiB, 80%%")
    parser.add_argument("--host-memory", default=None, help="accelerate's host budget (default: RAM available)")
    parser.add_argument("--streams", default="1,2,4", help="comma-separated stream counts")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=60.0, help="cap on the timed steps per stream count")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--device", default=None, help="cpu: everything on the CPU (tests); default cuda if present")
    parser.add_argument(
        "--fallback",
        default="fp32",
        choices=FALLBACKS,
        help="when a forward fails in --dtype: reload in fp32 (default), retry under torch.autocast, or give up",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON + Markdown receipt")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Write the receipt; 0 when measured, 1 when the baseline failed (the receipt says why)."""
    cfg = HFBenchConfig(
        model=args.model,
        streams=parse_int_list(args.streams, "--streams"),
        prompt_len=args.prompt_len,
        warmup=args.warmup,
        steps=args.steps,
        repeats=args.repeats,
        max_seconds=args.max_seconds,
        dtype=args.dtype,
        gpu_memory=args.gpu_memory,
        host_memory=args.host_memory,
        device=args.device,
        fallback=args.fallback,
        seed=args.seed,
    )
    receipt = run_hf_bench(cfg)
    path = write_receipt(receipt, args.out)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    return 1 if receipt["error"] else 0


# --- ``moetier bench decode --hf-baseline`` ------------------------------------------------------------------


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench decode`` flags of the transformers baseline."""
    parser.add_argument(
        "--hf-baseline",
        action="store_true",
        help="first measure transformers + accelerate device_map=auto (a subprocess) and add x hf ratios",
    )
    parser.add_argument("--gpu-memory", default="24GiB", help="VRAM budget of the --hf-baseline run (max_memory)")
    parser.add_argument("--host-memory", default=None, help="host RAM budget of the --hf-baseline run")
    parser.add_argument(
        "--hf-args", default="", help="extra 'moetier bench hf' flags, e.g. '--steps 4 --max-seconds 30'"
    )


def decode_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "hf_baseline": args.hf_baseline,
        "gpu_memory": args.gpu_memory,
        "host_memory": args.host_memory,
        "hf_args": args.hf_args,
    }


def subprocess_command(cfg: Any, out_dir: Path) -> list[str]:
    """``moetier bench hf`` for a ``DecodeBenchConfig``: same model, streams, prompts, dtype and device."""
    command = [sys.executable, "-m", "moetier.cli", "bench", "hf", "--model", str(cfg.model), "--out", str(out_dir)]
    command += ["--streams", ",".join(map(str, cfg.streams)), "--prompt-len", str(cfg.prompt_len)]
    command += ["--dtype", cfg.dtype, "--seed", str(cfg.seed), "--gpu-memory", cfg.gpu_memory]
    if cfg.host_memory:
        command += ["--host-memory", cfg.host_memory]
    if cfg.device:
        command += ["--device", cfg.device]
    return command + shlex.split(cfg.hf_args)


def run_subprocess(cfg: Any, timeout: float = SUBPROCESS_TIMEOUT_S) -> dict[str, Any]:
    """Run the baseline in its own process (its host copy of the weights dies with it); its receipt, or an error."""
    with tempfile.TemporaryDirectory(prefix="moetier-hf-") as tmp:
        command = subprocess_command(cfg, Path(tmp))
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"kind": KIND, "results": [], "error": f"subprocess timed out after {timeout:.0f} s"}
        receipts = sorted(Path(tmp).glob(f"{KIND}-*.json"))
        if receipts:
            return json.loads(receipts[-1].read_text())
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
    return {"kind": KIND, "results": [], "error": f"subprocess exited {done.returncode} without a receipt: {tail}"}


def merge_into_decode(results: list[dict[str, Any]], notes: list[str], hf: dict[str, Any] | None) -> None:
    """Append the baseline's results to a decode run's and say in ``notes`` what was measured."""
    if hf is None:
        return
    if hf.get("error"):
        notes.append(f"hf-accelerate baseline failed: {hf['error']}")
        return
    for r in hf["results"]:
        results.append({k: v for k, v in r.items() if k != "tokens"})
    place = hf.get("placement") or {}
    note = f"hf-accelerate: {place.get('mode')} ({placement_summary(place)}), dtype {hf['dtype_used']}"
    if hf.get("fallback_reason"):
        note += f" because {hf['dtype_requested']} failed: {hf['fallback_reason']}"
    notes.append(note)


def add_hf_ratios(results: list[dict[str, Any]]) -> None:
    """``ratio_to_hf`` on every result with an ``hf-accelerate`` result at the same stream count."""
    hf = {r["streams"]: r["tok_s"]["median"] for r in results if r["mode"] == MODE}
    for r in results:
        if r["mode"] != MODE and hf.get(r["streams"]):
            r["ratio_to_hf"] = r["tok_s"]["median"] / hf[r["streams"]]
