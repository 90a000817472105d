/* actcache._native: the loaders' copy kernel (optional; the loaders fall back to numpy).
 *
 * gather(src, rows, stride, piece, dst, n_src, stream=False, scales=None, scale=1.0)
 *     for i in range(len(rows)):
 *         dst[i*piece : (i+1)*piece] = src[rows[i]*stride : rows[i]*stride + piece]  (bytes)
 *     optionally times a float32 factor (``scale`` for all rows, or ``scales[i]`` per row).
 *
 * src, dst: integer addresses (numpy's arr.ctypes.data); rows: a C-contiguous int64 buffer;
 * every row is checked against n_src (the number of rows src holds) before anything is copied,
 * so a bad index raises IndexError instead of reading outside the mapping.
 *
 * Why native: warm, a loader is a memory copy, and two cores must do it at memory speed.
 * numpy's take copies row by row with regular stores (the destination is read into the cache
 * first, then written back) and nothing asks for the next random row ahead of time; here the
 * source rows are prefetched a few rows ahead and, for batches larger than the CPU cache
 * (``stream``), written with non-temporal stores that skip that read. Measured on the project
 * VM (2 cores, scripts/bench_loaders.py): see BENCHMARKS.md. The GIL is released while copying.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ACT_X86 1
#endif

#define AHEAD 8                 /* rows prefetched ahead of the one being copied */
#define PREFETCH_MAX (16 << 10) /* larger pieces are sequential enough for the hardware prefetcher */

static inline void prefetch_row(const char *p, Py_ssize_t piece) {
#if defined(__GNUC__) || defined(__clang__)
    if (piece > PREFETCH_MAX) return;
    for (Py_ssize_t o = 0; o < piece; o += 64) __builtin_prefetch(p + o, 0, 0);
#else
    (void)p;
    (void)piece;
#endif
}

/* ---- plain copies (any alignment, any size) ---------------------------------------------- */
static void gather_plain(const char *src, const int64_t *rows, Py_ssize_t n, Py_ssize_t stride, Py_ssize_t piece,
                         char *dst, const float *scales, float scale, int scaled) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) prefetch_row(src + rows[i + AHEAD] * stride, piece);
        const char *s = src + rows[i] * stride;
        char *d = dst + i * piece;
        if (!scaled) {
            memcpy(d, s, (size_t)piece);
        } else {
            float f = scales ? scales[i] : scale;
            const float *sf = (const float *)s;
            float *df = (float *)d;
            for (Py_ssize_t k = 0; k < piece / 4; k++) df[k] = sf[k] * f;
        }
    }
}

#ifdef ACT_X86
/* ---- streaming copies: piece % 64 == 0, dst 64-byte aligned ------------------------------- */
__attribute__((target("avx512f"))) static void gather_stream512(const char *src, const int64_t *rows, Py_ssize_t n,
                                                               Py_ssize_t stride, Py_ssize_t piece, char *dst,
                                                               const float *scales, float scale, int scaled) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) prefetch_row(src + rows[i + AHEAD] * stride, piece);
        const char *s = src + rows[i] * stride;
        char *d = dst + i * piece;
        if (!scaled) {
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
            __m512 f = _mm512_set1_ps(scales ? scales[i] : scale);
            for (Py_ssize_t o = 0; o < piece; o += 64)
                _mm512_stream_ps((float *)(d + o), _mm512_mul_ps(_mm512_loadu_ps((const float *)(s + o)), f));
        }
    }
    _mm_sfence();
}

__attribute__((target("avx2"))) static void gather_stream256(const char *src, const int64_t *rows, Py_ssize_t n,
                                                            Py_ssize_t stride, Py_ssize_t piece, char *dst,
                                                            const float *scales, float scale, int scaled) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) prefetch_row(src + rows[i + AHEAD] * stride, piece);
        const char *s = src + rows[i] * stride;
        char *d = dst + i * piece;
        if (!scaled) {
            for (Py_ssize_t o = 0; o < piece; o += 64) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(s + o));
                __m256i b = _mm256_loadu_si256((const __m256i *)(s + o + 32));
                _mm256_stream_si256((__m256i *)(d + o), a);
                _mm256_stream_si256((__m256i *)(d + o + 32), b);
            }
        } else {
            __m256 f = _mm256_set1_ps(scales ? scales[i] : scale);
            for (Py_ssize_t o = 0; o < piece; o += 32)
                _mm256_stream_ps((float *)(d + o), _mm256_mul_ps(_mm256_loadu_ps((const float *)(s + o)), f));
        }
    }
    _mm_sfence();
}

static void gather_stream128(const char *src, const int64_t *rows, Py_ssize_t n, Py_ssize_t stride, Py_ssize_t piece,
                             char *dst, const float *scales, float scale, int scaled) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) prefetch_row(src + rows[i + AHEAD] * stride, piece);
        const char *s = src + rows[i] * stride;
        char *d = dst + i * piece;
        if (!scaled) {
            for (Py_ssize_t o = 0; o < piece; o += 16)
                _mm_stream_si128((__m128i *)(d + o), _mm_loadu_si128((const __m128i *)(s + o)));
        } else {
            __m128 f = _mm_set1_ps(scales ? scales[i] : scale);
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

static PyObject *gather(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"src", "rows", "stride", "piece", "dst", "n_src", "stream", "scales", "scale", NULL};
    unsigned long long src_addr, dst_addr;
    Py_buffer rows = {0}, scales = {0};
    Py_ssize_t stride, piece, n_src;
    int stream = 0;
    PyObject *scales_obj = Py_None;
    double scale = 1.0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Ky*nnKn|pOd", names, &src_addr, &rows, &stride, &piece, &dst_addr,
                                     &n_src, &stream, &scales_obj, &scale))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = rows.len / (Py_ssize_t)sizeof(int64_t);
    if (rows.len % (Py_ssize_t)sizeof(int64_t) != 0 || !PyBuffer_IsContiguous(&rows, 'C')) {
        PyErr_SetString(PyExc_ValueError, "gather: rows must be a C-contiguous int64 array");
        goto done;
    }
    if (piece < 0 || stride < 0 || n_src < 0) {
        PyErr_SetString(PyExc_ValueError, "gather: piece, stride and n_src must be >= 0");
        goto done;
    }
    const float *sc = NULL;
    if (scales_obj != Py_None) {
        if (PyObject_GetBuffer(scales_obj, &scales, PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (scales.len != n * (Py_ssize_t)sizeof(float)) {
            PyErr_SetString(PyExc_ValueError, "gather: scales must be float32 with one value per row");
            goto done;
        }
        sc = (const float *)scales.buf;
    }
    int scaled = sc != NULL || scale != 1.0;
    if (scaled && piece % 4 != 0) {
        PyErr_SetString(PyExc_ValueError, "gather: scaling needs float32 pieces (piece % 4 == 0)");
        goto done;
    }
    const int64_t *r = (const int64_t *)rows.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (r[i] < 0 || r[i] >= n_src) {
            PyErr_Format(PyExc_IndexError, "gather: row %lld at position %zd is outside [0, %zd)", (long long)r[i], i,
                         n_src);
            goto done;
        }
    }
    const char *src = (const char *)(uintptr_t)src_addr;
    char *dst = (char *)(uintptr_t)dst_addr;
    float f = (float)scale;
    Py_BEGIN_ALLOW_THREADS;
#ifdef ACT_X86
    if (stream && piece % 64 == 0 && ((uintptr_t)dst % 64) == 0) {
        if (isa == 2)
            gather_stream512(src, r, n, stride, piece, dst, sc, f, scaled);
        else if (isa == 1)
            gather_stream256(src, r, n, stride, piece, dst, sc, f, scaled);
        else
            gather_stream128(src, r, n, stride, piece, dst, sc, f, scaled);
    } else
#endif
        gather_plain(src, r, n, stride, piece, dst, sc, f, scaled);
    Py_END_ALLOW_THREADS;
    result = Py_None;
    Py_INCREF(result);
done:
    if (rows.obj) PyBuffer_Release(&rows);
    if (scales.obj) PyBuffer_Release(&scales);
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
    PyBuffer_Release(&pi);
    PyBuffer_Release(&rot);
    PyBuffer_Release(&tau);
    PyBuffer_Release(&shift);
    if (out.obj) PyBuffer_Release(&out);
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

static PyMethodDef methods[] = {
    {"gather", (PyCFunction)(void (*)(void))gather, METH_VARARGS | METH_KEYWORDS,
     "gather(src, rows, stride, piece, dst, n_src, stream=False, scales=None, scale=1.0): copy piece bytes "
     "from src + rows[i]*stride to dst + i*piece for every i (see the module source)."},
    {"touch", touch, METH_VARARGS, "touch(addr, nbytes, step): write a zero every step bytes (fault fresh memory in)."},
    {"balanced_order", balanced_order, METH_VARARGS,
     "balanced_order(n, per, j0, lo, hi, pi, rot, tau, shift, out) -> count: a run's balanced example order "
     "(see actcache/loaders/kernels.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "actcache._native",
                                    "The loaders' copy kernel (see _native.c).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
#ifdef ACT_X86
    __builtin_cpu_init();
    isa = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "isa", isa_name()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
