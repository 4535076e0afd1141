"""DeepSeek-V4 decode's eager attention core: its ops per call stay under a ceiling, its outputs stay right.

:meth:`DeepseekV4Attention.decode_attend` runs eagerly between a decode step's CUDA graphs and is bound
by host overhead (every op a dispatch and a launch), so its op count per call is pinned here at one
sequence, by layer kind and for the steps where a compressor window closes (``tests/v4_decode_host.py``
measures and prints it). Its results are checked against the prefill path (the same tokens in one
forward, none of the decode code) over steps that close many CSA and HCA windows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import relative_error
from test_v4_decode_ops import tiny_model
from v4_decode_host import decode_attend_samples

from moetier.models.deepseek_v4_config import CSA, HCA
from moetier.models.deepseek_v4_rope import RotaryTable

# The most aten ops (views included) of one decode_attend call at one sequence, by (layer kind, a window
# closes), set 2 above the counts reached (a regression fails). Before the host-overhead work: fp32 13 /
# 16 / 46 / 29 / 94 (sliding, HCA, HCA closing, CSA, CSA closing, medians), bf16 14 / 17 / 54 / 29 / 104;
# most of the closing steps' cost was the entries' rotation, now rows of a table (RotaryTable.entries).
# The maxima include the first call's sink-logit views (the window is a ring now: no compaction steps).
# Paged caches. Sliding layers hold no paged store: they take the fixed-shape step in the layer's graph, not this
# core. The ops rose (e.g. CSA without a close from 34 to 41) when these counts moved to paged stores (block gathers).
# Closing CSA calls rose by 4 (105 -> 109 fp32, 114 -> 118 bf16) when pooling took its softmax over the last
# dimension: two transposes (views) in each of the call's two poolings.
OP_CEILINGS = {
    torch.float32: {(HCA, False): 26, (HCA, True): 49, (CSA, False): 41, (CSA, True): 111},
    torch.bfloat16: {(HCA, False): 27, (HCA, True): 54, (CSA, False): 42, (CSA, True): 120},
}
# The most torch calls made from Python per call (functions, methods, operators, indexing, attribute reads
# of tensors), the host's share beyond the ops (paged stores; on contiguous ones they were 25 / 60 / 42 / 125).
# Closing CSA calls: 151 -> 155 with the poolings' transposes. A closing call's rotations (one an HCA call, two a CSA
# one) each read ``x.is_cuda`` once more since the rotation kernel (kernels/rope_rotate.py): 72 -> 73, 155 -> 157.
CALL_CEILINGS = {(HCA, False): 29, (HCA, True): 73, (CSA, False): 49, (CSA, True): 159}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4_decode_host")
    tiny_model(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_attend_ops_per_call_stay_under_their_ceilings(checkpoint, dtype):
    model = tiny_model(checkpoint, dtype)
    ops = decode_attend_samples(model, 1, steps=16, count="ops")
    calls = decode_attend_samples(model, 1, steps=16, count="calls")
    assert set(ops) == set(OP_CEILINGS[dtype])  # every layer kind, closing and not, was seen
    for key, counts in ops.items():
        assert max(counts) <= OP_CEILINGS[dtype][key], f"{key}: {max(counts)} ops per call"
        assert max(calls[key]) <= CALL_CEILINGS[key], f"{key}: {max(calls[key])} torch calls per call"


@pytest.mark.parametrize("streams", [1, 3])
@torch.no_grad()
def test_decode_equals_prefill_across_window_closes(checkpoint, streams):
    """Decode logits (the segmented step, the attention core) equal the one-call prefill of the same tokens
    at float32 noise over 40 steps: 10 CSA (rate 4) and 5 HCA (rate 8) windows close per sequence, the
    window slides, and the indexer keeps 4 of up to 14 entries."""
    model = tiny_model(checkpoint)
    generator = torch.Generator().manual_seed(21)
    vocab, prompts, steps = model.embed.num_embeddings, [5 + 3 * i for i in range(streams)], 40
    tokens = [torch.randint(0, vocab, (n + steps,), generator=generator) for n in prompts]
    whole = [model.compute_logits(model(t, model.new_cache(64)))[n - 1 :] for t, n in zip(tokens, prompts, strict=True)]
    caches = [model.new_cache(64) for _ in prompts]
    for t, n, cache in zip(tokens, prompts, caches, strict=True):
        model(t[: n - 1], cache)
    worst = 0.0
    for step in range(steps + 1):
        ids = torch.stack([t[n - 1 + step] for t, n in zip(tokens, prompts, strict=True)])
        hidden = model(ids, caches[0]) if streams == 1 else model(ids, caches, [1] * streams)
        decoded = model.compute_logits(hidden)
        for i, expected in enumerate(whole):  # row ``step`` of each: the position just decoded
            worst = max(worst, relative_error(decoded[i : i + 1], expected[step : step + 1]))
    print(f"{streams} stream(s): worst relative error {worst:.2e}")
    assert worst < 1e-5


def test_entry_rotations_are_rows_of_their_table(checkpoint):
    """The table's rows are bitwise the rotations computed at the entries' positions alone, also after it grows."""
    model = tiny_model(checkpoint)
    compress: RotaryTable = model.rope_tables["compress"]
    table = RotaryTable(compress.inv_freq, compress.factor)
    for first, count in [(0, 1), (5, 3), (RotaryTable.MIN_ENTRIES + 7, 2), (3, 1)]:  # the third grows the table
        got = table.entries(first, count, 4, torch.bfloat16)
        want = table(torch.arange(first * 4, (first + count) * 4, 4), torch.bfloat16)
        for a, b in zip((got.cos, got.sin, got.sin_inverse), (want.cos, want.sin, want.sin_inverse), strict=True):
            assert torch.equal(a, b)
    assert table.entry_tables[4, torch.bfloat16].shape[0] >= RotaryTable.MIN_ENTRIES + 9
    ids = torch.tensor([7, 2, 30])
    got = table.entries_at(ids, 4, torch.bfloat16, 31)
    assert torch.equal(got.cos, table(ids * 4, torch.bfloat16).cos)


if __name__ == "__main__":
    import tempfile

    from v4_decode_host import report

    with tempfile.TemporaryDirectory() as tmp:
        print(report(tiny_model(Path(tmp)), 1))
