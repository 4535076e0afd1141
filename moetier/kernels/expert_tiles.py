"""Device-side pieces of the grouped expert kernels (:mod:`moetier.kernels.grouped_experts`): Triton
functions the kernels inline, for reading expert blocks of every format and for SwiGLU's roundings.

An expert block is reached as ``blocks_ptr`` (a uint8 pointer Triton knows to be 16-byte aligned) plus
a byte offset from the launch table (:func:`block_offset`), never as a raw address: Triton cannot see
the alignment of an address it loads, and without it every load is one element wide (the first fp4
kernels ran 20x slower for it). Dense matrices are read as ``rows x cols`` tiles (:func:`dense_tile`);
quantised ones as units of columns under one scale, so a scale is loaded per unit rather than per
weight: fp8 (:func:`fp8_row_dot`) and packed fp4, both nibbles of each byte used (:func:`fp4_row_dot`).
"""

from __future__ import annotations

try:  # Triton ships with CUDA builds of torch; CPU-only installs never import this module's kernels.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

if triton is not None:
    from moetier.kernels.fp8_dequant import widened_fp8

    @triton.jit
    def block_offset(entry_ptr, ALIGN: tl.constexpr):
        """A table's byte offset of an expert block from ``blocks_ptr``. ALIGN > 1 promises that every offset
        of the call is a multiple of it (and so is ``blocks_ptr``, which Triton checks): the compiler may
        then use vector loads, where an address it cannot see into would cost one load per element."""
        offset = tl.load(entry_ptr)
        if ALIGN > 1:
            offset = tl.multiple_of(offset, ALIGN)
        return offset

    @triton.jit
    def as_f32(pointer):
        """A byte pointer as a float32 pointer (the scale grids inside a quantised block)."""
        return pointer.to(tl.pointer_type(tl.float32), bitcast=True)

    @triton.jit
    def dense_tile(block, part, rows, cols, mask, width: tl.constexpr, dtype: tl.constexpr):
        """Rows x cols of one matrix of a dense expert block (elements in ``dtype``, the matrix from element
        ``part``, ``width`` columns a row)."""
        base = block.to(tl.pointer_type(dtype), bitcast=True)
        return tl.load(base + part + rows[:, None] * width + cols[None, :], mask=mask, other=0.0)

    @triton.jit
    def fp8_row_dot(
        block,
        part,
        scales,
        rows,
        rows_ok,
        k0,
        x,
        width: tl.constexpr,
        dtype: tl.constexpr,
        TILE_R: tl.constexpr,
        TILE_C: tl.constexpr,
        UNIT: tl.constexpr,
        UNITS: tl.constexpr,
        upto,
    ):
        """``sum_k w[row, k] * x[k]`` over the ``UNITS * UNIT`` columns from ``k0`` of an e4m3 matrix, per row, the
        columns from ``upto`` on left out (``width``, or a split expert's rows the device computes).

        The matrix is ``[rows, width]`` bytes at byte ``part`` of ``block``, its float32 scales
        ``[ceil(rows / TILE_R), ceil(width / TILE_C)]`` at byte ``scales`` (edge tiles may be partial). A
        unit is ``UNIT`` columns (a power of two dividing ``TILE_C``) under one scale, read ``[rows, UNITS,
        UNIT]``, so each scale is loaded once per unit, not per weight; ``x`` is the float32 inputs
        ``[UNITS, UNIT]``. Each weight is the loader's ``(float(v) * scale).to(dtype)``."""
        unit = k0 + tl.arange(0, UNITS) * UNIT  # each unit's first column
        cols = unit[:, None] + tl.arange(0, UNIT)[None, :]
        ok = rows_ok[:, None, None] & (cols < upto)[None, :, :]
        raw = tl.load(block + part + rows[:, None, None] * width + cols[None, :, :], mask=ok, other=0)
        grid = (width + TILE_C - 1) // TILE_C
        scale_at = (rows // TILE_R)[:, None] * grid + (unit // TILE_C)[None, :]
        scale_ok = rows_ok[:, None] & (unit < upto)[None, :]
        scale = tl.load(as_f32(block + scales) + scale_at, mask=scale_ok, other=0.0)
        w = (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]).to(dtype).to(tl.float32)
        return tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)

    @triton.jit
    def units(row_ptr, k0, width: tl.constexpr, UNIT: tl.constexpr, UNITS: tl.constexpr, upto):
        """The float32 inputs of a ``UNITS * UNIT`` column step from ``k0``, ``[UNITS, UNIT]`` (zeros from ``upto``)."""
        cols = k0 + tl.arange(0, UNITS)[:, None] * UNIT + tl.arange(0, UNIT)[None, :]
        return tl.load(row_ptr + cols, mask=cols < upto, other=0.0).to(tl.float32)  # upto <= width

    @triton.jit
    def e2m1(code):
        """float32 values of 4-bit e2m1 codes (32-bit ints, sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives.

        No table: the code's exponent and mantissa bits become a float32's lowest exponent bits and top
        mantissa bit, which is the value times 2^-126 for every code (code 1, 0.5, lands on the subnormal
        2^-127, as e2m1's own subnormal); one multiply by 2^126 is exact (the kernels keep subnormals)."""
        bits = ((code & 7) << 22) | ((code & 8) << 28)
        return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126

    @triton.jit
    def fp4_row_dot(
        block,
        part,
        scales,
        rows,
        rows_ok,
        k0,
        x_even,
        x_odd,
        width: tl.constexpr,
        dtype: tl.constexpr,
        TILE_R: tl.constexpr,
        TILE_C: tl.constexpr,
        UNIT: tl.constexpr,
        UNITS: tl.constexpr,
        POW2: tl.constexpr,
        E8M0: tl.constexpr,
        upto,
    ):
        """``sum_k w[row, k] * x[k]`` over the ``UNITS * UNIT`` columns from ``k0`` of a packed fp4 matrix, per row,
        the columns from ``upto`` on left out (``width``, or a split expert's rows the device computes: a multiple of
        ``UNIT``).

        The matrix is ``[rows, width / 2]`` bytes at byte ``part`` of ``block`` (column ``c`` is byte
        ``c // 2`` of its row, low nibble when ``c`` is even), its float32 scales ``[rows / TILE_R,
        width / TILE_C]`` at byte ``scales``. A unit is ``UNIT`` columns under one scale (``UNIT`` divides
        ``TILE_C`` or equals it); the bytes are read ``[rows, UNITS, UNIT / 2]`` (contiguous per unit, so
        vector loads), both nibbles of a byte used. ``x_even``/``x_odd`` are the float32 inputs of the even
        and odd columns, ``[UNITS, UNIT / 2]``. Each weight is the loader's ``(value * scale).to(dtype)``:
        with ``POW2`` (every scale a power of two, as ue8m0 scales are) that product is exact, so the
        scale multiplies each unit's sum instead, which is the same number (scaling by a power of two
        commutes with every rounding) for a fraction of the work. With ``E8M0`` the scales are exponent bytes
        ``e`` (uint8, ``2 ** (e - 127)``): the float32 with that exponent field (``e = 0``: the subnormal
        2^-127, as ``torch.ldexp`` gives), the same values from a quarter of the bytes.
        """
        HALF: tl.constexpr = UNIT // 2
        unit = k0 // UNIT + tl.arange(0, UNITS)
        unit_ok = unit < upto // UNIT
        j = tl.arange(0, HALF)
        base = block
        at = rows[:, None, None] * (width // 2) + (unit * HALF)[None, :, None] + j[None, None, :]
        ok = rows_ok[:, None] & unit_ok[None, :]
        raw = tl.load(base + part + at, mask=ok[:, :, None], other=0).to(tl.uint32)
        grid = width // TILE_C
        scale_at = (rows // TILE_R)[:, None] * grid + (unit * UNIT // TILE_C)[None, :]
        if E8M0:
            e = tl.load(base + scales + scale_at, mask=ok, other=0).to(tl.uint32)
            scale = tl.where(e == 0, 2.0**-127, (e << 23).to(tl.float32, bitcast=True))
        else:
            scale = tl.load(as_f32(base + scales) + scale_at, mask=ok, other=0.0)
        low, high = e2m1(raw & 0xF), e2m1(raw >> 4)
        if POW2:
            return tl.sum(tl.sum(low * x_even[None, :, :] + high * x_odd[None, :, :], axis=2) * scale, axis=1)
        else:
            low = (low * scale[:, :, None]).to(dtype).to(tl.float32)
            high = (high * scale[:, :, None]).to(dtype).to(tl.float32)
            return tl.sum(tl.sum(low * x_even[None, :, :] + high * x_odd[None, :, :], axis=2), axis=1)

    @triton.jit
    def even_odd(row_ptr, k0, width: tl.constexpr, UNIT: tl.constexpr, UNITS: tl.constexpr, upto):
        """The float32 inputs of a ``UNITS * UNIT`` column step from ``k0``, split into even and odd columns (zeros
        from ``upto``)."""
        HALF: tl.constexpr = UNIT // 2
        cols = k0 + tl.arange(0, UNITS)[:, None, None] * UNIT + tl.arange(0, HALF)[None, :, None] * 2
        cols = cols + tl.arange(0, 2)[None, None, :]
        pairs = tl.load(row_ptr + cols, mask=cols < upto, other=0.0).to(tl.float32)  # upto <= width
        return tl.split(pairs)

    @triton.jit
    def activation(gate, up, limit, dtype: tl.constexpr, HAS_LIMIT: tl.constexpr):
        """SwiGLU of float32 gate/up sums, rounded as :func:`swiglu_expert` rounds in ``dtype``."""
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (silu * up).to(dtype)

    @triton.jit
    def fp8_tile(block, part, scales, rows, rows_ok, k0, width: tl.constexpr, dtype: tl.constexpr,
                 TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """Rows x ``BLOCK_K`` columns from ``k0`` of an e4m3 matrix (as in :func:`fp8_row_dot`), dequantised in
        ``dtype`` as the loader does (``(float(v) * scale).to(dtype)``): a tensor-core operand. The bytes are
        widened from their bit fields (:func:`~moetier.kernels.fp8_dequant.widened_fp8`): Ampere has no float8
        conversion."""
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = rows_ok[:, None] & (cols < width)[None, :]
        raw = tl.load(block + part + rows[:, None] * width + cols[None, :], mask=ok, other=0).to(tl.int32) & 0xFF
        grid = (width + TILE_C - 1) // TILE_C
        scale_at = (rows // TILE_R)[:, None] * grid + (cols // TILE_C)[None, :]
        scale = tl.load(as_f32(block + scales) + scale_at, mask=ok, other=0.0)
        return (widened_fp8(raw, False) * scale).to(dtype)

    @triton.jit
    def fp4_tiles(block, part, scales, rows, rows_ok, k0, width: tl.constexpr, dtype: tl.constexpr,
                  TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK_K: tl.constexpr, E8M0: tl.constexpr):  # fmt: skip
        """Rows x ``BLOCK_K`` columns from ``k0`` (even) of a packed fp4 matrix (as in :func:`fp4_row_dot`: column
        ``c`` is byte ``c // 2``'s low nibble when ``c`` is even), dequantised in ``dtype`` as the loader does
        (``(value * scale).to(dtype)``, float32 or e8m0 scales), as two tensor-core operands: the even columns
        (low nibbles) and the odd ones, ``[rows, BLOCK_K / 2]`` each (interleaving them into one tile is a layout
        change Hopper's MMA pipeline does not compile). A byte's two columns share a scale (``TILE_C`` is even),
        so the scales are read per byte."""
        HALF: tl.constexpr = BLOCK_K // 2
        byte = k0 // 2 + tl.arange(0, HALF)
        ok = rows_ok[:, None] & (byte < width // 2)[None, :]
        raw = tl.load(block + part + rows[:, None] * (width // 2) + byte[None, :], mask=ok, other=0).to(tl.uint32)
        scale_at = (rows // TILE_R)[:, None] * (width // TILE_C) + (2 * byte // TILE_C)[None, :]
        if E8M0:
            e = tl.load(block + scales + scale_at, mask=ok, other=0).to(tl.uint32)
            scale = tl.where(e == 0, 2.0**-127, (e << 23).to(tl.float32, bitcast=True))
        else:
            scale = tl.load(as_f32(block + scales) + scale_at, mask=ok, other=0.0)
        return (e2m1(raw & 0xF) * scale).to(dtype), (e2m1(raw >> 4) * scale).to(dtype)
