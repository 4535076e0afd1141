/* moetier CPU expert kernel, the job (#included by cpu_experts.c after its dot products and weight rows, which
 * this part builds on; not a translation unit of its own): its arrays, its phases taken in chunks by the
 * calling thread and its team (cpu_team.c, included here), its marks, and the exported entry points. */

/* ------------------------------------------------------------------------------------------------------- */
/* The job                                                                                                 */

/* A job's marks, seconds after run_job's entry: its buffers allocated; the first and the last thread to join
 * the job (the team's start); the first and the last thread done with phase 1 (the spread is what the phase's
 * end waits out); the same for phase 2; the job's end. A team of one has all of them. */
enum {
    MARK_ALLOCATED,
    MARK_ENTERED_FIRST,
    MARK_ENTERED_LAST,
    MARK_GATE_UP_FIRST,
    MARK_GATE_UP_LAST,
    MARK_DOWN_FIRST,
    MARK_DOWN_LAST,
    MARK_END,
    MARK_JOINED, /* not a time: how many threads took part (a helper that came after the work was done did not) */
    N_MARKS
};
enum { THREAD_ENTERED, THREAD_GATE_UP, THREAD_DOWN, THREAD_MARKS };

/* One phase's shared counters: the next item to take, and how many are done (added with release). */
typedef struct {
    int64_t next, done;
} phase_t;
enum { PHASE_CONVERT, PHASE_GATE_UP, PHASE_DOWN, N_PHASES };

typedef struct job {
    int64_t n_experts;
    const bf16_t *const *gate_up; /* [E] -> [2I, H] (gate rows, then up rows) */
    const bf16_t *const *down;    /* [E] -> [H, I] */
    const int64_t *offsets;       /* [E + 1]: expert e owns pairs offsets[e] .. offsets[e + 1] */
    /* [E] or NULL (0 for every expert): expert e's first intermediate row. A fed job's split expert (the device
     * computes rows 0 .. from[e], this job the rest: gate/up rows from[e] .. I, down columns from[e] .. I, a
     * multiple of 32 and of the scales' tile width, so every row read starts on a tile). */
    const int64_t *from;
    const int64_t *rows;          /* [P]: row of `hidden` / `out` of each pair */
    const float *gates;           /* [P] */
    const bf16_t *hidden;         /* [U, H] */
    int64_t out_rows;             /* U */
    int64_t hidden_size;          /* H */
    int64_t inter;                /* I */
    int has_limit;
    float limit;
    float *out;        /* [U, H] */
    const xval_t *x;   /* [U, H]: `hidden` itself when xval_t is bf16, else a converted copy */
    xval_t *x_scratch; /* the converted copy (NULL when not needed) */
    xval_t *act;       /* [P, I] */
    /* Quantised jobs (quant not QUANT_NONE; gate_up and down NULL): per matrix (GATE, UP, DOWN), [E] -> its
     * rows (float8 e4m3fn codes, or e2m1 nibbles packed two a byte) and their grids of one scale per
     * tile_rows x tile_cols tile of values (partial edge tiles allowed): float32, or for QUANT_E2M1_E8M0 uint8
     * exponent bytes behind the same pointers (row_scales reads them). */
    int quant;
    int exact_scales; /* e2m1: every tile scale exact (QUANT_EXACT_SCALES, checked by the caller) */
    const uint8_t *const *codes[3];
    const float *const *scales[3];
    int64_t tile_rows, tile_cols;
    /* Per thread (thread_stride bf16 apart): MAX_ROWS dequantised rows of row_stride bf16, then (e8m0 scales)
     * MAX_ROWS rows of scale_stride float32 scales widened from their bytes. */
    bf16_t *row_buf;
    int64_t row_stride, scale_stride, thread_stride;
    /* Jobs whose fp4 tiles are read shuffled (shuffled_job): the token vectors in the shuffled order, rows of
     * hidden_size / inter rounded up to 32 (only whole 32-value blocks are read shuffled). */
    xval_t *x_shuffled;   /* [U, H rounded up] */
    xval_t *act_shuffled; /* [P, I rounded up] */
    /* Where the job's wall time went (run_job fills it: seconds after t0, run_job's entry; see MARK_*). */
    double t0;
    double *thread_marks; /* [threads][THREAD_MARKS]: when each thread joined, ended phase 1, ended phase 2 */
    double marks[N_MARKS];
    phase_t phases[N_PHASES]; /* zeroed by run_job */
} job_t;

/* The team the phases run on (needs job_t's tag and now_seconds). */
#include "cpu_team.c"

enum { GATE = 0, UP = 1, DOWN = 2 };

ALWAYS_INLINE int is_quantised(const job_t *job) { return job->quant != QUANT_NONE; }

/* This thread's MAX_ROWS row buffers (NULL for bf16 jobs). */
ALWAYS_INLINE bf16_t *thread_rows(const job_t *job, int tid) {
    return job->row_buf == NULL ? NULL : job->row_buf + (int64_t)tid * job->thread_stride;
}

/* Packed e2m1, with float32 or e8m0 scales. */
ALWAYS_INLINE int is_e2m1(const job_t *job) { return job->quant == QUANT_E2M1 || job->quant == QUANT_E2M1_E8M0; }

/* A job's `quant` argument into its fields: the format, and QUANT_EXACT_SCALES (e2m1 formats only). 0 for a
 * format it does not know or the flag on another. */
static int set_quant(job_t *job, int quant) {
    job->quant = quant & ~QUANT_EXACT_SCALES;
    job->exact_scales = (quant & QUANT_EXACT_SCALES) != 0;
    if (job->quant < QUANT_NONE || job->quant > QUANT_E2M1_E8M0) return 0;
    return !job->exact_scales || is_e2m1(job);
}

/* Whether this job's packed rows read their tiles shuffled (E2M1_SHUFFLED builds, the release's 32-value tiles). */
ALWAYS_INLINE int shuffled_job(const job_t *job) {
#if defined(E2M1_SHUFFLED)
    return is_e2m1(job) && job->tile_cols == 32;
#else
    (void)job;
    return 0;
#endif
}

ALWAYS_INLINE int64_t whole_blocks(int64_t n) { return (n + 31) / 32 * 32; }

/* n e8m0 exponent bytes as the float32 scales 2^(e - 127) they stand for, as the reference widens them
 * (torch.ldexp: e = 0 the subnormal 2^-127, e = 255 infinity, which is e << 23 as well). */
static void e8m0_widen(const uint8_t *e, int64_t n, float *dst) {
    uint32_t *bits = (uint32_t *)dst;
    int64_t i = 0;
    /* A row's 64-128 bytes a byte at a time, branch and all, cost ~12% of an fp4 job (H200, 14 threads: 1.70 against
     * 1.51 ms for float32 scales, results/h200-20261203-a33ca58-e8m0): widened a vector at a time here. */
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(e + i)));
        const __mmask16 zero = _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512());
        _mm512_storeu_si512(bits + i, _mm512_mask_mov_epi32(_mm512_slli_epi32(b, 23), zero, _mm512_set1_epi32(0x00400000)));
    }
#elif defined(VLEN)
    for (; i + 8 <= n; i += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(e + i)));
        const __m256i zero = _mm256_cmpeq_epi32(b, _mm256_setzero_si256());
        _mm256_storeu_si256((__m256i *)(bits + i),
                            _mm256_blendv_epi8(_mm256_slli_epi32(b, 23), _mm256_set1_epi32(0x00400000), zero));
    }
#endif
    for (; i < n; ++i) bits[i] = e[i] ? (uint32_t)e[i] << 23 : 0x00400000u;
}

/* The float32 scales of row `row` (of `cols` values) of matrix m of expert e: in the job's grid, or for e8m0
 * scale bytes widened into `slot` of this thread's scale rows. */
static const float *row_scales(const job_t *job, int m, int64_t e, int64_t row, int64_t cols, bf16_t *bufs, int slot) {
    const int64_t grid_cols = (cols + job->tile_cols - 1) / job->tile_cols, at = (row / job->tile_rows) * grid_cols;
    if (job->quant != QUANT_E2M1_E8M0) return job->scales[m][e] + at;
    float *widened = (float *)(bufs + MAX_ROWS * job->row_stride) + slot * job->scale_stride;
    e8m0_widen((const uint8_t *)job->scales[m][e] + at, grid_cols, widened);
    return widened;
}

/* Whether the dot products read this expert's rows packed (rows_t.packed, dot_rows_e2m1): e2m1 rows in the
 * release's 32-value tiles, for experts of at most MOETIER_FP4_FUSED_TOKENS tokens. */
ALWAYS_INLINE int packed_rows(const job_t *job, int64_t tokens) {
    return is_e2m1(job) && job->tile_cols == 32 && tokens <= MOETIER_FP4_FUSED_TOKENS;
}

/* Row `row` of matrix m of expert e from column `col0` on (0, or a split expert's first down column: a multiple
 * of the scales' tile width) into `slot` of `rows`: a pointer into the weights (bf16), or those values
 * dequantised into `slot` of this thread's buffers (quantised), or for packed rows their codes and scales
 * (dot_rows_e2m1 dequantises what it does not read packed). */
static void weight_row_from(const job_t *job, int m, int64_t e, int64_t row, int64_t col0, bf16_t *bufs, int slot,
                            rows_t *rows) {
    const int64_t H = job->hidden_size, I = job->inter;
    if (!is_quantised(job)) {
        rows->w[slot] = (m == DOWN ? job->down[e] + row * I : job->gate_up[e] + (m == UP ? I + row : row) * H) + col0;
        return;
    }
    const int64_t cols = m == DOWN ? I : H, tile = col0 / job->tile_cols;
    const float *scales = row_scales(job, m, e, row, cols, bufs, slot) + tile;
    bf16_t *dst = bufs + slot * job->row_stride;
    rows->w[slot] = rows->buf[slot] = dst;
    if (job->quant == QUANT_E4M3) {
        e4m3_row(job->codes[m][e] + row * cols + col0, scales, cols - col0, job->tile_cols, dst);
        return;
    }
    rows->q[slot] = job->codes[m][e] + row * (cols / 2) + col0 / 2;
    rows->s[slot] = scales;
    if (!rows->packed) e2m1_row(rows->q[slot], scales, cols - col0, job->tile_cols, dst);
}

/* Row `row` of matrix m of expert e, whole (weight_row_from at column 0). */
static void weight_row(const job_t *job, int m, int64_t e, int64_t row, bf16_t *bufs, int slot, rows_t *rows) {
    weight_row_from(job, m, e, row, 0, bufs, slot, rows);
}

/* silu(gate) * up on the bf16-rounded projections, with DeepSeek-V4's optional clamp; rounded to bf16. */
ALWAYS_INLINE xval_t swiglu(const job_t *job, float gate, float up) {
    gate = round_bf16(gate);
    up = round_bf16(up);
    if (job->has_limit) { /* comparisons, not fminf: a NaN stays NaN, as with torch's clamp */
        const float limit = job->limit;
        gate = gate > limit ? limit : gate;
        up = up > limit ? limit : (up < -limit ? -limit : up);
    }
    return x_from_bf16(f32_to_bf16(gate / (1.0f + expf(-gate)) * up));
}

/* The size of the token block starting at token tb of expert e (at most TOKEN_BLOCK). */
ALWAYS_INLINE int token_block(const job_t *job, int64_t e, int64_t tb) {
    int64_t left = job->offsets[e + 1] - job->offsets[e] - tb;
    return (int)(left < TOKEN_BLOCK ? left : TOKEN_BLOCK);
}

/* Phase 0 (only when xval_t is fp32): hidden values [lo, hi), converted. */
static void convert_values(const job_t *job, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    for (int64_t i = lo; i < hi; ++i) job->x_scratch[i] = x_from_bf16(job->hidden[i]);
}

/* Units j in [j0, j1) of one expert (gate row j and up row j), for all of its tokens. Units j and
 * j + half go together: four row streams per thread instead of two. */
static void gate_up_rows(const job_t *job, int64_t e, int64_t j0, int64_t j1, bf16_t *bufs) {
    const int64_t H = job->hidden_size, I = job->inter, first = job->offsets[e];
    const int64_t count = job->offsets[e + 1] - first, half = (j1 - j0 + 1) / 2;
    for (int64_t i = 0; i < half; ++i) {
        const int64_t j[2] = {j0 + i, j0 + half + i};
        const int units = j[1] < j1 ? 2 : 1;
        rows_t w = {.packed = packed_rows(job, count), .exact = job->exact_scales};
        for (int u = 0; u < units; ++u) {
            weight_row(job, GATE, e, j[u], bufs, 2 * u, &w);
            weight_row(job, UP, e, j[u], bufs, 2 * u + 1, &w);
        }
        for (int64_t tb = 0; tb < count; tb += TOKEN_BLOCK) {
            const int nt = token_block(job, e, tb);
            const xval_t *x[TOKEN_BLOCK];
            for (int t = 0; t < nt; ++t) x[t] = job->x + job->rows[first + tb + t] * H;
            if (job->x_shuffled != NULL)
                for (int t = 0; t < nt; ++t) w.xs[t] = job->x_shuffled + job->rows[first + tb + t] * whole_blocks(H);
            float res[MAX_ROWS][TOKEN_BLOCK];
            dot_block(&w, 2 * units, x, nt, H, res);
            for (int t = 0; t < nt; ++t)
                for (int u = 0; u < units; ++u) {
                    const int64_t p = first + tb + t;
                    const xval_t a = swiglu(job, res[2 * u][t], res[2 * u + 1][t]);
                    job->act[p * I + j[u]] = a;
#if defined(E2M1_SHUFFLED)
                    if (job->act_shuffled != NULL) job->act_shuffled[p * whole_blocks(I) + e2m1_shuffled_at(j[u])] = a;
#endif
                }
        }
    }
}

/* Phase 1: units [lo, hi) of the (expert, j) units of all experts, flattened (a range may span experts). */
static void gate_up_units(const job_t *job, int64_t lo, int64_t hi, int tid) {
    const int64_t I = job->inter;
    while (lo < hi) {
        int64_t e = lo / I, j0 = lo % I;
        int64_t j1 = (hi - lo < I - j0) ? j0 + (hi - lo) : I;
        const int64_t from = job->from != NULL ? job->from[e] : 0; /* a split expert's rows below are the device's */
        if (j1 > from) gate_up_rows(job, e, j0 > from ? j0 : from, j1, thread_rows(job, tid));
        lo += j1 - j0;
    }
}

/* Output columns [h0, h1) of one expert: out[row][h] += gate * bf16(down_h . act). The range is cut in
 * MAX_ROWS parts walked side by side (separate row streams). */
static void down_rows(const job_t *job, int64_t e, int64_t h0, int64_t h1, bf16_t *bufs) {
    const int64_t H = job->hidden_size, I = job->inter, first = job->offsets[e];
    const int64_t count = job->offsets[e + 1] - first, part = (h1 - h0 + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t from = job->from != NULL ? job->from[e] : 0; /* a split expert: its columns from here on */
    for (int64_t i = 0; i < part; ++i) {
        int64_t h[MAX_ROWS];
        rows_t w = {.packed = packed_rows(job, count), .exact = job->exact_scales};
        int r = 0;
        for (; r < MAX_ROWS && h0 + r * part + i < h1; ++r) {
            h[r] = h0 + r * part + i;
            weight_row_from(job, DOWN, e, h[r], from, bufs, r, &w);
        }
        for (int64_t tb = 0; tb < count; tb += TOKEN_BLOCK) {
            const int nt = token_block(job, e, tb);
            const xval_t *x[TOKEN_BLOCK];
            for (int t = 0; t < nt; ++t) x[t] = job->act + (first + tb + t) * I + from;
            if (job->act_shuffled != NULL)
                for (int t = 0; t < nt; ++t) w.xs[t] = job->act_shuffled + (first + tb + t) * whole_blocks(I) + from;
            float res[MAX_ROWS][TOKEN_BLOCK];
            dot_block(&w, r, x, nt, I - from, res);
            for (int t = 0; t < nt; ++t) {
                const int64_t p = first + tb + t;
                float *dst = job->out + job->rows[p] * H;
                for (int q = 0; q < r; ++q) dst[h[q]] += job->gates[p] * round_bf16(res[q][t]);
            }
        }
    }
}

/* Phase 2: output grains [g0, g1) (OUT_GRAIN columns each, so threads never share a line of `out`): zeroed,
 * then every expert's part accumulated in job order (as index_add would). One thread owns each column: no
 * atomics, and the same sums whichever thread it is. */
static void down_grains(const job_t *job, int64_t g0, int64_t g1, int tid) {
    const int64_t H = job->hidden_size, h0 = g0 * OUT_GRAIN, h1 = g1 * OUT_GRAIN < H ? g1 * OUT_GRAIN : H;
    for (int64_t u = 0; u < job->out_rows; ++u) memset(job->out + u * H + h0, 0, (size_t)(h1 - h0) * sizeof(float));
    for (int64_t e = 0; e < job->n_experts; ++e) down_rows(job, e, h0, h1, thread_rows(job, tid));
}

typedef void (*chunk_fn_t)(const job_t *job, int64_t lo, int64_t hi, int tid);

/* Take chunks of phase p's `total` items until none is left, then wait until every chunk is done (other threads
 * may still hold some): the acquire that sees the count complete makes their results visible to this thread. */
static void run_phase(job_t *job, int p, int64_t total, int64_t chunk, chunk_fn_t fn, int tid) {
    phase_t *phase = &job->phases[p];
    for (;;) {
        const int64_t lo = __atomic_fetch_add(&phase->next, chunk, __ATOMIC_RELAXED);
        if (lo >= total) break;
        const int64_t hi = lo + chunk < total ? lo + chunk : total;
        fn(job, lo, hi, tid);
        __atomic_add_fetch(&phase->done, hi - lo, __ATOMIC_RELEASE);
    }
    while (__atomic_load_n(&phase->done, __ATOMIC_ACQUIRE) < total) CPU_RELAX();
}

static int valid(const job_t *job) {
    if (job->n_experts < 0 || job->hidden_size < 1 || job->inter < 1 || job->out_rows < 0) return 0;
    if (job->quant < QUANT_NONE || job->quant > QUANT_E2M1_E8M0) return 0;
    if (is_quantised(job) && (job->tile_rows < 1 || job->tile_cols < 1)) return 0;
    if (is_e2m1(job) && (job->tile_cols % 2 || job->hidden_size % 2 || job->inter % 2))
        return 0; /* whole bytes: every row and every tile starts on one */
    if (job->offsets[0] != 0) return 0;
    for (int64_t e = 0; e < job->n_experts; ++e)
        if (job->offsets[e + 1] < job->offsets[e]) return 0;
    for (int64_t p = 0; p < job->offsets[job->n_experts]; ++p)
        if (job->rows[p] < 0 || job->rows[p] >= job->out_rows) return 0;
    return 1;
}

static void release(job_t *job) {
    free(job->thread_marks);
    job->thread_marks = NULL;
    free(job->act);
    free(job->x_scratch);
    free(job->row_buf);
    free(job->x_shuffled);
    free(job->act_shuffled);
}

/* The shuffled token vectors (shuffled_job): the hidden rows' made here (a few rows of H values: the caller alone),
 * the activations' written beside them in phase 1; 0 when out of memory. */
static int allocate_shuffled(job_t *job) {
    const int64_t H = whole_blocks(job->hidden_size), I = whole_blocks(job->inter);
    const int64_t pairs = job->offsets[job->n_experts], rows = job->out_rows;
    job->x_shuffled = aligned_alloc(64, (size_t)(rows > 0 ? rows : 1) * (size_t)H * sizeof(xval_t));
    job->act_shuffled = aligned_alloc(64, (size_t)(pairs > 0 ? pairs : 1) * (size_t)I * sizeof(xval_t));
    if (job->x_shuffled == NULL || job->act_shuffled == NULL) return 0;
#if defined(E2M1_SHUFFLED)
    for (int64_t u = 0; u < rows; ++u) e2m1_shuffle_x(job->x + u * job->hidden_size, job->hidden_size, job->x_shuffled + u * H);
#endif
    return 1;
}

/* The activations, (for an fp32 xval_t) the converted hidden rows and (quantised) the row buffers of `threads`
 * threads; 0 when out of memory. */
static int allocate(job_t *job, int threads) {
    int64_t pairs = job->offsets[job->n_experts];
    job->act = malloc((size_t)(pairs > 0 ? pairs : 1) * (size_t)job->inter * sizeof(xval_t));
    job->x_scratch = NULL;
    job->row_buf = NULL;
    job->x_shuffled = job->act_shuffled = NULL;
    job->x = (const xval_t *)job->hidden;
    job->thread_marks = malloc((size_t)threads * THREAD_MARKS * sizeof(double));
    if (job->thread_marks != NULL) /* -1: never joined (a helper may not come) */
        for (int64_t i = 0; i < (int64_t)threads * THREAD_MARKS; ++i) job->thread_marks[i] = -1.0;
    if (!X_IS_BF16) {
        job->x_scratch = malloc((size_t)(job->out_rows > 0 ? job->out_rows : 1) * (size_t)job->hidden_size *
                                sizeof(xval_t));
        job->x = job->x_scratch;
    }
    if (is_quantised(job)) {
        /* Rows padded to whole cache lines (32 bf16), so each buffer starts on a line of its own. */
        const int64_t widest = job->hidden_size > job->inter ? job->hidden_size : job->inter;
        job->row_stride = (widest + 31) / 32 * 32;
        const int64_t scales = (widest + job->tile_cols - 1) / job->tile_cols;
        job->scale_stride = job->quant == QUANT_E2M1_E8M0 ? (scales + 15) / 16 * 16 : 0; /* whole lines */
        job->thread_stride = MAX_ROWS * (job->row_stride + 2 * job->scale_stride);   /* in bf16 */
        job->row_buf = aligned_alloc(64, (size_t)threads * (size_t)job->thread_stride * sizeof(bf16_t));
    }
    if (shuffled_job(job) && !allocate_shuffled(job)) return 0;
    return job->act != NULL && job->thread_marks != NULL && (X_IS_BF16 || job->x_scratch != NULL) &&
           (!is_quantised(job) || job->row_buf != NULL);
}

/* This thread's mark `which` (THREAD_*), seconds after the job's entry. */
ALWAYS_INLINE void mark_thread(const job_t *job, int tid, int which) {
    job->thread_marks[tid * THREAD_MARKS + which] = now_seconds() - job->t0;
}

/* The first and the last joined thread's mark `which` into marks[first] and marks[first + 1]; the count of
 * threads that joined into MARK_JOINED (the caller always does). */
static void reduce_marks(job_t *job, int threads, int which, int first) {
    double lo = job->thread_marks[which], hi = lo; /* the caller's: never -1 */
    int joined = 1;
    for (int t = 1; t < threads; ++t) {
        const double v = job->thread_marks[t * THREAD_MARKS + which];
        if (v < 0.0) continue;
        ++joined;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    job->marks[first] = lo;
    job->marks[first + 1] = hi;
    if (which == THREAD_ENTERED) job->marks[MARK_JOINED] = joined;
}

/* One thread's part of every phase: chunks while there are any, each phase waited out before the next (the
 * caller, tid 0, returns only once the job is done; see cpu_team.c). */
static void work(job_t *job, int tid) {
    mark_thread(job, tid, THREAD_ENTERED);
    if (!X_IS_BF16) run_phase(job, PHASE_CONVERT, job->out_rows * job->hidden_size, CONVERT_CHUNK, convert_values, tid);
    run_phase(job, PHASE_GATE_UP, job->n_experts * job->inter, GATE_UP_CHUNK, gate_up_units, tid);
    mark_thread(job, tid, THREAD_GATE_UP);
    const int64_t grains = (job->hidden_size + OUT_GRAIN - 1) / OUT_GRAIN;
    run_phase(job, PHASE_DOWN, grains, DOWN_CHUNK / OUT_GRAIN, down_grains, tid);
    mark_thread(job, tid, THREAD_DOWN);
}

/* Validate, allocate, compute and free one job of either kind. */
static int run_job(job_t *job, int threads) {
    /* torch's clamp of a bf16 tensor by a float bound gives the bound rounded to bf16, so clamp by that. */
    job->limit = round_bf16(job->limit);
    job->t0 = now_seconds();
    job->thread_marks = NULL;
    memset(job->phases, 0, sizeof job->phases);
    if (threads < 1 || !valid(job)) return MOETIER_BAD_ARGS;
    if (!allocate(job, threads)) {
        release(job);
        return MOETIER_NO_MEMORY;
    }
    job->marks[MARK_ALLOCATED] = now_seconds() - job->t0;
    /* Without a team (its threads could not be started) the caller does every chunk itself: slower, same sums. */
    if (threads == 1 || !team_run(job, work, threads)) work(job, 0);
    job->marks[MARK_END] = now_seconds() - job->t0;
    reduce_marks(job, threads, THREAD_ENTERED, MARK_ENTERED_FIRST);
    reduce_marks(job, threads, THREAD_GATE_UP, MARK_GATE_UP_FIRST);
    reduce_marks(job, threads, THREAD_DOWN, MARK_DOWN_FIRST);
    release(job);
    return MOETIER_OK;
}

/* Compute a whole job of bf16 experts; returns 0, MOETIER_BAD_ARGS (bad offsets or a row outside
 * [0, out_rows)) or MOETIER_NO_MEMORY. `out` [out_rows, H] is overwritten (rows no pair touches are zeroed). */
int moetier_cpu_experts(int64_t n_experts, const bf16_t *const *gate_up, const bf16_t *const *down,
                        const int64_t *offsets, const int64_t *rows, const float *gates, const bf16_t *hidden,
                        int64_t out_rows, int64_t hidden_size, int64_t inter, int has_limit, float limit, float *out,
                        int threads) {
    job_t job = {.n_experts = n_experts, .gate_up = gate_up, .down = down, .offsets = offsets, .rows = rows,
                 .gates = gates, .hidden = hidden, .out_rows = out_rows, .hidden_size = hidden_size,
                 .inter = inter, .has_limit = has_limit, .limit = limit, .out = out};
    return run_job(&job, threads);
}

/* moetier_cpu_experts for quantised experts, `quant` QUANT_E4M3 (float8 e4m3fn, one code a byte) or
 * QUANT_E2M1 (packed fp4, two codes a byte: value 2j the low nibble of byte j) or QUANT_E2M1_E8M0 (the same
 * with uint8 e8m0 scale grids, passed through the scale pointer arrays). gate [E] -> [I, H] values,
 * up [E] -> [I, H], down [E] -> [H, I] (rows of H or I bytes, or H / 2 or I / 2 packed), each with its
 * float32 scale grid ([ceil(rows / tile_rows), ceil(cols / tile_cols)] in values, row-major). e2m1 needs
 * even H, I and tile_cols. The result is bit for bit moetier_cpu_experts on the weights dequantised to bf16
 * (fp32 code * scale, rounded to nearest even). */
int moetier_cpu_experts_quantised(int quant, int64_t n_experts, const uint8_t *const *gate, const uint8_t *const *up,
                                  const uint8_t *const *down, const float *const *gate_scale,
                                  const float *const *up_scale, const float *const *down_scale, int64_t tile_rows,
                                  int64_t tile_cols, const int64_t *offsets, const int64_t *rows, const float *gates,
                                  const bf16_t *hidden, int64_t out_rows, int64_t hidden_size, int64_t inter,
                                  int has_limit, float limit, float *out, int threads) {
    job_t job = {.n_experts = n_experts, .offsets = offsets, .rows = rows, .gates = gates, .hidden = hidden,
                 .out_rows = out_rows, .hidden_size = hidden_size, .inter = inter, .has_limit = has_limit,
                 .limit = limit, .out = out, .codes = {gate, up, down},
                 .scales = {gate_scale, up_scale, down_scale}, .tile_rows = tile_rows, .tile_cols = tile_cols};
    if (!set_quant(&job, quant) || quant == QUANT_NONE || gate == NULL || up == NULL || down == NULL)
        return MOETIER_BAD_ARGS;
    return run_job(&job, threads);
}
