/* Python entry points: gpg, dro, cispo, sapo, gspo, geo_mean.
 * Included by _fused.c after DISPATCH; LOSSES_A_METHODS lists the PyMethodDef entries.
 * Every pointer comes from a tensor native.Inputs checked (its losses-A section). Row sums come back
 * as lists of floats, first (rows_take / rows_list in _fused.c). The passes that read logp also take
 * the aux loop's arguments (AUX_FMT: entropy, ref, e, kind, check, skip: ROW_LOOP_V's, ignored by the
 * passes that read every token) and return, last, its entropy and KL row sums (lists, None where not
 * asked for) and its k2 check sum, as native.Inputs.aux does. */
#define AUX_FMT "KKKipp"
#define AUX_DECL                                                                                         \
    ptr_t ent, ref, e;                                                                                   \
    int kind, check, skip;                                                                               \
    double k2 = 0.0, *ent_out = NULL, *kl_out = NULL
#define AUX_REFS &ent, &ref, &e, &kind, &check, &skip
#define AUX_PASS(T) P(T, ent), P(T, ref), P(T, e), kind, check, ent_out, kl_out, &k2, skip
/* ... entropy rows, KL rows, k2: the end of every aux pass's return value (buffers: ROWS_TAKE) */
#define AUX_FMT_OUT "NNd"
#define AUX_OUT ENT_KL_LISTS, k2
/* No exp buffer (e with k3, or the ratio r) means exp inline, which needs the checked exp */
static int exp_ready(int f64, int inline_exp, const char *name) {
    if (inline_exp && (f64 ? !torch_exp_f64 : !torch_exp_f32)) {
        PyErr_Format(PyExc_RuntimeError, "%s: no exp buffer and no checked exp to take it inline", name);
        return 0;
    }
    return 1;
}
#define AUX_EXP_READY(name, ...) exp_ready(f64, (kind == 4 && !e) __VA_ARGS__, name)

static PyObject *py_gpg(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, adv, mask;
    Py_ssize_t rows, width;
    AUX_DECL;
    if (!PyArg_ParseTuple(args, "pKKKnn" AUX_FMT, &f64, &lp, &adv, &mask, &rows, &width, AUX_REFS)) return NULL;
    if (!AUX_EXP_READY("gpg")) return NULL;
    ROWS_TAKE(1);
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(gpg_f64, P(double, lp), P(double, adv), P(uint8_t, mask), rows, width, row_out, AUX_PASS(double));
    else
        DISPATCH(gpg_f32, P(float, lp), P(float, adv), P(uint8_t, mask), rows, width, row_out, AUX_PASS(float));
    Py_END_ALLOW_THREADS;
    RETURN_ROWS("N" AUX_FMT_OUT, rows_list(row_out, rows), AUX_OUT);
}

static PyObject *py_dro(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, old, adv, mask;
    Py_ssize_t rows, width;
    AUX_DECL;
    double hb, kl = 0.0;
    if (!PyArg_ParseTuple(args, "pKKKKnnd" AUX_FMT, &f64, &lp, &old, &adv, &mask, &rows, &width, &hb, AUX_REFS))
        return NULL;
    if (!AUX_EXP_READY("dro")) return NULL;
    ROWS_TAKE(1);
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(dro_f64, P(double, lp), P(double, old), P(double, adv), P(uint8_t, mask), rows, width, hb,
                 row_out, &kl, AUX_PASS(double));
    else
        DISPATCH(dro_f32, P(float, lp), P(float, old), P(float, adv), P(uint8_t, mask), rows, width, (float)hb,
                 row_out, &kl, AUX_PASS(float));
    Py_END_ALLOW_THREADS;
    RETURN_ROWS("Nd" AUX_FMT_OUT, rows_list(row_out, rows), kl, AUX_OUT);
}

static PyObject *py_cispo(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, old, r, adv, mask;
    Py_ssize_t rows, width;
    AUX_DECL;
    double lo, hi, kl = 0.0;
    int64_t hits = 0;
    if (!PyArg_ParseTuple(args, "pKKKKKnndd" AUX_FMT, &f64, &lp, &old, &r, &adv, &mask, &rows, &width, &lo, &hi,
                          AUX_REFS))
        return NULL;
    if (!AUX_EXP_READY("cispo", || !r)) return NULL;
    ROWS_TAKE(1);
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(cispo_f64, P(double, lp), P(double, old), P(double, r), P(double, adv), P(uint8_t, mask), rows,
                 width, lo, hi, row_out, &kl, &hits, AUX_PASS(double));
    else
        DISPATCH(cispo_f32, P(float, lp), P(float, old), P(float, r), P(float, adv), P(uint8_t, mask), rows,
                 width, (float)lo, (float)hi, row_out, &kl, &hits, AUX_PASS(float));
    Py_END_ALLOW_THREADS;
    RETURN_ROWS("NdL" AUX_FMT_OUT, rows_list(row_out, rows), kl, (long long)hits, AUX_OUT);
}

static PyObject *py_sapo_gate(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, old, r, adv, mask, x;
    Py_ssize_t rows, width;
    AUX_DECL;
    double tp, tn, kl = 0.0;
    if (!PyArg_ParseTuple(args, "pKKKKKnnddK" AUX_FMT, &f64, &lp, &old, &r, &adv, &mask, &rows, &width, &tp, &tn, &x, AUX_REFS))
        return NULL;
    if (!AUX_EXP_READY("sapo_gate", || !r)) return NULL;
    ROWS_TAKE(0);
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(sapo_gate_f64, P(double, lp), P(double, old), P(double, r), P(double, adv), P(uint8_t, mask),
                 rows, width, tp, tn, P(double, x), &kl, AUX_PASS(double));
    else
        DISPATCH(sapo_gate_f32, P(float, lp), P(float, old), P(float, r), P(float, adv), P(uint8_t, mask), rows,
                 width, (float)tp, (float)tn, P(float, x), &kl, AUX_PASS(float));
    Py_END_ALLOW_THREADS;
    RETURN_ROWS("d" AUX_FMT_OUT, kl, AUX_OUT);
}

static PyObject *py_sapo(PyObject *self, PyObject *args) {
    int f64;
    ptr_t g, adv, mask;
    Py_ssize_t rows, width;
    double qp, qn;
    if (!PyArg_ParseTuple(args, "pKKKnndd", &f64, &g, &adv, &mask, &rows, &width, &qp, &qn)) return NULL;
    double *row_out = rows_take(rows);
    if (!row_out) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(sapo_f64, P(double, g), P(double, adv), P(uint8_t, mask), rows, width, qp, qn, row_out);
    else
        DISPATCH(sapo_f32, P(float, g), P(float, adv), P(uint8_t, mask), rows, width, (float)qp, (float)qn,
                 row_out);
    Py_END_ALLOW_THREADS;
    RETURN_ROWS("N", rows_list(row_out, rows));
}

static PyObject *py_gspo_logratio(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, old, mask, d;
    Py_ssize_t rows, width;
    AUX_DECL;
    if (!PyArg_ParseTuple(args, "pKKKnnK" AUX_FMT, &f64, &lp, &old, &mask, &rows, &width, &d, AUX_REFS)) return NULL;
    if (!AUX_EXP_READY("gspo_logratio")) return NULL;
    ROWS_TAKE(0);
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(gspo_logratio_f64, P(double, lp), P(double, old), P(uint8_t, mask), rows, width, P(double, d), AUX_PASS(double));
    else
        DISPATCH(gspo_logratio_f32, P(float, lp), P(float, old), P(uint8_t, mask), rows, width, P(float, d), AUX_PASS(float));
    Py_END_ALLOW_THREADS;
    RETURN_ROWS(AUX_FMT_OUT, AUX_OUT);
}

static PyObject *py_gspo(PyObject *self, PyObject *args) {
    int f64;
    ptr_t adv, mask, s;
    Py_ssize_t rows, width;
    double lo, hi;
    int64_t hits = 0;
    if (!PyArg_ParseTuple(args, "pKKKnndd", &f64, &adv, &mask, &s, &rows, &width, &lo, &hi)) return NULL;
    double *row_out = rows_take(rows);
    if (!row_out) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(gspo_f64, P(double, adv), P(uint8_t, mask), P(double, s), rows, width, lo, hi, row_out, &hits);
    else
        DISPATCH(gspo_f32, P(float, adv), P(uint8_t, mask), P(float, s), rows, width, (float)lo, (float)hi, row_out,
                 &hits);
    Py_END_ALLOW_THREADS;
    RETURN_ROWS("NL", rows_list(row_out, rows), (long long)hits);
}

static PyObject *py_geo_mean(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, old, adv, mask;
    Py_ssize_t rows, width;
    AUX_DECL;
    double nlo, hi, kl = 0.0;
    int64_t pos = 0, neg = 0;
    if (!PyArg_ParseTuple(args, "pKKKKnndd" AUX_FMT, &f64, &lp, &old, &adv, &mask, &rows, &width, &nlo, &hi, AUX_REFS))
        return NULL;
    if (!AUX_EXP_READY("geo_mean")) return NULL;
    ROWS_TAKE(2);
    double *adv_out = row_out + rows;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(geo_mean_f64, P(double, lp), P(double, old), P(double, adv), P(uint8_t, mask), rows, width, nlo,
                 hi, row_out, adv_out, &kl, &pos, &neg, AUX_PASS(double));
    else
        DISPATCH(geo_mean_f32, P(float, lp), P(float, old), P(float, adv), P(uint8_t, mask), rows, width,
                 (float)nlo, (float)hi, row_out, adv_out, &kl, &pos, &neg, AUX_PASS(float));
    Py_END_ALLOW_THREADS;
    RETURN_ROWS("NNdLL" AUX_FMT_OUT, rows_list(row_out, rows), rows_list(adv_out, rows), kl, (long long)pos,
                (long long)neg, AUX_OUT);
}

static PyObject *py_logratios(PyObject *self, PyObject *args) {
    int f64;
    ptr_t lp, old, ref, r, e;
    Py_ssize_t rows, width;
    if (!PyArg_ParseTuple(args, "pKKKnnKK", &f64, &lp, &old, &ref, &rows, &width, &r, &e)) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    if (f64)
        DISPATCH(logratios_f64, P(double, lp), P(double, old), P(double, ref), rows, width, P(double, r),
                 P(double, e));
    else
        DISPATCH(logratios_f32, P(float, lp), P(float, old), P(float, ref), rows, width, P(float, r), P(float, e));
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

#define LOSSES_A_METHODS                                                                                 \
    {"logratios", py_logratios, METH_VARARGS, "clamp(logp - old) and clamp(ref - logp) into buffers"}, \
    {"gpg", py_gpg, METH_VARARGS, "gpg: row sums of logp A m"},                                          \
    {"dro", py_dro, METH_VARARGS, "dro: row sums of (logp A - hb d^2) m, kl sum"},                       \
    {"cispo", py_cispo, METH_VARARGS, "cispo: row sums of clamp(r) A logp m, kl sum, clip count"},       \
    {"sapo_gate", py_sapo_gate, METH_VARARGS, "sapo: (r - 1) tau into a buffer, kl sum"},                \
    {"sapo", py_sapo, METH_VARARGS, "sapo: row sums of (sigmoid q) A m"},                                \
    {"gspo_logratio", py_gspo_logratio, METH_VARARGS, "gspo: (logp - old) m into a buffer"},             \
    {"gspo", py_gspo, METH_VARARGS, "gspo: row sums of the sequence-ratio loss, clip count"},            \
    {"geo_mean", py_geo_mean, METH_VARARGS, "geo_mean: row sums of the clipped log-ratio and A m, kl, clip counts"},
