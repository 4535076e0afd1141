"""The ``moetier`` command line: ``generate``, ``serve``, ``plan`` and ``bench`` (each registered in SUBCOMMANDS).

A user mistake (any :class:`MoetierError`, a missing file) prints one line ``moetier: error: ...``
to stderr and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from moetier import __version__
from moetier.errors import MoetierError
from moetier.tiers.tiered_config import MISS_ROUTES

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# A subcommand's setup adds its arguments to its parser and sets ``handler``: a function taking
# the parsed arguments and returning the exit status. Later subcommands register here.
Setup = Callable[[argparse.ArgumentParser], None]
SUBCOMMANDS: dict[str, tuple[str, Setup]] = {}


def subcommand(name: str, help_text: str) -> Callable[[Setup], Setup]:
    """Register ``setup`` as the parser builder of ``moetier NAME``."""

    def register(setup: Setup) -> Setup:
        SUBCOMMANDS[name] = (help_text, setup)
        return setup

    return register


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model/--dtype/--device/--max-model-len, shared by every subcommand that loads a model."""
    parser.add_argument("--model", required=True, help="Hugging Face model folder (config.json + *.safetensors)")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")


def add_kv_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--kv-dtype: the KV cache's storage, shared by ``serve``, ``generate`` and ``plan``."""
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "bf16", "fp8"],
        help="KV cache storage: auto (the model dtype), bf16, or fp8 (e4m3, per-token scales: about half of bf16)",
    )


def add_prefix_cache_argument(parser: argparse.ArgumentParser) -> None:
    """--prefix-cache: the prefix cache's VRAM bound, shared by ``serve`` and ``plan``."""
    parser.add_argument(
        "--prefix-cache",
        default="1GiB",
        metavar="SIZE",
        help="VRAM for snapshots of earlier prompts that later requests start from (default 1GiB; 0: no prefix "
        "caching); DeepSeek-V4 with spare caches reserves only its borrowed snapshots' rolling state, within it",
    )


def add_expert_format_argument(parser: argparse.ArgumentParser) -> None:
    """--expert-format: the routed experts' home copy, shared by ``serve``, ``generate`` and ``plan``."""
    parser.add_argument(
        "--expert-format",
        default="dense",
        choices=["dense", "fp8", "fp4"],  # moetier.config.EXPERT_FORMATS (not imported: torch stays lazy)
        help="routed experts' home copy: dense (dequantised to --dtype at load, default), fp8 (an fp8-block "
        "checkpoint such as DeepSeek-V3/R1 keeps its float8 weights and scales: half the host RAM and miss bytes) "
        "or fp4 (DeepSeek-V4's FP4 experts stay packed with their scales: about 0.27x of bf16)",
    )


def add_backbone_format_argument(parser: argparse.ArgumentParser) -> None:
    """--backbone-format: the backbone linears' VRAM copy, shared by ``serve``, ``generate`` and ``plan``."""
    parser.add_argument(
        "--backbone-format",
        default="auto",
        choices=["auto", "fp8", "dense"],  # moetier.config.BACKBONE_FORMATS (not imported: torch stays lazy)
        help="backbone linears (attention, shared experts): fp8 (those the checkpoint stores fp8-block, as "
        "DeepSeek's releases do, stay so: half the VRAM and decode bytes of bf16; no effect on other checkpoints), "
        "dense (dequantised to --dtype at load) or auto (default: fp8 on a GPU, dense on the CPU, where an fp8 "
        "linear would dequantise its weight every call)",
    )


def add_prefill_chunk_argument(parser: argparse.ArgumentParser) -> None:
    """--prefill-chunk: prefill tokens per step, shared by ``serve``, ``generate`` and ``plan``."""
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prefill tokens per step (default auto: with --gpu-memory the plan picks up to 8192 from the VRAM "
        "left, larger chunks amortise streaming the experts; else 512). Decodes wait while a chunk runs",
    )


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """--gpu-memory and the tiered-expert options, shared by ``serve`` and ``generate``."""
    parser.add_argument(
        "--gpu-memory",
        default=None,
        help="VRAM budget (24GiB, 24GB, 80%%): plan placement, experts' home copy in pinned host RAM and an "
        "expert cache in the VRAM left (default: every expert resident)",
    )
    parser.add_argument("--host-memory", default=None, help="host RAM budget, checked against the experts' home copy")
    parser.add_argument("--expert-policy", default="lfu", help="expert cache policy (lru, lfu, static)")
    parser.add_argument("--cpu-threads", type=int, default=None, help="threads of the CPU expert tier")
    parser.add_argument(
        "--miss-route",
        default="auto",
        choices=list(MISS_ROUTES),
        help="where cache misses run (default auto: split by cost; mapped: the GPU reads them from pinned RAM)",
    )
    parser.add_argument(
        "--kv-reserve-streams",
        type=int,
        default=None,
        help="reserve KV for this many streams (default all); the others borrow expert-cache slots while they run",
    )
    parser.add_argument(
        "--min-cache-slots", type=int, default=None, help="the expert cache never shrinks below this (default top_k)"
    )


def tier_options(args: argparse.Namespace):
    """The TierOptions of parsed ``add_tier_arguments`` (None without --gpu-memory)."""
    if args.gpu_memory is None:
        return None
    from moetier.tiers.plan import TierOptions

    return TierOptions(
        args.gpu_memory,
        args.host_memory,
        args.expert_policy,
        args.cpu_threads,
        args.miss_route,
        kv_reserve_streams=args.kv_reserve_streams,
        min_cache_slots=args.min_cache_slots,
    )


@subcommand("generate", "generate a completion for one prompt and print it")
def _setup_generate(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message through the chat template"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_kv_dtype_argument(parser)
    add_expert_format_argument(parser)
    add_backbone_format_argument(parser)
    add_prefill_chunk_argument(parser)
    add_tier_arguments(parser)
    parser.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from moetier.engine.sampling import SamplingParams
    from moetier.llm import LLM

    options = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop,
    }
    chosen = {k: v for k, v in options.items() if v is not None}
    SamplingParams(**chosen)  # reject bad values before spending minutes loading weights
    tier_options(args)  # reject bad tier options before loading, like the sampling options
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        gpu_memory=args.gpu_memory,
        host_memory=args.host_memory,
        expert_policy=args.expert_policy,
        cpu_threads=args.cpu_threads,
        miss_route=args.miss_route,
        kv_dtype=args.kv_dtype,
        prefill_chunk_tokens=args.prefill_chunk,
        expert_format=args.expert_format,
        backbone_format=args.backbone_format,
    )
    # Options left out keep the checkpoint's generation_config defaults.
    params = replace(llm.get_default_sampling_params(), **chosen)
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate(args.prompt, params)[0]
    print(output.outputs[0].text)
    return 0


@subcommand("make-bench-model", "write a random checkpoint with a real model's widths and fewer layers")
def _setup_make_bench_model(parser: argparse.ArgumentParser) -> None:
    from moetier.bench import make_model

    make_model.configure_parser(parser)
    parser.set_defaults(handler=make_model.run)


@subcommand("serve", "serve a model behind an OpenAI-compatible HTTP API (no --model: the built-in demo model)")
def _setup_serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="model folder (config.json + *.safetensors); default: the built-in demo model"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-streams", type=int, default=4, help="requests decoding together")
    parser.add_argument(
        "--context",
        "--max-model-len",
        dest="context",
        type=int,
        default=None,
        help="context window in tokens, prompt + output (default: the model's)",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MOETIER_API_KEY"),
        help="require 'Authorization: Bearer KEY' on the API (default: $MOETIER_API_KEY, else no key)",
    )
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    parser.add_argument("--reasoning-parser", default="auto", help="auto (by model family), none, or a parser name")
    parser.add_argument("--tool-call-parser", default="auto", help="auto (by model family), none, or a parser name")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument(
        "--sse-keepalive",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a streamed request waiting for its first token (long prefill) gets an SSE comment with the prefill's "
        "progress this often (default 5; 0: off)",
    )
    parser.add_argument(
        "--kv-layout",
        default="auto",
        choices=["auto", "contiguous", "paged"],
        help="KV cache rows: paged (blocks from shared pools, allocated as tokens arrive and shared by prefix-cache "
        "hits instead of copied) or contiguous per sequence; auto (default): paged where decode attention reads "
        "the blocks in place (Qwen3, DeepSeek-V3 on CUDA), contiguous otherwise",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the start-up warm-up (on CUDA: a few decode steps per batch size, to compile kernels and "
        "capture decode graphs before the first request)",
    )
    parser.add_argument(
        "--spare-cache-seconds",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a finished request's KV cache waits for the next request, which starts in it (DeepSeek-V4: its decode "
        "CUDA graphs replay instead of being captured again); where the expert cache lends it memory, this many "
        "seconds (default 30; 0: no reuse)",
    )
    add_kv_dtype_argument(parser)
    add_expert_format_argument(parser)
    add_backbone_format_argument(parser)
    add_prefill_chunk_argument(parser)
    add_prefix_cache_argument(parser)
    add_tier_arguments(parser)
    parser.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from moetier.server.app import ServeConfig, serve

    config = ServeConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        max_streams=args.max_streams,
        context=args.context,
        dtype=args.dtype,
        device=args.device,
        api_key=args.api_key or None,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        log_level=args.log_level,
        kv_dtype=args.kv_dtype,
        kv_layout=args.kv_layout,
        keepalive_seconds=args.sse_keepalive,
        warmup=args.warmup,
        prefill_chunk_tokens=args.prefill_chunk,
        expert_format=args.expert_format,
        backbone_format=args.backbone_format,
        spare_cache_seconds=args.spare_cache_seconds,
        prefix_cache=args.prefix_cache,
        tiers=tier_options(args),
    )
    return serve(config)


@subcommand("plan", "show where a model's bytes would go (VRAM, pinned host RAM) and the predicted decode bound")
def _setup_plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder (config.json + *.safetensors); no weights read")
    parser.add_argument("--gpu-memory", required=True, help="VRAM budget: 24GiB, 24GB, 80%% (of this machine's GPU)")
    parser.add_argument("--host-memory", default=None, help="host RAM budget for the experts' pinned home copy")
    parser.add_argument("--context", type=int, default=None, help="tokens per stream (default: the model's window)")
    parser.add_argument("--max-streams", type=int, default=4, help="streams decoding together (KV cache)")
    parser.add_argument("--workspace", default=None, help="activation workspace (default: a stated estimate)")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]
    )
    parser.add_argument("--device", default=None, help="device the plan is for (default: cuda if available)")
    parser.add_argument("--host-read-gbps", type=float, default=None, help="host DRAM read GB/s (default: H200 box)")
    parser.add_argument("--pcie-gbps", type=float, default=None, help="PCIe host->device GB/s (default: H200 box)")
    parser.add_argument(
        "--hbm-gbps", type=float, default=None, help="GPU memory GB/s, read + write (default: H200 box's copy)"
    )
    add_kv_dtype_argument(parser)
    add_expert_format_argument(parser)
    add_backbone_format_argument(parser)
    add_prefill_chunk_argument(parser)
    add_prefix_cache_argument(parser)
    parser.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from moetier.config import default_device
    from moetier.engine.spare_caches import borrowed_prefix_snapshots
    from moetier.engine.types import EngineConfig, checkpoint_config, resolve_dtype, resolve_window
    from moetier.tiers import plan
    from moetier.units import parse_size

    path = Path(args.model).expanduser()
    hf_config = checkpoint_config(path)
    device = torch.device(args.device) if args.device else default_device()
    bandwidths = {"host_read_gbps": args.host_read_gbps, "pcie_gbps": args.pcie_gbps, "hbm_gbps": args.hbm_gbps}
    prefix = parse_size(args.prefix_cache, "--prefix-cache")
    # The prefix cache as `moetier serve` reserves it.
    serving = EngineConfig(max_streams=args.max_streams, prefix_cache_bytes=prefix, enable_prefix_caching=prefix > 0)
    budget = plan.PlanBudget(
        gpu_memory=args.gpu_memory,
        host_memory=args.host_memory,
        context=resolve_window(hf_config, args.context),
        max_streams=args.max_streams,
        prefill_chunk_tokens=args.prefill_chunk,
        workspace=args.workspace,
        device_memory=plan.device_memory(device),
        kv_dtype=args.kv_dtype,
        expert_format=args.expert_format,
        backbone_format=args.backbone_format,
        prefix_cache=prefix,
        prefix_snapshots=borrowed_prefix_snapshots(hf_config, serving, device),
        **{k: v for k, v in bandwidths.items() if v is not None},
    )
    print(plan.make_plan(path, budget, resolve_dtype(args.dtype, hf_config, device)).table())
    return 0


@subcommand("bench", "measure decode, prefill or serving speed and write a receipt")
def _setup_bench(parser: argparse.ArgumentParser) -> None:
    from moetier.bench import (
        cpu_tier,
        decode,
        dispatch_host,
        gpu_experts,
        hf_baseline,
        links,
        plots,
        prefill,
        serve,
        trace_routing,
        v4_kernels,
    )

    kinds = parser.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    decode.configure_parser(kinds.add_parser("decode", help="decode tok/s at 1/2/4 streams, all placements"))
    prefill.configure_parser(
        kinds.add_parser("prefill", help="TTFT and prefill tok/s of long prompts: resident, sync copy, tiered, bound")
    )
    serve.configure_parser(
        kinds.add_parser("serve", help="TTFT/TPOT/ITL and output tok/s of a running server at several concurrencies")
    )
    plots.configure_parser(kinds.add_parser("plot", help="PNG plots of decode, prefill, serve receipts"))
    hf_baseline.configure_parser(
        kinds.add_parser("hf", help="decode tok/s of transformers + accelerate device_map=auto (comparison point)")
    )
    trace_routing.configure_record_parser(
        kinds.add_parser("record-trace", help="record the expert ids a checkpoint routes (for --routing-trace)")
    )
    cpu_tier.configure_parser(
        kinds.add_parser("cpu-tier", help="CPU expert tier alone: ms/job and GB/s, torch vs the C kernel, cold experts")
    )
    gpu_experts.configure_parser(
        kinds.add_parser("gpu-experts", help="device expert kernels alone: us/call and GB/s per format, cold experts")
    )
    links.configure_parser(
        kinds.add_parser("links", help="the home copy's links (CPU tier, mapped reads, DMA, DRAM) alone and at once")
    )
    dispatch_host.configure_parser(
        kinds.add_parser("dispatch-host", help="the host's cost of one MoE dispatch call: us and aten calls per call")
    )
    v4_kernels.configure_parser(
        kinds.add_parser("v4-kernels", help="V4's decode kernels alone against their torch ops: us a call in graphs")
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moetier", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"moetier {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, setup) in SUBCOMMANDS.items():
        setup(commands.add_parser(name, help=help_text, description=help_text))
    return parser


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 user error)."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (MoetierError, OSError) as exc:
        print(f"moetier: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("moetier: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
