"""``moetier bench serve``: drive an OpenAI-compatible server with the ``openai`` client at several concurrencies.

Each concurrency level sends ``requests`` streamed text completions (``stream_options.include_usage``,
``ignore_eos`` so every request generates exactly ``max_tokens``) from ``concurrency`` client
threads, with fixed prompts drawn from a seeded word list. Per level the receipt reports TTFT (the
first chunk that carries generated text), TPOT (``(latency - TTFT) / (tokens - 1)``), ITL (gaps
between text chunks), end-to-end latency, output tok/s over the level's wall time, and every error
(a healthy run has none). Requests have a timeout and the run has a deadline; only loopback
addresses are driven. With ``--start-model`` the bench starts ``moetier serve`` itself on a free
loopback port, and stops it afterwards.

``--turns N`` makes each request an agent session of ``N`` turns: turn ``k + 1``'s prompt is turn ``k``'s
prompt, its completion and ``--turn-tokens`` new words (a tool's result), sent when turn ``k`` has finished,
so every follow-up extends a prefix the server has just computed. The receipt then reports the follow-up
turns' TTFT apart from the first turns'. Every level also reports what the server's ``/metrics`` counters
moved by during it (decode graphs captured, sequences started in a finished sequence's cache, prompt
tokens served from the prefix cache, preemptions), when the server exposes them.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from moetier.bench.common import fmt, parse_int_list, percentiles, stats, write_receipt_files
from moetier.bench.environment import environment
from moetier.errors import ConfigError, MoetierError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEMO = "demo"  # --start-model demo: the built-in demo model
# Plain words, so any tokenizer makes roughly one token of each; prompts are seeded draws of them.
_WORD_TEXT = (
    "the of and to in is that for it as with was on be by at this have from or one had not but what all were "
    "when we there can an your which their said if do will each about how up out them then she many some so "
    "these would other into has more her two like him see time could no make than first been its who now people"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass
class ServeBenchConfig:
    """What to measure; validated on construction."""

    url: str | None = None
    start_model: str | None = None
    serve_args: list[str] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4])
    requests: int = 8
    prompt_tokens: int = 256
    max_tokens: int = 64
    warmup: int = 1
    seed: int = 0
    turns: int = 1
    turn_tokens: int = 32
    request_timeout: float = 300.0
    deadline: float = 1800.0  # the whole run, start-up included
    start_timeout: float = 600.0
    api_key: str = "none"

    def __post_init__(self) -> None:
        if (self.url is None) == (self.start_model is None):
            raise ConfigError("bench serve needs exactly one of --url (a running server) or --start-model")
        if self.url is not None and urlparse(self.url).hostname not in LOOPBACK:
            raise ConfigError(f"bench serve drives loopback servers only ({', '.join(LOOPBACK)}), got {self.url}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError(f"--concurrency must be positive integers, got {self.concurrency}")
        if min(self.requests, self.prompt_tokens, self.max_tokens, self.turns, self.turn_tokens) < 1 or self.warmup < 0:
            raise ConfigError(
                "--requests, --prompt-tokens, --max-tokens, --turns and --turn-tokens must be >= 1 and --warmup >= 0"
            )
        if min(self.request_timeout, self.deadline, self.start_timeout) <= 0:
            raise ConfigError("timeouts must be positive")


def make_prompts(count: int, words: int, seed: int) -> list[str]:
    """``count`` fixed prompts of ``words`` seeded words each (the same for every run with ``seed``)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(count)]


@dataclass
class RequestRecord:
    """One streamed request, timed from just before it was sent."""

    ttft: float | None = None
    latency: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each text-carrying chunk
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""  # the completion (the next turn's prompt builds on it)
    turn: int = 0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def stream_one(client: Any, model: str, prompt: str, cfg: ServeBenchConfig) -> RequestRecord:
    """Send one streamed completion and time its chunks; errors are recorded, not raised."""
    record = RequestRecord()
    start = time.perf_counter()
    try:
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=cfg.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            timeout=cfg.request_timeout,
        )
        for chunk in stream:
            now = time.perf_counter() - start
            if chunk.choices and chunk.choices[0].text:
                record.text += chunk.choices[0].text
                record.chunk_times.append(now)
                if record.ttft is None:
                    record.ttft = now
            if chunk.choices and chunk.choices[0].finish_reason:
                record.finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                record.prompt_tokens = chunk.usage.prompt_tokens
                record.completion_tokens = chunk.usage.completion_tokens
        record.latency = time.perf_counter() - start
        if record.completion_tokens is None:
            record.error = "the stream ended without a usage chunk"
        elif record.ttft is None:
            record.error = "the stream carried no text"
    except Exception as exc:  # noqa: BLE001 - every failure is a counted error in the receipt
        record.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return record


def run_session(client: Any, model: str, prompt: str, cfg: ServeBenchConfig, seed: int) -> list[RequestRecord]:
    """``cfg.turns`` turns, each prompt the last one's prompt, completion and ``cfg.turn_tokens`` new seeded words;
    a failed turn ends the session."""
    additions = make_prompts(cfg.turns - 1, cfg.turn_tokens, seed)
    records: list[RequestRecord] = []
    for turn in range(cfg.turns):
        record = stream_one(client, model, prompt, cfg)
        record.turn = turn
        records.append(record)
        if record.error is not None:
            break
        if turn < cfg.turns - 1:
            prompt = f"{prompt}{record.text} {additions[turn]}"
    return records


def run_level(
    client: Any, model: str, prompts: list[str], concurrency: int, cfg: ServeBenchConfig, metrics_url: str | None = None
) -> dict[str, Any]:
    """One request (or session of ``cfg.turns``) per prompt, ``concurrency`` in flight at a time; the level's
    figures, with what the server's counters at ``metrics_url`` moved by."""
    before = server_counters(metrics_url)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        sessions = list(
            pool.map(lambda i: run_session(client, model, prompts[i], cfg, cfg.seed + 1 + i), range(len(prompts)))
        )
    wall = time.perf_counter() - start
    after = server_counters(metrics_url)
    records = [r for session in sessions for r in session]
    good = [r for r in records if r.error is None]
    output_tokens = sum(r.completion_tokens for r in good)
    turns = {}
    if cfg.turns > 1:
        turns = {
            "turns": cfg.turns,
            "first_turn_ttft_s": _summary([r.ttft for r in good if r.turn == 0]),
            "followup_ttft_s": _summary([r.ttft for r in good if r.turn > 0]),
        }
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "errors": len(records) - len(good),
        "error_messages": sorted({r.error for r in records if r.error}),
        "wall_seconds": wall,
        "output_tokens": output_tokens,
        "prompt_tokens": [r.prompt_tokens for r in good],
        "completion_tokens": [r.completion_tokens for r in good],
        "text_chunks": [len(r.chunk_times) for r in good],
        "finish_reasons": sorted({r.finish_reason for r in good if r.finish_reason}),
        "output_tok_s": output_tokens / wall if wall > 0 else None,
        "ttft_s": _summary([r.ttft for r in good]),
        "tpot_s": _summary([r.tpot for r in good if r.tpot is not None]),
        "itl_s": _summary([gap for r in good for gap in r.itl]),
        "latency_s": _summary([r.latency for r in good]),
        **turns,
        "server_counters": {k: after[k] - before[k] for k in after if k in before},
    }


# The server's counters a level reports the change of (the `moetier:` Prometheus series, without `_total`).
SERVER_COUNTERS = ("decode_graph_captures", "spare_cache_reuses", "prefix_cache_hits", "preemptions")


def server_counters(metrics_url: str | None) -> dict[str, float]:
    """The :data:`SERVER_COUNTERS` the server at ``metrics_url`` exposes now (none where it has no such page)."""
    if metrics_url is None:
        return {}
    from urllib.request import urlopen

    try:
        with urlopen(metrics_url, timeout=10) as response:  # noqa: S310 - a loopback URL (checked in the config)
            text = response.read().decode()
    except OSError:
        return {}
    wanted = {f"moetier:{name}_total": name for name in SERVER_COUNTERS}
    values: dict[str, float] = {}
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        name = wanted.get(series.split("{", 1)[0])
        if name is not None:  # summed over labels (one model_name here)
            values[name] = values.get(name, 0.0) + float(value)
    return values


def metrics_url_of(api_url: str) -> str:
    """``http://host:port/metrics`` of an API base such as ``http://host:port/v1``."""
    parts = urlparse(api_url)
    return f"{parts.scheme}://{parts.netloc}/metrics"


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return percentiles([]) | {"min": None, "median": None, "max": None, "mean": None}
    return percentiles(values) | stats(values) | {"mean": sum(values) / len(values)}


# --- a server started by the bench -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class StartedServer:
    """``moetier serve`` in a child process on a free loopback port; its log goes to a temporary file."""

    def __init__(self, model: str, serve_args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = tempfile.NamedTemporaryFile(prefix="moetier-bench-serve-", suffix=".log", delete=False)  # noqa: SIM115
        command = [sys.executable, "-m", "moetier.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if model != DEMO:
            command += ["--model", model]
        self.command = command + list(serve_args)
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until ``/health`` answered 200; MoetierError with the log's tail if it died or timed out."""
        import httpx

        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                raise MoetierError(f"the server exited with status {self.process.returncode}: {self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.2)
        raise MoetierError(f"the server was not healthy after {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        return self.process.returncode


def run_serve_bench(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Warm up, then measure every concurrency level; return the receipt (not yet written)."""
    import openai

    started = time.time()
    deadline = time.monotonic() + cfg.deadline
    server = StartedServer(cfg.start_model, cfg.serve_args) if cfg.start_model is not None else None
    notes: list[str] = []
    try:
        start_seconds = server.wait_healthy(min(cfg.start_timeout, cfg.deadline)) if server else None
        url = server.url if server else cfg.url
        client = openai.OpenAI(base_url=url, api_key=cfg.api_key, max_retries=0, timeout=cfg.request_timeout)
        model = client.models.list().data[0].id
        # Every level and the warm-up get their own prompts, so no prompt is ever sent twice (a prefix
        # cache would make repeats look fast); the draws are fixed by the seed.
        per_level = cfg.requests
        prompts = make_prompts(cfg.warmup + per_level * len(cfg.concurrency), cfg.prompt_tokens, cfg.seed)
        warm = [stream_one(client, model, p, cfg) for p in prompts[: cfg.warmup]]
        results = []
        for i, concurrency in enumerate(cfg.concurrency):
            if time.monotonic() > deadline:
                notes.append(f"concurrency {concurrency}: not run, the {cfg.deadline:.0f} s deadline passed")
                continue
            first = cfg.warmup + i * per_level
            level_prompts = prompts[first : first + per_level]
            results.append(run_level(client, model, level_prompts, concurrency, cfg, metrics_url_of(url)))
    finally:
        exit_status = server.stop() if server else None
    return {
        "kind": "serve",
        "environment": environment(),
        "config": asdict(cfg),
        "server": {
            "url": url,
            "model": model,
            "started_by_bench": server is not None,
            "command": server.command if server else None,
            "start_seconds": start_seconds,
            "exit_status": exit_status,
            "warmup_errors": [r.error for r in warm if r.error],
        },
        "results": results,
        "notes": notes,
        "wall_seconds": time.time() - started,
    }


def markdown_table(receipt: dict[str, Any]) -> str:
    """A Markdown summary of a serve receipt."""
    cfg, server = receipt["config"], receipt["server"]
    lines = [
        f"Serve, model {server['model']} at {server['url']}, {cfg['requests']} requests per level, "
        f"~{cfg['prompt_tokens']} prompt words, {cfg['max_tokens']} output tokens, "
        f"{cfg.get('turns', 1)} turn(s) a request (+{cfg.get('turn_tokens', 0)} words each), "
        f"git {receipt['environment']['git_sha']}",
        "",
        "| concurrency | errors | output tok/s | TTFT p50/p90/p99 s | TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms "
        "| follow-up TTFT p50/p90/p99 s | graphs captured | spare caches reused |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in receipt["results"]:
        followup = _pct(r["followup_ttft_s"], 1, 3) if "followup_ttft_s" in r else "-"
        counters = r.get("server_counters", {})
        lines.append(
            f"| {r['concurrency']} | {r['errors']} | {fmt(r['output_tok_s'], 1)} | {_pct(r['ttft_s'], 1, 3)} "
            f"| {_pct(r['tpot_s'], 1e3, 1)} | {_pct(r['itl_s'], 1e3, 1)} | {followup} "
            f"| {fmt(counters.get('decode_graph_captures'), 0)} | {fmt(counters.get('spare_cache_reuses'), 0)} |"
        )
    lines += [f"- {note}" for note in receipt["notes"]]
    return "\n".join(lines) + "\n"


def _pct(summary: dict[str, float | None], scale: float, digits: int) -> str:
    return "/".join(fmt(None if summary[p] is None else summary[p] * scale, digits) for p in ("p50", "p90", "p99"))


def write_receipt(receipt: dict[str, Any], out_dir: Path) -> Path:
    return write_receipt_files(receipt, out_dir, markdown_table)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running server on this machine, e.g. http://127.0.0.1:8000/v1")
    target.add_argument(
        "--start-model", help=f"start 'moetier serve --model DIR' on a free loopback port ('{DEMO}': the demo model)"
    )
    parser.add_argument("--serve-args", default="", help="extra 'moetier serve' arguments, e.g. '--gpu-memory 24GiB'")
    parser.add_argument("--concurrency", default="1,2,4", help="comma-separated numbers of requests in flight")
    parser.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (seeded words, ~1 token each)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (EOS ignored)")
    parser.add_argument(
        "--turns", type=int, default=1, help="turns per request: each follow-up extends the last prompt and completion"
    )
    parser.add_argument("--turn-tokens", type=int, default=32, help="new words a follow-up turn adds (a tool result)")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--deadline", type=float, default=1800.0, help="seconds for the whole run")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a started server to load")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON + Markdown receipt")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cfg = ServeBenchConfig(
        url=args.url,
        start_model=args.start_model,
        serve_args=shlex.split(args.serve_args),
        concurrency=parse_int_list(args.concurrency, "--concurrency"),
        requests=args.requests,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        turns=args.turns,
        turn_tokens=args.turn_tokens,
        warmup=args.warmup,
        seed=args.seed,
        request_timeout=args.request_timeout,
        deadline=args.deadline,
        start_timeout=args.start_timeout,
        api_key=args.api_key,
    )
    receipt = run_serve_bench(cfg)
    path = write_receipt(receipt, args.out)
    print(markdown_table(receipt))
    print(f"receipt: {path}")
    errors = sum(r["errors"] for r in receipt["results"])
    if errors:
        print(f"bench serve: {errors} request(s) failed", file=sys.stderr)
    return 1 if errors else 0
