/* The CPU tier's native worker (included by cpu_experts.c: one translation unit).
 *
 * One POSIX thread per worker runs submitted jobs in submission order, so a decode job needs no Python
 * thread at all: the dispatching thread packs the job and returns, and nothing competes with it for the
 * GIL while it launches the device's work (a Python worker holds the GIL for its per-job prelude and
 * wrap-up, which the launching thread then waits for). A job may name a 32-bit word of pinned host
 * memory and a value: the worker stores the value there once the job's sums are in `out` (also when the
 * job failed), which is what a CUDA stream waiting on that word (cuStreamWaitValue32) is released by.
 *
 * A submitted job owns copies of its small arrays (pointer tables, offsets, rows, gates); `hidden`, `out`
 * and the expert weights are the caller's and must stay alive until the job is done.
 *
 * A fed job (moetier_worker_submit_fed) is queued before its inputs exist: the GPU writes them (a decode layer's
 * pair ids, gates and hidden rows) into pinned memory and then stores a start value into a pinned word with a
 * stream write (cuStreamWriteValue32, ordered after the copies). The worker spins on that word, reads the pairs
 * whose id is >= 0 (the device marked the others -1: it computes those itself), groups them by expert over the
 * layer's static table of home-copy pointers, and runs them as any job. So no host thread reads the router's
 * ids: the device decides which pairs the CPU takes, and the step needs no host wait. The worker stores 0 back
 * into the start word once it has seen the value, so a device that writes one constant (a CUDA graph replays
 * the values it captured) starts the next job of that word again. moetier_worker_cancel_fed abandons every fed
 * job queued so far whose start has not come (a step that failed before its device work was enqueued): they
 * end with MOETIER_ABANDONED and store no flag.
 *
 * After a job the worker may spin for a while before it sleeps (`spin_seconds` of moetier_worker_start):
 * decode submits a job every MoE layer (every ~1-2 ms), and waking a sleeping thread costs the submitting
 * thread a futex call and, on a virtual machine, an interrupt to another CPU. A spinning worker is only told
 * by the queue itself. Spinning takes a core, so it suits a GPU host (whose cores are not computing), not a
 * CPU-only run. */

#include <pthread.h>
#include <time.h>


/* A fed job's inputs, written by the device (see the header). */
typedef struct {
    int32_t *start; /* the word the device's stream write stores start_value into (the worker stores 0 back) */
    int32_t start_value;
    /* [pairs]: the layer's expert of each (token, k) pair in the low 32 bits, -1 where the device runs it; the high
     * 32 bits the first intermediate row this job computes (0: all of them; else the device computes the rows
     * below: a split expert, every pair of which carries the same row). */
    const int64_t *ids;
    const float *weights;  /* [pairs] */
    int64_t pairs, top_k;
    const uint64_t *table; /* the layer's pointers, part by part (parts x n_layer), alive as long as the worker */
    int64_t n_layer, parts;
} feed_t;

typedef struct queued {
    struct queued *next;
    job_t job;
    feed_t *feed;           /* NULL: an ordinary job, its arrays given */
    uint64_t *fed_table;    /* a fed job's: its experts' pointers, part by part (parts x pairs) */
    int64_t *fed_order;     /* a fed job's: its pairs sorted by expert */
    int threads;
    int32_t *flag; /* NULL: no flag */
    int32_t flag_value;
    int status;     /* run_job's, once done */
    double seconds; /* the job's wall time on the worker */
    double started; /* when the worker began it (now_seconds) */
    int done;       /* set under the worker's lock; read atomically by moetier_worker_done */
    int64_t epoch;  /* a fed job's: the worker's cancel epoch when it was queued */
    void *owned;    /* the copied arrays, one allocation */
} queued_t;

typedef struct {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;     /* the worker: a job queued, or stop */
    pthread_cond_t finished; /* waiters: a job done */
    queued_t *head, *tail;
    int stop;
    int sleeping; /* the worker waits on `wake` (set and cleared under the lock): submit must signal it */
    double spin_seconds;
    int64_t epoch; /* moetier_worker_cancel_fed's count: fed jobs queued before a cancel are abandoned */
} worker_t;

/* Spin (without the lock) until a job is queued, stop is asked, or spin_seconds pass. */
static void spin_for_work(worker_t *w) {
    if (w->spin_seconds <= 0.0) return;
    const double until = now_seconds() + w->spin_seconds;
    for (int i = 0;; ++i) {
        if (__atomic_load_n(&w->head, __ATOMIC_ACQUIRE) != NULL || __atomic_load_n(&w->stop, __ATOMIC_ACQUIRE))
            return;
        if ((i & 255) == 255 && now_seconds() > until) return;
        CPU_RELAX();
    }
}

/* Spin until the device's stream write stored the job's start value, then store 0 back (the word's next job
 * waits for the next write). 0: stop was asked first (the device never will, e.g. its step failed before the
 * write; the job is abandoned and still stores its flag); -1: the job was cancelled (no flag). */
static int wait_for_start(worker_t *w, const queued_t *q) {
    const feed_t *f = q->feed;
    for (int i = 0;; ++i) {
        if ((i & 1023) == 0) {
            if (__atomic_load_n(&w->epoch, __ATOMIC_ACQUIRE) != q->epoch) return -1;
            if (i > 0 && __atomic_load_n(&w->stop, __ATOMIC_ACQUIRE)) return 0;
        }
        const uint32_t now = (uint32_t)__atomic_load_n(f->start, __ATOMIC_ACQUIRE);
        if ((int32_t)(now - (uint32_t)f->start_value) >= 0) { /* cyclic, as the stream's GEQ wait */
            __atomic_store_n(f->start, 0, __ATOMIC_RELEASE);
            return 1;
        }
        CPU_RELAX();
    }
}

/* A fed pair's expert (-1: the device's pair) and the first intermediate row the job computes of it. */
ALWAYS_INLINE int64_t fed_expert(int64_t id) { return id < 0 ? -1 : (id & 0xffffffffll); }
ALWAYS_INLINE int64_t fed_from(int64_t id) { return id < 0 ? 0 : (id >> 32); }

/* The fed job's pairs (ids >= 0) grouped by expert, in increasing expert order and, within one, increasing
 * pair order, into the job's arrays (allocated for every pair at submit), then run. A pair's row of `hidden`
 * and `out` is its token (pair / top_k). */
static int run_fed(queued_t *q) {
    const feed_t *f = q->feed;
    job_t *job = &q->job;
    int64_t *order = q->fed_order, n = 0;
    for (int64_t p = 0; p < f->pairs; ++p) {
        const int64_t e = fed_expert(f->ids[p]), from = fed_from(f->ids[p]);
        /* an id or a row the device should never write: no sums at all, not stale ones */
        if (e >= f->n_layer || from < 0 || from >= job->inter || from % 32 != 0 ||
            (job->tile_cols > 0 && from % job->tile_cols != 0)) {
            memset(job->out, 0, (size_t)(job->out_rows * job->hidden_size) * sizeof(float));
            return MOETIER_BAD_ARGS;
        }
        if (e < 0) continue;
        int64_t i = n++; /* insertion sort by (expert, pair): a decode layer has a few dozen pairs */
        while (i > 0 && fed_expert(f->ids[order[i - 1]]) > e) {
            order[i] = order[i - 1];
            --i;
        }
        order[i] = p;
    }
    uint64_t *table = q->fed_table;
    int64_t *offsets = (int64_t *)job->offsets, *rows = (int64_t *)job->rows, *from = (int64_t *)job->from;
    float *gates = (float *)job->gates;
    int64_t experts = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t e = fed_expert(f->ids[order[i]]);
        if (i == 0 || e != fed_expert(f->ids[order[i - 1]])) {
            for (int64_t part = 0; part < f->parts; ++part)
                table[part * f->pairs + experts] = f->table[part * f->n_layer + e];
            from[experts] = fed_from(f->ids[order[i]]);
            offsets[experts++] = i;
        }
        rows[i] = order[i] / f->top_k;
        gates[i] = f->weights[order[i]];
    }
    offsets[experts] = n;
    job->n_experts = experts;
    if (experts == 0) { /* nothing on the CPU this layer: the sums are zeros */
        memset(job->out, 0, (size_t)(job->out_rows * job->hidden_size) * sizeof(float));
        return MOETIER_OK;
    }
    return run_job(job, q->threads);
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    pin_self(0); /* thread 0 of the team its jobs run on */
    for (;;) {
        spin_for_work(w);
        pthread_mutex_lock(&w->lock);
        while (w->head == NULL && !w->stop) {
            w->sleeping = 1;
            pthread_cond_wait(&w->wake, &w->lock);
            w->sleeping = 0;
        }
        queued_t *q = w->head;
        if (q == NULL) break; /* stopping, and every queued job has run */
        __atomic_store_n(&w->head, q->next, __ATOMIC_RELEASE);
        if (w->head == NULL) w->tail = NULL;
        pthread_mutex_unlock(&w->lock);
        const int started = q->feed != NULL ? wait_for_start(w, q) : 1;
        if (started <= 0) {
            q->status = MOETIER_ABANDONED;
            if (started < 0) q->flag = NULL; /* cancelled: nothing waits for it */
        } else {
            q->started = now_seconds();
            q->status = q->feed != NULL ? run_fed(q) : run_job(&q->job, q->threads);
            q->seconds = now_seconds() - q->started;
        }
        /* The sums are in `out`: release a stream waiting for them (x86-TSO and this barrier keep the order). */
        if (q->flag != NULL) __atomic_store_n(q->flag, q->flag_value, __ATOMIC_RELEASE);
        pthread_mutex_lock(&w->lock);
        __atomic_store_n(&q->done, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&w->finished);
        pthread_mutex_unlock(&w->lock);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* A started worker that spins `spin_seconds` for the next job before it sleeps, or NULL when the thread could
 * not be created. */
void *moetier_worker_start(double spin_seconds) {
    worker_t *w = calloc(1, sizeof(worker_t));
    if (w == NULL) return NULL;
    w->spin_seconds = spin_seconds;
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->wake, NULL);
    pthread_cond_init(&w->finished, NULL);
    if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
        pthread_cond_destroy(&w->finished);
        pthread_cond_destroy(&w->wake);
        pthread_mutex_destroy(&w->lock);
        free(w);
        return NULL;
    }
    return w;
}

/* Run what is queued, end the thread, free the worker (handles of its jobs stay valid until freed). */
void moetier_worker_stop(void *handle) {
    worker_t *w = handle;
    if (w == NULL) return;
    pthread_mutex_lock(&w->lock);
    __atomic_store_n(&w->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->finished);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->lock);
    free(w);
}

/* Abandon every fed job queued so far whose start has not come (see the header); ordinary jobs still run. */
void moetier_worker_cancel_fed(void *handle) {
    worker_t *w = handle;
    if (w != NULL) __atomic_add_fetch(&w->epoch, 1, __ATOMIC_ACQ_REL);
}

/* Point a job's expert arrays at a table of `stride` pointers per part (bf16: gate_up, down; quantised: gate,
 * up, down, then their scales). */
static void point_experts(job_t *job, const uint64_t *table, int64_t stride) {
    const void *const *ptrs = (const void *const *)table;
    if (job->quant == QUANT_NONE) {
        job->gate_up = (const bf16_t *const *)ptrs;
        job->down = (const bf16_t *const *)(ptrs + stride);
    } else {
        for (int m = 0; m < 3; ++m) {
            job->codes[m] = (const uint8_t *const *)(ptrs + m * stride);
            job->scales[m] = (const float *const *)(ptrs + (3 + m) * stride);
        }
    }
}

static void enqueue(worker_t *w, queued_t *q) {
    pthread_mutex_lock(&w->lock);
    if (w->tail == NULL)
        __atomic_store_n(&w->head, q, __ATOMIC_RELEASE);
    else
        w->tail->next = q;
    w->tail = q;
    if (w->sleeping) pthread_cond_signal(&w->wake); /* a spinning worker sees the queue itself */
    pthread_mutex_unlock(&w->lock);
}

/* Queue one job, as moetier_cpu_experts (quant QUANT_NONE; `table` holds the gate_up then the down pointers,
 * n_experts each) or moetier_cpu_experts_quantised (`table`: gate, up, down, their scales, n_experts each)
 * would run it, then the flag store. Returns the job's handle, or NULL with *status MOETIER_BAD_ARGS (bad
 * offsets, threads < 1, an unknown quant) or MOETIER_NO_MEMORY; rows are checked when the job runs. */
void *moetier_worker_submit(void *handle, int quant, int64_t n_experts, const uint64_t *table, int64_t tile_rows,
                            int64_t tile_cols, const int64_t *offsets, const int64_t *rows, const float *gates,
                            const bf16_t *hidden, int64_t out_rows, int64_t hidden_size, int64_t inter,
                            int has_limit, float limit, float *out, int threads, int32_t *flag, int32_t flag_value,
                            int *status) {
    worker_t *w = handle;
    *status = MOETIER_BAD_ARGS;
    job_t job = {.n_experts = n_experts, .hidden = hidden, .out_rows = out_rows, .hidden_size = hidden_size,
                 .inter = inter, .has_limit = has_limit, .limit = limit, .out = out, .tile_rows = tile_rows,
                 .tile_cols = tile_cols};
    if (w == NULL || n_experts < 0 || threads < 1 || !set_quant(&job, quant) || offsets[0] != 0) return NULL;
    for (int64_t e = 0; e < n_experts; ++e)
        if (offsets[e + 1] < offsets[e]) return NULL;
    const int64_t pairs = offsets[n_experts], parts = job.quant == QUANT_NONE ? 2 : 6;
    const size_t table_bytes = (size_t)(parts * n_experts) * sizeof(uint64_t);
    const size_t offsets_bytes = (size_t)(n_experts + 1) * sizeof(int64_t);
    const size_t rows_bytes = (size_t)pairs * sizeof(int64_t), gates_bytes = (size_t)pairs * sizeof(float);
    queued_t *q = calloc(1, sizeof(queued_t));
    char *owned = malloc(table_bytes + offsets_bytes + rows_bytes + gates_bytes + 1);
    if (q == NULL || owned == NULL) {
        free(q);
        free(owned);
        *status = MOETIER_NO_MEMORY;
        return NULL;
    }
    /* 8-byte parts first, the 4-byte gates last: every part stays aligned. */
    uint64_t *t = (uint64_t *)owned;
    int64_t *o = (int64_t *)(owned + table_bytes), *r = (int64_t *)(owned + table_bytes + offsets_bytes);
    float *g = (float *)(owned + table_bytes + offsets_bytes + rows_bytes);
    memcpy(t, table, table_bytes);
    memcpy(o, offsets, offsets_bytes);
    memcpy(r, rows, rows_bytes);
    memcpy(g, gates, gates_bytes);
    q->owned = owned;
    q->threads = threads;
    q->flag = flag;
    q->flag_value = flag_value;
    job.offsets = o, job.rows = r, job.gates = g;
    point_experts(&job, t, n_experts);
    q->job = job;
    enqueue(w, q);
    *status = MOETIER_OK;
    return q;
}

/* Queue a fed job (see the header): once *start >= start_value (as a wrapping int32 difference; the worker then
 * stores 0 into *start), the pairs of
 * ids / weights ([tokens * top_k], pinned, written by the device) whose id is >= 0 are computed from `table`
 * (the layer's n_layer experts, laid out as moetier_worker_submit's table; the caller keeps it alive while the
 * worker runs) over hidden [tokens, H] into out [tokens, H] (overwritten: rows without a pair are zeros), then
 * `value` is stored into `flag`. Returns the handle, or NULL with *status MOETIER_BAD_ARGS / MOETIER_NO_MEMORY.
 * A job abandoned at stop (its start never came) has status MOETIER_ABANDONED and still stores its flag. */
void *moetier_worker_submit_fed(void *handle, int quant, int64_t n_layer, const uint64_t *table, int64_t tile_rows,
                                int64_t tile_cols, int32_t *start, int32_t start_value, const int64_t *ids,
                                const float *weights, int64_t tokens, int64_t top_k, const bf16_t *hidden,
                                int64_t hidden_size, int64_t inter, int has_limit, float limit, float *out,
                                int threads, int32_t *flag, int32_t flag_value, int *status) {
    worker_t *w = handle;
    *status = MOETIER_BAD_ARGS;
    job_t job = {.hidden = hidden, .out_rows = tokens, .hidden_size = hidden_size, .inter = inter,
                 .has_limit = has_limit, .limit = limit, .out = out, .tile_rows = tile_rows, .tile_cols = tile_cols};
    if (w == NULL || n_layer < 1 || tokens < 1 || top_k < 1 || threads < 1 || !set_quant(&job, quant) ||
        start == NULL || ids == NULL || weights == NULL || table == NULL)
        return NULL;
    const int64_t pairs = tokens * top_k, parts = job.quant == QUANT_NONE ? 2 : 6;
    /* 8-byte arrays first, the 4-byte gates last: every part stays aligned. */
    const size_t table_bytes = (size_t)(parts * pairs) * sizeof(uint64_t);
    const size_t offsets_bytes = (size_t)(pairs + 1) * sizeof(int64_t), rows_bytes = (size_t)pairs * sizeof(int64_t);
    queued_t *q = calloc(1, sizeof(queued_t));
    feed_t *f = calloc(1, sizeof(feed_t));
    char *owned = malloc(table_bytes + offsets_bytes + 3 * rows_bytes + (size_t)pairs * sizeof(float));
    if (q == NULL || f == NULL || owned == NULL) {
        free(q);
        free(f);
        free(owned);
        *status = MOETIER_NO_MEMORY;
        return NULL;
    }
    *f = (feed_t){.start = start, .start_value = start_value, .ids = ids, .weights = weights, .pairs = pairs,
                  .top_k = top_k, .table = table, .n_layer = n_layer, .parts = parts};
    uint64_t *t = (uint64_t *)owned;
    int64_t *o = (int64_t *)(owned + table_bytes), *r = (int64_t *)(owned + table_bytes + offsets_bytes);
    job.offsets = o, job.rows = r, job.from = r + 2 * pairs;
    job.gates = (float *)(owned + table_bytes + offsets_bytes + 3 * rows_bytes);
    point_experts(&job, t, pairs);
    q->job = job;
    q->feed = f;
    q->fed_table = t;
    q->fed_order = r + pairs;
    q->owned = owned;
    q->threads = threads;
    q->flag = flag;
    q->flag_value = flag_value;
    q->epoch = __atomic_load_n(&w->epoch, __ATOMIC_ACQUIRE);
    enqueue(w, q);
    *status = MOETIER_OK;
    return q;
}

/* Whether the job has run (never blocks). */
int moetier_worker_done(void *job) { return __atomic_load_n(&((queued_t *)job)->done, __ATOMIC_ACQUIRE); }

/* Block until the job has run; its status (run_job's) and wall seconds. */
int moetier_worker_wait(void *handle, void *job, double *seconds) {
    worker_t *w = handle;
    queued_t *q = job;
    if (!moetier_worker_done(q)) {
        pthread_mutex_lock(&w->lock);
        while (!q->done) pthread_cond_wait(&w->finished, &w->lock);
        pthread_mutex_unlock(&w->lock);
    }
    *seconds = q->seconds;
    return q->status;
}

/* The distinct experts a job that has run computed (a fed job's: those of its pairs the device left it). */
int64_t moetier_worker_experts(void *job) { return ((queued_t *)job)->job.n_experts; }

/* A job that has run: its N_MARKS marks into out (seconds after run_job's entry, see the enum in
 * cpu_experts.c; a job that failed before its region has only zeros), and the seconds its worker spent before
 * run_job (a fed job grouping its pairs). Returns N_MARKS, the count the caller must have room for. */
int moetier_worker_marks(void *job, double *out, double *before) {
    const queued_t *q = job;
    memcpy(out, q->job.marks, sizeof q->job.marks);
    *before = q->job.t0 > 0.0 ? q->job.t0 - q->started : 0.0;
    return N_MARKS;
}

/* Free a job that has run (moetier_worker_wait returned for it). */
void moetier_worker_free(void *job) {
    queued_t *q = job;
    if (q == NULL) return;
    free(q->owned);
    free(q->feed);
    free(q);
}
