"""V4's decode kernels compiled for the GPUs users run (no device needed): Triton's code generator and ptxas, which
the interpreter of the other kernel tests never reaches (libdevice calls, layouts, loop-carried types, registers).

Targets: sm_80 (A100), sm_86 (RTX 3090 / A6000), sm_89 (RTX 4090 / L40S), sm_90 (H100 / H200). Shapes are
DeepSeek-V4-Flash's (head_dim 512, window 128, CSA rate 4, HCA rate 128, indexer dim 128, 256 experts of top-6,
hidden 4096). A compile that fails here fails to the torch ops on a user's GPU (the kernels' guard) and costs them
the kernel's speed, silently but for a log line.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moetier.kernels import (  # noqa: E402
    fat_experts,
    fp4_dequant,
    fp8_dequant,
    rope_rotate,
    swiglu,
    v4_attention,
    v4_attention_tiles,
    v4_compress,
    v4_router,
)

TARGETS = [80, 86, 89, 90]
CUDA = {"LIBDEVICE": True}  # the kernels that take libdevice's functions where compiled (the interpreter has none)


def _attention(picked: bool, dtype: str, gathered: bool = False) -> tuple:
    pointers = dict.fromkeys(["q", "ring", "new_key", "entries", "out"], f"*{dtype}")
    sig = {**pointers, "position": "*i64", "ids": "*i64", "sinks": "*fp32", "capacity": "i32", "rate": "i32"}
    consts = {"W": 128, "D": 512, "S": v4_attention.keys_per_block(512), "PICKED": picked, "GATHERED": gathered}
    consts["ROUND"] = dtype != "fp32"
    return v4_attention._attend_kernel, {**sig, "scale": "fp32", "slots": "i32"}, consts, 8


def _split(picked: bool, values: bool) -> tuple:
    """The split attention's launches (logits and chunk stats; values), bf16."""
    pointers = dict.fromkeys(["ring", "new_key", "entries"], "*bf16") | {"position": "*i64", "ids": "*i64"}
    pointers |= dict.fromkeys(["sinks", "logits", "stats"], "*fp32")
    counts = dict.fromkeys(["capacity", "rate"], "i32")
    tail = dict.fromkeys(["slots", "splits", "row_stride"], "i32")
    consts = {"W": 128, "D": 512, "C": v4_attention.CHUNK_KEYS, "WINDOW_SPLITS": 2, "PICKED": picked, "GATHERED": False}
    if values:
        sig = {**pointers, "out": "*bf16", **counts, **tail}
        consts |= {"DS": v4_attention.CHANNELS_PER_PROGRAM, "S": 64}
        return v4_attention._split_values_kernel, sig, consts, 4
    sig = {"q": "*bf16", **pointers, **counts, "scale": "fp32", **tail}
    consts |= {"S": v4_attention.keys_per_block(512), "ROUND": True}
    return v4_attention._split_logits_kernel, sig, consts, 8


def _tiles(picked: bool, dtype: str, values: bool = False, grouped: bool = False) -> tuple:
    """The tile attention's launches (logits and chunk stats; values, alone or in groups of keys; the groups' sum)."""
    tiles = v4_attention_tiles
    pointers = dict.fromkeys(["ring", "new_key", "entries"], f"*{dtype}") | {"position": "*i64", "ids": "*i64"}
    pointers |= dict.fromkeys(["sinks", "logits", "stats"], "*fp32")
    counts = dict.fromkeys(["capacity", "rate"], "i32")
    tail = dict.fromkeys(["slots", "splits", "row_stride", "heads"], "i32")
    consts = {"W": 128, "D": 512, "HB": tiles.HEADS_PER_TILE, "S": tiles.TILE_KEYS, "C": v4_attention.CHUNK_KEYS}
    consts |= {"WINDOW_SPLITS": 2, "PICKED": picked, "GATHERED": False, "IEEE": dtype == "fp32"}
    if values:
        sig = {**pointers, "out": f"*{dtype}", "partials": "*fp32", **counts, **tail, "group_keys": "i32"}
        consts |= {"DS": v4_attention.CHANNELS_PER_PROGRAM, "GROUPED": grouped}
        return tiles._tile_values_kernel, sig, consts, 4
    sig = {"q": f"*{dtype}", **pointers, **counts, "scale": "fp32", **tail}
    consts |= {"DK": tiles.TILE_CHANNELS, "ROUND": dtype != "fp32"}
    return tiles._tile_logits_kernel, sig, consts, 4


def _pool(rate: int, dim: int, overlap: bool) -> tuple:
    width = 2 * dim if overlap else dim
    window, rows, channels = v4_compress.pool_blocks(rate, dim, overlap)
    sig = {"open": "*bf16", "row": "*bf16", "prev_kv": "*bf16", "prev_gate": "*fp32", "ape": "*fp32"}
    sig |= {"position": "*i64", "pooled": "*bf16"} | dict.fromkeys(
        ["stride_open", "stride_ape", "stride_prev_kv", "stride_prev_gate"], "i32"
    )
    consts = {"RATE": rate, "WIDTH": width, "DIM": dim, "OVERLAP": overlap, "POOL": True, "WINDOW": window}
    consts |= {"ROWS": rows, "CB": channels}
    consts |= {"ROW_BLOCK": triton.next_power_of_2(2 * width)} | CUDA
    return v4_compress._pool_kernel, sig, consts, 4


def _finish(rate: int, dim: int, store: bool) -> tuple:
    sig = {"pooled": "*bf16", "weight": "*fp32", "position": "*i64", "table": "*fp32", "entries": "*bf16"}
    sig |= {"out": "*bf16", "at_out": "*i64", "closing_out": "*u8"}
    sig |= dict.fromkeys(["stride_table", "stride_part", "stride_entries", "capacity"], "i32") | {"eps": "fp32"}
    return v4_compress._finish_kernel, sig, {"RATE": rate, "DIM": dim, "R": 64, "STORE": store}, 8


def _route(hashed: bool, sigmoid: bool) -> tuple:
    sig = {"logits": "*fp32", "bias": "*fp32", "tid2eid": "*i64", "input_ids": "*i64", "ids": "*i64"}
    sig |= {"weights": "*bf16", "E": "i32", "stride_tid": "i32", "scaling": "fp32"}
    consts = {"K": 6, "KB": 8, "EP": 256, "HASHED": hashed, "SIGMOID": sigmoid} | CUDA
    return v4_router._route_kernel, sig, consts, 1


def _kernels() -> dict[str, tuple]:
    logits = {"x": "*bf16", "weight": "*bf16", "out": "*fp32", "stride_x": "i32", "stride_w": "i32", "E": "i32"}
    gated = {"gate": "*bf16", "up": "*bf16", "out": "*bf16", "cols": "i32", "stride_gate": "i32", "stride_up": "i32"}
    angles = {"positions": "*i64", "inv_freq": "*fp32", "factor": "fp32"}
    angles |= dict.fromkeys(["cos", "sin", "sin_inverse"], "*fp32") | {"n": "i32"}
    return {
        "attention window+entries bf16": _attention(False, "bf16"),
        "attention top-k picks bf16": _attention(True, "bf16"),
        "attention top-k picks read out (fp8 store)": _attention(True, "bf16", gathered=True),
        "attention fp32": _attention(False, "fp32"),
        "split attention logits": _split(False, False),
        "split attention logits, top-k picks": _split(True, False),
        "split attention values": _split(False, True),
        "split attention values, top-k picks": _split(True, True),
        "tile attention logits": _tiles(False, "bf16"),
        "tile attention logits, top-k picks": _tiles(True, "bf16"),
        "tile attention logits fp32": _tiles(False, "fp32"),
        "tile attention values": _tiles(False, "bf16", values=True),
        "tile attention values, groups of keys": _tiles(False, "bf16", values=True, grouped=True),
        "tile attention values, top-k picks fp32": _tiles(True, "fp32", values=True),
        "tile attention groups' sum": (
            v4_attention_tiles._group_sum_kernel,
            {"partials": "*fp32", "out": "*bf16", "heads": "i32", "groups": "i32"},
            {"D": 512, "DS": v4_attention.CHANNELS_PER_PROGRAM},
            2,
        ),
        "compressor pool HCA": _pool(128, 512, False),
        "compressor pool CSA": _pool(4, 512, True),
        "compressor pool indexer": _pool(4, 128, True),
        "compressor finish, plain entry": _finish(128, 512, True),
        "compressor finish, fp8 entry": _finish(4, 128, False),
        "router logits": (v4_router._logits_kernel, logits, {"H": 4096, "EB": 4, "HB": 1024}, 4),
        "router learned": _route(False, False),
        "router hashed": _route(True, False),
        "router sigmoid": _route(False, True),
        "swiglu clamped": (swiglu._swiglu_kernel, gated | {"limit": "fp32"}, {"CLAMP": True, "BLOCK": 1024} | CUDA, 4),
        "rope angles": (rope_rotate._angles_kernel, angles, {"R": 64, "ROUND": 1, "ROWS": 16} | CUDA, 1),
        "fp4 dequant, e8m0 bytes to bf16": _fp4_dequant("*u8", "*bf16"),
        "fp4 dequant, float32 scales to fp16": _fp4_dequant("*fp32", "*fp16"),
        "fp4 expert dequant, e8m0 bytes to bf16": _fp4_expert_dequant(),
        "fp8 dequant, e4m3 to bf16": _fp8_dequant(False),
        "fp8 dequant, e5m2 to bf16": _fp8_dequant(True),
        "fat experts gate/up, dense bf16": _fat(0, down=False),
        "fat experts gate/up, fp4 e8m0 bytes": _fat(3, down=False),
        "fat experts gate/up, fp4 float32 scales, clamped": _fat(2, down=False, limit=True),
        "fat experts gate/up, fp8": _fat(1, down=False),
        "fat experts down, dense bf16": _fat(0, down=True),
        "fat experts down, fp4 e8m0 bytes": _fat(3, down=True),
        "fat experts down, fp8": _fat(1, down=True),
        "fat experts sum": (
            fat_experts._sum_kernel,
            {"y_ptr": "*fp32", "rows_ptr": "*i64", "token_table_ptr": "*i64", "out_ptr": "*fp32"},
            {"hidden": 4096, "MAX_ROWS": 8, "BLOCK_H": fat_experts.SUM_BLOCK},
            4,
        ),
    }


def _fat(quant: int, down: bool, limit: bool = False) -> tuple:
    """A prefill chunk's fat experts (V4-Flash widths; fp4: a scale for 32 values of a row, fp8: 128 x 128 tiles)."""
    tile = (128, 128) if quant == 1 else (1, 32)
    consts = {"hidden": 4096, "inter": 2048, "IEEE": False, "QUANT": quant, "TILE_R": tile[0], "TILE_C": tile[1]}
    consts |= {"ALIGN": 16, "BLOCK_M": fat_experts.BLOCK_M, "BLOCK_N": fat_experts.BLOCK_N}
    consts |= {"BLOCK_K": fat_experts.BLOCK_K}
    scale = 1 << 24  # where a quantised block's scale grids start (any byte offset: the layout is the caller's)
    pointers = {"table_ptr": "*i64", "blocks_ptr": "*u8"}
    if down:
        sig = {"act_ptr": "*bf16", **pointers, "pair_gate_ptr": "*bf16", "y_ptr": "*fp32"}
        consts |= {"DOWN": 0 if quant == 0 else 1 << 23, "DOWN_SCALE": scale}
        return fat_experts._down_kernel, sig, consts, 4
    sig = {"x_ptr": "*bf16", **pointers, "pair_token_ptr": "*i64", "act_ptr": "*bf16", "stride_x": "i32"}
    consts |= {"GATE": 0, "UP": 1 << 22, "GATE_SCALE": scale, "UP_SCALE": scale + (1 << 18), "HAS_LIMIT": limit}
    return fat_experts._gate_up_kernel, sig | {"limit": "fp32"}, consts, 4


def _fp8_dequant(e5m2: bool) -> tuple:
    """A prefill's fat fp8 expert dequantised (DeepSeek-V3's release tiles: 128 x 128)."""
    sig = {"values": "*u8", "scales": "*fp32", "out": "*bf16"} | dict.fromkeys(["rows", "cols", "scale_cols"], "i32")
    consts = {"TILE_ROWS": 128, "TILE_COLS": 128, "E5M2": e5m2}
    return fp8_dequant._dequant_kernel, sig, consts | {"BR": fp8_dequant.BLOCK_ROWS, "BC": fp8_dequant.BLOCK_COLS}, 4


def _fp4_dequant(scales: str, out: str) -> tuple:
    """A prefill's fat expert dequantised (V4-Flash's release tiles: a scale for 32 values of a row)."""
    sig = {"packed": "*u8", "scales": scales, "out": out} | dict.fromkeys(["rows", "row_bytes", "scale_cols"], "i32")
    consts = {"ROWS_PER_SCALE": 1, "BYTES_PER_SCALE": 16, "EXPONENT_BYTES": scales == "*u8"}
    return fp4_dequant._dequant_kernel, sig, consts | {"BR": fp4_dequant.BLOCK_ROWS, "BC": fp4_dequant.BLOCK_BYTES}, 4


def _fp4_expert_dequant() -> tuple:
    """A prefill's fat expert's three matrices dequantised in one launch (V4-Flash's release format)."""
    sig = {f"{m}{part}": kind for part, kind in (("", "*u8"), ("_scale", "*u8"), ("_out", "*bf16"))
           for m in ("gate", "up", "down")}  # fmt: skip
    sig |= dict.fromkeys(["inter", "hidden", "inter_scale_cols", "hidden_scale_cols"], "i32")
    consts = {"ROWS_PER_SCALE": 1, "BYTES_PER_SCALE": 16, "EXPONENT_BYTES": True}
    consts |= {"BR": fp4_dequant.BLOCK_ROWS, "BC": fp4_dequant.BLOCK_BYTES}
    return fp4_dequant._dequant_expert_kernel, sig, consts, 4


KERNELS = _kernels()


# Every target with unmarked pointers, and sm_90 (where Triton pipelines loads) with the marks the JIT gives a
# 16-byte-aligned pointer argument (every fresh torch allocation is one): that code vectorises and pipelines loads
# the other does not, so it is compiled too.
BUILDS = [(c, False) for c in TARGETS] + [(90, True)]


@pytest.mark.parametrize(("capability", "aligned"), BUILDS, ids=[f"sm_{c}{'-aligned' * a}" for c, a in BUILDS])
@pytest.mark.parametrize("name", KERNELS)
def test_the_decode_kernels_compile_for_the_users_gpus(name, capability, aligned):
    fn, signature, constexprs, warps = KERNELS[name]
    pointers = [i for i, arg in enumerate(fn.arg_names) if str(signature.get(arg, "")).startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers} if aligned else None
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": warps})
    assert "cubin" in compiled.asm  # through ptxas: registers allocated for the target
    assert ".local" not in compiled.asm["ptx"] or name == "rope angles"  # no spills (libdevice's sin/cos use some)
