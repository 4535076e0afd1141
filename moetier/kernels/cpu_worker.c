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
 * After a job the worker may spin for a while before it sleeps (`spin_seconds` of moetier_worker_start):
 * decode submits a job every MoE layer (every ~1-2 ms), and waking a sleeping thread costs the submitting
 * thread a futex call and, on a virtual machine, an interrupt to another CPU. A spinning worker is only told
 * by the queue itself. Spinning takes a core, so it suits a GPU host (whose cores are not computing), not a
 * CPU-only run. */

#include <pthread.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif


typedef struct queued {
    struct queued *next;
    job_t job;
    int threads;
    int32_t *flag; /* NULL: no flag */
    int32_t flag_value;
    int status;     /* run_job's, once done */
    double seconds; /* the job's wall time on the worker */
    int done;       /* set under the worker's lock; read atomically by moetier_worker_done */
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
} worker_t;

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

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

static void *worker_main(void *arg) {
    worker_t *w = arg;
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
        const double start = now_seconds();
        q->status = run_job(&q->job, q->threads);
        q->seconds = now_seconds() - start;
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
    if (w == NULL || n_experts < 0 || threads < 1 || quant < QUANT_NONE || quant > QUANT_E2M1 || offsets[0] != 0)
        return NULL;
    for (int64_t e = 0; e < n_experts; ++e)
        if (offsets[e + 1] < offsets[e]) return NULL;
    const int64_t pairs = offsets[n_experts], parts = quant == QUANT_NONE ? 2 : 6;
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
    job_t job = {.n_experts = n_experts, .offsets = o, .rows = r, .gates = g, .hidden = hidden,
                 .out_rows = out_rows, .hidden_size = hidden_size, .inter = inter, .has_limit = has_limit,
                 .limit = limit, .out = out, .quant = quant, .tile_rows = tile_rows, .tile_cols = tile_cols};
    const void *const *ptrs = (const void *const *)t;
    if (quant == QUANT_NONE) {
        job.gate_up = (const bf16_t *const *)ptrs;
        job.down = (const bf16_t *const *)(ptrs + n_experts);
    } else {
        for (int m = 0; m < 3; ++m) {
            job.codes[m] = (const uint8_t *const *)(ptrs + m * n_experts);
            job.scales[m] = (const float *const *)(ptrs + (3 + m) * n_experts);
        }
    }
    q->job = job;
    pthread_mutex_lock(&w->lock);
    if (w->tail == NULL)
        __atomic_store_n(&w->head, q, __ATOMIC_RELEASE);
    else
        w->tail->next = q;
    w->tail = q;
    if (w->sleeping) pthread_cond_signal(&w->wake); /* a spinning worker sees the queue itself */
    pthread_mutex_unlock(&w->lock);
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

/* Free a job that has run (moetier_worker_wait returned for it). */
void moetier_worker_free(void *job) {
    queued_t *q = job;
    if (q == NULL) return;
    free(q->owned);
    free(q);
}
