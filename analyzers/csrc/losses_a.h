/* Kernels: gpg, dro, cispo, sapo, gspo, geo_mean.
 * Included by kernels.h once per instruction set (names through K(...), vectors as in kernels.h).
 *
 * Each one is the torch-op pass of the same name in kernels.py (_fused_<mode>), op for op: the per-token
 * floats are those of that pass (and so verl's), the sums are float64 lane sums, the counts exact. exp is
 * torch's own, inline (xchunk, kernels.h) or from a buffer; what torch must compute otherwise (sapo's
 * sigmoid, gspo's per-sequence ratio) splits those passes in two halves, torch's op between them. The
 * row loop, the entropy / KL terms riding along and the inline exp are kernels.h's (shared with aux). */

/* ---- gpg: l = -(logp A); the row sums of (logp A) m (the caller negates them) ------------------------ */
#define GPG_BODY(S, LP, ADV, M)                                                                          \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        K(acc_##S)(acc, (K(ld_##S)(LP) * K(ld_##S)(ADV)) * m);                                           \
    }

#define DEFINE_GPG(S, T)                                                                                 \
    static void K(gpg_##S)(const T *lp, const T *adv, const uint8_t *mask, Py_ssize_t rows,              \
                           Py_ssize_t width, double *row_out, AUX_PARAMS(T)) {                           \
        AUX_CONSTS(S, T);                                                                            \
        XBUFS(T);                                                                                \
        AUX_SPECIALISED(T, ROW_LOOP_V(S, AUX_XP(S, T), dacc acc[2] = {0}; AUX_PRE,                                                          \
                 {                                                                                       \
                     GPG_BODY(S, lp + o + j, adv + o + j, mask + o + j);                                 \
                     AUX_AT(S, lp + o + j, mask + o + j);                                                \
                 },                                                                                      \
                 {                                                                                       \
                     PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, adv, adv + o, j, width);          \
                     PAD(uint8_t, N_##S, m, mask + o, j, width);                                         \
                     GPG_BODY(S, lp_pad, adv_pad, m_pad);                                                \
                     AUX_TAIL(S, T);                                                                     \
                 },                                                                                      \
                 {                                                                                       \
                     row_out[i] = K(acc_total)(acc);                                                     \
                     AUX_POST;                                                                           \
                 }))                                                                                      \
        AUX_END;                                                                                         \
    }
DEFINE_GPG(f32, float)
DEFINE_GPG(f64, double)

/* ---- dro: l = -(logp A - hb (logp - old)^2), hb = 0.5 beta; kl: masked sum of logp - old (no clamp) -- */
#define DRO_BODY(S, LP, OLD, ADV, M)                                                                     \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##v lpv = K(ld_##S)(LP);                                                                  \
        const S##v d = lpv - K(ld_##S)(OLD);                                                             \
        K(acc_##S)(kl_acc, d * m);                                                                       \
        K(acc_##S)(acc, (lpv * K(ld_##S)(ADV) - (d * d) * hb) * m);                                      \
    }

#define DEFINE_DRO(S, T)                                                                                 \
    static void K(dro_##S)(const T *lp, const T *old, const T *adv, const uint8_t *mask, Py_ssize_t rows, \
                           Py_ssize_t width, T hb_, double *row_out, double *lr_out, AUX_PARAMS(T)) {    \
        const S##v hb = SPLAT(S, T, hb_);                                                                \
        AUX_CONSTS(S, T);                                                                            \
        XBUFS(T);                                                                                \
        dacc kl_acc[2] = {0};                                                                            \
        AUX_SPECIALISED(T, ROW_LOOP_V(S, AUX_XP(S, T), dacc acc[2] = {0}; AUX_PRE,                                                          \
                 {                                                                                       \
                     DRO_BODY(S, lp + o + j, old + o + j, adv + o + j, mask + o + j);                    \
                     AUX_AT(S, lp + o + j, mask + o + j);                                                \
                 },                                                                                      \
                 {                                                                                       \
                     PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, old, old + o, j, width);          \
                     PAD(T, N_##S, adv, adv + o, j, width) PAD(uint8_t, N_##S, m, mask + o, j, width);   \
                     DRO_BODY(S, lp_pad, old_pad, adv_pad, m_pad);                                       \
                     AUX_TAIL(S, T);                                                                     \
                 },                                                                                      \
                 {                                                                                       \
                     row_out[i] = K(acc_total)(acc);                                                     \
                     AUX_POST;                                                                           \
                 }))                                                                                      \
        *lr_out = K(acc_total)(kl_acc);                                                                  \
        AUX_END;                                                                                         \
    }
DEFINE_DRO(f32, float)
DEFINE_DRO(f64, double)

/* ---- cispo: l = -(clamp(r, lo, hi) A logp); clipped where r != clamp(r, lo, hi) ----------------------
 * kl: the masked sum of clamp(logp - old, -20, 20); r = exp(that) from torch. */
#define CISPO_BODY(S, LP, OLD, R, ADV, M)                                                                \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        S##v d = K(ld_##S)(LP) - K(ld_##S)(OLD);                                                         \
        d = CLAMP(S, d, -lim, lim);                                                                      \
        K(acc_##S)(kl_acc, d * m);                                                                       \
        const S##v rk = K(ld_##S)(R);                                                                    \
        const S##v c = CLAMP(S, rk, lo, hi);                                                             \
        K(acc_##S)(acc, ((c * K(ld_##S)(ADV)) * K(ld_##S)(LP)) * m);                                     \
        hc += (rk != c) & (m != zero);                                                                   \
    }

#define DEFINE_CISPO(S, T)                                                                               \
    static void K(cispo_##S)(const T *lp, const T *old, const T *r, const T *adv, const uint8_t *mask,   \
                             Py_ssize_t rows, Py_ssize_t width, T lo_, T hi_, double *row_out,           \
                             double *lr_out, int64_t *hits_out, AUX_PARAMS(T)) {                         \
        const S##v lo = SPLAT(S, T, lo_), hi = SPLAT(S, T, hi_);                                         \
        AUX_CONSTS(S, T);                                                                            \
        XBUFS_R(T);                                                                                \
        dacc kl_acc[2] = {0};                                                                            \
        int64_t hits = 0;                                                                                \
        AUX_SPECIALISED(T, ROW_LOOP_V(S, AUX_XP_R(S, T), dacc acc[2] = {0}; S##m hc = {0}; AUX_PRE,                                           \
                 {                                                                                       \
                     CISPO_BODY(S, lp + o + j, old + o + j, ro + j, adv + o + j, mask + o + j);       \
                     AUX_AT(S, lp + o + j, mask + o + j);                                                \
                 },                                                                                      \
                 {                                                                                       \
                     PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, old, old + o, j, width);          \
                     PAD(T, N_##S, r, ro, j, width) PAD(T, N_##S, adv, adv + o, j, width);            \
                     PAD(uint8_t, N_##S, m, mask + o, j, width);                                         \
                     CISPO_BODY(S, lp_pad, old_pad, r_pad, adv_pad, m_pad);                              \
                     AUX_TAIL(S, T);                                                                     \
                 },                                                                                      \
                 {                                                                                       \
                     row_out[i] = K(acc_total)(acc);                                                     \
                     hits += K(count_##S)(hc);                                                           \
                     AUX_POST;                                                                           \
                 }))                                                                                      \
        *lr_out = K(acc_total)(kl_acc);                                                                  \
        *hits_out = hits;                                                                                \
        AUX_END;                                                                                         \
    }
DEFINE_CISPO(f32, float)
DEFINE_CISPO(f64, double)

/* ---- sapo, first half: x = (r - 1) tau, tau = tau_pos where A > 0 else tau_neg (verl's where), written
 * over r (x may be r); and the masked sum of clamp(logp - old, -20, 20). Torch then takes sigmoid(x). */
#define SAPO_GATE_BODY(S, LP, OLD, R, ADV, M, X)                                                         \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        S##v d = K(ld_##S)(LP) - K(ld_##S)(OLD);                                                         \
        d = CLAMP(S, d, -lim, lim);                                                                      \
        K(acc_##S)(kl_acc, d * m);                                                                       \
        const S##v tau = K(sel_##S)(K(ld_##S)(ADV) > zero, tp, tn);                                      \
        K(st_##S)(X, (K(ld_##S)(R) - one) * tau);                                                        \
    }

#define DEFINE_SAPO_GATE(S, T)                                                                           \
    static void K(sapo_gate_##S)(const T *lp, const T *old, const T *r, const T *adv, const uint8_t *mask, \
                                 Py_ssize_t rows, Py_ssize_t width, T tp_, T tn_, T *x, double *lr_out,  \
                                 AUX_PARAMS(T)) {                                                        \
        const S##v tp = SPLAT(S, T, tp_), tn = SPLAT(S, T, tn_);                                         \
        AUX_CONSTS(S, T);                                                                            \
        XBUFS_R(T);                                                                                \
        dacc kl_acc[2] = {0};                                                                            \
        AUX_SPECIALISED(T, ROW_LOOP_X(S, AUX_XP_R(S, T), AUX_PRE,                                                                             \
                 {                                                                                       \
                     AUX_AT(S, lp + o + j, mask + o + j);                                                \
                     SAPO_GATE_BODY(S, lp + o + j, old + o + j, ro + j, adv + o + j, mask + o + j,    \
                                    x + o + j);                                                          \
                 },                                                                                      \
                 {                                                                                       \
                     PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, old, old + o, j, width);          \
                     PAD(T, N_##S, r, ro, j, width) PAD(T, N_##S, adv, adv + o, j, width);            \
                     PAD(uint8_t, N_##S, m, mask + o, j, width);                                         \
                     T x_pad[N_##S];                                                                     \
                     AUX_TAIL(S, T);                                                                     \
                     SAPO_GATE_BODY(S, lp_pad, old_pad, r_pad, adv_pad, m_pad, x_pad);                   \
                     memcpy(x + o + j, x_pad, (size_t)(width - j) * sizeof(T));                          \
                 },                                                                                      \
                 AUX_POST))                                                                               \
        *lr_out = K(acc_total)(kl_acc);                                                                  \
        AUX_END;                                                                                         \
    }
DEFINE_SAPO_GATE(f32, float)
DEFINE_SAPO_GATE(f64, double)

/* ---- sapo, second half: row sums of ((g q) A) m, g = sigmoid(x) from torch, q = q_pos where A > 0
 * else q_neg (verl's 4 / tau: reciprocal(tau) * 4, rounded by the caller); l = -(g q) A. */
#define SAPO_BODY(S, G, ADV, M)                                                                          \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##v a = K(ld_##S)(ADV);                                                                   \
        const S##v q = K(sel_##S)(a > zero, qp, qn);                                                     \
        K(acc_##S)(acc, ((K(ld_##S)(G) * q) * a) * m);                                                   \
    }

#define DEFINE_SAPO(S, T)                                                                                \
    static void K(sapo_##S)(const T *g, const T *adv, const uint8_t *mask, Py_ssize_t rows,              \
                            Py_ssize_t width, T qp_, T qn_, double *row_out) {                           \
        const S##v qp = SPLAT(S, T, qp_), qn = SPLAT(S, T, qn_), zero = SPLAT(S, T, 0);                  \
        ROW_LOOP(S, dacc acc[2] = {0}, SAPO_BODY(S, g + o + j, adv + o + j, mask + o + j),               \
                 {                                                                                       \
                     PAD(T, N_##S, g, g + o, j, width) PAD(T, N_##S, adv, adv + o, j, width);            \
                     PAD(uint8_t, N_##S, m, mask + o, j, width);                                         \
                     SAPO_BODY(S, g_pad, adv_pad, m_pad);                                                \
                 },                                                                                      \
                 row_out[i] = K(acc_total)(acc))                                                         \
    }
DEFINE_SAPO(f32, float)
DEFINE_SAPO(f64, double)

/* ---- gspo, first half: d = (logp - old) m, written out; torch sums its rows (verl's float sum, whose
 * exp gives the sequence ratio s_i) ------------------------------------------------------------------- */
#define GSPO_LOGRATIO_BODY(S, LP, OLD, M, D)                                                             \
    K(st_##S)(D, (K(ld_##S)(LP) - K(ld_##S)(OLD)) * K(mask_##S)(M));

#define DEFINE_GSPO_LOGRATIO(S, T)                                                                       \
    static void K(gspo_logratio_##S)(const T *lp, const T *old, const uint8_t *mask, Py_ssize_t rows,    \
                                     Py_ssize_t width, T *d, AUX_PARAMS(T)) {                            \
        AUX_CONSTS(S, T);                                                                            \
        XBUFS(T);                                                                                \
        AUX_SPECIALISED(T, ROW_LOOP_X(S, AUX_XP(S, T), AUX_PRE,                                                                             \
                 {                                                                                       \
                     AUX_AT(S, lp + o + j, mask + o + j);                                                \
                     GSPO_LOGRATIO_BODY(S, lp + o + j, old + o + j, mask + o + j, d + o + j);            \
                 },                                                                                      \
                 {                                                                                       \
                     PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, old, old + o, j, width);          \
                     PAD(uint8_t, N_##S, m, mask + o, j, width);                                         \
                     T d_pad[N_##S];                                                                     \
                     AUX_TAIL(S, T);                                                                     \
                     GSPO_LOGRATIO_BODY(S, lp_pad, old_pad, m_pad, d_pad);                               \
                     memcpy(d + o + j, d_pad, (size_t)(width - j) * sizeof(T));                          \
                 },                                                                                      \
                 AUX_POST))                                                                               \
        AUX_END;                                                                                         \
    }
DEFINE_GSPO_LOGRATIO(f32, float)
DEFINE_GSPO_LOGRATIO(f64, double)

/* ---- gspo, second half: s = s_i (per row, from torch), c = clamp(s, lo, hi);
 * l = A- max(s, c) - A+ min(s, c) (verl's max(-A s, -A c): monotone rounding), with a = A m,
 * A+ = max(a, 0), A- = A+ - a; clipped where z = a s + l > 0 (verl's pg_losses2 > pg_losses1). */
#define GSPO_BODY(S, ADV, M)                                                                             \
    {                                                                                                    \
        const S##v a = K(ld_##S)(ADV) * K(mask_##S)(M);                                                  \
        const S##v ap = CLAMP_MIN(S, a, zero);                                                           \
        const S##v an = ap - a;                                                                          \
        const S##v loss = an * shi - ap * slo;                                                           \
        K(acc_##S)(acc, loss);                                                                           \
        hc += (a * sv + loss > zero);                                                                    \
    }

#define DEFINE_GSPO(S, T)                                                                                \
    static void K(gspo_##S)(const T *adv, const uint8_t *mask, const T *s, Py_ssize_t rows,              \
                            Py_ssize_t width, T lo, T hi, double *row_out, int64_t *hits_out) {          \
        const S##v zero = SPLAT(S, T, 0);                                                                \
        int64_t hits = 0;                                                                                \
        ROW_LOOP(S,                                                                                      \
                 dacc acc[2] = {0};                                                                      \
                 S##m hc = {0};                                                                          \
                 const T si = s[i];                                                                      \
                 /* clamp, maximum, minimum as torch's: NaN stays NaN */                                 \
                 const T ci = si < lo ? lo : si;                                                         \
                 const T cc = ci > hi ? hi : ci;                                                         \
                 const S##v sv = SPLAT(S, T, si);                                                        \
                 const S##v shi = SPLAT(S, T, si != si ? si : (si > cc ? si : cc));                      \
                 const S##v slo = SPLAT(S, T, si != si ? si : (si < cc ? si : cc)),                      \
                 GSPO_BODY(S, adv + o + j, mask + o + j),                                                \
                 {                                                                                       \
                     PAD(T, N_##S, adv, adv + o, j, width) PAD(uint8_t, N_##S, m, mask + o, j, width);   \
                     GSPO_BODY(S, adv_pad, m_pad);                                                       \
                 },                                                                                      \
                 {                                                                                       \
                     row_out[i] = K(acc_total)(acc);                                                     \
                     hits += K(count_##S)(hc);                                                           \
                 })                                                                                      \
        *hits_out = hits;                                                                                \
    }
DEFINE_GSPO(f32, float)
DEFINE_GSPO(f64, double)

/* ---- geo_mean: d = logp - old (no clamp); g = (A > 0) m, n = (A < 0) m;
 * v = min(d, hi) g + max(d, -lo) n (verl's sgn(A) min(sgn(A) d, sgn(A) clamp(d, -lo, hi)));
 * the row sums of v and of A m; clipped where d != clamp(d, -lo, hi), counted under g and under n;
 * kl: the masked sum of d. */
#define GEO_MEAN_BODY(S, LP, OLD, ADV, M)                                                                \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##v d = K(ld_##S)(LP) - K(ld_##S)(OLD);                                                   \
        K(acc_##S)(kl_acc, d * m);                                                                       \
        const S##v a = K(ld_##S)(ADV);                                                                   \
        const S##v g = K(sel_##S)(a > zero, m, zero), n = K(sel_##S)(a < zero, m, zero);                 \
        K(acc_##S)(acc, CLAMP_MAX(S, d, hi) * g + CLAMP_MIN(S, d, nlo) * n);                             \
        K(acc_##S)(adv_acc, a * m);                                                                      \
        const S##m clipped = d != CLAMP(S, d, nlo, hi);                                                  \
        hp += clipped & (g != zero);                                                                     \
        hn += clipped & (n != zero);                                                                     \
    }

#define DEFINE_GEO_MEAN(S, T)                                                                            \
    static void K(geo_mean_##S)(const T *lp, const T *old, const T *adv, const uint8_t *mask,            \
                                Py_ssize_t rows, Py_ssize_t width, T nlo_, T hi_, double *row_out,       \
                                double *adv_out, double *lr_out, int64_t *pos_out, int64_t *neg_out,     \
                                AUX_PARAMS(T)) {                                                         \
        const S##v nlo = SPLAT(S, T, nlo_), hi = SPLAT(S, T, hi_);                                       \
        AUX_CONSTS(S, T);                                                                            \
        XBUFS(T);                                                                                \
        dacc kl_acc[2] = {0};                                                                            \
        int64_t pos = 0, neg = 0;                                                                        \
        AUX_SPECIALISED(T, ROW_LOOP_X(S, AUX_XP(S, T), dacc acc[2] = {0}; dacc adv_acc[2] = {0}; S##m hp = {0}; S##m hn = {0}; AUX_PRE,     \
                 {                                                                                       \
                     GEO_MEAN_BODY(S, lp + o + j, old + o + j, adv + o + j, mask + o + j);               \
                     AUX_AT(S, lp + o + j, mask + o + j);                                                \
                 },                                                                                      \
                 {                                                                                       \
                     PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, old, old + o, j, width);          \
                     PAD(T, N_##S, adv, adv + o, j, width) PAD(uint8_t, N_##S, m, mask + o, j, width);   \
                     GEO_MEAN_BODY(S, lp_pad, old_pad, adv_pad, m_pad);                                  \
                     AUX_TAIL(S, T);                                                                     \
                 },                                                                                      \
                 {                                                                                       \
                     row_out[i] = K(acc_total)(acc);                                                     \
                     adv_out[i] = K(acc_total)(adv_acc);                                                 \
                     pos += K(count_##S)(hp);                                                            \
                     neg += K(count_##S)(hn);                                                            \
                     AUX_POST;                                                                           \
                 }))                                                                                      \
        *lr_out = K(acc_total)(kl_acc);                                                                  \
        *pos_out = pos;                                                                                  \
        *neg_out = neg;                                                                                  \
        AUX_END;                                                                                         \
    }
DEFINE_GEO_MEAN(f32, float)
DEFINE_GEO_MEAN(f64, double)

/* ---- the log-ratios torch takes the exp of: r = clamp(logp - old, -20, 20) (the loss's ratio) and
 * e = clamp(ref - logp, -20, 20) (k3), each written where its pointer is not NULL (two sub + clamp
 * torch ops each, in one read of logp) ------------------------------------------------------------- */
#define LOGRATIOS_BODY(S, LP, OLD, REF, R, E)                                                            \
    {                                                                                                    \
        const S##v lpv = K(ld_##S)(LP);                                                                  \
        if (r) K(st_##S)(R, CLAMP(S, lpv - K(ld_##S)(OLD), -lim, lim));                                  \
        if (e) K(st_##S)(E, CLAMP(S, K(ld_##S)(REF) - lpv, -lim, lim));                                  \
    }

#define DEFINE_LOGRATIOS(S, T)                                                                           \
    static void K(logratios_##S)(const T *lp, const T *old, const T *ref, Py_ssize_t rows,               \
                                 Py_ssize_t width, T *r, T *e) {                                         \
        const S##v lim = SPLAT(S, T, 20);                                                                \
        ROW_LOOP(S, (void)0, LOGRATIOS_BODY(S, lp + o + j, old + o + j, ref + o + j, r + o + j, e + o + j), \
                 {                                                                                       \
                     PAD(T, N_##S, lp, lp + o, j, width);                                                \
                     PAD(T, N_##S, old, r ? old + o : NULL, j, width);                                   \
                     PAD(T, N_##S, ref, e ? ref + o : NULL, j, width);                                   \
                     T r_pad[N_##S];                                                                     \
                     T e_pad[N_##S];                                                                     \
                     LOGRATIOS_BODY(S, lp_pad, old_pad, ref_pad, r_pad, e_pad);                          \
                     if (r) memcpy(r + o + j, r_pad, (size_t)(width - j) * sizeof(T));                   \
                     if (e) memcpy(e + o + j, e_pad, (size_t)(width - j) * sizeof(T));                   \
                 },                                                                                      \
                 (void)0)                                                                                \
    }
DEFINE_LOGRATIOS(f32, float)
DEFINE_LOGRATIOS(f64, double)
