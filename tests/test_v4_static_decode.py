"""DeepSeek-V4's fixed-shape decode attention (``deepseek_v4_static_decode``) against the eager core.

Contiguous caches decode through the fixed-shape step, paged ones through the eager attention core: two
implementations of one attention, compared over enough steps for windows to close, the ring to wrap and the
indexer to pick among more entries than its top-k. Also: the state tensors never move (a graph replays their
addresses), the masked entry write, the entry bucket, and a finished sequence's graphs dropped with it.
"""

from __future__ import annotations

import gc

import pytest
import torch
from reference import relative_error
from test_v4_decode_ops import tiny_model
from test_v4_graph_segments import FakeGraphs

from moetier.models import deepseek_v4_static_decode as static_decode
from moetier.models.cache import KVRows
from moetier.models.paged_kv import PagedKVSpace, paged_kv


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4_static_decode")
    tiny_model(path)
    return path


PROMPTS = (3, 19, 40)  # windows and entries at different fills; 40 tokens: more CSA entries than the top-k of 4
# Equal capacities, and the engine's case: each sequence's own (prompt + max_tokens), here with the longest
# sequence in the smallest cache, so the bucket outgrows the other stores.
CAPACITIES = {"equal": (128, 128, 128), "mixed": (96, 64, 80)}


def _decode_both(model, prompts, capacities, steps, generator, tolerance) -> tuple[float, list, list]:
    """Prefill ``prompts`` into contiguous and paged caches of ``capacities``, decode ``steps`` batched steps on
    each and compare the logits every step -> the worst relative error and the two sets of caches."""
    contiguous, paged = _caches(model, capacities)
    for prompt, a, b in zip(prompts, contiguous, paged, strict=True):
        model(prompt, a)
        model(prompt, b)
    vocab, worst = model.embed.num_embeddings, 0.0
    for step in range(steps):
        tokens = torch.randint(0, vocab, (len(prompts),), generator=generator)
        fixed = model.compute_logits(model(tokens, contiguous, [1] * len(prompts)))
        eager = model.compute_logits(model(tokens, paged, [1] * len(prompts)))
        worst = max(worst, relative_error(fixed, eager))
        assert relative_error(fixed, eager) < tolerance, f"step {step}"
    return worst, contiguous, paged


def _caches(model, capacities):
    contiguous = [model.new_cache(n) for n in capacities]
    with paged_kv(PagedKVSpace("cpu", block_tokens=8)):
        paged = [model.new_cache(n) for n in capacities]
    assert static_decode.supports([c.layers[1] for c in contiguous])
    assert not static_decode.supports([c.layers[1] for c in paged])
    return contiguous, paged


@pytest.mark.parametrize("capacities", CAPACITIES.values(), ids=CAPACITIES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_fixed_shape_step_matches_the_eager_core(checkpoint, dtype, capacities):
    model = tiny_model(checkpoint, dtype)
    generator = torch.Generator().manual_seed(9)
    vocab = model.embed.num_embeddings
    prompts = [torch.randint(0, vocab, (n,), generator=generator) for n in PROMPTS]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    # 40 steps: the rings wrap (window 8 in the tiny config), CSA / HCA windows close
    worst, contiguous, paged = _decode_both(model, prompts, capacities, 40, generator, tolerance)
    print(f"{dtype} {capacities}: worst relative error fixed-shape vs eager core {worst:.2e}")
    for a, b in zip(contiguous, paged, strict=True):
        for la, lb in zip(a.layers, b.layers, strict=True):
            assert la.window.seen == lb.window.seen
            for sa, sb in ((la.compressor, lb.compressor), (la.indexer, lb.indexer)):
                if sa is not None:
                    assert (sa.count, sa.n_open) == (sb.count, sb.n_open)


@torch.no_grad()
def test_stores_shorter_than_a_window_batch_with_longer_ones(checkpoint):
    """A 7-token sequence has no HCA entry (rate 8) and one CSA entry (rate 4): its empty and one-row stores
    batch with a sequence whose bucket is larger, through the fixed-shape step, as the eager core computes."""
    model = tiny_model(checkpoint)
    generator = torch.Generator().manual_seed(3)
    vocab = model.embed.num_embeddings
    prompts = [torch.randint(0, vocab, (n,), generator=generator) for n in (2, 36)]
    worst, contiguous, _ = _decode_both(model, prompts, (7, 64), 5, generator, 1e-5)  # 7 tokens after 5 steps
    assert {layer.compressor.entries.capacity for layer in contiguous[0].layers if layer.compressor} == {0, 1}
    print(f"worst relative error fixed-shape vs eager core {worst:.2e}")


def _addresses(cache) -> list[int]:
    tensors = []
    for layer in cache.layers:
        tensors.append(layer.window.buffer)
        for state in (layer.compressor, layer.indexer):
            if state is not None:
                tensors += [state.open, state.entries.data]
                tensors += [t for t in (state.prev_kv, state.prev_gate, state.entries.scales) if t is not None]
    return [t.data_ptr() for t in tensors]


@torch.no_grad()
def test_state_tensors_never_move(checkpoint):
    model = tiny_model(checkpoint)
    cache = model.new_cache(96, kv_dtype="fp8")
    before = _addresses(cache)
    vocab = model.embed.num_embeddings
    model(torch.randint(0, vocab, (21,)), cache)  # a prefill chunk (windows close, prev halves replaced)
    for _ in range(12):
        model(torch.randint(0, vocab, (1,)), cache)
    model(torch.randint(0, vocab, (17,)), cache)  # another chunk after decode
    assert _addresses(cache) == before


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_write_where_writes_only_where_asked(kv_dtype):
    rows = KVRows((), 6, 8, torch.float32, "cpu", kv_dtype)
    rows.write(0, torch.arange(48, dtype=torch.float32).view(6, 8))
    before = rows.read(6).clone()
    new = torch.full((2, 8), -3.0)
    rows.write_where(torch.tensor([1, 4]), new, torch.tensor([True, False]))
    after = rows.read(6)
    assert torch.equal(after[1], torch.full((8,), -3.0))
    keep = [0, 2, 3, 4, 5]
    assert torch.equal(after[keep], before[keep])


def test_entry_bucket_is_a_power_of_two_within_capacity(checkpoint):
    model = tiny_model(checkpoint)
    cache = model.new_cache(400)
    layer = next(i for i, s in enumerate(cache.layers) if s.compressor is not None)
    states = [cache.layers[layer]]
    assert static_decode.entry_bucket(states) == static_decode.MIN_BUCKET
    compressor = states[0].compressor
    compressor.count, compressor.n_open = 40, compressor.rate - 1  # this step closes the 41st
    assert static_decode.entry_bucket(states) == 64
    compressor.count = compressor.entries.capacity - 1
    assert static_decode.entry_bucket(states) == compressor.entries.capacity
    sliding = next(s for s in cache.layers if s.compressor is None)
    assert static_decode.entry_bucket([sliding]) == 0


@torch.no_grad()
def test_a_finished_sequences_graphs_go_with_it(checkpoint, monkeypatch):
    model = tiny_model(checkpoint)
    graphs = FakeGraphs(warmup=1)
    monkeypatch.setattr(model, "graphs", graphs)
    vocab = model.embed.num_embeddings
    keep, drop = model.new_cache(64), model.new_cache(64)
    for cache in (keep, drop):
        model(torch.randint(0, vocab, (9,)), cache)
        for _ in range(3):
            model(torch.randint(0, vocab, (1,)), cache)
    layers = len(model.layers)
    tagged = lambda serial: sum(serial in entry.tags for entry in graphs._entries.values())  # noqa: E731
    assert tagged(keep.serial) == tagged(drop.serial) == layers
    serial = drop.serial
    del drop, cache  # the loop's name held it too
    gc.collect()
    assert tagged(serial) == 0 and tagged(keep.serial) == layers
    model(torch.randint(0, vocab, (1,)), keep)  # the kept sequence still replays its graphs
    assert graphs.failures == {}
