/* moetier CPU expert kernel, packed FP4 (e2m1) weights: #included by cpu_experts.c after its dot products
 * (vf32, STEP, w_fma, dot_steps, ...) and FP8 section (bf16_lanes8), which this part builds on; not a
 * translation unit of its own. cpu_experts.py hashes it into the build key with cpu_experts.c. */

/* ------------------------------------------------------------------------------------------------------- */
/* FP4 (e2m1, DeepSeek-V4's routed experts): rows of packed nibbles (value 2j is the LOW nibble of byte j,  */
/* 2j + 1 the high one) with one float32 scale per tile_cols values. The reference (dequantize_fp4) computes */
/* bf16(fp32(e2m1) * scale): one fp32 multiply, one rounding to nearest even. A tile's values take only 16  */
/* codes, so each tile computes its 16 products (that same multiply and rounding) into a table and every    */
/* value is a lookup: bit for bit the reference for any scale (subnormal, huge or not a power of two), with */
/* the multiply and rounding paid per 16 codes instead of per value. Then the bf16 dot products run, as fp8, */
/* but for the tiles the fused dot products below read straight from their codes.                         */

/* e2m1 code -> value: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0); code 8 is -0.0. */
static const float E2M1_F32[16] __attribute__((aligned(64))) = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Values [from, n) of one tile (from and n even) by a table in memory: the portable build's whole tile, a
 * non-finite scale's tile, and the short tail of the SIMD builds (tile widths not a multiple of 16). */
static void e2m1_span_scalar(const uint8_t *q, float scale, int64_t from, int64_t n, bf16_t *dst) {
    if (from >= n) return;
    bf16_t table[16];
    for (int c = 0; c < 16; ++c) table[c] = f32_to_bf16(E2M1_F32[c] * scale);
    for (int64_t i = from; i < n; i += 2) {
        dst[i] = table[q[i / 2] & 0xf];
        dst[i + 1] = table[q[i / 2] >> 4];
    }
}

#if defined(VLEN) /* AVX2 and SSSE3 ops only: the same code in the AVX-512 builds */

/* The table of a finite scale, as two pshufb tables: the low and the high bytes of bf16(E2M1_F32[c] * scale)
 * for c = 0..15. For a finite scale, IEEE multiplication and rounding are symmetric in sign: code c + 8
 * (value -v) gives exactly bf16(v * scale) ^ 0x8000, so only the 8 magnitudes are multiplied (a NaN scale
 * would break this: the product's NaN keeps the scale's sign). Each product is rounded in place, its bf16 in
 * the high half of its 32 bits (when every low half is zero, as with the release's power-of-two scales, the
 * products already are bf16 and rounding is the identity), and bytes 2 and 3 of each become the tables. */
ALWAYS_INLINE void e2m1_tables(float scale, __m128i *lo, __m128i *hi) {
    const __m256 p = _mm256_mul_ps(_mm256_load_ps(E2M1_F32), _mm256_set1_ps(scale));
    __m256i bits = _mm256_castps_si256(p);
    if (!_mm256_testz_si256(bits, _mm256_set1_epi32(0xffff))) bits = _mm256_slli_epi32(bf16_lanes8(p), 16);
    /* each 128-bit half (4 products) -> [low bytes, high bytes, low bytes, high bytes] of its products */
    const __m256i pick = _mm256_setr_epi8(2, 6, 10, 14, 3, 7, 11, 15, 2, 6, 10, 14, 3, 7, 11, 15, /* */
                                          2, 6, 10, 14, 3, 7, 11, 15, 2, 6, 10, 14, 3, 7, 11, 15);
    /* -> [low 0-3, low 4-7, low 0-3, low 4-7 | high 0-3, high 4-7, high 0-3, high 4-7]: codes 8-15 repeat 0-7 */
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(bits, pick),
                                                      _mm256_setr_epi32(0, 4, 0, 4, 1, 5, 1, 5));
    *lo = _mm256_castsi256_si128(bytes);
    *hi = _mm_xor_si128(_mm256_extracti128_si256(bytes, 1), _mm_setr_epi32(0, 0, (int)0x80808080u, (int)0x80808080u));
}

/* 16 codes (one a byte, in value order) -> their 16 bf16 products at dst. */
ALWAYS_INLINE void e2m1x16_lookup(__m128i codes, __m128i lo, __m128i hi, bf16_t *dst) {
    const __m128i l = _mm_shuffle_epi8(lo, codes), h = _mm_shuffle_epi8(hi, codes);
    _mm_storeu_si128((__m128i *)dst, _mm_unpacklo_epi8(l, h));
    _mm_storeu_si128((__m128i *)(dst + 8), _mm_unpackhi_epi8(l, h));
}

/* The codes of packed bytes 0-7 (values 0-15) in value order, one a byte: each byte's low nibble, then its
 * high nibble. */
ALWAYS_INLINE __m128i e2m1_codes_lo8(__m128i bytes) {
    const __m128i nib = _mm_set1_epi8(0x0f);
    return _mm_unpacklo_epi8(_mm_and_si128(bytes, nib), _mm_and_si128(_mm_srli_epi16(bytes, 4), nib));
}

/* The same for packed bytes 8-15 (values 16-31). */
ALWAYS_INLINE __m128i e2m1_codes_hi8(__m128i bytes) {
    const __m128i nib = _mm_set1_epi8(0x0f);
    return _mm_unpackhi_epi8(_mm_and_si128(bytes, nib), _mm_and_si128(_mm_srli_epi16(bytes, 4), nib));
}

/* 32 values (16 packed bytes) through the tables. */
ALWAYS_INLINE void e2m1x32(const uint8_t *q, __m128i lo, __m128i hi, bf16_t *dst) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    e2m1x16_lookup(e2m1_codes_lo8(bytes), lo, hi, dst);
    e2m1x16_lookup(e2m1_codes_hi8(bytes), lo, hi, dst + 16);
}

/* dst[i] = bf16(e2m1(value i) * scale) for i in [0, n) of one tile, 32 then 16 at a time; returns how many
 * were done (the rest, fewer than 16, is the scalar tail's; all of it for a non-finite scale). */
ALWAYS_INLINE int64_t e2m1_span_simd(const uint8_t *q, float scale, int64_t n, bf16_t *dst) {
    if (n < 16 || !isfinite(scale)) return 0;
    __m128i lo, hi;
    e2m1_tables(scale, &lo, &hi);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) e2m1x32(q + i / 2, lo, hi, dst + i);
    if (i + 16 <= n) {
        e2m1x16_lookup(e2m1_codes_lo8(_mm_loadl_epi64((const __m128i *)(q + i / 2))), lo, hi, dst + i);
        i += 16;
    }
    return i;
}

/* The release's 32-value tiles from the start of a row: one table and one e2m1x32 each, without the general
 * loop's per-tile bookkeeping (measured: 31.5 -> 27.8 ms per 6-expert 4096 x 2048 job, one thread). Stops
 * at a non-finite scale or a partial last tile; returns the tiles done. */
ALWAYS_INLINE int64_t e2m1_tiles32(const uint8_t *q, const float *scales, int64_t n, bf16_t *dst) {
    int64_t t = 0;
    for (; 32 * t + 32 <= n && isfinite(scales[t]); ++t) {
        __m128i lo, hi;
        e2m1_tables(scales[t], &lo, &hi);
        e2m1x32(q + 16 * t, lo, hi, dst + 32 * t);
    }
    return t;
}

#else

ALWAYS_INLINE int64_t e2m1_span_simd(const uint8_t *q, float scale, int64_t n, bf16_t *dst) {
    (void)q, (void)scale, (void)n, (void)dst;
    return 0;
}

ALWAYS_INLINE int64_t e2m1_tiles32(const uint8_t *q, const float *scales, int64_t n, bf16_t *dst) {
    (void)q, (void)scales, (void)n, (void)dst;
    return 0;
}

#endif

/* One packed weight row of n values (n and tile_cols even): tile t of `tile_cols` values is scaled by scales[t]. */
static void e2m1_row(const uint8_t *q, const float *scales, int64_t n, int64_t tile_cols, bf16_t *dst) {
    int64_t t = tile_cols == 32 ? e2m1_tiles32(q, scales, n, dst) : 0;
    for (int64_t c0 = t * tile_cols; c0 < n; c0 += tile_cols, ++t) {
        const int64_t len = n - c0 < tile_cols ? n - c0 : tile_cols;
        const int64_t done = e2m1_span_simd(q + c0 / 2, scales[t], len, dst + c0);
        e2m1_span_scalar(q + c0 / 2, scales[t], done, len, dst + c0);
    }
}

/* ------------------------------------------------------------------------------------------------------- */
/* Fused FP4 dot products (SIMD builds, the release's 32-value tiles): where a tile's scale is a power of   */
/* two whose products with every code are normal fp32 numbers, each product is exact with at most two     */
/* significant bits, so it is its own bf16: bf16(e2m1 * scale) = e2m1 * scale, zero codes keeping the sign */
/* the multiply gives them.                                                                                */
/* Such tiles go from their 16 packed bytes straight into the dot products' registers as those exact       */
/* products, with no row buffer and no rounding, then take the very steps the bf16 path takes on the       */
/* dequantised row (the same weights in the same lanes, summed in the same order): the sums are bit for bit */
/* that path's. From the first tile that is not such a tile (any other scale: rounded, subnormal, infinite  */
/* or NaN products), and for a partial last tile, the rows are dequantised into the row buffer as above and */
/* finish on the bf16 path.                                                                                */

/* Experts of at most this many tokens (one token block) take the fused path: it decodes a row again for each
 * token block, where the row buffer is filled once and then only read per block (at 8 tokens, 2 blocks, the
 * two measured alike on AVX2). -DMOETIER_FP4_FUSED_TOKENS=N changes it; 0 turns the fused path off. */
#ifndef MOETIER_FP4_FUSED_TOKENS
#define MOETIER_FP4_FUSED_TOKENS TOKEN_BLOCK
#endif

/* Whether every product of a tile's scale is exact and normal: +-2^k with k in [-125, 125] (|code| is 0 or in
 * [0.5, 6]), that is a zero mantissa and an exponent field in [2, 252]. With x = |bits| - (2 << 23), that is
 * x a multiple of 2^23 (else rotating it right by 23 moves a set bit to bit 9 or above) and x >> 23 <= 250. */
ALWAYS_INLINE int e2m1_exact_scale(const float *scale) {
    uint32_t bits;
    memcpy(&bits, scale, sizeof bits);
    const uint32_t x = (bits & 0x7fffffffu) - (2u << 23);
    return ((x >> 23) | (x << 9)) <= 250u;
}

#if defined(VLEN)

/* How many of the first n tiles of a row have exact scales (e2m1_exact_scale), before the first that has not:
 * VLEN scales at a time, by the same arithmetic (AVX2 has no rotate: two shifts and an or). */
static int64_t e2m1_exact_tiles(const float *s, int64_t n) {
    int64_t t = 0;
    for (; t + VLEN <= n; t += VLEN) {
#if defined(__AVX512F__)
        const __m512i x = _mm512_sub_epi32(_mm512_and_si512(_mm512_loadu_si512(s + t), _mm512_set1_epi32(0x7fffffff)),
                                           _mm512_set1_epi32(2 << 23));
        const unsigned bad = (unsigned)_mm512_cmpgt_epu32_mask(_mm512_ror_epi32(x, 23), _mm512_set1_epi32(250));
#else
        const __m256i x = _mm256_sub_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(s + t)),
                                                            _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(2 << 23));
        const __m256i rot = _mm256_or_si256(_mm256_srli_epi32(x, 23), _mm256_slli_epi32(x, 9));
        const __m256i ok = _mm256_cmpeq_epi32(_mm256_min_epu32(rot, _mm256_set1_epi32(250)), rot);
        const unsigned bad = ~(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(ok)) & 0xffu;
#endif
        if (bad) return t + __builtin_ctz(bad);
    }
    while (t < n && e2m1_exact_scale(s + t)) ++t;
    return t;
}

#if defined(E2M1_SHUFFLED)

/* AVX512-BF16 with VBMI: the tile's values in a shuffled order, the token vectors in the same order.
 *
 * vpmultishiftqb copies any 8-bit window of a qword into each byte of that qword. With the tile's 16 bytes in
 * each 128-bit lane (a broadcast load, no shuffle), qwords 0, 2, 4, 6 hold values 0-15 and qwords 1, 3, 5, 7
 * values 16-31; each word's low byte takes the window whose bits 1-4 are one value's nibble. Word p = 4q + w
 * (qword q) gets value 16 (q % 2) + 4 (q / 2) + w: pairs of words hold pairs of values (2m, 2m + 1) in their
 * order, so dword lane d holds the value pair of lane E2M1_LANE_OF[d] of the natural layout, and the token
 * vectors are read in that order (e2m1_shuffle_x). vpermw reads 5 bits of each index word: bits 1-4 are
 * the code, bit 0 (the window's garbage) is set to pick the product's high word. A multishift and an or make a
 * tile's indices, where the natural order takes a widening, two shifts and a ternary op. Each
 * accumulator lane then sums the natural lane's products in the natural order: the accumulators are the
 * natural layout's, their lanes moved, and move back before their sums (e2m1_unshuffle). */
static const int32_t E2M1_LANE_OF[16] __attribute__((aligned(64))) = {0, 1, 8, 9, 2, 3, 10, 11,
                                                                       4, 5, 12, 13, 6, 7, 14, 15};
static const int32_t E2M1_LANE_AT[16] __attribute__((aligned(64))) = {0, 1, 4, 5, 8, 9, 12, 13,
                                                                       2, 3, 6, 7, 10, 11, 14, 15};

/* Control byte 2p of word p (low byte): the window starting one bit below its value's nibble. */
#define E2M1_WINDOWS(q) (char)((16 * ((q) / 2) + 63) & 63), 0, (char)((16 * ((q) / 2) + 3) & 63), 0, \
                        (char)((16 * ((q) / 2) + 7) & 63), 0, (char)((16 * ((q) / 2) + 11) & 63), 0
static const char E2M1_CONTROL[64] __attribute__((aligned(64))) = {
    E2M1_WINDOWS(0), E2M1_WINDOWS(1), E2M1_WINDOWS(2), E2M1_WINDOWS(3),
    E2M1_WINDOWS(4), E2M1_WINDOWS(5), E2M1_WINDOWS(6), E2M1_WINDOWS(7)};
#undef E2M1_WINDOWS

/* n values of a token vector (whole 32-value blocks) into the shuffled order. */
static void e2m1_shuffle_x(const xval_t *x, int64_t n, xval_t *dst) {
    const __m512i lane_of = _mm512_load_si512(E2M1_LANE_OF);
    for (int64_t i = 0; i + 32 <= n; i += 32)
        _mm512_storeu_si512(dst + i, _mm512_permutexvar_epi32(lane_of, _mm512_loadu_si512(x + i)));
}

/* Where value j of a row goes in the shuffled order. */
ALWAYS_INLINE int64_t e2m1_shuffled_at(int64_t j) {
    const int64_t v = j % 32, r = v % 16;
    return j - v + 8 * (r / 4) + 4 * (v / 16) + r % 4;
}

/* The accumulators' lanes back into the natural order. */
ALWAYS_INLINE void e2m1_unshuffle(int R, int NT, vf32 acc[MAX_ROWS][TOKEN_BLOCK]) {
    const __m512i lane_at = _mm512_load_si512(E2M1_LANE_AT);
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_permutexvar_ps(lane_at, acc[r][t]);
}

/* One tile's 32 values times every token's shuffled vector. The table is the codes' products with the scale in
 * fp32 lanes (exact), code c's bf16 the high word of lane c: index 2c + 1. */
ALWAYS_INLINE void e2m1_tile_fma(const uint8_t *q, const float *scale, const xval_t *const *x, int NT, int64_t i,
                                 vf32 acc[TOKEN_BLOCK]) {
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q));
    const __m512i index = _mm512_or_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(E2M1_CONTROL), bytes),
                                          _mm512_set1_epi16(1));
    const __m512i table = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(E2M1_F32), _mm512_set1_ps(*scale)));
    const wvec_t a = (__m512bh)_mm512_permutexvar_epi16(index, table);
    for (int t = 0; t < NT; ++t) acc[t] = w_fma(acc[t], a, x_load(x[t] + i));
}

#elif defined(__AVX512BF16__)

/* One tile's 32 values times every token's, as one vdpbf16ps step each. The table, the 16 code values times
 * the scale in fp32 lanes (exact), holds the bf16 of code c in word 2c + 1 (its high half); vpermw picks it
 * by 5 bits of each index word. With b byte j of the tile widened to dword j (values 2j = b & 15 and
 * 2j + 1 = b >> 4), (b << 1) | (b << 13) | 0x10001 has 2 (b & 15) + 1 in those bits of its low word and
 * 2 (b >> 4) + 1 in its high word's. */
ALWAYS_INLINE void e2m1_tile_fma(const uint8_t *q, const float *scale, const xval_t *const *x, int NT, int64_t i,
                                 vf32 acc[TOKEN_BLOCK]) {
    const __m512i table = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(E2M1_F32), _mm512_set1_ps(*scale)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    const __m512i words = _mm512_ternarylogic_epi32(_mm512_slli_epi32(b, 1), _mm512_slli_epi32(b, 13),
                                                    _mm512_set1_epi32(0x00010001), 0xfe); /* a | b | c */
    const wvec_t a = (__m512bh)_mm512_permutexvar_epi16(words, table);
    for (int t = 0; t < NT; ++t) acc[t] = w_fma(acc[t], a, x_load(x[t] + i));
}

#elif defined(__AVX512F__)

/* One tile's 32 values times every token's, as two steps of 16 fp32 lanes, looked up by vpermps in the
 * table of the 16 code values times the scale (exact). Value v is nibble v of the tile's bytes read as 4
 * little-endian dwords: dword v / 8 shifted right by 4 (v % 8) has its code in the low 4 bits, all that
 * vpermps reads of an index. */
ALWAYS_INLINE void e2m1_tile_fma(const uint8_t *q, const float *scale, const xval_t *const *x, int NT, int64_t i,
                                 vf32 acc[TOKEN_BLOCK]) {
    const __m512 table = _mm512_mul_ps(_mm512_load_ps(E2M1_F32), _mm512_set1_ps(*scale));
    const __m512i dwords = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)q));
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    for (int h = 0; h < 2; ++h) {
        const int d = 2 * h; /* values 16h..16h + 15: dwords 2h and 2h + 1 */
        const __m512i pick = _mm512_setr_epi32(d, d, d, d, d, d, d, d, d + 1, d + 1, d + 1, d + 1, d + 1, d + 1,
                                               d + 1, d + 1);
        const __m512i codes = _mm512_srlv_epi32(_mm512_permutexvar_epi32(pick, dwords), shifts);
        const vf32 a = _mm512_permutexvar_ps(codes, table);
        for (int t = 0; t < NT; ++t) acc[t] = w_fma(acc[t], a, x_load(x[t] + i + VLEN * h));
    }
}

#else /* AVX2 */

/* One tile's 32 values times every token's, as four steps of 8 fp32 lanes. AVX2 has no 16-entry lookup of
 * 32-bit values: each code's bf16 value (at scale 1) is looked up a byte at a time (pshufb, per 128-bit
 * lane), low and high bytes interleaved into bf16 words (per lane too), the even and the odd words of each
 * lane shifted or masked into fp32 lanes, and those multiplied by the scale (exact). So the codes are first
 * laid out for this, one a byte: lane 0 holding values 0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26,
 * 19, 27 and lane 1 the same plus 4. Values v and v + 8 are the same nibble of bytes v / 2 and v / 2 + 4:
 * with those two bytes in one word w, w & 0x0f0f holds their low nibbles and (w >> 4) & 0x0f0f their high
 * nibbles, each in its own byte. */
ALWAYS_INLINE void e2m1_tile_fma(const uint8_t *q, const float *scale, const xval_t *const *x, int NT, int64_t i,
                                 vf32 acc[TOKEN_BLOCK]) {
    const __m256i pairs = _mm256_setr_epi8(0, 4, 0, 4, 1, 5, 1, 5, 8, 12, 8, 12, 9, 13, 9, 13, /* */
                                           2, 6, 2, 6, 3, 7, 3, 7, 10, 14, 10, 14, 11, 15, 11, 15);
    /* bf16 of the e2m1 values, low bytes and high bytes, codes 0-15 in each lane (code 8 is -0.0) */
    const __m256i lo = _mm256_setr_epi8(0, 0, -128, -64, 0, 64, -128, -64, 0, 0, -128, -64, 0, 64, -128, -64, /* */
                                        0, 0, -128, -64, 0, 64, -128, -64, 0, 0, -128, -64, 0, 64, -128, -64);
    const __m256i hi = _mm256_setr_epi8(0, 63, 63, 63, 64, 64, 64, 64, -128, -65, -65, -65, -64, -64, -64, -64, /* */
                                        0, 63, 63, 63, 64, 64, 64, 64, -128, -65, -65, -65, -64, -64, -64, -64);
    const __m256i w = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q)), pairs);
    const __m256i codes = _mm256_and_si256(_mm256_blend_epi16(w, _mm256_srli_epi16(w, 4), 0xaa), _mm256_set1_epi8(15));
    const __m256i l = _mm256_shuffle_epi8(lo, codes), h = _mm256_shuffle_epi8(hi, codes);
    const __m256i words[2] = {_mm256_unpacklo_epi8(l, h), _mm256_unpackhi_epi8(l, h)}; /* values 0, 8, 1, 9, ... */
    const vf32 s = _mm256_broadcast_ss(scale);
    for (int step = 0; step < 4; ++step) {
        const __m256i half = words[step / 2];
        const __m256i f32 = step % 2 ? _mm256_and_si256(half, _mm256_set1_epi32((int)0xffff0000u))
                                     : _mm256_slli_epi32(half, 16);
        const vf32 a = v_mul(_mm256_castsi256_ps(f32), s);
        for (int t = 0; t < NT; ++t) acc[t] = w_fma(acc[t], a, x_load(x[t] + i + VLEN * step));
    }
}

#endif

/* dot_rows on packed e2m1 rows: their tiles of exact scales from the codes, from the first other tile on
 * (or the partial last tile) from the rows dequantised into their buffers. */
ALWAYS_INLINE void dot_rows_e2m1(const rows_t *rows, int R, const xval_t *const *x, int NT, int64_t k,
                                 float res[MAX_ROWS][TOKEN_BLOCK]) {
    vf32 acc[MAX_ROWS][TOKEN_BLOCK];
    dot_zero(R, NT, acc);
    const uint8_t *q[MAX_ROWS];
    const float *s[MAX_ROWS];
    for (int r = 0; r < R; ++r) q[r] = rows->q[r], s[r] = rows->s[r];
    int64_t tiles = k / 32;
    /* The scan's first reads of the scales wait on DRAM before any code is read: skipped where the job's experts
     * were checked whole (H200, 1-token jobs at 14 threads: 72.6 -> 78.3 GB/s, medians of an ABAB; nothing clear at
     * 4 tokens). */
    if (!rows->exact)
        for (int r = 0; r < R; ++r) tiles = e2m1_exact_tiles(s[r], tiles);
#if defined(E2M1_SHUFFLED)
    const xval_t *const *xt = rows->xs;
#else
    const xval_t *const *xt = x;
#endif
    int64_t i = 0;
    for (; i < 32 * tiles; i += 32)
        for (int r = 0; r < R; ++r) {
            prefetch(q[r] + i / 2);
            e2m1_tile_fma(q[r] + i / 2, s[r] + i / 32, xt, NT, i, acc[r]);
        }
#if defined(E2M1_SHUFFLED)
    if (tiles > 0) e2m1_unshuffle(R, NT, acc);
#endif
    for (int r = 0; r < R; ++r) e2m1_row(q[r] + i / 2, s[r] + i / 32, k - i, 32, rows->buf[r] + i);
    dot_finish(rows->w, R, x, NT, dot_steps(rows->w, R, x, NT, i, k, acc), k, acc, res);
}

#else /* portable: no fused path */

#undef MOETIER_FP4_FUSED_TOKENS
#define MOETIER_FP4_FUSED_TOKENS 0

ALWAYS_INLINE void dot_rows_e2m1(const rows_t *rows, int R, const xval_t *const *x, int NT, int64_t k,
                                 float res[MAX_ROWS][TOKEN_BLOCK]) {
    dot_rows(rows->w, R, x, NT, k, res); /* never called: no row is packed */
}

#endif

/* Whether all n float32 scales are exact (e2m1_exact_scale), or (bytes) all n e8m0 exponent bytes stand for such
 * scales (2^(e - 127) with e in [2, 252]): what QUANT_EXACT_SCALES promises, checked once per expert. */
int moetier_scales_exact(const void *scales, int64_t n, int bytes) {
    if (bytes) {
        const uint8_t *e = scales;
        uint8_t bad = 0;
        for (int64_t i = 0; i < n; ++i) bad |= (uint8_t)(e[i] < 2) | (uint8_t)(e[i] > 252);
        return !bad;
    }
#if defined(VLEN)
    return e2m1_exact_tiles(scales, n) == n;
#else
    int64_t i = 0;
    while (i < n && e2m1_exact_scale((const float *)scales + i)) ++i;
    return i == n;
#endif
}
