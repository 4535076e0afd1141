/* The CPU kernel's threads (included by cpu_experts.c, before the job: one translation unit).
 *
 * Each thread that runs jobs (a native worker, or a Python thread calling the kernel directly) owns a team of
 * helper threads, started on its first job of more than one thread and stopped when that thread exits. A job
 * is published to the team; the caller and every helper that comes take the job's work in chunks
 * (cpu_job.c's phases), and the job is over when its work is done, whichever threads did it (the caller alone,
 * where its team could not be started).
 *
 * Why not an OpenMP parallel region: a region ends when its last thread has arrived, and on the H200 host's
 * virtual machine one of 14 threads regularly arrived 0.2-1.4 ms late (the job marks' team start, in medians
 * of jobs that take 0.4-2.6 ms): a core the hypervisor had given to someone else, or a thread asleep. Here a
 * late helper finds the job closed and waits for the next one; the others have done its share.
 *
 * Lifetime of a job's memory: a helper counts itself in (`inside`) before it looks at the published job, and
 * the caller, once the work is done, closes the job (`open` back to 0) and then waits until no helper is
 * inside. A helper that counted itself in after the close sees the job closed and leaves without touching it
 * (sequentially consistent atomics on both sides: either the helper sees the close, or the caller sees it in).
 *
 * Idle helpers spin TEAM_SPIN_S for the next job (decode submits one every MoE layer, ~1-2 ms apart), then
 * sleep on a condition variable that the caller signals only when someone sleeps. */

#include <pthread.h>

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#ifndef TEAM_SPIN_S
#define TEAM_SPIN_S 0.002
#endif
/* For tests: -DMOETIER_TEAM_ODD_HELPERS_ABSENT=1 builds a team whose odd helpers never take part in a job, as if
 * always late: the results must not change. */
#if defined(MOETIER_TEAM_ODD_HELPERS_ABSENT) && MOETIER_TEAM_ODD_HELPERS_ABSENT
#define TEAM_SKIPS(id) ((id) % 2 == 1)
#else
#define TEAM_SKIPS(id) 0
#endif
/* For tests: -DMOETIER_TEAM_CANNOT_START=1 builds a kernel whose teams never start (as when threads cannot be
 * created): every job then runs on its caller alone. */
#if defined(MOETIER_TEAM_CANNOT_START) && MOETIER_TEAM_CANNOT_START
#define TEAM_CANNOT_START 1
#else
#define TEAM_CANNOT_START 0
#endif

/* The cores the kernel's threads run on (moetier_pin_threads; none, the default: wherever the OS puts them). With
 * them, thread i of a team (the native worker is thread 0 of its team) pins itself to cores[i % n] as it starts.
 * Tried because idle helpers spin between decode's jobs, so 14 of 16 cores stay busy, and an unpinned spinner may
 * land on the core of the thread that launches the device's work; on the H200 pinned decode runs fell within the
 * unpinned ones' spread (results/h200-20261203-2fc484a-pin-ab), so the tier pins only with MOETIER_CPU_PIN=1. */
#define PIN_MAX 1024
static int pin_cores[PIN_MAX];
static int pin_count; /* written before the threads it pins start (moetier_pin_threads' contract) */

/* Pin the calling thread as thread `index` of its team (nothing without cores, or where the OS refuses). */
static void pin_self(int index) {
    const int n = __atomic_load_n(&pin_count, __ATOMIC_ACQUIRE);
    if (n <= 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(pin_cores[index % n], &set);
    (void)sched_setaffinity(0, sizeof set, &set); /* 0: this thread; a refusal leaves it unpinned */
}

/* Pin the threads started from now on to cores[0..n) (n = 0: stop pinning them); threads already running keep
 * their cores. MOETIER_BAD_ARGS for n outside [0, PIN_MAX] or a core outside [0, CPU_SETSIZE). */
int moetier_pin_threads(const int *cores, int n) {
    if (n < 0 || n > PIN_MAX) return MOETIER_BAD_ARGS;
    for (int i = 0; i < n; ++i)
        if (cores[i] < 0 || cores[i] >= CPU_SETSIZE) return MOETIER_BAD_ARGS;
    for (int i = 0; i < n; ++i) pin_cores[i] = cores[i];
    __atomic_store_n(&pin_count, n, __ATOMIC_RELEASE);
    return MOETIER_OK;
}

struct job; /* cpu_job.c's job_t */
typedef void (*team_body_t)(struct job *job, int tid);

typedef struct {
    pthread_t *threads;
    int helpers;        /* threads started besides the caller */
    struct job *job;    /* the published job (valid while `open` is its generation) */
    team_body_t body;   /* what each thread runs on it */
    int nthreads;       /* the job's threads: helpers with id >= nthreads sit it out */
    int64_t generation; /* bumped for every job: helpers wait for a new one */
    int64_t open;       /* the generation whose job may be touched, 0 once closed */
    int inside;         /* helpers counted in on the current generation */
    int stop;
    int sleeping; /* helpers asleep on `wake`, or about to be */
    pthread_mutex_t lock;
    pthread_cond_t wake;
} team_t;

typedef struct {
    team_t *team;
    int id; /* 1 .. helpers (the caller is 0) */
} helper_arg_t;

/* Spin until the team's generation passes `seen` (or stop), for TEAM_SPIN_S; 1 when it did. */
static int team_spin(team_t *t, int64_t seen) {
    const double until = now_seconds() + TEAM_SPIN_S;
    for (int i = 0;; ++i) {
        if (__atomic_load_n(&t->generation, __ATOMIC_ACQUIRE) != seen || __atomic_load_n(&t->stop, __ATOMIC_ACQUIRE))
            return 1;
        if ((i & 255) == 255 && now_seconds() > until) return 0;
        CPU_RELAX();
    }
}

/* Block until the team's generation passes `seen` or stop is asked; the new generation (or -1: stop). */
static int64_t team_wait(team_t *t, int64_t seen) {
    if (!team_spin(t, seen)) {
        /* Counted asleep before the generation is looked at again: a caller that publishes after this check
         * sees the count and signals (under the lock, so not before this thread waits). */
        pthread_mutex_lock(&t->lock);
        __atomic_add_fetch(&t->sleeping, 1, __ATOMIC_SEQ_CST);
        while (__atomic_load_n(&t->generation, __ATOMIC_SEQ_CST) == seen &&
               !__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE))
            pthread_cond_wait(&t->wake, &t->lock);
        __atomic_sub_fetch(&t->sleeping, 1, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&t->lock);
    }
    return __atomic_load_n(&t->stop, __ATOMIC_ACQUIRE) ? -1 : __atomic_load_n(&t->generation, __ATOMIC_ACQUIRE);
}

static void *team_helper(void *arg) {
    helper_arg_t *a = arg;
    team_t *t = a->team;
    const int id = a->id;
    free(a);
    pin_self(id);
    int64_t seen = 0;
    for (;;) {
        const int64_t g = team_wait(t, seen);
        if (g < 0) return NULL;
        seen = g;
        __atomic_add_fetch(&t->inside, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&t->open, __ATOMIC_SEQ_CST) == g && id < t->nthreads && !TEAM_SKIPS(id))
            t->body(t->job, id);
        __atomic_sub_fetch(&t->inside, 1, __ATOMIC_SEQ_CST);
    }
}

/* Stop and join every helper, then free the team (the calling thread's exit, or a team too small). */
static void team_free(void *p) {
    team_t *t = p;
    if (t == NULL) return;
    pthread_mutex_lock(&t->lock);
    __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&t->wake);
    pthread_mutex_unlock(&t->lock);
    for (int i = 0; i < t->helpers; ++i) pthread_join(t->threads[i], NULL);
    pthread_cond_destroy(&t->wake);
    pthread_mutex_destroy(&t->lock);
    free(t->threads);
    free(t);
}

/* A team of `helpers` started threads, or NULL when a thread could not be created. */
static team_t *team_new(int helpers) {
    if (TEAM_CANNOT_START) return NULL;
    team_t *t = calloc(1, sizeof(team_t));
    if (t == NULL) return NULL;
    t->threads = calloc((size_t)helpers, sizeof(pthread_t));
    pthread_mutex_init(&t->lock, NULL);
    pthread_cond_init(&t->wake, NULL);
    if (t->threads == NULL) {
        team_free(t);
        return NULL;
    }
    for (; t->helpers < helpers; ++t->helpers) {
        helper_arg_t *a = malloc(sizeof(helper_arg_t));
        if (a == NULL) break;
        *a = (helper_arg_t){t, t->helpers + 1};
        if (pthread_create(&t->threads[t->helpers], NULL, team_helper, a) != 0) {
            free(a);
            break;
        }
    }
    if (t->helpers < helpers) {
        team_free(t);
        return NULL;
    }
    return t;
}

static pthread_key_t team_key;
static pthread_once_t team_key_once = PTHREAD_ONCE_INIT;

/* A forked child has the forking thread's team but none of its helpers: it starts a team of its own (the
 * parent's record is left alone: its helpers' state belongs to the parent). */
static void team_forget_after_fork(void) { pthread_setspecific(team_key, NULL); }

static void team_key_init(void) {
    pthread_key_create(&team_key, team_free);
    pthread_atfork(NULL, NULL, team_forget_after_fork);
}

/* The calling thread's team with at least `helpers` helpers (a smaller one is replaced), or NULL. */
static team_t *my_team(int helpers) {
    pthread_once(&team_key_once, team_key_init);
    team_t *t = pthread_getspecific(team_key);
    if (t != NULL && t->helpers >= helpers) return t;
    team_free(t);
    t = team_new(helpers);
    pthread_setspecific(team_key, t);
    return t;
}

/* Run body(job, tid) on the caller (tid 0) and on whichever of the team's helpers come (tids 1 ..
 * nthreads - 1). body must end only once the job's work is done, whoever did it (a helper may never come). 0
 * when the team could not be started. */
static int team_run(struct job *job, team_body_t body, int nthreads) {
    team_t *t = my_team(nthreads - 1);
    if (t == NULL) return 0;
    t->job = job;
    t->body = body;
    t->nthreads = nthreads;
    const int64_t g = t->generation + 1; /* only this thread writes it */
    __atomic_store_n(&t->open, g, __ATOMIC_SEQ_CST);
    __atomic_store_n(&t->generation, g, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&t->sleeping, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&t->lock);
        pthread_cond_broadcast(&t->wake);
        pthread_mutex_unlock(&t->lock);
    }
    body(job, 0);
    __atomic_store_n(&t->open, 0, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&t->inside, __ATOMIC_SEQ_CST) > 0) CPU_RELAX();
    return 1;
}
