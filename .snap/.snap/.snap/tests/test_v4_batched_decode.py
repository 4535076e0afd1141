"""DeepSeek-V4 decode of several sequences at once (one batched, padded attention) equals decoding each alone.

``test_batched_forward`` mixes a prefill chunk into its steps, so it runs the per-sequence path; here every
sequence brings one token, of different lengths (different window fills, compressed-entry counts and
windows closing on different steps), so the padded keys and their masks are exercised.
"""

import pytest
import torch
from reference import relative_error
from test_v4_decode_ops import tiny_model

from moetier.models.deepseek_v4_decode import padded_keys, sink_attention_decode, sink_attention_one


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4_batched_decode")
    tiny_model(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_batched_decode_equals_solo_decode(checkpoint, dtype):
    model = tiny_model(checkpoint, dtype)
    generator = torch.Generator().manual_seed(7)
    vocab = model.embed.num_embeddings
    prompts = [torch.randint(0, vocab, (n,), generator=generator) for n in (3, 19, 12, 26)]
    solo, together = [model.new_cache(96) for _ in prompts], [model.new_cache(96) for _ in prompts]
    for prompt, a, b in zip(prompts, solo, together, strict=True):
        model(prompt, a)
        model(prompt, b)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: GEMMs of other shapes round differently
    worst = 0.0
    for step in range(12):
        tokens = torch.randint(0, vocab, (len(prompts),), generator=generator)
        alone = torch.cat([model.compute_logits(model(t[None], c)) for t, c in zip(tokens, solo, strict=True)])
        batched = model.compute_logits(model(tokens, together, [1] * len(prompts)))
        worst = max(worst, relative_error(batched, alone))
        assert relative_error(batched, alone) < tolerance, f"step {step}"
    print(f"{dtype}: worst relative error {worst:.2e}")
    assert [c.length for c in together] == [c.length for c in solo]


def test_padded_attention_matches_each_sequence_alone():
    generator = torch.Generator().manual_seed(11)
    heads, dim = 4, 16
    sinks = torch.randn(heads, generator=generator)
    keys = [[torch.randn(n, dim, generator=generator) for n in parts] for parts in ([5], [3, 9], [7, 1], [12])]
    q = torch.randn(len(keys), heads, dim, generator=generator)
    padded, lengths = padded_keys(keys)
    assert lengths == [5, 12, 8, 12] and padded.shape == (4, 12, dim)
    assert torch.equal(padded[0, 5:], torch.zeros(7, dim))  # padding is zeros: probability 0 times 0
    masks = {}
    out = sink_attention_decode(q, keys, sinks, dim**-0.5, masks)
    for i, parts in enumerate(keys):
        alone = sink_attention_one(q[i], torch.cat(parts), sinks, dim**-0.5)
        assert (out[i] - alone).abs().max() < 1e-6
    assert list(masks) == [(5, 12, 8, 12)]
    one = sink_attention_decode(q[:1], keys[:1], sinks, dim**-0.5, {})
    assert torch.equal(one[0], sink_attention_one(q[0], keys[0][0], sinks, dim**-0.5))
