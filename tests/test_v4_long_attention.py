"""DeepSeek-V4 attention in query blocks: bounded prefill workspace, unchanged results.

The tiny V4 model of ``test_deepseek_v4`` (sliding, CSA and HCA layers) prefills a 160-token prompt in
64-token chunks, then decodes. With :data:`QUERY_BLOCK_BYTES` shrunk to a few queries' worth, the
indexer and the attention run in many blocks; the logits and the indexer's choices must equal the
single-block run's. The memory estimate of ``moetier bench prefill`` must stay bounded for V4-Flash.
"""

import pytest
import torch
from reference import relative_error
from test_deepseek_v4 import VOCAB, save_tiny_v4

import moetier.models.deepseek_v4_attention as v4_attention
import moetier.models.deepseek_v4_static_decode as static_decode
from moetier.bench.prefill import attention_bytes
from moetier.bench.shapes import build_config
from moetier.config import ModelLoadConfig
from moetier.models.deepseek_v4 import DeepseekV4ForCausalLM
from moetier.weights.loader import load_model

PROMPT, CHUNK, STEPS = 160, 64, 6  # 40 CSA / 20 HCA entries; index_topk 4 keeps a tenth of them


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4_long")
    save_tiny_v4(path, torch.float32)
    return load_model(path, ModelLoadConfig(dtype=torch.float32, device="cpu"), progress=False).model


@torch.no_grad()
def _run(model, prompt: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[int], list[torch.Tensor]]:
    """Chunked prefill logits, greedy cached decode logits and tokens, and every indexer's selected ids."""
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.attn.indexer.register_forward_hook(lambda _m, _i, out: chosen.append(out[0].clone()))
        for layer in model.layers
        if layer.attn.indexer is not None
    ]
    # Decode picks in the fixed-shape step (deepseek_v4_static_decode.select), not through the module's hooks.
    real_select = static_decode.select
    static_decode.select = _recorded(real_select, chosen)
    try:
        cache = model.new_cache(PROMPT + STEPS + 1)
        hidden = torch.cat([model(prompt[i : i + CHUNK], cache) for i in range(0, PROMPT, CHUNK)])
        prefill = model.compute_logits(hidden)
        token, steps, tokens = int(prefill[-1].argmax()), [], []
        for _ in range(STEPS):
            tokens.append(token)
            steps.append(model.compute_logits(model(torch.tensor([token]), cache))[-1])
            token = int(steps[-1].argmax())
    finally:
        for hook in hooks:
            hook.remove()
        static_decode.select = real_select
    return prefill, steps, tokens, chosen


def _recorded(decode, chosen: list[torch.Tensor]):
    """``decode`` (a function selecting entry ids) appending the ids it selects to ``chosen``."""

    def run(*args, **kwargs):
        ids = decode(*args, **kwargs)
        chosen.append(ids.clone())
        return ids

    return run


def _record_blocks(monkeypatch) -> list[tuple[int, int, list[slice]]]:
    """Wrap :func:`query_blocks`; each call appends ``(tokens, bytes_per_query, blocks)``."""
    calls: list[tuple[int, int, list[slice]]] = []
    real = v4_attention.query_blocks

    def recording(tokens: int, bytes_per_query: int) -> list[slice]:
        blocks = real(tokens, bytes_per_query)
        calls.append((tokens, bytes_per_query, blocks))
        return blocks

    monkeypatch.setattr(v4_attention, "query_blocks", recording)
    return calls


# Blocks change only the row count of each GEMM. BLAS picks its kernel by shape, so rows may round
# differently at the last bit (one-row products take the GEMV path, as decode does): not bitwise,
# but the errors stay at float32 noise, and the indexer's choices and the greedy tokens are identical.
@pytest.mark.parametrize(("budget", "tolerance"), [(1, 1e-5), (20_000, 1e-6)])  # 1 query per block; 4-6
def test_blocked_prefill_and_decode_equal_the_single_block_run(tiny_model, monkeypatch, budget, tolerance):
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(5))
    calls = _record_blocks(monkeypatch)
    whole = _run(tiny_model, prompt)
    assert calls and all(len(blocks) == 1 for _, _, blocks in calls)  # the default budget: one block each

    calls.clear()
    monkeypatch.setattr(v4_attention, "QUERY_BLOCK_BYTES", budget)
    blocked = _run(tiny_model, prompt)

    # The blocked path really ran: every prefill call split its queries, within the budget.
    prefill_calls = [c for c in calls if c[0] > 1]
    decode_calls = [c for c in calls if c[0] == 1]
    assert len(prefill_calls) == 3 * (5 + 2)  # 3 chunks x (5 attention layers + 2 indexers)
    assert min(len(blocks) for _, _, blocks in prefill_calls) >= (4 if budget > 1 else 32)
    for tokens, per_query, blocks in prefill_calls:
        sizes = [b.stop - b.start for b in blocks]
        assert blocks[0].start == 0 and blocks[-1].stop == tokens
        assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:], strict=False))
        assert max(sizes) - min(sizes) <= 1 and (max(sizes) == 1 or max(sizes) * per_query <= budget)
    assert not decode_calls  # one query per sequence: decode never splits (nor asks query_blocks)

    prefill, steps, tokens, chosen = blocked
    errors = [relative_error(prefill, whole[0]), *(relative_error(a, b) for a, b in zip(steps, whole[1], strict=True))]
    print(f"budget {budget}: max relative error {max(errors):.2e} over prefill + {STEPS} decode steps")
    assert max(errors) <= tolerance
    assert tokens == whole[2]
    assert len(chosen) == len(whole[3]) == 2 * (3 + STEPS)
    assert all(torch.equal(a, b) for a, b in zip(chosen, whole[3], strict=True))  # identical top-k choices


def test_query_blocks_cover_the_queries_in_order():
    assert v4_attention.query_blocks(4, 10) == [slice(0, 4)]  # fits: one block, as in decode
    assert v4_attention.query_blocks(0, 10) == [slice(0, 0)]
    budget = v4_attention.QUERY_BLOCK_BYTES
    blocks = v4_attention.query_blocks(100, budget // 7)  # 7 per block at most: 15 blocks of 6 or 7
    assert [b.stop - b.start for b in blocks] == [7] * 10 + [6] * 5
    assert blocks[0].start == 0 and blocks[-1].stop == 100
    assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:], strict=False))
    assert v4_attention.query_blocks(3, 2 * budget) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # one query each


def _flash_config():
    return DeepseekV4ForCausalLM.config_from_hf(build_config("deepseek-v4-flash", 43))


def test_v4_flash_attention_estimate_is_bounded_at_long_prompts():
    config = _flash_config()
    need = {(n, c): attention_bytes(config, n, min(c, n), 2) for n in (8192, 32768, 131072) for c in (4096, 16384)}
    print({f"{n}/{c}": f"{v / 1e9:.2f} GB" for (n, c), v in need.items()})
    # Unblocked, the indexer alone held [4096, 64, 32768] fp32 scores (34 GB) at 128k tokens.
    assert need[131072, 4096] < 4e9 and need[131072, 16384] < 6e9
    # Growth with the prompt is the cache (linear): 4x the tokens, less than 4x the bytes (not 16x).
    assert need[131072, 4096] < 4 * need[32768, 4096]
    # The transient part is bounded by the block budget plus terms linear in the chunk.
    budget = v4_attention.QUERY_BLOCK_BYTES
    transient = [v4_attention.workspace_bytes(config, i, 4096, 131072, 2) for i in range(config.num_hidden_layers)]
    assert max(transient) < budget + 4096 * 64 * 1024  # 64 KiB per query of projections and outputs


def test_estimate_follows_the_block_budget(monkeypatch):
    config = _flash_config()
    bounded = attention_bytes(config, 131072, 4096, 2)
    monkeypatch.setattr(v4_attention, "QUERY_BLOCK_BYTES", 1 << 50)  # never blocks: the old, quadratic path
    unbounded = attention_bytes(config, 131072, 4096, 2)
    assert unbounded > 30e9 > 10 * bounded


def test_bf16_indexer_scores_pick_what_fp32_scores_pick():
    """16-bit keys are scored in their dtype (the fp32 matmul dominated long prefills): the top-k must
    stay essentially the fp32 one on V4-Flash's indexer widths (64 heads x 128 dims, top-512)."""
    cfg = _flash_config()
    indexer = v4_attention.Indexer(cfg, rate=4)
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(8, indexer.heads, indexer.dim, generator=generator)
    keys = torch.randn(4096, indexer.dim, generator=generator)
    head_weights = torch.randn(8, indexer.heads, generator=generator) * indexer.heads**-0.5
    exact = indexer._scores(q, head_weights, keys)
    fast = indexer._scores(q.bfloat16(), head_weights, keys.bfloat16())
    assert fast.dtype == torch.float32 and relative_error(fast, exact) < 2e-2
    top = indexer.topk
    overlap = [
        len(set(a.tolist()) & set(b.tolist())) / top
        for a, b in zip(exact.topk(top).indices, fast.topk(top).indices, strict=True)
    ]
    print(f"\nbf16 vs fp32 indexer: rel {relative_error(fast, exact):.2e}, top-{top} overlap min {min(overlap):.3f}")
    assert min(overlap) > 0.95
