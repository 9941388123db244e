/* Python entry points: dppo_tv, dppo_kl, clip_cov, kl_cov (bypass_mode reuses vanilla and rollout).
 * Included by _fused.c after DISPATCH; LOSSES_B_METHODS lists the PyMethodDef entries. */

static PyObject *py_dppo_pack(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, old, mask, x;
    Py_ssize_t rows, width, cap, n;
    if (!PyArg_ParseTuple(args, "pKKKnnKn", &f64, &lp, &old, &mask, &rows, &width, &x, &cap)) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        n = DISPATCH(dppo_pack_f64, P(double, lp), P(double, old), P(uint8_t, mask), rows, width, P(double, x), cap);
    else
        n = DISPATCH(dppo_pack_f32, P(float, lp), P(float, old), P(uint8_t, mask), rows, width, P(float, x), cap);
    Py_END_ALLOW_THREADS;
    return PyLong_FromSsize_t(n);
}

static PyObject *py_dppo(PyObject *self, PyObject *args) {
    int f64, kl_kind;
    ptr_t lp, old, x, l, adv, mask, row_out;
    Py_ssize_t cap, rows, width;
    double lo, hi, c, kl = 0.0;
    int64_t kept = 0, lower = 0;
    if (!PyArg_ParseTuple(args, "ppKKKKnKKnndddK", &f64, &kl_kind, &lp, &old, &x, &l, &cap, &adv, &mask, &rows,
                          &width, &lo, &hi, &c, &row_out))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
#define DPPO_ARGS(T) P(T, lp), P(T, old), P(T, x), P(T, l), cap, P(T, adv), P(uint8_t, mask), rows, width
    if (f64 && kl_kind)
        DISPATCH(dppo_kl_f64, DPPO_ARGS(double), lo, hi, c, P(double, row_out), &kl, &kept, &lower);
    else if (f64)
        DISPATCH(dppo_tv_f64, DPPO_ARGS(double), lo, hi, c, P(double, row_out), &kl, &kept, &lower);
    else if (kl_kind)
        DISPATCH(dppo_kl_f32, DPPO_ARGS(float), (float)lo, (float)hi, (float)c, P(double, row_out), &kl, &kept,
                 &lower);
    else
        DISPATCH(dppo_tv_f32, DPPO_ARGS(float), (float)lo, (float)hi, (float)c, P(double, row_out), &kl, &kept,
                 &lower);
#undef DPPO_ARGS
    Py_END_ALLOW_THREADS;
    return Py_BuildValue("dLL", kl, (long long)kept, (long long)lower);
}

static PyObject *py_dppo_frac(PyObject *self, PyObject *args) {
    int f64;
    ptr_t p, q, out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "pKKnK", &f64, &p, &q, &n, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(dppo_frac_f64, P(double, p), P(double, q), n, P(double, out));
    else
        DISPATCH(dppo_frac_f32, P(float, p), P(float, q), n, P(float, out));
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *py_clip_cov_pack(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, old, adv, mask, am, lm, vd;
    Py_ssize_t rows, width, cap, n;
    double kl = 0.0;
    if (!PyArg_ParseTuple(args, "pKKKKnnKKKn", &f64, &lp, &old, &adv, &mask, &rows, &width, &am, &lm, &vd, &cap))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        n = DISPATCH(clip_cov_pack_f64, P(double, lp), P(double, old), P(double, adv), P(uint8_t, mask), rows,
                     width, P(double, am), P(double, lm), P(double, vd), cap, &kl);
    else
        n = DISPATCH(clip_cov_pack_f32, P(float, lp), P(float, old), P(float, adv), P(uint8_t, mask), rows, width,
                     P(float, am), P(float, lm), P(float, vd), cap, &kl);
    Py_END_ALLOW_THREADS;
    return Py_BuildValue("dn", kl, n);
}

static PyObject *py_clip_cov(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, adv, xr, mask, row_out, cand, cand_q;
    Py_ssize_t n_packed, rows, width, cap, n;
    double lo, hi, mean_a, mean_lp, lb, ub;
    if (!PyArg_ParseTuple(args, "pKKKnKnnddddddKKKn", &f64, &lp, &adv, &xr, &n_packed, &mask, &rows, &width, &lo,
                          &hi, &mean_a, &mean_lp, &lb, &ub, &row_out, &cand, &cand_q, &cap))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        n = DISPATCH(clip_cov_f64, P(double, lp), P(double, adv), P(double, xr), n_packed, P(uint8_t, mask), rows,
                     width, lo, hi, mean_a, mean_lp, lb, ub, P(double, row_out), P(int64_t, cand),
                     P(int64_t, cand_q), cap);
    else
        n = DISPATCH(clip_cov_f32, P(float, lp), P(float, adv), P(float, xr), n_packed, P(uint8_t, mask), rows,
                     width, (float)lo, (float)hi, (float)mean_a, (float)mean_lp, (float)lb, (float)ub,
                     P(double, row_out), P(int64_t, cand), P(int64_t, cand_q), cap);
    Py_END_ALLOW_THREADS;
    return PyLong_FromSsize_t(n);
}

static PyObject *py_clip_cov_fix(PyObject *self, PyObject *args) {
    int f64, rc;
    ptr_t adv, xr, cand, cand_q, sel, row_out;
    Py_ssize_t n_packed, n_tokens, width, n_cand, k;
    double lo, hi;
    if (!PyArg_ParseTuple(args, "pKKnnnKKnKnddK", &f64, &adv, &xr, &n_packed, &n_tokens, &width, &cand, &cand_q,
                          &n_cand, &sel, &k, &lo, &hi, &row_out))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        rc = DISPATCH(clip_cov_fix_f64, P(double, adv), P(double, xr), n_packed, n_tokens, width, P(int64_t, cand),
                      P(int64_t, cand_q), n_cand, P(int64_t, sel), k, lo, hi, P(double, row_out));
    else
        rc = DISPATCH(clip_cov_fix_f32, P(float, adv), P(float, xr), n_packed, n_tokens, width, P(int64_t, cand),
                      P(int64_t, cand_q), n_cand, P(int64_t, sel), k, (float)lo, (float)hi, P(double, row_out));
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(rc);
}

static PyObject *py_kl_cov_pack(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, old, adv, mask, va, vl, vd;
    Py_ssize_t rows, width, cap, n;
    double abs_sum = 0.0, a_sum = 0.0;
    if (!PyArg_ParseTuple(args, "pKKKKnnKKKn", &f64, &lp, &old, &adv, &mask, &rows, &width, &va, &vl, &vd, &cap))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        n = DISPATCH(kl_cov_pack_f64, P(double, lp), P(double, old), P(double, adv), P(uint8_t, mask), rows, width,
                     P(double, va), P(double, vl), P(double, vd), cap, &abs_sum, &a_sum);
    else
        n = DISPATCH(kl_cov_pack_f32, P(float, lp), P(float, old), P(float, adv), P(uint8_t, mask), rows, width,
                     P(float, va), P(float, vl), P(float, vd), cap, &abs_sum, &a_sum);
    Py_END_ALLOW_THREADS;
    return Py_BuildValue("ddn", abs_sum, a_sum, n);
}

static PyObject *py_kl_cov_rows(PyObject *self, PyObject *args) {
    int f64;
    ptr_t va, vl, r, n_row, row_out, cov;
    Py_ssize_t rows;
    double mean_a, mean_lp;
    if (!PyArg_ParseTuple(args, "pKKKKnddKK", &f64, &va, &vl, &r, &n_row, &rows, &mean_a, &mean_lp, &row_out,
                          &cov))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(kl_cov_rows_f64, P(double, va), P(double, vl), P(double, r), P(int64_t, n_row), rows, mean_a,
                 mean_lp, P(double, row_out), P(double, cov));
    else
        DISPATCH(kl_cov_rows_f32, P(float, va), P(float, vl), P(float, r), P(int64_t, n_row), rows, (float)mean_a,
                 (float)mean_lp, P(double, row_out), P(float, cov));
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *py_kl_cov_fix(PyObject *self, PyObject *args) {
    int f64, rc;
    ptr_t lp, old, adv, mask, offsets, r, sel, row_out;
    Py_ssize_t rows, width, k;
    double coef;
    if (!PyArg_ParseTuple(args, "pKKKKnnKKKndK", &f64, &lp, &old, &adv, &mask, &rows, &width, &offsets, &r, &sel,
                          &k, &coef, &row_out))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        rc = DISPATCH(kl_cov_fix_f64, P(double, lp), P(double, old), P(double, adv), P(uint8_t, mask), rows, width,
                      P(int64_t, offsets), P(double, r), P(int64_t, sel), k, coef, P(double, row_out));
    else
        rc = DISPATCH(kl_cov_fix_f32, P(float, lp), P(float, old), P(float, adv), P(uint8_t, mask), rows, width,
                      P(int64_t, offsets), P(float, r), P(int64_t, sel), k, (float)coef, P(double, row_out));
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(rc);
}

#define LOSSES_B_METHODS                                                                                   \
    {"dppo", py_dppo, METH_VARARGS, "DPPO-Binary TV / KL: row sums of the loss, kl sum, kept and lower counts"}, \
    {"dppo_pack", py_dppo_pack, METH_VARARGS, "DPPO: the valid tokens' clamped log-ratio, lp, old, packed"},  \
    {"dppo_frac", py_dppo_frac, METH_VARARGS, "dppo_kl's log argument ((1 - q) + 1e-8) / ((1 - p) + 1e-8)"},  \
    {"clip_cov_pack", py_clip_cov_pack, METH_VARARGS, "Clip-Cov: A m, lp m, kl sum, packed log-ratio"},       \
    {"clip_cov", py_clip_cov, METH_VARARGS, "Clip-Cov: loss row sums, candidate flat and packed indices"},     \
    {"clip_cov_fix", py_clip_cov_fix, METH_VARARGS, "Clip-Cov: the drawn candidates' loss off their rows"},    \
    {"kl_cov_pack", py_kl_cov_pack, METH_VARARGS, "KL-Cov: |log-ratio| sum, compacted adv / log_prob / log-ratio"}, \
    {"kl_cov_rows", py_kl_cov_rows, METH_VARARGS, "KL-Cov: loss row sums and covariance of the compacted tokens"}, \
    {"kl_cov_fix", py_kl_cov_fix, METH_VARARGS, "KL-Cov: the top-k tokens' loss with the |log-ratio| term"},
