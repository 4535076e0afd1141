"""The placement plan: size parsing, numbers on a tiny checkpoint computed by hand, errors and the CLI."""

import math
from types import SimpleNamespace

import pytest
import torch
from reference import save_tiny
from test_qwen3_moe import tiny_qwen3_config

from moetier import cli
from moetier.errors import ConfigError
from moetier.tiers.plan import (
    DEFAULT_HBM_GBPS,
    DEFAULT_HOST_READ_GBPS,
    DEFAULT_PCIE_GBPS,
    WORKSPACE_HIDDEN_ROWS,
    PlacementPlan,
    PlanBudget,
    TierOptions,
    checkpoint_sizes,
    kv_estimate,
    make_plan,
)
from moetier.tiers.tiered_dispatcher import default_staging_slots
from moetier.tiers.workspace import (
    DECODE_COST_SHARE,
    MAX_AUTO_CHUNK,
    auto_chunk_limit,
    choose_prefill_chunk,
    workspace_allowance,
    workspace_estimate,
)
from moetier.units import parse_size
from moetier.weights.checkpoint import Checkpoint

# The tiny Qwen3-MoE of tests/test_qwen3_moe.py: 4 layers (layer 1 dense), 8 experts of width 32, top-2.
HIDDEN, MOE_INTER, EXPERTS, TOP_K, MOE_LAYERS, LAYERS = 64, 32, 8, 2, 3, 4
KV_HEADS, HEAD_DIM, VOCAB = 2, 16, 320


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-plan")
    save_tiny(tiny_qwen3_config(), path)  # fp32 on disk
    return path


def test_parse_size_forms():
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("1.5 MiB") == 3 * 2**19
    assert parse_size("4096") == 4096 and parse_size(512) == 512
    assert parse_size("80%", total=1000) == 800
    for bad, fragment in [
        ("24G", "unknown unit 'G'"),
        ("lots", "cannot read 'lots'"),
        ("80%", "percentage"),
        ("-3GiB", "cannot read"),
        ("1.5", "unknown unit"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            parse_size(bad, "--gpu-memory")
    with pytest.raises(ConfigError, match=r"in \(0, 100\]"):
        parse_size("150%", total=1000)
    with pytest.raises(ConfigError, match="--max-streams"):
        PlanBudget("1GiB", max_streams=0)
    with pytest.raises(ConfigError, match="--miss-route"):
        TierOptions("1GiB", miss_route="gpu")
    with pytest.raises(ConfigError, match="--expert-policy"):
        TierOptions("1GiB", policy="fifo")


def test_sizes_add_up_to_the_checkpoint(checkpoint):
    sizes = checkpoint_sizes(checkpoint, torch.float32)
    assert sizes.stored_backbone + sizes.stored_experts + sizes.stored_ignored == Checkpoint(checkpoint).total_bytes()
    assert sizes.stored_ignored == 0
    assert sizes.stored_experts == MOE_LAYERS * EXPERTS * 3 * MOE_INTER * HIDDEN * 4
    assert sizes.backbone == sizes.stored_backbone  # fp32 load of an fp32 checkpoint, nothing tied
    assert checkpoint_sizes(checkpoint, torch.bfloat16).backbone == sizes.stored_backbone // 2


def _hand_numbers(context: int, streams: int, dtype_bytes: int) -> dict[str, int]:
    block = 3 * MOE_INTER * HIDDEN * dtype_bytes
    return {
        "block": block,
        "kv": streams * context * LAYERS * 2 * KV_HEADS * HEAD_DIM * dtype_bytes,
        "workspace": 512 * HIDDEN * WORKSPACE_HIDDEN_ROWS * 4 + streams * VOCAB * 4,
        "staging": default_staging_slots(TOP_K) * block,
    }


def test_plan_numbers_by_hand(checkpoint):
    sizes = checkpoint_sizes(checkpoint, torch.float32)
    hand = _hand_numbers(context=256, streams=2, dtype_bytes=4)
    fixed = sizes.backbone + hand["kv"] + hand["workspace"] + hand["staging"]
    budget = fixed + 5 * hand["block"] + 100  # room for 5 experts and change
    plan = make_plan(checkpoint, PlanBudget(budget, context=256, max_streams=2), torch.float32)
    assert plan.expert_block_bytes == hand["block"]
    assert plan.kv_bytes == hand["kv"] and plan.workspace_bytes == hand["workspace"]
    assert plan.staging_slots == default_staging_slots(TOP_K) and plan.staging_bytes == hand["staging"]
    assert plan.total_experts == MOE_LAYERS * EXPERTS == 24
    assert plan.cache_slots == (budget - fixed) // hand["block"] == 5
    assert plan.vram_used_bytes == budget - 100
    assert plan.host_expert_bytes == sizes.stored_experts
    assert plan.backbone_bytes + plan.host_expert_bytes == Checkpoint(checkpoint).total_bytes()
    assert plan.cache_share == pytest.approx(5 / 24)
    routed = TOP_K * MOE_LAYERS * hand["block"]
    assert plan.routed_bytes_per_token == routed
    assert plan.decode_bound_dram == pytest.approx(DEFAULT_HOST_READ_GBPS * 1e9 / ((1 - 5 / 24) * routed))
    assert plan.decode_bound_pcie == pytest.approx(DEFAULT_PCIE_GBPS * 1e9 / ((1 - 5 / 24) * routed))
    # A step reads the backbone but the embedding table (one row a token) and its hits from VRAM, then the misses.
    assert sizes.embedding == VOCAB * HIDDEN * 4 and plan.backbone_read_bytes == sizes.backbone - sizes.embedding
    step = (plan.backbone_read_bytes + 5 / 24 * routed) / (DEFAULT_HBM_GBPS * 1e9)
    step += (1 - 5 / 24) * routed / (DEFAULT_HOST_READ_GBPS * 1e9)
    assert plan.decode_bound_serial == pytest.approx(1 / step) and plan.decode_bound_serial < plan.decode_bound_dram
    assert plan.dispatcher_options(policy="lfu") == {
        "cache_slots": 5,
        "staging_slots": default_staging_slots(TOP_K),
        "policy": "lfu",
    }
    table = plan.table()
    for fragment in ["backbone", "KV cache: 2 stream(s) x 256 tokens", "expert cache: 5 of 24 experts (20.8%)"]:
        assert fragment in table
    assert "tok/s (host read 118.6 GB/s)" in table and "pinned" in table
    assert f"1 / ((B + h R) / HBM_bw + (1-h) R / DRAM_bw) = {plan.decode_bound_serial:.1f} tok/s" in table


def test_big_budget_caches_every_expert_and_bf16_halves_blocks(checkpoint):
    plan = make_plan(checkpoint, PlanBudget("1GiB", context=128), torch.bfloat16)
    assert plan.cache_slots == plan.total_experts == 24
    assert plan.expert_block_bytes == 3 * MOE_INTER * HIDDEN * 2
    assert math.isinf(plan.decode_bound_dram) and "no bound" in plan.table()


def test_too_small_budget_names_the_shortfall_and_the_knob(checkpoint):
    sizes = checkpoint_sizes(checkpoint, torch.float32)
    min_kv = 1 * 512 * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # one stream at the requested 512 (< 4096) tokens
    short = sizes.backbone + min_kv - 2**17  # 128 KiB short
    with pytest.raises(ConfigError, match=r"is 0\.000122 GiB short of the backbone .* raise --gpu-memory"):
        make_plan(checkpoint, PlanBudget(short, context=512, max_streams=1), torch.float32)
    # Room for the backbone, but not for 64 streams of 512 tokens: the message offers each knob.
    with pytest.raises(ConfigError, match=r"64 stream\(s\) x 512 tokens .* --context to \d+, or lower --max-streams"):
        make_plan(checkpoint, PlanBudget(sizes.backbone + 8 * 2**20, context=512, max_streams=64), torch.float32)


def test_host_memory_shortfall_is_a_warning(checkpoint):
    plan = make_plan(checkpoint, PlanBudget("1GiB", host_memory="100KiB", context=128), torch.float32)
    assert len(plan.warnings) == 1 and "--host-memory is" in plan.warnings[0]
    assert "warning:" in plan.table()


def test_kv_estimates_per_attention_kind():
    mla = SimpleNamespace(num_hidden_layers=3, kv_lora_rank=512, qk_rope_head_dim=64)
    assert kv_estimate(mla).per_token == 3 * 576 and kv_estimate(mla).per_stream == 0
    gqa = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=128)
    assert kv_estimate(gqa).per_token == 2 * 2 * 4 * 128
    v4 = SimpleNamespace(
        num_hidden_layers=3,
        layer_types=("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        compress_rate=lambda i: [0, 4, 128][i],
        head_dim=512,
        index_head_dim=128,
        sliding_window=128,
    )
    estimate = kv_estimate(v4)
    assert estimate.per_token == pytest.approx(512 / 4 + 128 / 4 + 512 / 128)
    window = 3 * 128 * 512  # a ring of sliding_window keys per layer
    # open windows (CSA, its indexer, HCA), plus CSA's and its indexer's predecessor halves (kv and gate)
    open_windows = 2 * 4 * 1024 + 2 * 4 * 256 + 2 * 128 * 512 + 2 * 4 * 512 + 2 * 4 * 128
    assert estimate.per_stream == window + open_windows
    with pytest.raises(ConfigError, match="cannot estimate"):
        kv_estimate(SimpleNamespace(num_hidden_layers=2))


def test_plan_cli_prints_the_table(checkpoint, capsys):
    args = ["plan", "--model", str(checkpoint), "--gpu-memory", "8MiB", "--context", "256", "--max-streams", "2"]
    args += ["--prefix-cache", "0"]  # the default 1GiB (as `moetier serve` reserves it) would not fit 8MiB
    assert cli.main([*args, "--device", "cpu", "--dtype", "fp32", "--host-read-gbps", "50", "--hbm-gbps", "900"]) == 0
    out = capsys.readouterr().out
    assert "placement plan for" in out and "expert cache:" in out and "host read 50 GB/s" in out
    assert "read a token, HBM 900 GB/s)" in out
    assert "prefill chunk: 512 tokens (auto: workspace" in out  # 256 x 2 tokens in flight at most
    assert cli.main([*args, "--device", "cpu", "--dtype", "fp32", "--prefill-chunk", "384"]) == 0
    assert "prefill chunk: 384 tokens (given)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--gpu-memory", "24G"], "unknown unit 'G'"),
        (["--gpu-memory", "80%"], "percentage"),
        (["--gpu-memory", "10KiB"], "short of the backbone"),
        (["--gpu-memory", "1GiB", "--context", "100000"], "max_position_embeddings"),
        (["--gpu-memory", "1GiB", "--prefix-cache", "lots"], "--prefix-cache: cannot read 'lots'"),
        (["--gpu-memory", "1GiB"], "raise --gpu-memory by"),  # the default 1GiB prefix cache does not fit
        (["--gpu-memory", "1GiB", "--prefix-cache", "0", "--hbm-gbps", "0"], "(host read, PCIe, HBM) must be positive"),
    ],
)
def test_plan_cli_bad_input_is_one_line_exit_2(checkpoint, capsys, extra, fragment):
    assert cli.main(["plan", "--model", str(checkpoint), "--device", "cpu", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moetier: error:") and fragment in err and err.count("\n") == 1


def test_prefix_cache_memory_is_reserved_before_the_expert_cache(checkpoint):
    hand = _hand_numbers(context=256, streams=2, dtype_bytes=4)
    sizes = checkpoint_sizes(checkpoint, torch.float32)
    fixed = sizes.backbone + hand["kv"] + hand["workspace"] + hand["staging"]
    budget = fixed + 5 * hand["block"]
    reserved = 3 * hand["block"]  # snapshots the engine may keep: three experts' worth
    plan = make_plan(checkpoint, PlanBudget(budget, context=256, max_streams=2, prefix_cache=reserved), torch.float32)
    assert plan.cache_slots == 2 and plan.vram_used_bytes == budget
    assert "prefix cache" in plan.table()


def test_prefix_snapshots_never_reserve_more_than_the_bound(checkpoint):
    """Qwen3 keeps no per-stream state (its snapshots own their rows): the bound is reserved; bad counts refused."""
    budget = PlanBudget("1GiB", context=256, max_streams=2, prefix_cache=1 << 20, prefix_snapshots=4)
    assert make_plan(checkpoint, budget, torch.float32).prefix_cache_bytes == 1 << 20
    for bad in (0, True, 2.5):
        with pytest.raises(ConfigError, match="prefix_snapshots must be an integer >= 1"):
            PlanBudget("1GiB", prefix_snapshots=bad)


# --- the prefill chunk ------------------------------------------------------------------------------

CHUNK_CONTEXT, CHUNK_STREAMS = 4096, 2  # 8192 prompt tokens in flight at most: every chunk up to 8192 is useful


def _workspace(chunk: int, streams: int = CHUNK_STREAMS) -> int:
    """The tiny Qwen3's workspace by hand: 32 fp32 hidden rows per chunk token, fp32 logits per stream."""
    return chunk * HIDDEN * WORKSPACE_HIDDEN_ROWS * 4 + streams * VOCAB * 4


def _chunk_plan(checkpoint, room: int, **budget) -> PlacementPlan:
    """A plan whose workspace and expert cache share ``room`` bytes (everything else fixed, by hand)."""
    sizes = checkpoint_sizes(checkpoint, torch.float32)
    hand = _hand_numbers(CHUNK_CONTEXT, CHUNK_STREAMS, dtype_bytes=4)
    gpu = sizes.backbone + hand["kv"] + hand["staging"] + room
    return make_plan(
        checkpoint, PlanBudget(gpu, context=CHUNK_CONTEXT, max_streams=CHUNK_STREAMS, **budget), torch.float32
    )


def test_plan_picks_the_prefill_chunk_from_the_room_left(checkpoint):
    experts = MOE_LAYERS * EXPERTS * 3 * MOE_INTER * HIDDEN * 4  # 24 blocks of 24 KiB: the cache's whole use
    # Room for every expert and an 8192-token workspace: spare room is free, 8192 is the cap.
    plan = _chunk_plan(checkpoint, experts + _workspace(8192) + 1000)
    assert plan.prefill_chunk_tokens == 8192 and plan.workspace_bytes == _workspace(8192) == 64 * 2**20 + 2560
    assert plan.cache_slots == 24
    line = next(x for x in plan.table().splitlines() if x.startswith("prefill chunk:"))
    assert line.startswith("prefill chunk: 8192 tokens (auto: workspace 0.06 GiB of 0.06 GiB allowed; capped at 8192")
    # Room for every expert and the 1024-token workspace, but not for 2048's: 1024 (the cache still fills).
    plan = _chunk_plan(checkpoint, experts + _workspace(1024) + _workspace(1024) // 2)
    assert plan.prefill_chunk_tokens == 1024 and plan.workspace_bytes == _workspace(1024)
    assert plan.cache_slots == 24 and "prefill chunk: 1024 tokens (auto: workspace 0.007815 GiB of" in plan.table()
    # Given chunks are honoured, above the automatic cap too, and sized by the same estimate.
    for given in (2048, 3 * MAX_AUTO_CHUNK):
        plan = _chunk_plan(checkpoint, experts + _workspace(3 * MAX_AUTO_CHUNK), prefill_chunk_tokens=given)
        assert plan.prefill_chunk_tokens == given and plan.workspace_bytes == _workspace(given)
        assert f"prefill chunk: {given} tokens (given)" in plan.table()
    # A given workspace: the automatic chunk grows to fill it, and the workspace stays as given.
    plan = _chunk_plan(checkpoint, experts + _workspace(8192), workspace=_workspace(2048) + 5)
    assert plan.prefill_chunk_tokens == 2048 and plan.workspace_bytes == _workspace(2048) + 5
    # Few prompt tokens can be in flight (256 x 2): no chunk beyond 512 is worth its workspace.
    small = make_plan(checkpoint, PlanBudget("1GiB", context=256, max_streams=2), torch.float32)
    assert small.prefill_chunk_tokens == 512 and "no more prompt tokens fit context x streams" in small.table()


def test_too_small_room_keeps_512_and_the_usual_error(checkpoint):
    with pytest.raises(ConfigError, match=r"the KV cache of 2 stream\(s\) x 4096 tokens needs .* raise --gpu-memory"):
        _chunk_plan(checkpoint, _workspace(512) - 1024)  # not even 512 tokens' workspace: nothing shrinks it
    plan = _chunk_plan(checkpoint, _workspace(512) + 100)  # 512 fits, the cache gets nothing
    assert plan.prefill_chunk_tokens == 512 and plan.cache_slots == 0


def test_workspace_allowance_prices_the_decode_bound():
    gib = 2**30
    # The cache would hold 2 of 16 GiB of experts: W <= (16 - 2) / 7 = 2 GiB keeps 7/8 of the decode bound.
    assert workspace_allowance(2 * gib, 16 * gib) == 2 * gib
    assert workspace_allowance(10 * gib, 16 * gib) == 6 * gib // 7
    allowed = workspace_allowance(10 * gib, 16 * gib)  # check the promise itself on the uniform decode bound
    before, after = 1 - 10 / 16, 1 - (10 * gib - allowed) / (16 * gib)
    assert before / after == pytest.approx(1 - 1 / DECODE_COST_SHARE, rel=1e-6)
    assert workspace_allowance(20 * gib, 16 * gib) == 4 * gib  # every expert fits: only the spare 4 GiB
    assert workspace_allowance(1 * gib, 100 * gib) == 1 * gib and workspace_allowance(-5, 100) == 0
    assert [auto_chunk_limit(n) for n in (1, 512, 513, 3000, 8192, 10**6)] == [512, 512, 1024, 4096, 8192, 8192]

    def linear(tokens: int) -> int:
        return 100 * 2**20 + tokens * 2**20  # 100 MiB fixed, 1 MiB per token

    assert choose_prefill_chunk(linear, 4196 * 2**20).tokens == 4096  # 4096 needs exactly 4196 MiB
    assert choose_prefill_chunk(linear, 4196 * 2**20 - 1).tokens == 2048
    assert choose_prefill_chunk(linear, 4196 * 2**20, limit=1024).tokens == 1024
    tight = choose_prefill_chunk(linear, 10 * 2**20)
    assert tight.tokens == 512 and tight.workspace == linear(512) and "even this chunk" in tight.note


def test_v4_workspace_counts_the_prefill_attention():
    from test_deepseek_v4 import tiny_v4_config

    from moetier.models import deepseek_v4_attention as attention
    from moetier.models.deepseek_v4_config import DeepseekV4Config

    cfg = DeepseekV4Config.from_hf(tiny_v4_config().to_dict())
    rows = 1024 * cfg.hidden_size * WORKSPACE_HIDDEN_ROWS * 4 + 2 * cfg.vocab_size * 4
    layers = range(cfg.num_hidden_layers)
    for context in (1024, 65536):
        peak = max(attention.workspace_bytes(cfg, layer, 1024, context, 2) for layer in layers)
        assert peak > 0 and workspace_estimate(cfg, 1024, 2, context, 2) == rows + peak
    assert workspace_estimate(cfg, 1024, 2, 65536, 2) > workspace_estimate(cfg, 1024, 2, 1024, 2)  # more entries
