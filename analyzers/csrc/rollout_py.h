/* Python entry points: rollout correction: IS weights, rejection masks, rollout_corr/... and training/rollout_... metrics.
 * Included by _fused.c after DISPATCH; ROLLOUT_METHODS lists the PyMethodDef entries.
 * The wrappers are native.Inputs.rc_* (analyzers/fast/native_calls.py): they check every buffer. */

static PyObject *py_rc_off(PyObject *self, PyObject *args) {
    int f64, big;
    ptr_t old, ro, e, rho, mask, dm_out, row_out, count_out, tot_out, rho_out;
    Py_ssize_t rows, width;
    if (!PyArg_ParseTuple(args, "pKKKKKnnKKKKK", &f64, &old, &ro, &e, &rho, &mask, &rows, &width, &dm_out,
                          &row_out, &count_out, &tot_out, &rho_out))
        return NULL;
    if ((!e || !rho) && (e || rho || (f64 ? !torch_exp_f64 : !torch_exp_f32))) {
        PyErr_SetString(PyExc_RuntimeError, "rc_off: exp inline needs the checked exp (and neither buffer)");
        return NULL;
    }
    if (e && rho_out) {
        PyErr_SetString(PyExc_RuntimeError, "rc_off: rho_out is the inline exp's output");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        big = DISPATCH(rc_off_f64, P(double, old), P(double, ro), P(double, e), P(double, rho), P(uint8_t, mask),
                       rows, width, P(double, dm_out), P(double, row_out), P(int64_t, count_out), P(double, tot_out),
                       P(double, rho_out));
    else
        big = DISPATCH(rc_off_f32, P(float, old), P(float, ro), P(float, e), P(float, rho), P(uint8_t, mask), rows,
                       width, P(float, dm_out), P(double, row_out), P(int64_t, count_out), P(double, tot_out),
                       P(float, rho_out));
    Py_END_ALLOW_THREADS;
    return PyBool_FromLong(big);
}

static PyObject *py_rc_ist(PyObject *self, PyObject *args) {
    int f64, icepop;
    ptr_t rho, mask, w_out, sq_out, row_out, tot_out, cnt_out, mm_out;
    Py_ssize_t rows, width;
    double lo, hi;
    if (!PyArg_ParseTuple(args, "pKKnnpddKKKKKK", &f64, &rho, &mask, &rows, &width, &icepop, &lo, &hi, &w_out,
                          &sq_out, &row_out, &tot_out, &cnt_out, &mm_out))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(rc_ist_f64, P(double, rho), P(uint8_t, mask), rows, width, icepop, lo, hi, P(double, w_out),
                 P(double, sq_out), P(double, row_out), P(double, tot_out), P(int64_t, cnt_out), P(double, mm_out));
    else
        DISPATCH(rc_ist_f32, P(float, rho), P(uint8_t, mask), rows, width, icepop, (float)lo, (float)hi,
                 P(float, w_out), P(float, sq_out), P(double, row_out), P(double, tot_out), P(int64_t, cnt_out), P(double, mm_out));
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *py_rc_ess(PyObject *self, PyObject *args) {
    int f64, norm;
    ptr_t w, mask;
    Py_ssize_t rows, width;
    double hi, c, bn, total;
    if (!PyArg_ParseTuple(args, "pKKnnddpd", &f64, &w, &mask, &rows, &width, &hi, &c, &norm, &bn)) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        total = DISPATCH(rc_ess_f64, P(double, w), P(uint8_t, mask), rows, width, hi, c, norm, bn);
    else
        total = DISPATCH(rc_ess_f32, P(float, w), P(uint8_t, mask), rows, width, (float)hi, (float)c, norm,
                         (float)bn);
    Py_END_ALLOW_THREADS;
    return PyFloat_FromDouble(total);
}

static PyObject *py_rc_fill(PyObject *self, PyObject *args) {
    int f64;
    ptr_t vals, mask, out;
    Py_ssize_t rows, width;
    if (!PyArg_ParseTuple(args, "pKKnnK", &f64, &vals, &mask, &rows, &width, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(rc_fill_f64, P(double, vals), P(uint8_t, mask), rows, width, P(double, out));
    else
        DISPATCH(rc_fill_f32, P(float, vals), P(uint8_t, mask), rows, width, P(float, out));
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *py_rc_rs(PyObject *self, PyObject *args) {
    int f64, kind, token, k1;
    ptr_t old, ro, rho, mask, keep, x1, x2, row_out, rej_out, tot_out, cnt_out, mm_out;
    Py_ssize_t rows, width;
    double lo, hi, clo;
    if (!PyArg_ParseTuple(args, "pKKKKnnippdddKKKKKKKK", &f64, &old, &ro, &rho, &mask, &rows, &width, &kind,
                          &token, &k1, &lo, &hi, &clo, &keep, &x1, &x2, &row_out, &rej_out, &tot_out, &cnt_out,
                          &mm_out))
        return NULL;
    if (kind < 1 || kind > 3) {
        PyErr_SetString(PyExc_ValueError, "kind must be 1, 2 or 3");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(rc_rs_f64, P(double, old), P(double, ro), P(double, rho), P(uint8_t, mask), rows, width, kind,
                 token, k1, lo, hi, clo, P(uint8_t, keep), P(double, x1), P(double, x2), P(double, row_out),
                 P(int64_t, rej_out),
                 P(double, tot_out), P(int64_t, cnt_out), P(double, mm_out));
    else
        DISPATCH(rc_rs_f32, P(float, old), P(float, ro), P(float, rho), P(uint8_t, mask), rows, width, kind, token,
                 k1, (float)lo, (float)hi, (float)clo, P(uint8_t, keep), P(float, x1), P(float, x2),
                 P(double, row_out), P(int64_t, rej_out),
                 P(double, tot_out), P(int64_t, cnt_out), P(double, mm_out));
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *py_rc_dbg(PyObject *self, PyObject *args) {
    int f64;
    ptr_t a, r, la, lr, mask, out;
    Py_ssize_t rows, width;
    if (!PyArg_ParseTuple(args, "pKKKKKnnK", &f64, &a, &r, &la, &lr, &mask, &rows, &width, &out)) return NULL;
    if ((!a || !r) && (a || r || !la || !lr || (f64 ? !torch_exp_f64 : !torch_exp_f32))) {
        PyErr_SetString(PyExc_RuntimeError, "rc_dbg: exp inline needs both log-probs and the checked exp");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(rc_dbg_f64, P(double, a), P(double, r), P(double, la), P(double, lr), P(uint8_t, mask), rows,
                 width, P(double, out));
    else
        DISPATCH(rc_dbg_f32, P(float, a), P(float, r), P(float, la), P(float, lr), P(uint8_t, mask), rows, width,
                 P(double, out));
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *py_rc_mask(PyObject *self, PyObject *args) {
    int kind, ok = 0;
    ptr_t src, out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iKnK", &kind, &src, &n, &out)) return NULL;
    if (kind < 0 || kind > 3) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 (int64), 1 (int32), 2 (float32) or 3 (float64)");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    if (kind == 0)
        ok = DISPATCH(rc_mask_i64, P(int64_t, src), n, P(uint8_t, out));
    else if (kind == 1)
        ok = DISPATCH(rc_mask_i32, P(int32_t, src), n, P(uint8_t, out));
    else if (kind == 2)
        ok = DISPATCH(rc_mask_f32, P(float, src), n, P(uint8_t, out));
    else
        ok = DISPATCH(rc_mask_f64, P(double, src), n, P(uint8_t, out));
    Py_END_ALLOW_THREADS;
    return PyBool_FromLong(ok);
}

#define ROLLOUT_METHODS                                                                                  \
    {"rc_off", py_rc_off, METH_VARARGS, "off-policy row sums, counts, k3 and rho^2 totals; |d| > 20 seen"}, \
    {"rc_ist", py_rc_ist, METH_VARARGS, "token IS weights (TIS / IcePop), their sums, counts, max, min"},   \
    {"rc_ess", py_rc_ess, METH_VARARGS, "ESS sum of the token weights; batch normalisation in place"},     \
    {"rc_fill", py_rc_fill, METH_VARARGS, "one value per row on its valid tokens"},                        \
    {"rc_rs", py_rc_rs, METH_VARARGS, "rejection statistic sums, maxima, counts and keep mask"},       \
    {"rc_dbg", py_rc_dbg, METH_VARARGS, "probability-difference and correlation sums (debug metrics)"},   \
    {"rc_mask", py_rc_mask, METH_VARARGS, "a 0/1 mask of int64 / int32 / float32 / float64 as bytes"},
