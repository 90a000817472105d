/* actcache._native: the loaders' copy kernel (optional; the loaders fall back to numpy).
 *
 * gather_multi(bases, n_src, srcs, rows, stride, piece, dst, stream=False, scales=None, scale=1.0,
 *              prefetch=0)
 *     for i in range(len(rows)):
 *         dst[i*piece : (i+1)*piece] = (bytes at bases[srcs[i]] + rows[i]*stride, piece of them)
 *     optionally times a float32 factor (``scale`` for all rows, or ``scales[i]`` per row).
 *
 * bases: int64 source addresses (numpy's arr.ctypes.data), n_src: rows each source holds; dst:
 * an integer address; srcs, rows: C-contiguous int64. Every source and row is checked before
 * anything is copied, so a bad index raises IndexError instead of reading outside a mapping.
 * Also: balanced_order, index_rows (the shuffle plan's and the batch index's arithmetic), touch
 * (fault fresh memory in) and probe (which byte ranges of a file are cached); see loaders/kernels.py.
 *
 * Why native: warm, a loader is a memory copy, and two cores must do it at memory speed.
 * numpy's take copies row by row with regular stores (the destination is read into the cache
 * first, then written back) and nothing asks for the next random row ahead of time; here the
 * source rows are prefetched a few rows ahead and, for batches larger than the CPU cache
 * (``stream``), written with non-temporal stores that skip that read (scripts/bench_loaders.py
 * measures the loaders: see BENCHMARKS.md). The GIL is released while copying.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* preadv2, RWF_NOWAIT */
#endif
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ACT_X86 1
#endif

/* Software prefetch of the rows ahead of the one being copied: whole rows, PREFETCH_SPAN bytes of
 * rows ahead (at least MIN_AHEAD rows, at most MAX_AHEAD), into the L2 cache (prefetcht1,
 * PREFETCH_LOCALITY 2). Whole rows into L2 beat a row's first bytes and non-temporal prefetches on
 * some hosts; into L1 (prefetcht0) was no better than none. scripts/bench_kernel.py measures the
 * variants (built from this file, alternated in one process); its figures are in BENCHMARKS.md,
 * "Copy kernel". Rows over WHOLE_MAX bytes (the ordered loader's whole images) have only their
 * first HEAD_BYTES prefetched (prefetchnta), MIN_AHEAD rows ahead: whole, they would flush the L2
 * cache, and the hardware prefetcher follows a long row anyway. The macros can be overridden
 * (-DPREFETCH_SPAN=0 turns prefetching off). */
#ifndef PREFETCH_SPAN
#define PREFETCH_SPAN (24 << 10)
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif
#ifndef MIN_AHEAD
#define MIN_AHEAD 2
#endif
#ifndef MAX_AHEAD
#define MAX_AHEAD 16
#endif
#ifndef WHOLE_MAX
#define WHOLE_MAX (16 << 10)
#endif
#ifndef HEAD_BYTES
#define HEAD_BYTES 512
#endif
/* The second scheme, "heads" (prefetch=1 in gather_multi): only the first HEADS_BYTES of the row
 * HEADS_AHEAD rows ahead, into L3 (prefetcht2); the hardware prefetcher brings in the rest of
 * the row once the copy reaches it. Which scheme is faster depends on the CPU (BENCHMARKS.md,
 * "Copy kernel"), so the loader measures both on its own copies and keeps the faster one
 * (kernels.PrefetchChooser). */
#ifndef HEADS_BYTES
#define HEADS_BYTES 256
#endif
#ifndef HEADS_AHEAD
#define HEADS_AHEAD 4
#endif

/* The prefetch helpers must be inlined before GCC's interprocedural passes see them: on their own
 * they have no visible side effect, GCC marks them const and drops every call (an out-of-line
 * helper once left no prefetch instruction in the module at -O2). */
#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

/* How prefetch_bytes hints (the locality must be a constant). */
enum { HINT_NTA = 0, HINT_L3 = 1, HINT_WHOLE = 2 };

/* Prefetch nbytes at p: into L2 (HINT_WHOLE: a whole row), L3 (HINT_L3: the head of a row, the
 * "heads" scheme) or non-temporally (HINT_NTA: the head of a long row). */
static ALWAYS_INLINE void prefetch_bytes(const char *p, Py_ssize_t nbytes, int hint) {
#if defined(__GNUC__) || defined(__clang__)
    if (hint == HINT_NTA)
        for (Py_ssize_t o = 0; o < nbytes; o += 64) __builtin_prefetch(p + o, 0, 0);
    else if (hint == HINT_L3)
        for (Py_ssize_t o = 0; o < nbytes; o += 64) __builtin_prefetch(p + o, 0, 1);
    else
        for (Py_ssize_t o = 0; o < nbytes; o += 64) __builtin_prefetch(p + o, 0, PREFETCH_LOCALITY);
#else
    (void)p;
    (void)nbytes;
    (void)hint;
#endif
}

/* Release the buffers that were filled (obj set); the others stay zeroed. */
static void release_buffers(Py_buffer *const *bufs, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (bufs[i]->obj) PyBuffer_Release(bufs[i]);
}
#define RELEASE(...)                                             \
    do {                                                         \
        Py_buffer *b_[] = {__VA_ARGS__};                         \
        release_buffers(b_, sizeof(b_) / sizeof(b_[0]));         \
    } while (0)

/* One copy job: row i comes from bases[srcs[i]] (or bases[0] when srcs is NULL) + rows[i] * stride. */
typedef struct {
    const char *const *bases;
    const int64_t *srcs;
    const int64_t *rows;
    Py_ssize_t n, stride, piece;
    char *dst;
    const float *scales; /* per row, or NULL */
    float scale;
    int scaled;
    Py_ssize_t ahead, head; /* prefetch: row i + ahead, its first head bytes (set_prefetch) */
    int scheme;             /* 0: whole rows (PREFETCH_SPAN), 1: heads (HEADS_BYTES) */
    int hint;               /* HINT_*, set by set_prefetch */
} job_t;

static inline const char *row_src(const job_t *j, Py_ssize_t i) {
    return j->bases[j->srcs ? j->srcs[i] : 0] + j->rows[i] * j->stride;
}

/* How far ahead the copy loops prefetch, and how much of each row (see PREFETCH_SPAN). */
static void set_prefetch(job_t *j) {
    j->hint = HINT_WHOLE;
    if (PREFETCH_SPAN <= 0) {
        j->head = j->ahead = 0;
    } else if (j->scheme == 1) {
        j->hint = HINT_L3;
        j->head = j->piece < HEADS_BYTES ? j->piece : HEADS_BYTES;
        j->ahead = HEADS_AHEAD;
    } else if (j->piece <= WHOLE_MAX) {
        j->head = j->piece;
        j->ahead = j->piece > 0 ? PREFETCH_SPAN / j->piece : 0;
        if (j->ahead < MIN_AHEAD) j->ahead = MIN_AHEAD;
        if (j->ahead > MAX_AHEAD) j->ahead = MAX_AHEAD;
    } else {
        j->hint = HINT_NTA;
        j->head = HEAD_BYTES;
        j->ahead = MIN_AHEAD;
    }
}

static ALWAYS_INLINE void prefetch_ahead(const job_t *j, Py_ssize_t i) {
    if (i + j->ahead < j->n) {
        const char *p = row_src(j, i + j->ahead);
        if (j->hint == HINT_WHOLE)
            prefetch_bytes(p, j->head, HINT_WHOLE);
        else if (j->hint == HINT_L3)
            prefetch_bytes(p, j->head, HINT_L3);
        else
            prefetch_bytes(p, j->head, HINT_NTA);
    }
}

/* ---- plain copies (any alignment, any size) ---------------------------------------------- */
static void gather_plain(const job_t *j) {
    const Py_ssize_t n = j->n, piece = j->piece;
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_ahead(j, i);
        const char *s = row_src(j, i);
        char *d = j->dst + i * piece;
        if (!j->scaled) {
            memcpy(d, s, (size_t)piece);
        } else {
            float f = j->scales ? j->scales[i] : j->scale;
            const float *sf = (const float *)s;
            float *df = (float *)d;
            for (Py_ssize_t k = 0; k < piece / 4; k++) df[k] = sf[k] * f;
        }
    }
}

#ifdef ACT_X86
/* ---- streaming copies: piece % 64 == 0, dst 64-byte aligned ------------------------------- */
__attribute__((target("avx512f"))) static void gather_stream512(const job_t *j) {
    const Py_ssize_t n = j->n, piece = j->piece;
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_ahead(j, i);
        const char *s = row_src(j, i);
        char *d = j->dst + i * piece;
        if (!j->scaled) {
            Py_ssize_t o = 0;
            for (; o + 256 <= piece; o += 256) {
                __m512i a = _mm512_loadu_si512((const void *)(s + o));
                __m512i b = _mm512_loadu_si512((const void *)(s + o + 64));
                __m512i c = _mm512_loadu_si512((const void *)(s + o + 128));
                __m512i e = _mm512_loadu_si512((const void *)(s + o + 192));
                _mm512_stream_si512((void *)(d + o), a);
                _mm512_stream_si512((void *)(d + o + 64), b);
                _mm512_stream_si512((void *)(d + o + 128), c);
                _mm512_stream_si512((void *)(d + o + 192), e);
            }
            for (; o < piece; o += 64) _mm512_stream_si512((void *)(d + o), _mm512_loadu_si512((const void *)(s + o)));
        } else {
            __m512 f = _mm512_set1_ps(j->scales ? j->scales[i] : j->scale);
            for (Py_ssize_t o = 0; o < piece; o += 64)
                _mm512_stream_ps((float *)(d + o), _mm512_mul_ps(_mm512_loadu_ps((const float *)(s + o)), f));
        }
    }
    _mm_sfence();
}

__attribute__((target("avx2"))) static void gather_stream256(const job_t *j) {
    const Py_ssize_t n = j->n, piece = j->piece;
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_ahead(j, i);
        const char *s = row_src(j, i);
        char *d = j->dst + i * piece;
        if (!j->scaled) {
            for (Py_ssize_t o = 0; o < piece; o += 64) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(s + o));
                __m256i b = _mm256_loadu_si256((const __m256i *)(s + o + 32));
                _mm256_stream_si256((__m256i *)(d + o), a);
                _mm256_stream_si256((__m256i *)(d + o + 32), b);
            }
        } else {
            __m256 f = _mm256_set1_ps(j->scales ? j->scales[i] : j->scale);
            for (Py_ssize_t o = 0; o < piece; o += 32)
                _mm256_stream_ps((float *)(d + o), _mm256_mul_ps(_mm256_loadu_ps((const float *)(s + o)), f));
        }
    }
    _mm_sfence();
}

static void gather_stream128(const job_t *j) {
    const Py_ssize_t n = j->n, piece = j->piece;
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_ahead(j, i);
        const char *s = row_src(j, i);
        char *d = j->dst + i * piece;
        if (!j->scaled) {
            for (Py_ssize_t o = 0; o < piece; o += 16)
                _mm_stream_si128((__m128i *)(d + o), _mm_loadu_si128((const __m128i *)(s + o)));
        } else {
            __m128 f = _mm_set1_ps(j->scales ? j->scales[i] : j->scale);
            for (Py_ssize_t o = 0; o < piece; o += 16)
                _mm_stream_ps((float *)(d + o), _mm_mul_ps(_mm_loadu_ps((const float *)(s + o)), f));
        }
    }
    _mm_sfence();
}

static int isa = -1; /* 2: avx512f, 1: avx2, 0: sse2 */
static const char *isa_name(void) {
    return isa == 2 ? "avx512f" : isa == 1 ? "avx2" : "sse2";
}
#else
static const char *isa_name(void) { return "generic"; }
#endif

/* ---- SIGBUS guard: a mapped file that shrinks under a copy is an error, not a crash ---------
 * Reading a page of a file mapping past the file's end raises SIGBUS, which kills the process.
 * A copy out of the shards' mappings runs "guarded": this thread's jump buffer is set, and the
 * SIGBUS handler, seeing it set, jumps back out of the copy (siglongjmp), which then raises
 * BusError (an OSError carrying the faulting address) instead of returning. Chosen over checking
 * the file's size before each copy because that leaves a race (a truncate between the check and
 * the read). The jump buffer is thread-local (initial-exec TLS: safe to read in a handler), so
 * threads copying in parallel each return to their own copy, and a SIGBUS in a thread that is
 * not copying goes to the handler that was installed before ours (faulthandler, or the default:
 * the process dies as it would have). Each guarded call checks that our handler is still the
 * one installed and puts it back in front if another (faulthandler.enable()) replaced it. */
#if defined(__GNUC__) || defined(__clang__)
#define GUARD_TLS __thread __attribute__((tls_model("initial-exec")))
#else
#define GUARD_TLS _Thread_local
#endif
static GUARD_TLS sigjmp_buf *guard_jmp;     /* set while this thread copies out of mappings */
static GUARD_TLS uintptr_t guard_fault;     /* the address whose read faulted */
static struct sigaction guard_prev;         /* the handler installed before ours */
static volatile sig_atomic_t guard_passed_on; /* a SIGBUS not ours was handed on: we step aside */
static PyObject *BusError;                  /* actcache._native.BusError (an OSError) */

static void guard_handler(int sig, siginfo_t *si, void *uc) {
    (void)uc;
    sigjmp_buf *jb = guard_jmp;
    if (jb != NULL) { /* this thread is in a guarded copy (a fault, or a handler before us re-raising it) */
        guard_jmp = NULL;
        guard_fault = si ? (uintptr_t)si->si_addr : 0;
        siglongjmp(*jb, 1);
    }
    /* Not ours: hand it to the handler before ours, once; then step aside for good. */
    if (guard_passed_on) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    guard_passed_on = 1;
    sigaction(sig, &guard_prev, NULL);
    if (!si || si->si_code <= 0) raise(sig); /* a sent signal: send it again, to that handler */
    /* a fault: returning runs the faulting instruction again, and its fault reaches that handler */
}

/* Our handler in front (called with the GIL held, so installs do not race). */
static void guard_install(void) {
    struct sigaction cur;
    if (guard_passed_on || sigaction(SIGBUS, NULL, &cur) != 0) return;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == guard_handler) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = guard_handler;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    guard_prev = cur;
    sigaction(SIGBUS, &sa, NULL);
}

/* One copy to run under the guard: a gather (run_job) or a widening gather (widen_run). */
typedef struct {
    job_t *j;
    int kind, stream;
} copy_t;

/* copy(c) with the guard: 0, or 1 with *fault set when a read faulted (the copy stopped there). */
static int run_guarded(void (*copy)(const copy_t *), const copy_t *c, uintptr_t *fault) {
    sigjmp_buf jb;
    /* The signal mask is not saved (a system call per copy): the jump leaves the handler with
     * SIGBUS blocked (its only change to the mask), so that is undone here, on the error path. */
    if (sigsetjmp(jb, 0)) {
        sigset_t bus;
        sigemptyset(&bus);
        sigaddset(&bus, SIGBUS);
        pthread_sigmask(SIG_UNBLOCK, &bus, NULL);
        *fault = guard_fault;
        return 1;
    }
    guard_jmp = &jb;
    copy(c);
    guard_jmp = NULL;
    return 0;
}

/* Raise BusError for a faulted copy; its ``address`` attribute is the faulting address. */
static void raise_bus_error(const char *who, uintptr_t fault) {
    PyObject *exc = PyObject_CallFunction(BusError, "iN", EIO,
                                          PyUnicode_FromFormat("%s: SIGBUS reading a memory-mapped file (it was "
                                                               "truncated, or the device behind it failed, while "
                                                               "it was read)", who));
    if (exc == NULL) return;
    PyObject *addr = PyLong_FromUnsignedLongLong((unsigned long long)fault);
    if (addr == NULL || PyObject_SetAttrString(exc, "address", addr) < 0) {
        Py_XDECREF(addr);
        Py_DECREF(exc);
        return;
    }
    Py_DECREF(addr);
    PyErr_SetObject(BusError, exc);
    Py_DECREF(exc);
}
/* ---- end of the SIGBUS guard -------------------------------------------------------------- */

static void run_job(job_t *j, int stream) {
    set_prefetch(j);
#ifdef ACT_X86
    if (stream && j->piece % 64 == 0 && ((uintptr_t)j->dst % 64) == 0) {
        if (isa == 2)
            gather_stream512(j);
        else if (isa == 1)
            gather_stream256(j);
        else
            gather_stream128(j);
        return;
    }
#else
    (void)stream;
#endif
    gather_plain(j);
}

/* Argument checks of gather_multi; fills j->rows / n / scales / scaled. 0 on error. */
static int check_job(job_t *j, const char *who, Py_buffer *rows, PyObject *scales_obj, Py_buffer *scales,
                     double scale) {
    j->n = rows->len / (Py_ssize_t)sizeof(int64_t);
    if (rows->len % (Py_ssize_t)sizeof(int64_t) != 0 || !PyBuffer_IsContiguous(rows, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s: rows must be a C-contiguous int64 array", who);
        return 0;
    }
    if (j->piece < 0 || j->stride < 0) {
        PyErr_Format(PyExc_ValueError, "%s: piece and stride must be >= 0", who);
        return 0;
    }
    j->rows = (const int64_t *)rows->buf;
    j->scales = NULL;
    if (scales_obj != Py_None) {
        if (PyObject_GetBuffer(scales_obj, scales, PyBUF_C_CONTIGUOUS) < 0) return 0;
        if (scales->len != j->n * (Py_ssize_t)sizeof(float)) {
            PyErr_Format(PyExc_ValueError, "%s: scales must be float32 with one value per row", who);
            return 0;
        }
        j->scales = (const float *)scales->buf;
    }
    j->scale = (float)scale;
    j->scaled = j->scales != NULL || scale != 1.0;
    if (j->scaled && j->piece % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "%s: scaling needs float32 pieces (piece %% 4 == 0)", who);
        return 0;
    }
    return 1;
}

/* copy(c) under the guard with the GIL released: 1, or 0 with BusError set (``who`` names the call). */
static int run_copy(void (*copy)(const copy_t *), const copy_t *c, const char *who) {
    uintptr_t fault = 0;
    int faulted;
    guard_install();
    Py_BEGIN_ALLOW_THREADS;
    faulted = run_guarded(copy, c, &fault);
    Py_END_ALLOW_THREADS;
    if (faulted) raise_bus_error(who, fault);
    return !faulted;
}

/* Check a multi-source job's sources (one int64 address and row count per source, one source per
 * row, every row inside its source) and point j at them: 1, or 0 with an exception set. */
static int check_sources(job_t *j, const char *who, Py_buffer *bases, Py_buffer *nsrc, Py_buffer *srcs,
                         Py_buffer *rows) {
    Py_ssize_t k = bases->len / 8;
    if (bases->len % 8 != 0 || nsrc->len != bases->len || srcs->len != rows->len) {
        PyErr_Format(PyExc_ValueError, "%s: bases and n_src need one int64 per source, srcs one per row", who);
        return 0;
    }
    const int64_t *S = srcs->buf, *N = nsrc->buf;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        if (S[i] < 0 || S[i] >= k) {
            PyErr_Format(PyExc_IndexError, "%s: source %lld at position %zd is outside [0, %zd)", who, (long long)S[i],
                         i, k);
            return 0;
        }
        if (j->rows[i] < 0 || j->rows[i] >= N[S[i]]) {
            PyErr_Format(PyExc_IndexError, "%s: row %lld of source %lld at position %zd is outside [0, %lld)", who,
                         (long long)j->rows[i], (long long)S[i], i, (long long)N[S[i]]);
            return 0;
        }
    }
    j->bases = (const char *const *)bases->buf;
    j->srcs = S;
    return 1;
}

static void copy_gather(const copy_t *c) { run_job(c->j, c->stream); }

/* gather_multi(bases, n_src, srcs, rows, stride, piece, dst, stream=False, scales=None, scale=1.0,
 *              prefetch=0):
 * as gather, but row i comes from source srcs[i]: bases (int64 addresses) and n_src (int64 row counts)
 * have one entry per source. prefetch: 0 whole rows ahead, 1 row heads (see HEADS_BYTES). */
static PyObject *gather_multi(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"bases", "n_src", "srcs", "rows",   "stride",   "piece",
                            "dst",   "stream", "scales", "scale", "prefetch", NULL};
    unsigned long long dst_addr;
    Py_buffer bases = {0}, nsrc = {0}, srcs = {0}, rows = {0}, scales = {0};
    int stream = 0;
    PyObject *scales_obj = Py_None;
    double scale = 1.0;
    job_t j;
    (void)self;
    j.scheme = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*y*y*y*nnK|pOdi", names, &bases, &nsrc, &srcs, &rows, &j.stride,
                                     &j.piece, &dst_addr, &stream, &scales_obj, &scale, &j.scheme))
        return NULL;
    PyObject *result = NULL;
    if (j.scheme != 0 && j.scheme != 1) {
        PyErr_Format(PyExc_ValueError, "gather_multi: prefetch must be 0 (whole rows) or 1 (row heads), not %d",
                     j.scheme);
        goto done;
    }
    if (!check_job(&j, "gather_multi", &rows, scales_obj, &scales, scale)) goto done;
    if (!check_sources(&j, "gather_multi", &bases, &nsrc, &srcs, &rows)) goto done;
    j.dst = (char *)(uintptr_t)dst_addr;
    if (!run_copy(copy_gather, &(copy_t){&j, 0, stream}, "gather_multi")) goto done;
    result = Py_None;
    Py_INCREF(result);
done:
    RELEASE(&bases, &nsrc, &srcs, &rows, &scales);
    return result;
}

/* balanced_order(n, per, j0, lo, hi, pi, rot, tau, shift, out) -> count (see loaders/kernels.py):
 * for round k, position p: img = tau[(p + shift[k]) % n], example pi[(k + rot[img]) % per] of image
 * j0 + img, as a run-local id (j0 + img) * per + example; ids outside [lo, hi) are left out. */
static PyObject *balanced_order(PyObject *self, PyObject *args) {
    Py_ssize_t n, per;
    long long j0, lo, hi;
    Py_buffer pi = {0}, rot = {0}, tau = {0}, shift = {0}, out = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "nnLLLy*y*y*y*w*", &n, &per, &j0, &lo, &hi, &pi, &rot, &tau, &shift, &out)) return NULL;
    PyObject *result = NULL;
    if (n < 0 || per < 0 || pi.len != per * 8 || rot.len != n * 8 || tau.len != n * 8 || shift.len != per * 8 ||
        out.len < n * per * 8) {
        PyErr_SetString(PyExc_ValueError, "balanced_order: arrays of the wrong size (int64: pi, shift per; rot, tau n)");
        goto done;
    }
    const int64_t *P = pi.buf, *R = rot.buf, *U = tau.buf, *S = shift.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (R[i] < 0 || R[i] >= per || U[i] < 0 || U[i] >= n) {
            PyErr_SetString(PyExc_ValueError, "balanced_order: rot or tau out of range");
            goto done;
        }
    for (Py_ssize_t k = 0; k < per; k++)
        if (P[k] < 0 || P[k] >= per || S[k] < 0 || S[k] >= n) {
            PyErr_SetString(PyExc_ValueError, "balanced_order: pi or shift out of range");
            goto done;
        }
    int64_t *O = out.buf;
    Py_ssize_t m = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t k = 0; k < per; k++) {
        Py_ssize_t q = S[k];
        for (Py_ssize_t p = 0; p < n; p++, q++) {
            if (q >= n) q -= n;
            int64_t img = U[q];
            int64_t e = k + R[img];
            if (e >= per) e -= per;
            int64_t v = (j0 + img) * per + P[e];
            if (v >= lo && v < hi) O[m++] = v;
        }
    }
    Py_END_ALLOW_THREADS;
    result = PyLong_FromSsize_t(m);
done:
    RELEASE(&pi, &rot, &tau, &shift, &out);
    return result;
}

/* index_rows(x, run_start, run_img0, run_cimg0, run_src, run_sub, perm, per, nT, L, T, ts, cls, layer_idx,
 *            layers, out_src, out_rows, out_img, out_patch, out_layer, out_lpos)
 * A batch's rows in the order perm gives (see loaders/kernels.py: index_rows): element i of x is a
 * run-local example id of run r (run_start[r] <= i < run_start[r + 1]); run_sub is None (rows in the
 * shard: from the geometry) or one int64 per run (rows = x - run_sub[r], io="read"); out_lpos may be
 * None. All int64. */
static PyObject *index_rows(PyObject *self, PyObject *args) {
    Py_buffer x = {0}, rs = {0}, img0 = {0}, cimg0 = {0}, src = {0}, sub = {0}, perm = {0}, lidx = {0}, lay = {0};
    Py_buffer o_src = {0}, o_rows = {0}, o_img = {0}, o_patch = {0}, o_layer = {0}, o_lpos = {0};
    PyObject *sub_obj, *lpos_obj;
    Py_ssize_t per, nT, L, T, ts, cls;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*Oy*nnnnnny*y*w*w*w*w*w*O", &x, &rs, &img0, &cimg0, &src, &sub_obj, &perm,
                          &per, &nT, &L, &T, &ts, &cls, &lidx, &lay, &o_src, &o_rows, &o_img, &o_patch, &o_layer,
                          &lpos_obj))
        return NULL;
    PyObject *result = NULL;
    int32_t *run_of = NULL;
    Py_ssize_t n = x.len / 8, R = rs.len / 8 - 1, nl = lidx.len / 8;
    if (sub_obj != Py_None && PyObject_GetBuffer(sub_obj, &sub, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (lpos_obj != Py_None && PyObject_GetBuffer(lpos_obj, &o_lpos, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (R < 0 || img0.len != R * 8 || cimg0.len != R * 8 || src.len != R * 8 || (sub.obj && sub.len != R * 8) ||
        perm.len != x.len || o_src.len != x.len || o_rows.len != x.len || o_img.len != x.len ||
        o_patch.len != x.len || o_layer.len != x.len || (o_lpos.obj && o_lpos.len != x.len) || nl < 1 ||
        lay.len < 8 * L || per <= 0 || nT <= 0 || per != nl * nT) {
        PyErr_SetString(PyExc_ValueError, "index_rows: arrays or sizes do not fit together");
        goto done;
    }
    const int64_t *X = x.buf, *RS = rs.buf, *P = perm.buf, *LI = lidx.buf;
    if (RS[0] != 0 || RS[R] != n) {
        PyErr_SetString(PyExc_ValueError, "index_rows: run_start must go from 0 to len(x)");
        goto done;
    }
    run_of = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    if (!run_of) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0; r < R; r++) {
        if (RS[r + 1] < RS[r]) {
            PyErr_SetString(PyExc_ValueError, "index_rows: run_start must not decrease");
            goto done;
        }
        for (int64_t i = RS[r]; i < RS[r + 1]; i++) run_of[i] = (int32_t)r;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (P[i] < 0 || P[i] >= n || X[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "index_rows: perm outside [0, len(x)) or a negative id");
            goto done;
        }
    for (Py_ssize_t i = 0; i < nl; i++)
        if (LI[i] < 0 || LI[i] >= L) {
            PyErr_SetString(PyExc_ValueError, "index_rows: layer_idx outside [0, L)");
            goto done;
        }
    const int64_t *I0 = img0.buf, *C0 = cimg0.buf, *SR = src.buf, *SB = sub.obj ? sub.buf : NULL, *LV = lay.buf;
    int64_t *OS = o_src.buf, *OR = o_rows.buf, *OI = o_img.buf, *OP = o_patch.buf, *OL = o_layer.buf;
    int64_t *OLP = o_lpos.obj ? o_lpos.buf : NULL;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t i = P[k], r = run_of[i], xi = X[i];
        int64_t jimg = xi / per, e = xi - jimg * per;
        int64_t lp = e / nT, tok = e - lp * nT, li = LI[lp];
        OS[k] = SR[r];
        OR[k] = SB ? xi - SB[r] : ((I0[r] + jimg) * L + li) * T + ts + tok;
        OI[k] = C0[r] + jimg;
        OP[k] = tok + ts - cls;
        OL[k] = LV[li];
        if (OLP) OLP[k] = lp;
    }
    Py_END_ALLOW_THREADS;
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(run_of);
    RELEASE(&x, &rs, &img0, &cimg0, &src, &sub, &perm, &lidx, &lay, &o_src, &o_rows, &o_img, &o_patch, &o_layer,
            &o_lpos);
    return result;
}

/* touch(addr, nbytes, step): write a zero byte every `step` bytes of fresh memory, faulting its pages
 * in. Page faults take only their memory area's lock (Linux >= 6.4), where madvise(MADV_POPULATE_WRITE)
 * holds the whole process's mmap lock, so a thread that maps memory meanwhile (numpy allocating an
 * array) does not wait for it. */
static PyObject *touch(PyObject *self, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t nbytes, step;
    (void)self;
    if (!PyArg_ParseTuple(args, "Knn", &addr, &nbytes, &step)) return NULL;
    if (step <= 0 || nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "touch: step must be > 0 and nbytes >= 0");
        return NULL;
    }
    volatile char *p = (volatile char *)(uintptr_t)addr;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t o = 0; o < nbytes; o += step) p[o] = 0;
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* probe(fd, starts, ends, n, advise) -> ranges not found cached, or -1 where the OS cannot tell
 * (no RWF_NOWAIT for this file). starts, ends: addresses of n int64 byte offsets. A range counts as
 * cached when its first and last bytes are in the page cache (preadv2 of one byte with RWF_NOWAIT,
 * which fails with EAGAIN rather than wait for the disk); with `advise`, each range that is not is
 * asked for (posix_fadvise WILLNEED, asynchronous). The loop runs without the GIL: done from
 * Python, the GIL changes hands around each of the two system calls per range, which costs
 * several times the calls themselves when reader threads run beside the gathers. */
static PyObject *probe(PyObject *self, PyObject *args) {
    int fd, advise;
    unsigned long long starts_addr, ends_addr;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKnp", &fd, &starts_addr, &ends_addr, &n, &advise)) return NULL;
    const int64_t *starts = (const int64_t *)(uintptr_t)starts_addr, *ends = (const int64_t *)(uintptr_t)ends_addr;
    Py_ssize_t missing = 0;
    int err = 0;
#if defined(__linux__) && defined(RWF_NOWAIT)
    char byte;
    struct iovec iov = {&byte, 1};
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n && !err; i++) {
        int64_t s = starts[i], e = ends[i];
        if (e <= s) continue;
        int cached = 1;
        int64_t offs[2] = {s, e - 1};
        for (int k = 0; k < 2 && cached; k++) {
            ssize_t got = preadv2(fd, &iov, 1, (off_t)offs[k], RWF_NOWAIT);
            if (got == 1) continue;
            cached = 0;
            if (got < 0 && errno != EAGAIN) err = errno;
        }
        if (err) break;
        if (!cached) {
            missing++;
            if (advise) posix_fadvise(fd, (off_t)s, (off_t)(e - s), POSIX_FADV_WILLNEED);
        }
    }
    Py_END_ALLOW_THREADS;
#else
    err = EOPNOTSUPP;
#endif
    if (err == EOPNOTSUPP || err == EINVAL || err == ENOSYS) return PyLong_FromLong(-1);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(missing);
}

/* permutation(n, key, out): a random order of 0 .. n-1 into out (int64, n), a function of the
 * 64-bit key alone: Fisher-Yates (from the top, swapping i with j in [0, i]) drawing j from the
 * i-th output of splitmix64 started at key, scaled to [0, i] by a 128-bit multiply (Lemire; the
 * bias, i / 2^64, does not matter here). kernels.permutation does the same in numpy. */
static inline uint64_t splitmix64_at(uint64_t key, uint64_t i) {
    uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static PyObject *permutation(PyObject *self, PyObject *args) {
    Py_ssize_t n;
    unsigned long long key;
    Py_buffer out = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "nKw*", &n, &key, &out)) return NULL;
    if (n < 0 || out.len != n * 8) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "permutation: out must be int64 with n entries");
        return NULL;
    }
    int64_t *P = out.buf;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++) P[i] = i;
    for (Py_ssize_t i = n - 1; i > 0; i--) {
        uint64_t r = splitmix64_at((uint64_t)key, (uint64_t)(n - 1 - i));
        Py_ssize_t j = (Py_ssize_t)(((unsigned __int128)r * (uint64_t)(i + 1)) >> 64);
        int64_t t = P[i];
        P[i] = P[j];
        P[j] = t;
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* concat_ranges(addrs, starts, counts, out): out = the int64 arrays at addrs[r], elements
 * [starts[r], starts[r] + counts[r]) of each, one after the other (a batch's example ids from its
 * runs' orders: plan.EpochPlan.batches). The caller keeps the arrays alive and the ranges inside
 * them; all arguments int64, out of sum(counts) entries. */
static PyObject *concat_ranges(PyObject *self, PyObject *args) {
    Py_buffer ad = {0}, st = {0}, ct = {0}, out = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &ad, &st, &ct, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t R = ad.len / 8, total = 0;
    const int64_t *A = ad.buf, *S = st.buf, *C = ct.buf;
    if (st.len != ad.len || ct.len != ad.len) {
        PyErr_SetString(PyExc_ValueError, "concat_ranges: addrs, starts and counts must have one int64 per array");
        goto done;
    }
    for (Py_ssize_t r = 0; r < R; r++) {
        if (C[r] < 0 || S[r] < 0 || (C[r] && !A[r])) {
            PyErr_SetString(PyExc_ValueError, "concat_ranges: a negative start or count, or a null array");
            goto done;
        }
        total += C[r];
    }
    if (out.len != total * 8) {
        PyErr_SetString(PyExc_ValueError, "concat_ranges: out must have sum(counts) int64 entries");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS;
    int64_t *O = out.buf;
    for (Py_ssize_t r = 0; r < R; r++) {
        if (!C[r]) continue;
        memcpy(O, (const int64_t *)(uintptr_t)A[r] + S[r], (size_t)C[r] * 8);
        O += C[r];
    }
    Py_END_ALLOW_THREADS;
    result = Py_None;
    Py_INCREF(result);
done:
    RELEASE(&ad, &st, &ct, &out);
    return result;
}

/* ---- widening copies: 16-bit stored values (protocol 2.0) -> float32 ------------------------
 * gather_widen(bases, n_src, srcs, rows, stride, piece, dst, kind, stream=False, scales=None,
 *              scale=1.0, prefetch=0)
 * as gather_multi, but the piece bytes of each source row hold piece / 2 16-bit values (kind 0:
 * float16, 1: bfloat16) and land in dst as float32 values (2 * piece bytes per row), times the
 * scale as in gather_multi. Exact; a NaN keeps its sign and payload and comes out quiet (bit 22
 * set, as x86's F16C conversion does): actcache/dtypes.py's numpy fallback follows the same
 * rule, so both give the same bytes. Kept apart from gather_multi so each can change alone. */

static inline uint32_t widen_f16_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0);
    if (exp != 0) return sign | ((exp + 112) << 23) | (man << 13);
    if (man == 0) return sign;
    int e = -1; /* subnormal: shift the mantissa up until its leading bit is the implicit one */
    do {
        e++;
        man <<= 1;
    } while (!(man & 0x400u));
    return sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
}

static inline uint32_t widen_bf16_bits(uint16_t h) {
    uint32_t f = (uint32_t)h << 16;
    return (f & 0x7fffffffu) > 0x7f800000u ? f | 0x00400000u : f;
}

static void widen_row_scalar(const uint16_t *s, float *d, Py_ssize_t m, int kind, int scaled, float f) {
    for (Py_ssize_t k = 0; k < m; k++) {
        uint32_t u = kind ? widen_bf16_bits(s[k]) : widen_f16_bits(s[k]);
        float v;
        memcpy(&v, &u, 4);
        d[k] = scaled ? v * f : v;
    }
}

static void widen_plain(const job_t *j, int kind) {
    const Py_ssize_t m = j->piece / 2;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        prefetch_ahead(j, i);
        float f = j->scales ? j->scales[i] : j->scale;
        widen_row_scalar((const uint16_t *)row_src(j, i), (float *)(j->dst + i * 2 * j->piece), m, kind, j->scaled, f);
    }
}

#ifdef ACT_X86
/* 8 values per step: F16C's vcvtph2ps for float16, a 16-bit shift for bfloat16. */
__attribute__((target("avx2,f16c"))) static void widen_avx2(const job_t *j, int kind, int stream) {
    const Py_ssize_t m = j->piece / 2;
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x00400000);
    for (Py_ssize_t i = 0; i < j->n; i++) {
        prefetch_ahead(j, i);
        const uint16_t *s = (const uint16_t *)row_src(j, i);
        float *d = (float *)(j->dst + i * 2 * j->piece);
        const float fs = j->scales ? j->scales[i] : j->scale;
        const __m256 f = _mm256_set1_ps(fs);
        Py_ssize_t k = 0;
        for (; k + 8 <= m; k += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(s + k));
            __m256 v;
            if (kind) {
                __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
                __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absmask), inf);
                v = _mm256_castsi256_ps(_mm256_or_si256(u, _mm256_and_si256(nan, quiet)));
            } else {
                v = _mm256_cvtph_ps(h);
            }
            if (j->scaled) v = _mm256_mul_ps(v, f);
            if (stream)
                _mm256_stream_ps(d + k, v);
            else
                _mm256_storeu_ps(d + k, v);
        }
        widen_row_scalar(s + k, d + k, m - k, kind, j->scaled, fs);
    }
    if (stream) _mm_sfence();
}

static int widen_isa = -1; /* 1: avx2 and f16c */
#endif

static void widen_run(const job_t *j, int kind, int stream) {
#ifdef ACT_X86
    if (widen_isa < 0) widen_isa = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (widen_isa == 1)
        widen_avx2(j, kind, stream && ((uintptr_t)j->dst % 32) == 0 && (2 * j->piece) % 32 == 0);
    else
        widen_plain(j, kind);
#else
    (void)stream;
    widen_plain(j, kind);
#endif
}

static void copy_widen(const copy_t *c) { widen_run(c->j, c->kind, c->stream); }

static PyObject *gather_widen(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"bases", "n_src",  "srcs",   "rows",  "stride",   "piece", "dst",
                            "kind",  "stream", "scales", "scale", "prefetch", NULL};
    unsigned long long dst_addr;
    Py_buffer bases = {0}, nsrc = {0}, srcs = {0}, rows = {0}, scales = {0};
    int stream = 0, kind = 0;
    PyObject *scales_obj = Py_None;
    double scale = 1.0;
    job_t j;
    (void)self;
    j.scheme = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*y*y*y*nnKi|pOdi", names, &bases, &nsrc, &srcs, &rows, &j.stride,
                                     &j.piece, &dst_addr, &kind, &stream, &scales_obj, &scale, &j.scheme))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t piece = j.piece;
    if ((kind != 0 && kind != 1) || (j.scheme != 0 && j.scheme != 1) || piece % 2 != 0) {
        PyErr_SetString(PyExc_ValueError, "gather_widen: kind 0 (float16) or 1 (bfloat16), prefetch 0 or 1, even piece");
        goto done;
    }
    j.piece = 2 * piece; /* check_job checks the float32 side */
    if (!check_job(&j, "gather_widen", &rows, scales_obj, &scales, scale)) goto done;
    j.piece = piece;
    if (!check_sources(&j, "gather_widen", &bases, &nsrc, &srcs, &rows)) goto done;
    j.dst = (char *)(uintptr_t)dst_addr;
    set_prefetch(&j);
    if (!run_copy(copy_widen, &(copy_t){&j, kind, stream}, "gather_widen")) goto done;
    result = Py_None;
    Py_INCREF(result);
done:
    RELEASE(&bases, &nsrc, &srcs, &rows, &scales);
    return result;
}

static PyMethodDef methods[] = {
    {"permutation", permutation, METH_VARARGS, "permutation(n, key, out): a random order of range(n) from key."},
    {"gather_multi", (PyCFunction)(void (*)(void))gather_multi, METH_VARARGS | METH_KEYWORDS,
     "gather_multi(bases, n_src, srcs, rows, stride, piece, dst, stream=False, scales=None, scale=1.0): gather "
     "from several sources (row i from source srcs[i])."},
    {"concat_ranges", concat_ranges, METH_VARARGS,
     "concat_ranges(addrs, starts, counts, out): ranges of int64 arrays, one after the other (kernels.py)."},
    {"index_rows", index_rows, METH_VARARGS, "index_rows(...): a batch's rows, sources and indices (kernels.py)."},
    {"touch", touch, METH_VARARGS, "touch(addr, nbytes, step): write a zero every step bytes (fault fresh memory in)."},
    {"probe", probe, METH_VARARGS,
     "probe(fd, starts, ends, n, advise) -> ranges not cached (-1: cannot tell): first and last bytes of each "
     "range looked up in the page cache (RWF_NOWAIT); with advise, posix_fadvise WILLNEED on those that are not."},
    {"balanced_order", balanced_order, METH_VARARGS,
     "balanced_order(n, per, j0, lo, hi, pi, rot, tau, shift, out) -> count: a run's balanced example order "
     "(see actcache/loaders/kernels.py)."},
    {"gather_widen", (PyCFunction)(void (*)(void))gather_widen, METH_VARARGS | METH_KEYWORDS,
     "gather_widen(bases, n_src, srcs, rows, stride, piece, dst, kind, ...): gather_multi from 16-bit rows "
     "(kind 0 float16, 1 bfloat16) into float32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "actcache._native",
                                    "The loaders' copy kernel (see _native.c).", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
#ifdef ACT_X86
    __builtin_cpu_init();
    isa = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    BusError = PyErr_NewException("actcache._native.BusError", PyExc_OSError, NULL);
    if (BusError == NULL || PyModule_AddObjectRef(m, "BusError", BusError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "isa", isa_name()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
