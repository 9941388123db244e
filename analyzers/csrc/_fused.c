/* Fused token passes of rlvitals.analyzers.fast (modes, modes_cov): one loop over the tokens per loss, GIL released.
 *
 * Each function reads row-major (rows, width) buffers, float32 or float64 (the token dtype T), and the
 * response mask as bytes (0 / non-zero), and writes per-row sums (float64) plus a few totals and counts.
 * The per-token values are the floats verl computes: the same IEEE operations in the same order, no
 * fused multiply-add (built with -ffp-contract=off) and no reassociation; what torch computes that C
 * cannot reproduce bit for bit, exp / sigmoid / log, is torch's: exp called inside the loops, per chunk,
 * where torch's own exp is resolved and checked (set_exp below), else everything arrives precomputed by
 * torch in a buffer.
 * Sums accumulate in float64 in LANES independent partial sums per row (a fixed order, so results are
 * deterministic; they differ from torch's float32 cascade sums by far less than the audit's tolerance).
 *
 * A non-finite value anywhere, under the mask or not, makes some returned sum non-finite (values are
 * multiplied by the 0/1 mask, and NaN * 0 is NaN): the Python side then takes verl's op-for-op path.
 * Clamps are written so that NaN stays NaN, as torch.clamp keeps it.
 *
 * The Python wrappers (analyzers/fast/native.py) check every pointer's tensor: contiguous, CPU, the dtype
 * and shape named here. Nothing here checks again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <dlfcn.h>
#include <stdlib.h>

#ifndef RLV_SOURCE_SHA
#define RLV_SOURCE_SHA "unknown"
#endif

/* torch's own exp, for the loops that take exp inline: on an MKL build of torch, torch.exp of float32 /
 * float64 is MKL's vsExp / vdExp (HA), which libtorch_cpu exports (Fortran interface). set_exp()
 * resolves them from the library torch loaded; native.py then checks, on ~1M values, that calling them
 * reproduces torch.exp bit for bit before any loop uses them, and clears them otherwise. NULL: the
 * loops that need exp run in passes with torch.exp between them. */
typedef void (*exp_f32_fn)(const int *n, const float *a, float *r);
typedef void (*exp_f64_fn)(const int *n, const double *a, double *r);
static exp_f32_fn torch_exp_f32 = NULL;
static exp_f64_fn torch_exp_f64 = NULL;

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2_COPY 1
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2")
#define ISA avx2
#if !defined(__clang__) /* GCC's target pragma enables the AVX2 intrinsics here; clang's does not */
#define RLV_AVX2_INTRINSICS 1 /* the few conversions GCC's vector extensions compile badly (kernels.h) */
#endif
#include "kernels.h"
#undef RLV_AVX2_INTRINSICS
#undef ISA
#pragma GCC pop_options
#endif
#define ISA base
#include "kernels.h"
#undef ISA

static int use_avx2 = 0; /* set once at import: the CPU has AVX2 */
#ifdef HAVE_AVX2_COPY
#define DISPATCH(name, ...) (use_avx2 ? name##_avx2(__VA_ARGS__) : name##_base(__VA_ARGS__))
#else
#define DISPATCH(name, ...) name##_base(__VA_ARGS__)
#endif

/* ---- Python entry points: pointers as integers (the wrappers hold the tensors) ---------------------- */
typedef unsigned long long ptr_t;
#define P(T, x) ((T *)(uintptr_t)(x))

/* Row sums as Python lists: the entry points that return them (count_rows, vanilla, aux, losses A)
 * write them into a buffer of their own, taken under the GIL, and build the lists themselves. Python
 * then allocates no output tensor and calls no .tolist() (about a microsecond each, several when the
 * caches are cold: most of the fixed cost of a small batch). The values are the same doubles .tolist()
 * would give. */
static double *rows_take(Py_ssize_t n) {
    double *p = PyMem_New(double, n > 0 ? n : 1);
    if (!p) PyErr_NoMemory();
    return p;
}

static PyObject *rows_list(const double *v, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyFloat_FromDouble(v[i]);
        if (!x) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, x);
    }
    return list;
}

/* rows_list(v, n), or None (a new reference) where the pass was not asked for v */
static PyObject *rows_list_or_none(const double *v, Py_ssize_t n) {
    if (!v) Py_RETURN_NONE;
    return rows_list(v, n);
}

/* One buffer for a pass's k row outputs (row_out: k * rows doubles) and the entropy / KL row sums
 * (ent_out only with an entropy tensor, kl_out only with a KL estimator: the loops write them only
 * then). Needs rows, ent, kind, ent_out and kl_out in scope. */
#define ROWS_TAKE(k)                                                                                     \
    double *row_out = rows_take(rows * ((k) + (ent != 0) + (kind != 0)));                                \
    if (!row_out) return NULL;                                                                           \
    ent_out = ent ? row_out + (k) * rows : NULL;                                                         \
    kl_out = kind ? row_out + ((k) + (ent != 0)) * rows : NULL
/* the entropy and KL row sums as lists (None where not asked for), for Py_BuildValue's "NN" */
#define ENT_KL_LISTS rows_list_or_none(ent_out, rows), rows_list_or_none(kl_out, rows)
/* Build the return value, then free the pass's buffer */
#define RETURN_ROWS(fmt, ...)                                                                            \
    do {                                                                                                 \
        PyObject *result_ = Py_BuildValue(fmt, __VA_ARGS__);                                             \
        PyMem_Free(row_out);                                                                             \
        return result_;                                                                                  \
    } while (0)

#include "losses_a_py.h"
#include "losses_b_py.h"
#include "rollout_py.h"

static PyObject *py_set_exp(PyObject *self, PyObject *args) {
    const char *path = NULL;
    if (!PyArg_ParseTuple(args, "z", &path)) return NULL;
    torch_exp_f32 = NULL;
    torch_exp_f64 = NULL;
    if (path) {
        void *lib = dlopen(path, RTLD_LAZY | RTLD_NOLOAD); /* only a library this process already loaded */
        if (lib) {
            torch_exp_f32 = (exp_f32_fn)dlsym(lib, "VSEXP_");
            torch_exp_f64 = (exp_f64_fn)dlsym(lib, "VDEXP_");
        }
    }
    return Py_BuildValue("OO", torch_exp_f32 ? Py_True : Py_False, torch_exp_f64 ? Py_True : Py_False);
}

/* exp of n values through the resolved function, in the loops' chunks (the self-test) */
static PyObject *py_exp_chunks(PyObject *self, PyObject *args) {
    int f64;
    ptr_t a, r;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "pKKn", &f64, &a, &r, &n)) return NULL;
    if (f64 ? !torch_exp_f64 : !torch_exp_f32) Py_RETURN_FALSE;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i += EXP_CHUNK) {
        int m = (int)(n - i < EXP_CHUNK ? n - i : EXP_CHUNK);
        if (f64)
            torch_exp_f64(&m, P(double, a) + i, P(double, r) + i);
        else
            torch_exp_f32(&m, P(float, a) + i, P(float, r) + i);
    }
    Py_END_ALLOW_THREADS;
    Py_RETURN_TRUE;
}

/* (loss rows, entropy rows, KL rows, pos, neg, kl, k2, guard); rows as lists, None where not asked for */
static PyObject *py_vfused(PyObject *self, PyObject *args) {
    int f64, kind, check, skip;
    ptr_t lp, old, ref, adv, ent, mask;
    Py_ssize_t rows, width;
    double lo, hi, c, kl = 0.0, k2 = 0.0, guard = 0.0, *ent_out, *kl_out;
    int64_t pos = 0, neg = 0;
    if (!PyArg_ParseTuple(args, "pKKKKKKnndddipp", &f64, &lp, &old, &ref, &adv, &ent, &mask, &rows, &width, &lo,
                          &hi, &c, &kind, &check, &skip))
        return NULL;
    if (f64 ? !torch_exp_f64 : !torch_exp_f32) {
        PyErr_SetString(PyExc_RuntimeError, "vfused: no checked exp");
        return NULL;
    }
    ROWS_TAKE(1);
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(vfused_f64, P(double, lp), P(double, old), P(double, ref), P(double, adv), P(double, ent),
                 P(uint8_t, mask), rows, width, lo, hi, c, kind, check, skip, row_out, ent_out, kl_out, &pos, &neg,
                 &kl, &k2, &guard);
    else
        DISPATCH(vfused_f32, P(float, lp), P(float, old), P(float, ref), P(float, adv), P(float, ent),
                 P(uint8_t, mask), rows, width, (float)lo, (float)hi, (float)c, kind, check, skip, row_out,
                 ent_out, kl_out, &pos, &neg, &kl, &k2, &guard);
    Py_END_ALLOW_THREADS;
    RETURN_ROWS("NNNLLddd", rows_list(row_out, rows), ENT_KL_LISTS, (long long)pos, (long long)neg, kl, k2, guard);
}

/* (counts per row: list of ints, verl's T + 1e-8 per row: list of floats, total) */
static PyObject *py_count_rows(PyObject *self, PyObject *args) {
    ptr_t mask;
    Py_ssize_t rows, width;
    int64_t total = 0;
    if (!PyArg_ParseTuple(args, "Knn", &mask, &rows, &width)) return NULL;
    double *len_out = rows_take(rows);
    int64_t *n_out = len_out ? PyMem_New(int64_t, rows > 0 ? rows : 1) : NULL;
    if (!n_out) {
        PyMem_Free(len_out);
        return len_out ? PyErr_NoMemory() : NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    total = DISPATCH(count_rows, P(uint8_t, mask), rows, width, n_out, len_out);
    Py_END_ALLOW_THREADS;
    PyObject *counts = PyList_New(rows);
    for (Py_ssize_t i = 0; counts && i < rows; i++) {
        PyObject *x = PyLong_FromLongLong((long long)n_out[i]);
        if (!x) Py_CLEAR(counts);
        else PyList_SET_ITEM(counts, i, x);
    }
    PyObject *lengths = counts ? rows_list(len_out, rows) : NULL;
    PyMem_Free(n_out);
    PyMem_Free(len_out);
    return Py_BuildValue("NNL", counts, lengths, (long long)total);
}

static PyObject *py_vprep(PyObject *self, PyObject *args) {
    int f64, check;
    ptr_t lp, old, ref, adv, ent, mask, xd, xk;
    Py_ssize_t rows, width, cap, q = 0;
    double kl = 0.0, k2 = 0.0, guard = 0.0;
    if (!PyArg_ParseTuple(args, "pKKKKKKnnpKKn", &f64, &lp, &old, &ref, &adv, &ent, &mask, &rows, &width,
                          &check, &xd, &xk, &cap))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        q = DISPATCH(vprep_f64, P(double, lp), P(double, old), P(double, ref), P(double, adv), P(double, ent),
                     P(uint8_t, mask), rows, width, check, P(double, xd), P(double, xk), cap, &kl, &k2, &guard);
    else
        q = DISPATCH(vprep_f32, P(float, lp), P(float, old), P(float, ref), P(float, adv), P(float, ent),
                     P(uint8_t, mask), rows, width, check, P(float, xd), P(float, xk), cap, &kl, &k2, &guard);
    Py_END_ALLOW_THREADS;
    return Py_BuildValue("nddd", q, kl, k2, guard);
}

/* (loss rows, entropy rows, KL rows, pos, neg); rows as lists, None where not asked for */
static PyObject *py_vpacked(PyObject *self, PyObject *args) {
    int f64, kind;
    ptr_t xr, xe, adv, mask, ent, lp, ref;
    Py_ssize_t cap, rows, width;
    double lo, hi, c, *ent_out, *kl_out;
    int64_t pos = 0, neg = 0;
    if (!PyArg_ParseTuple(args, "pKKnKKnndddKKKi", &f64, &xr, &xe, &cap, &adv, &mask, &rows, &width, &lo, &hi, &c,
                          &ent, &lp, &ref, &kind))
        return NULL;
    ROWS_TAKE(1);
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(vpacked_f64, P(double, xr), P(double, xe), cap, P(double, adv), P(uint8_t, mask), rows, width,
                 lo, hi, c, row_out, &pos, &neg, P(double, ent), P(double, lp), P(double, ref), kind, ent_out,
                 kl_out);
    else
        DISPATCH(vpacked_f32, P(float, xr), P(float, xe), cap, P(float, adv), P(uint8_t, mask), rows, width,
                 (float)lo, (float)hi, (float)c, row_out, &pos, &neg, P(float, ent), P(float, lp), P(float, ref),
                 kind, ent_out, kl_out);
    Py_END_ALLOW_THREADS;
    RETURN_ROWS("NNNLL", rows_list(row_out, rows), ENT_KL_LISTS, (long long)pos, (long long)neg);
}

/* (entropy rows, KL rows, k2); rows as lists, None where not asked for */
static PyObject *py_aux(PyObject *self, PyObject *args) {
    int f64, kind, check, skip;
    ptr_t mask, ent, lp, ref, e;
    Py_ssize_t rows, width;
    double k2 = 0.0, *ent_out, *kl_out;
    if (!PyArg_ParseTuple(args, "pKKKKKnnipp", &f64, &mask, &ent, &lp, &ref, &e, &rows, &width, &kind, &check,
                          &skip))
        return NULL;
    ROWS_TAKE(0);
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(aux_f64, P(uint8_t, mask), P(double, ent), P(double, lp), P(double, ref), P(double, e), rows, width,
                kind, check, ent_out, kl_out, &k2, skip);
    else
        DISPATCH(aux_f32, P(uint8_t, mask), P(float, ent), P(float, lp), P(float, ref), P(float, e), rows, width, kind,
                check, ent_out, kl_out, &k2, skip);
    Py_END_ALLOW_THREADS;
    RETURN_ROWS("NNd", ENT_KL_LISTS, k2);
}

static PyMethodDef methods[] = {
    {"set_exp", py_set_exp, METH_VARARGS, "resolve torch's exp (MKL vsExp / vdExp) from libtorch_cpu"},
    {"exp_chunks", py_exp_chunks, METH_VARARGS, "exp through the resolved function, in the loops' chunks"},
    {"vfused", py_vfused, METH_VARARGS, "vanilla + entropy / KL in one pass, exp inline (checked exp only)"},
    {"count_rows", py_count_rows, METH_VARARGS, "valid tokens per row, verl's T + 1e-8 per row (lists), the total"},
    {"vprep", py_vprep, METH_VARARGS, "vanilla: packed valid log-ratios, kl / k2 / non-finite guard sums"},
    {"vpacked", py_vpacked, METH_VARARGS, "vanilla over packed ratios, with entropy / KL rows"},
    {"aux", py_aux, METH_VARARGS, "entropy and KL-estimator row sums, and the k2 check sum"},
    LOSSES_A_METHODS LOSSES_B_METHODS ROLLOUT_METHODS
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_fused", .m_doc = "fused token passes (see native.py)", .m_size = -1,
    .m_methods = methods};

PyMODINIT_FUNC PyInit__fused(void) {
#ifdef HAVE_AVX2_COPY
    __builtin_cpu_init();
    /* RLVITALS_NATIVE_ISA=base runs the portable copy on an AVX2 machine (the tests compare the two) */
    const char *isa = getenv("RLVITALS_NATIVE_ISA");
    use_avx2 = __builtin_cpu_supports("avx2") && !(isa && strcmp(isa, "base") == 0);
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddStringConstant(m, "SOURCE_SHA", RLV_SOURCE_SHA) < 0 ||
              PyModule_AddStringConstant(m, "ISA", use_avx2 ? "avx2" : "base") < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
