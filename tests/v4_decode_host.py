"""Host cost of DeepSeek-V4's eager decode attention core (:meth:`DeepseekV4Attention.decode_attend`).

Decode steps of the tiny V4 (``test_deepseek_v4``'s: sliding, CSA rate 4, HCA rate 8) on the CPU, where
the tensors are so small that a call's time is almost all host overhead (Python and op dispatch). Each
``decode_attend`` call is timed and, in a separate pass, its aten ops are counted, by layer kind and by
whether one of its sequences closes a compressor window at that step.

``python tests/v4_decode_host.py`` prints the table (used by ``test_v4_decode_host``).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from moetier.models import deepseek_v4_attention as v4_attention
from moetier.models.paged_kv import PagedKVSpace, paged_kv

sys.path.insert(0, str(Path(__file__).parent))  # the tiny-config helpers, also when run as a script

Key = tuple[str, bool]  # (layer kind, a window closes in the call)


class _Ops(TorchDispatchMode):
    """Counts every aten op dispatched (views included: each is a host dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class _Calls(TorchFunctionMode):
    """Counts the torch calls made from Python (functions, methods, operators, indexing): each pays the
    Python binding's cost, where the aten ops that one call runs inside C++ are cheaper."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _closes(states) -> bool:
    """Whether pushing one more row closes a compressor window of any of ``states`` (LayerCaches)."""
    return any(s.compressor is not None and s.compressor.n_open == s.compressor.rate - 1 for s in states)


@contextmanager
def recording(count: str | None) -> Iterator[dict[Key, list[float]]]:
    """Patch ``decode_attend`` to record, per :data:`Key`, each call's seconds, or with ``count`` "ops" its aten
    ops (views included), with "calls" its torch calls from Python."""
    cls = v4_attention.DeepseekV4Attention
    original = cls.decode_attend
    samples: dict[Key, list[float]] = defaultdict(list)

    def recorded(self, q, index_q, inputs, rope, states):
        key = (self.kind, _closes(states))
        if count is not None:
            with _Ops() if count == "ops" else _Calls() as counter:
                out = original(self, q, index_q, inputs, rope, states)
            samples[key].append(counter.count)
            return out
        start = time.perf_counter()
        out = original(self, q, index_q, inputs, rope, states)
        samples[key].append(time.perf_counter() - start)
        return out

    cls.decode_attend = recorded
    try:
        yield samples
    finally:
        cls.decode_attend = original


@torch.no_grad()
def decode_attend_samples(
    model, streams: int, steps: int = 48, count: str | None = None, prompt_len: int = 21
) -> dict[Key, list[float]]:
    """Prefill ``streams`` prompts (``prompt_len + 3 * i`` tokens), then record ``steps`` decode steps."""
    generator = torch.Generator().manual_seed(3)
    vocab = model.embed.num_embeddings
    # Paged caches: the eager attention core (contiguous ones take the fixed-shape step, replayed in graphs).
    with paged_kv(PagedKVSpace("cpu", block_tokens=16)):
        caches = [model.new_cache(prompt_len + 3 * streams + steps + 8) for _ in range(streams)]
    for i, cache in enumerate(caches):
        model(torch.randint(0, vocab, (prompt_len + 3 * i,), generator=generator), cache)
    tokens = [torch.randint(0, vocab, (streams,), generator=generator) for _ in range(steps)]
    with recording(count) as samples:
        for step in tokens:
            model(step, caches[0]) if streams == 1 else model(step, caches, [1] * streams)
    return dict(samples)


def report(model, streams: int, steps: int = 48, repeats: int = 3) -> str:
    """A table of median us (the best of ``repeats`` runs) and ops per ``decode_attend`` call, by layer kind
    and window closing."""
    decode_attend_samples(model, streams, 8)  # warm up
    runs = [decode_attend_samples(model, streams, steps) for _ in range(repeats)]
    times = min(runs, key=lambda run: sum(sum(v) for v in run.values()))
    ops = decode_attend_samples(model, streams, steps, count="ops")
    calls = decode_attend_samples(model, streams, steps, count="calls")
    lines = [f"{streams} stream(s), {model.dtype}: median us, aten ops, torch calls from Python per call"]
    for key in sorted(times):
        kind, closing = key
        label = f"{kind}{' (closing)' if closing else ''}"
        us, n = statistics.median(times[key]) * 1e6, len(times[key])
        lines.append(f"  {label:<40} {us:7.1f} us {ops[key][0]:5d} ops {calls[key][0]:4d} calls ({n} calls)")
    everything = [t for v in times.values() for t in v]
    mean = [statistics.mean(n for v in counts.values() for n in v) for counts in (ops, calls)]
    us = statistics.median(everything) * 1e6
    lines.append(f"  {'all (median us, mean ops, calls)':<40} {us:7.1f} us {mean[0]:5.1f} ops {mean[1]:4.1f} calls")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile

    from test_v4_decode_ops import tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float32, torch.bfloat16):
            tiny = tiny_model(Path(tmp), dtype)
            for n in (1, 4):
                print(report(tiny, n))
