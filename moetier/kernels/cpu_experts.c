/* moetier CPU expert kernel: one whole CPU-tier job (several SwiGLU experts, a few tokens each) on the calling
 * thread and its team of helpers (cpu_team.c; none at one thread).
 *
 * Decode on the CPU tier is bound by DRAM bandwidth: each expert's weights (~50 MB in bf16) are read once
 * for 1-8 tokens. So every weight row is loaded once and used for all of its expert's tokens, and the
 * rows of all experts are split across all threads (a 1-token job over 6 experts still uses every core).
 *
 *   phase 1  units j (gate row j, up row j) of every expert, taken by threads in chunks as they come free:
 *            act[p][j] = bf16(silu(bf16(gate_j . x_p)) * bf16(up_j . x_p))   (clamped when has_limit)
 *   (phase 1 done: every chunk, whichever threads took them)
 *   phase 2  output columns h, taken in chunks the same way (one thread owns each h: no atomics):
 *            out[rows[p]][h] += gates[p] * bf16(down_h . act[p])
 *
 * Dot products accumulate in fp32. The roundings to bf16 are those of a bf16 GEMM (its output is bf16);
 * the activation is computed in fp32 from the rounded gate and up and rounded once. The clamp bound is
 * the limit rounded to bf16 (what torch's clamp of bf16 values gives).
 *
 * SIMD: AVX512_BF16 (vdpbf16ps) when the compiler targets it, else AVX-512F or AVX2 + FMA (one loop on 16
 * or 8 lanes: bf16 -> fp32 by a 16-bit shift, fp32 FMA), else portable code written so the compiler can
 * vectorise it. No Python headers: loaded by ctypes.
 *
 * Quantised experts (float8 e4m3fn, DeepSeek-V3's release; packed fp4 e2m1, DeepSeek-V4's) are dequantised
 * one weight row at a time into a per-thread bf16 buffer, exactly as the loader dequantises them, and then
 * take the same bf16 dot products: the results are bit for bit the bf16 path's on the dequantised weights.
 * FP4 tiles whose power-of-two scale makes every dequantised value exact skip the buffer: their codes are
 * decoded in registers into the same values, which take the same dot-product steps (cpu_experts_fp4.c).
 */
#define _GNU_SOURCE /* sched_setaffinity and cpu_set_t (cpu_team.c's pinned threads) */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

typedef uint16_t bf16_t;

/* Tokens that share one pass over a weight row; more tokens take further passes (the row is then in L1). */
#define TOKEN_BLOCK 4
/* Weight rows read side by side: separate memory streams keep more DRAM reads in flight per core. */
#define MAX_ROWS 4
/* Software prefetch distance ahead of each weight stream, in bytes. Off by default: on the machines
 * measured the hardware prefetchers did better alone (build with -DMOETIER_PREFETCH_BYTES=N to try). */
#ifndef MOETIER_PREFETCH_BYTES
#define MOETIER_PREFETCH_BYTES 0
#endif
/* Output columns per cache line of fp32: phase 2 splits h on this grain so threads never share a line. */
#define OUT_GRAIN 16
/* Threads take each phase's work in chunks from a shared counter as they come (cpu_team.c: a thread may come
 * late or not at all), and a phase is over when its chunks are done. Chunks: GATE_UP_CHUNK units (2 weight
 * rows each; 64 KB of fp4, 256 KB of bf16 at V4-Flash's width), DOWN_CHUNK output columns (a multiple of
 * OUT_GRAIN), CONVERT_CHUNK values. Every value is computed by the same steps whichever thread computes it, so
 * the sums do not depend on the threads. */
#define GATE_UP_CHUNK 16
#define DOWN_CHUNK 32
#define CONVERT_CHUNK 4096

#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { MOETIER_OK = 0, MOETIER_BAD_ARGS = -1, MOETIER_NO_MEMORY = -2, MOETIER_ABANDONED = -3 };
/* How a job's weights are stored (the `quant` argument of moetier_cpu_experts_quantised). */
/* QUANT_E2M1_E8M0: packed e2m1 whose scales are e8m0 exponent bytes (2^(e - 127), e = 0 the subnormal 2^-127). */
enum { QUANT_NONE = 0, QUANT_E4M3 = 1, QUANT_E2M1 = 2, QUANT_E2M1_E8M0 = 3 };
/* OR'ed into an e2m1 `quant`: the caller checked that every tile scale of the job's experts is exact for the
 * fused fp4 path (moetier_scales_exact), so its dot products skip their scan of each row's scales. */
enum { QUANT_EXACT_SCALES = 0x100 };

/* ------------------------------------------------------------------------------------------------------- */
/* bf16 <-> fp32                                                                                          */

ALWAYS_INLINE float bf16_to_f32(bf16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest, ties to even (what torch and CUDA do); NaN stays a quiet NaN. */
ALWAYS_INLINE bf16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((bits >> 16) | 0x0040u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16_t)(bits >> 16);
}

ALWAYS_INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

ALWAYS_INLINE void prefetch(const void *p) {
#if MOETIER_PREFETCH_BYTES > 0
    __builtin_prefetch((const char *)p + MOETIER_PREFETCH_BYTES, 0, 3);
#else
    (void)p;
#endif
}

/* ------------------------------------------------------------------------------------------------------- */
/* Token vectors (the hidden rows of phase 1, the activations of phase 2) are `xval_t`: bf16 for vdpbf16ps, */
/* else fp32 holding bf16-exact values, converted once per job instead of once per weight row.            */

#if defined(__AVX512BF16__)
typedef bf16_t xval_t;
#define X_IS_BF16 1
ALWAYS_INLINE float x_to_f32(xval_t v) { return bf16_to_f32(v); }
ALWAYS_INLINE xval_t x_from_bf16(bf16_t v) { return v; }
#else
typedef float xval_t;
#define X_IS_BF16 0
ALWAYS_INLINE float x_to_f32(xval_t v) { return v; }
ALWAYS_INLINE xval_t x_from_bf16(bf16_t v) { return bf16_to_f32(v); }
#endif

/* ------------------------------------------------------------------------------------------------------- */
/* fp32 vectors of VLEN lanes (AVX-512F or AVX2 + FMA builds): the widen-and-FMA dot products and the fp8  */
/* and fp4 dequantisations are each written once on these, whatever the width.                            */

#if defined(__AVX512F__)

#define VLEN 16
#define VEC_ISA "avx512f"
typedef __m512 vf32;

ALWAYS_INLINE vf32 v_zero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE vf32 v_set1(float f) { return _mm512_set1_ps(f); }
ALWAYS_INLINE vf32 v_load(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void v_store(float *p, vf32 v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE vf32 v_mul(vf32 a, vf32 b) { return _mm512_mul_ps(a, b); }
ALWAYS_INLINE vf32 v_fma(vf32 a, vf32 b, vf32 acc) { return _mm512_fmadd_ps(a, b, acc); }
ALWAYS_INLINE float v_sum(vf32 v) { return _mm512_reduce_add_ps(v); }

/* VLEN bf16 as fp32: each zero-extended to 32 bits and shifted into the high half (exact). */
ALWAYS_INLINE vf32 v_load_bf16(const bf16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

#elif defined(__AVX2__) && defined(__FMA__)

#define VLEN 8
#define VEC_ISA "avx2"
typedef __m256 vf32;

ALWAYS_INLINE vf32 v_zero(void) { return _mm256_setzero_ps(); }
ALWAYS_INLINE vf32 v_set1(float f) { return _mm256_set1_ps(f); }
ALWAYS_INLINE vf32 v_load(const float *p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE void v_store(float *p, vf32 v) { _mm256_storeu_ps(p, v); }
ALWAYS_INLINE vf32 v_mul(vf32 a, vf32 b) { return _mm256_mul_ps(a, b); }
ALWAYS_INLINE vf32 v_fma(vf32 a, vf32 b, vf32 acc) { return _mm256_fmadd_ps(a, b, acc); }

/* Horizontal sum: halves, then pairs, then the last two lanes. */
ALWAYS_INLINE float v_sum(vf32 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

ALWAYS_INLINE vf32 v_load_bf16(const bf16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#endif

/* ------------------------------------------------------------------------------------------------------- */
/* Dot products of R weight rows (1..MAX_ROWS) with NT token vectors (1..TOKEN_BLOCK) over k elements.    */
/* R and NT are compile-time constants at every call (see dot_block): the loops over them fully unroll.    */

/* Scalar tail from element `start` (k need not be a multiple of the vector width). */
ALWAYS_INLINE void dot_tail(const bf16_t *const *w, int R, const xval_t *const *x, int NT, int64_t start, int64_t k,
                            float res[MAX_ROWS][TOKEN_BLOCK]) {
    for (int64_t i = start; i < k; ++i)
        for (int t = 0; t < NT; ++t) {
            float b = x_to_f32(x[t][i]);
            for (int r = 0; r < R; ++r) res[r][t] += bf16_to_f32(w[r][i]) * b;
        }
}

#if defined(VLEN)

/* A step of the dot products: STEP weights of each row times the same STEP values of each token, into one
 * fp32 accumulator of VLEN lanes per (row, token). `wvec_t` holds one step's weights or token values. */
#if defined(__AVX512BF16__)

static const char ISA[] = "avx512_bf16";

#define STEP 32 /* vdpbf16ps: 32 bf16 products, summed in pairs into 16 fp32 lanes */
typedef __m512bh wvec_t;
ALWAYS_INLINE wvec_t w_load(const bf16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
ALWAYS_INLINE wvec_t x_load(const xval_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
ALWAYS_INLINE vf32 w_fma(vf32 acc, wvec_t a, wvec_t b) { return _mm512_dpbf16_ps(acc, a, b); }

#else

static const char ISA[] = VEC_ISA;

#define STEP VLEN /* bf16 -> fp32 by a 16-bit shift, fp32 FMA */
typedef vf32 wvec_t;
ALWAYS_INLINE wvec_t w_load(const bf16_t *p) { return v_load_bf16(p); }
ALWAYS_INLINE wvec_t x_load(const xval_t *p) { return v_load(p); }
ALWAYS_INLINE vf32 w_fma(vf32 acc, wvec_t a, wvec_t b) { return v_fma(a, b, acc); }

#endif

/* One accumulator per (row, token): R x NT independent FMA chains (4 to 16; R is MAX_ROWS but for a
 * thread's last rows), which hide the FMA latency. On AVX2's 16 ymm registers 4 rows x 4 tokens spill a
 * few accumulators, and still beat token groups of 2 that fit (measured at 4 tokens, 4096 x 2048 experts,
 * one thread: 10.3 against 8.9 GB/s; equal at 1 token). */
ALWAYS_INLINE void dot_zero(int R, int NT, vf32 acc[MAX_ROWS][TOKEN_BLOCK]) {
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = v_zero();
}

/* The steps of bf16 rows from element i on, while whole ones fit in k; returns where they stopped. */
ALWAYS_INLINE int64_t dot_steps(const bf16_t *const *w, int R, const xval_t *const *x, int NT, int64_t i, int64_t k,
                                vf32 acc[MAX_ROWS][TOKEN_BLOCK]) {
    for (; i + STEP <= k; i += STEP) {
        wvec_t a[MAX_ROWS];
        for (int r = 0; r < R; ++r) {
            prefetch(w[r] + i);
            a[r] = w_load(w[r] + i);
        }
        for (int t = 0; t < NT; ++t) {
            const wvec_t b = x_load(x[t] + i);
            for (int r = 0; r < R; ++r) acc[r][t] = w_fma(acc[r][t], a[r], b);
        }
    }
    return i;
}

/* res = the accumulators' sums, then the scalar tail of the bf16 rows from element i. */
ALWAYS_INLINE void dot_finish(const bf16_t *const *w, int R, const xval_t *const *x, int NT, int64_t i, int64_t k,
                              vf32 acc[MAX_ROWS][TOKEN_BLOCK], float res[MAX_ROWS][TOKEN_BLOCK]) {
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) res[r][t] = v_sum(acc[r][t]);
    dot_tail(w, R, x, NT, i, k, res);
}

ALWAYS_INLINE void dot_rows(const bf16_t *const *w, int R, const xval_t *const *x, int NT, int64_t k,
                            float res[MAX_ROWS][TOKEN_BLOCK]) {
    vf32 acc[MAX_ROWS][TOKEN_BLOCK];
    dot_zero(R, NT, acc);
    dot_finish(w, R, x, NT, dot_steps(w, R, x, NT, 0, k, acc), k, acc, res);
}

#else

static const char ISA[] = "portable";

/* LANES independent partial sums: the compiler may vectorise across lanes without reassociating a sum. */
#define LANES 16

/* One row and one token at a time (the row is in L1 after the first token): a loop this simple is one
 * that compilers vectorise, where loops over several tokens were not (GCC 12). The price is converting
 * each weight again per token: past 1-2 tokens this path is compute bound. */
ALWAYS_INLINE float dot_one(const bf16_t *w, const xval_t *x, int64_t k) {
    float acc[LANES] = {0.0f};
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES) {
        prefetch(w + i);
        for (int l = 0; l < LANES; ++l) acc[l] += bf16_to_f32(w[i + l]) * x[i + l];
    }
    float sum = 0.0f;
    for (int l = 0; l < LANES; ++l) sum += acc[l];
    for (; i < k; ++i) sum += bf16_to_f32(w[i]) * x[i];
    return sum;
}

ALWAYS_INLINE void dot_rows(const bf16_t *const *w, int R, const xval_t *const *x, int NT, int64_t k,
                            float res[MAX_ROWS][TOKEN_BLOCK]) {
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) res[r][t] = dot_one(w[r], x[t], k);
}

#endif

/* ------------------------------------------------------------------------------------------------------- */
/* FP8 (e4m3fn) weights: each row is dequantised into a per-thread bf16 buffer exactly as the reference     */
/* (`(w.float() * scale).to(bf16)`) does, then the bf16 dot products above run on that buffer. So the      */
/* results are bit for bit those of the bf16 path on the dequantised weights; the gain is reading half    */
/* the bytes from DRAM, the cost is the decode (the buffer stays in L1).                                 */

/* e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN. */
ALWAYS_INLINE float e4m3_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24, mag = b & 0x7fu;
    uint32_t bits;
    if (mag == 0x7fu) {
        bits = sign | 0x7fc00000u;
    } else if (mag >= 0x08u) { /* normal: rebias the exponent 7 -> 127 (+120) and widen the mantissa */
        bits = sign | ((mag << 20) + (120u << 23));
    } else { /* subnormal (and zero): m * 2^-9, exact in fp32 */
        float f = (float)mag * 0x1p-9f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Per ISA: v_load_e4m3 decodes VLEN codes to fp32 and v_store_bf16 rounds VLEN fp32 to bf16, both by the
 * same cases as e4m3_to_f32 and f32_to_bf16, as integer ops and blends (vcvtneps2bf16 would flush
 * subnormals, torch's cast does not). */

#if defined(VLEN) /* AVX2 (the AVX-512 builds have it too): the AVX2 store, and the fp4 tables below */

/* f32_to_bf16 of 8 lanes, each in the low 16 bits of its 32-bit lane. */
ALWAYS_INLINE __m256i bf16_lanes8(__m256 f) {
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    /* signed compare: both sides are below 2^31 */
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

#endif


#if defined(__AVX512F__)

ALWAYS_INLINE vf32 v_load_e4m3(const uint8_t *p) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
    __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f)); /* exact when mag < 8 */
    bits = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), bits, _mm512_castps_si512(sub));
    bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), bits,
                                   _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}

ALWAYS_INLINE void v_store_bf16(bf16_t *dst, vf32 f) {
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
}

#if defined(__AVX512BF16__)

/* The fast case (what real scales are): every nonzero product normal and finite. Then vcvtne2ps2bf16,
 * which flushes subnormals but otherwise rounds to nearest even, rounds exactly as f32_to_bf16 does. */
ALWAYS_INLINE int fast_tile(float scale) {
    const float a = fabsf(scale);
    return a >= 0x1p-117f && a < 0x1p7f; /* |e4m3| is 0 or in [2^-9, 448]; false for NaN */
}

/* 16 codes times `scale`, as fp32, each product rounded once as the reference computes it. A normal
 * code's magnitude bits shifted into place and rebiased (`(mag << 20) + (120 << 23)`) are its exact value;
 * a subnormal code (mag < 8) is mag * 2^-9, taken as the integer mag times `scale_sub` = scale * 2^-9
 * (exact: fast_tile keeps it normal). No lane ever feeds the multiplier an fp32 subnormal: on Intel cores
 * each such multiply takes a microcode assist, which made a job of uniformly random codes (1 in 16
 * subnormal, so nearly every vector has one) 8x slower than bf16 on the H200 host. */
ALWAYS_INLINE __m512 e4m3x16_scaled(const uint8_t *p, __m512 scale, __m512 scale_sub) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_and_si512(_mm512_slli_epi32(v, 24), _mm512_set1_epi32((int)0x80000000u));
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(normal), scale);
    value = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), value,
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(mag), scale_sub));
    value = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(value), sign)); /* code sign x scale sign */
    return _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), value,
                                _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

ALWAYS_INLINE int64_t dequant_span_fast(const uint8_t *q, float scale, int64_t n, bf16_t *dst) {
    const __m512 s = _mm512_set1_ps(scale), s_sub = _mm512_set1_ps(scale * 0x1p-9f);
    int64_t i = 0;
    for (; i + 2 * VLEN <= n; i += 2 * VLEN) {
        const __m512bh pair = _mm512_cvtne2ps_pbh(e4m3x16_scaled(q + i + VLEN, s, s_sub), e4m3x16_scaled(q + i, s, s_sub));
        _mm512_storeu_si512(dst + i, (__m512i)pair);
    }
    return i;
}

#endif

#elif defined(VLEN) /* AVX2: compares give all-ones lanes, which blendv selects by */

ALWAYS_INLINE vf32 v_load_e4m3(const uint8_t *p) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7f));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    __m256i bits = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f)); /* exact when mag < 8 */
    bits = _mm256_blendv_epi8(bits, _mm256_castps_si256(sub), _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
    return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

ALWAYS_INLINE void v_store_bf16(bf16_t *dst, vf32 f) {
    const __m256i half = bf16_lanes8(f); /* 8 values < 2^16, in 32-bit lanes */
    _mm_storeu_si128((__m128i *)dst, _mm_packus_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1)));
}

#endif

#if defined(VLEN)

/* dst[i] = bf16(e4m3(q[i]) * scale) for i in [0, n), VLEN at a time; returns how many were done. */
ALWAYS_INLINE int64_t dequant_span_simd(const uint8_t *q, float scale, int64_t n, bf16_t *dst) {
    const vf32 s = v_set1(scale);
    int64_t i = 0;
#if defined(__AVX512BF16__)
    if (fast_tile(scale)) i = dequant_span_fast(q, scale, n, dst);
#endif
    for (; i + VLEN <= n; i += VLEN) v_store_bf16(dst + i, v_mul(v_load_e4m3(q + i), s));
    return i;
}

/* The decode as the kernel runs it (vector, then scalar tail): what the exported test function checks. */
static void e4m3_decode(const uint8_t *in, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + VLEN <= n; i += VLEN) v_store(out + i, v_load_e4m3(in + i));
    for (; i < n; ++i) out[i] = e4m3_to_f32(in[i]);
}

#else

ALWAYS_INLINE int64_t dequant_span_simd(const uint8_t *q, float scale, int64_t n, bf16_t *dst) {
    (void)q, (void)scale, (void)n, (void)dst;
    return 0;
}

static void e4m3_decode(const uint8_t *in, float *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = e4m3_to_f32(in[i]);
}

#endif

/* One weight row of n columns: tile c of `tile_cols` columns is scaled by scales[c]. */
static void e4m3_row(const uint8_t *q, const float *scales, int64_t n, int64_t tile_cols, bf16_t *dst) {
    for (int64_t c0 = 0, t = 0; c0 < n; c0 += tile_cols, ++t) {
        const int64_t len = n - c0 < tile_cols ? n - c0 : tile_cols;
        const float s = scales[t];
        for (int64_t i = c0 + dequant_span_simd(q + c0, s, len, dst + c0); i < c0 + len; ++i)
            dst[i] = f32_to_bf16(e4m3_to_f32(q[i]) * s);
    }
}

/* ------------------------------------------------------------------------------------------------------- */
/* Weight rows as the dot products read them                                                             */

/* The weight rows of one dot_block: bf16 values at w[r]; for packed e2m1 rows (`packed`), codes q[r] with
 * one scale per 32 values s[r], and buf[r] (= w[r]) the buffer their columns past the fused tiles go to. */
typedef struct {
    const bf16_t *w[MAX_ROWS];
    bf16_t *buf[MAX_ROWS];
    const uint8_t *q[MAX_ROWS];
    const float *s[MAX_ROWS];
    const xval_t *xs[TOKEN_BLOCK]; /* E2M1_SHUFFLED builds: the token vectors in the shuffled order */
    int packed;
    int exact; /* packed rows whose every tile scale is exact (QUANT_EXACT_SCALES): no scan of them */
} rows_t;

/* AVX512-BF16 builds with VBMI read fp4 tiles in a shuffled order (cpu_experts_fp4.c), the token vectors too. */
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define E2M1_SHUFFLED 1
#endif

/* FP4 (e2m1) weights: row dequantisation (e2m1_row) and the fused dot products (dot_rows_e2m1). */
#include "cpu_experts_fp4.c"

/* One specialised dot_rows (or dot_rows_e2m1) per (rows, tokens): a runtime (r, nt) picks a fully unrolled
 * body. */
#define DOT_CASE(R, NT)                            \
    case NT:                                       \
        if (rows->packed)                          \
            dot_rows_e2m1(rows, R, x, NT, k, res); \
        else                                       \
            dot_rows(rows->w, R, x, NT, k, res);   \
        return;
#define DOT_ROWS(R)                                                                  \
    case R:                                                                          \
        switch (nt) { DOT_CASE(R, 1) DOT_CASE(R, 2) DOT_CASE(R, 3) DOT_CASE(R, 4) } \
        return;

static void dot_block(const rows_t *rows, int r, const xval_t *const *x, int nt, int64_t k,
                      float res[MAX_ROWS][TOKEN_BLOCK]) {
    switch (r) { DOT_ROWS(1) DOT_ROWS(2) DOT_ROWS(3) DOT_ROWS(4) }
}

/* The job: its phases, its team of threads, its entry points. */
#include "cpu_job.c"

/* Decode n float8 e4m3fn codes to fp32 with the kernel's own decoder (for tests). */
void moetier_e4m3_to_f32(const uint8_t *in, float *out, int64_t n) { e4m3_decode(in, out, n); }

/* Dequantise a whole [rows, cols] matrix (of values) to bf16 row by row, as the kernel does (for tests: the
 * dot products flush subnormal bf16 inputs, so only this sees how subnormal products are rounded). Returns
 * MOETIER_BAD_ARGS for an unknown `quant`, a bad tile or (e2m1) odd cols or tile_cols. */
int moetier_dequantize(int quant, const uint8_t *q, const float *scales, int64_t rows, int64_t cols,
                       int64_t tile_rows, int64_t tile_cols, bf16_t *out) {
    const int packed = quant == QUANT_E2M1;
    if ((quant != QUANT_E4M3 && !packed) || tile_rows < 1 || tile_cols < 1 || (packed && (cols % 2 || tile_cols % 2)))
        return MOETIER_BAD_ARGS;
    const int64_t grid_cols = (cols + tile_cols - 1) / tile_cols, row_bytes = packed ? cols / 2 : cols;
    for (int64_t r = 0; r < rows; ++r) {
        const float *s = scales + (r / tile_rows) * grid_cols;
        if (packed)
            e2m1_row(q + r * row_bytes, s, cols, tile_cols, out + r * cols);
        else
            e4m3_row(q + r * row_bytes, s, cols, tile_cols, out + r * cols);
    }
    return MOETIER_OK;
}

/* Which SIMD path this build compiled ("avx512_bf16", "avx512f", "avx2" or "portable"). */
const char *moetier_cpu_experts_isa(void) { return ISA; }

#include "cpu_worker.c"
