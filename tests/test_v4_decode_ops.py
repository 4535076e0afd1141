"""How many aten ops one DeepSeek-V4 decode step dispatches (a CPU proxy for GPU kernel launches).

Decode of one or a few streams is bound by per-op host overhead, not by arithmetic: every eager
op costs ~5-15 us to launch whatever its size. These tests count the ops of one decode step of the
tiny model of ``test_deepseek_v4`` (5 layers: sliding, CSA, HCA, CSA, HCA) at 1 and at 4 sequences
and fail when the count climbs past a ceiling set just above today's, so a change that adds launches
shows. Routed experts run behind the dispatcher (another component) and are counted apart; the
RMS norms count as the one launch their CUDA kernel is, the mHC mixing at a sublayer boundary as its two. Views count
too: each is a dispatch on the host even where it launches nothing, so the proxy includes them (and
reports them apart).

``python tests/test_v4_decode_ops.py`` prints the per-module breakdown.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetier.config import ModelLoadConfig
from moetier.models.paged_kv import PagedKVSpace, paged_kv
from moetier.weights.loader import load_model

sys.path.insert(0, str(Path(__file__).parent))  # the tiny-config helpers, also when run as a script

# Innermost module class -> bucket; ops outside any listed module fall to "model" (embedding, step setup).
_BUCKETS = {
    "V4RMSNorm": "norms",
    "Router": "router",
    "SharedExpert": "shared expert",
    "Indexer": "indexer",
    "Compressor": "compressor",
    "DeepseekV4Attention": "attention",
    "HyperConnection": "mHC",
    "HyperHead": "mHC",
    "DeepseekV4DecoderLayer": "mHC",  # the layer itself only merges the streams
    "DeepseekV4MoE": "router",
}
# Methods a decode step calls directly, outside their module's forward (the segmented decode of
# ``deepseek_v4_step``): bucketed as that module's ops. Nested module calls keep their own buckets.
_METHOD_BUCKETS = {
    ("DeepseekV4Attention", "project"): "attention",
    ("DeepseekV4Attention", "decode_queries"): "attention",
    ("DeepseekV4Attention", "decode_attend"): "attention",
    ("DeepseekV4Attention", "decode_output"): "attention",
    ("Compressor", "decode"): "compressor",  # the attention core calls these directly, not through the module
    ("Indexer", "decode"): "indexer",
    ("DeepseekV4DecoderLayer", "decode_pre"): "mHC",
    ("DeepseekV4DecoderLayer", "decode_post"): "mHC",
    ("DeepseekV4DecoderLayer", "finish_ffn"): "mHC",
}
# Ops that only make a new view of a tensor's storage: a host dispatch, no device kernel.
_VIEWS = {
    "view",
    "_unsafe_view",
    "reshape",
    "slice",
    "select",
    "expand",
    "unsqueeze",
    "squeeze",
    "transpose",
    "t",
    "permute",
    "as_strided",
    "split",
    "split_with_sizes",
    "unbind",
    "unfold",
    "alias",
    "detach",
    "lift_fresh",
    "view_as_real",
    "view_as_complex",
    "_reshape_alias",
    "narrow",
    "diagonal",
    "unflatten",
    "flatten",
    "chunk",
}


class OpCounter(TorchDispatchMode):
    """Counts aten ops per bucket (the innermost tracked module running when each is dispatched)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.ops: Counter[tuple[str, str]] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[(self.stack[-1] if self.stack else "model", func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def enter(self, bucket: str) -> None:
        self.stack.append(bucket)

    def leave(self) -> None:
        self.stack.pop()

    def count(self, bucket: str, name: str) -> None:
        self.ops[(bucket, name)] += 1

    def totals(self, views: bool | None = None) -> Counter[str]:
        """Ops per bucket; ``views`` True/False keeps only view/non-view ops, None all."""
        out: Counter[str] = Counter()
        for (bucket, name), n in self.ops.items():
            if views is None or (name.removesuffix("_") in _VIEWS) == views:
                out[bucket] += n
        return out


def _bucketed(counter: OpCounter, method, bucket: str):
    """``method`` (a plain function) running under ``bucket``."""

    def run(*args, **kwargs):
        counter.enter(bucket)
        try:
            return method(*args, **kwargs)
        finally:
            counter.leave()

    return run


@contextmanager
def counting(model):
    """Count the ops of everything run inside; experts and fused kernels are counted as noted in the module doc."""
    import moetier.models.deepseek_v4 as v4
    import moetier.models.deepseek_v4_attention as v4_attention

    counter = OpCounter()
    classes = {
        "DeepseekV4Attention": v4_attention.DeepseekV4Attention,
        "DeepseekV4DecoderLayer": v4.DeepseekV4DecoderLayer,
        "Compressor": v4_attention.Compressor,
        "Indexer": v4_attention.Indexer,
    }
    methods = [(classes[owner], name, bucket) for (owner, name), bucket in _METHOD_BUCKETS.items()]
    saved_methods = [cls.__dict__[name] for cls, name, _ in methods]
    for (cls, name, bucket), original in zip(methods, saved_methods, strict=True):
        if isinstance(original, staticmethod):
            setattr(cls, name, staticmethod(_bucketed(counter, original.__func__, bucket)))
        else:
            setattr(cls, name, _bucketed(counter, original, bucket))
    handles = []
    for name, module in model.named_modules():
        bucket = "head" if name == "head" else _BUCKETS.get(type(module).__name__)
        if bucket is None:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, b=bucket: counter.enter(b)))
        handles.append(module.register_forward_hook(lambda m, a, o: counter.leave()))
    dispatch = model.dispatcher.dispatch
    # Launches on CUDA: the RMS norm one, the mHC mixing at a sublayer boundary two (moetier.kernels.hyper_mix).
    kernels = [(v4, "hyper_mix", 2), (v4_attention, "rms_norm", 1)]
    originals = [getattr(module, name) for module, name, _ in kernels]

    def counted_dispatch(*args, **kwargs):
        counter.stack.append("experts")
        try:
            return dispatch(*args, **kwargs)
        finally:
            counter.stack.pop()

    def fused(name, launches, fn):
        def run(*args, **kwargs):
            for _ in range(launches):
                counter.count(counter.stack[-1] if counter.stack else "model", f"{name}_kernel")
            counter.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.paused -= 1

        return run

    model.dispatcher.dispatch = counted_dispatch
    for (module, name, launches), fn in zip(kernels, originals, strict=True):
        setattr(module, name, fused(name, launches, fn))
    try:
        with counter:
            yield counter
    finally:
        del model.dispatcher.dispatch
        for (module, name, _), fn in zip(kernels, originals, strict=True):
            setattr(module, name, fn)
        for handle in handles:
            handle.remove()
        for (cls, name, _), original in zip(methods, saved_methods, strict=True):
            setattr(cls, name, original)


def tiny_model(path: Path, dtype: torch.dtype = torch.float32):
    """The tiny V4 of ``test_deepseek_v4`` computing in ``dtype`` (bf16: the GPU dtype, with its casts)."""
    from test_deepseek_v4 import save_tiny_v4

    if not (path / "config.json").exists():
        save_tiny_v4(path, torch.float32)
    return load_model(path, ModelLoadConfig(dtype=dtype, device="cpu"), progress=False).model


@torch.no_grad()
def decode_step_ops(model, streams: int, prompt_len: int = 21) -> OpCounter:
    """Prefill ``streams`` prompts of ``prompt_len + i`` tokens, then count one decode step of all of them.

    Paged caches: the eager attention core, where every op is a launch. Contiguous caches take the fixed-shape
    step, replayed inside each layer's CUDA graph (its eager ops are counted in test_v4_graph_segments)."""
    generator = torch.Generator().manual_seed(5)
    vocab = model.embed.num_embeddings
    with paged_kv(PagedKVSpace("cpu", block_tokens=16)):
        caches = [model.new_cache(64) for _ in range(streams)]
    for i, cache in enumerate(caches):
        model(torch.randint(0, vocab, (prompt_len + i,), generator=generator), cache)
    tokens = torch.randint(0, vocab, (streams,), generator=generator)
    with counting(model) as counter:
        if streams == 1:
            model.compute_logits(model(tokens, caches[0]))
        else:
            model.compute_logits(model(tokens, caches, [1] * streams))
    return counter


def breakdown(counter: OpCounter) -> str:
    total, views = counter.totals(), counter.totals(views=True)
    rows = [f"  {b:<14}{n:>6}  ({views[b]} views)" for b, n in sorted(total.items(), key=lambda kv: -kv[1])]
    ours = sum(n for b, n in total.items() if b != "experts")
    return "\n".join([f"  total {sum(total.values())}, without experts {ours}", *rows])


# Ceilings on the non-expert ops of one decode step of the tiny model, set just above the counts reached
# (a regression fails). Before the decode-launch work (issue 4): fp32 1637 / 5139 and bf16 1860 / 5824 at
# 1 / 4 streams; after fused projections: fp32 931 / 1546, bf16 1086 / 1781; after the fused RMSNorm
# kernel and the batched decode attention: fp32 762 / 1278, bf16 843 / 1421 (780 / 1290, 861 / 1433 later);
# after batching the attention core's per-sequence work (one launch for the row copies, closing windows
# pooled together, one indexer scoring, one concatenation of the padded keys): fp32 759 / 1050, bf16 825 / 1130.
# Paged caches (the eager core); raised from 770 / 1065 / 835 / 1145 when the window became a ring (its keys are
# concatenated with the new one, one op per layer and sequence) and sliding layers took the fixed-shape step;
# 4 streams raised from 1145 / 1215 when the compressors' pooling took its softmax over the last dimension (two
# transposes a pooling: 1153 / 1225; the kernel it replaced took 28-78 us a call on the H200). The mHC mixing at a
# sublayer boundary as two kernels (merge, norms, GEMV, gates, Sinkhorn, collapse, sublayer norm): fp32 563 / 919,
# bf16 598 / 960 (the mHC bucket 245 -> 20 ops).
CEILINGS = {(torch.float32, 1): 575, (torch.float32, 4): 930, (torch.bfloat16, 1): 610, (torch.bfloat16, 4): 975}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4_ops")
    tiny_model(path)
    return path


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request, checkpoint):
    return tiny_model(checkpoint, request.param)


@pytest.mark.parametrize("streams", [1, 4])
def test_decode_step_op_count_stays_under_its_ceiling(model, streams):
    counter = decode_step_ops(model, streams)
    print(f"\n{model.dtype}, {streams} stream(s):\n{breakdown(counter)}")
    totals = counter.totals()
    ours = sum(n for bucket, n in totals.items() if bucket != "experts")
    # The counter sees every part of the step.
    assert all(totals[b] > 0 for b in ("attention", "indexer", "compressor", "mHC", "norms", "router", "experts"))
    ceiling = CEILINGS[model.dtype, streams]
    assert ours <= ceiling, f"{ours} ops per decode step, ceiling {ceiling}"


def test_op_count_is_deterministic(model):
    assert decode_step_ops(model, 1).ops == decode_step_ops(model, 1).ops


@torch.no_grad()
def test_unfused_projections_give_the_same_logits(checkpoint):
    """Replacing a fused weight (as ``model.to`` would) makes the layer fall back to separate GEMMs, unchanged."""
    model = tiny_model(checkpoint)
    prompt = torch.randint(0, model.embed.num_embeddings, (13,), generator=torch.Generator().manual_seed(2))

    def run() -> torch.Tensor:
        cache = model.new_cache(32)
        logits = [model.compute_logits(model(prompt, cache))]
        logits += [model.compute_logits(model(torch.tensor([t]), cache)) for t in (3, 7, 11, 5)]
        return torch.cat(logits)

    fused = run()
    assert all(layer.attn.x_proj.weight is not None for layer in model.layers)
    for layer in model.layers:
        for linear in (layer.attn.wq_a, layer.attn.wq_b, layer.ffn.shared_experts.up_proj):
            linear.weight = torch.nn.Parameter(linear.weight.detach().clone())
    counter = decode_step_ops(model, 1)
    assert sum(counter.totals().values()) > 0
    unfused = run()
    assert (unfused - fused).abs().max() <= 1e-5 * fused.abs().max()


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_model(Path(tmp))
        for n in (1, 4):
            print(f"{n} stream(s):\n{breakdown(decode_step_ops(tiny, n))}")
