"""Several sequences in one forward (rows concatenated) give the same logits as each run alone."""

import pytest
import torch
from reference import relative_error, save_tiny

from moetier.config import ModelLoadConfig
from moetier.weights.loader import load_model


def _save(family: str, path):
    if family == "deepseek_v4":
        from test_deepseek_v4 import save_tiny_v4

        save_tiny_v4(path, torch.float32)
    elif family == "deepseek_v3":
        from test_deepseek_v3 import tiny_v3_config

        save_tiny(tiny_v3_config(), path)
    else:
        from test_qwen3_moe import tiny_qwen3_config

        save_tiny(tiny_qwen3_config(), path)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "deepseek_v4"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    _save(request.param, path)
    return load_model(path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False).model


@torch.no_grad()
def test_batched_prefill_and_decode_equal_solo_runs(model):
    generator = torch.Generator().manual_seed(3)
    vocab = model.embed_tokens.num_embeddings if hasattr(model, "embed_tokens") else model.embed.num_embeddings
    prompts = [torch.randint(0, vocab, (n,), generator=generator) for n in (23, 9, 17)]
    solo = [model.new_cache(64) for _ in prompts]
    together = [model.new_cache(64) for _ in prompts]

    # Step 1: the three prompts prefilled in one forward; step 2: two decode tokens plus a prefill chunk.
    solo_logits = [model.compute_logits(model(p, c)) for p, c in zip(prompts, solo, strict=True)]
    batched = model.compute_logits(model(torch.cat(prompts), together, [len(p) for p in prompts]))
    for ours, ref in zip(batched.split([len(p) for p in prompts]), solo_logits, strict=True):
        assert relative_error(ours, ref) < 1e-5

    for step in range(6):
        tokens = [torch.randint(0, vocab, (1 if i else 5,), generator=generator) for i in range(3)]
        solo_logits = [model.compute_logits(model(t, c)) for t, c in zip(tokens, solo, strict=True)]
        batched = model.compute_logits(model(torch.cat(tokens), together, [len(t) for t in tokens]))
        for ours, ref in zip(batched.split([len(t) for t in tokens]), solo_logits, strict=True):
            assert relative_error(ours, ref) < 1e-5, f"step {step}"
    assert [c.length for c in together] == [c.length for c in solo]


def test_seq_lens_must_cover_the_tokens(model):
    caches = [model.new_cache(8), model.new_cache(8)]
    with pytest.raises(ValueError, match="seq_lens"):
        model(torch.tensor([1, 2, 3]), caches, [1, 1])
