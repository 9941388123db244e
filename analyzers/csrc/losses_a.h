/* Kernels: gpg, dro, cispo, sapo, gspo, geo_mean.
 * Included by kernels.h once per instruction set (names through K(...), vectors as in kernels.h).
 *
 * Each one is the torch-op pass of the same name in kernels.py (_fused_<mode>), op for op: the per-token
 * floats are those of that pass (and so verl's), the sums are float64 lane sums, the counts exact. What
 * torch must compute (exp, sigmoid) arrives in a buffer; the sapo and gspo passes therefore come in two
 * halves, torch's op between them. */

static inline void K(st_f32)(float *p, f32v v) { memcpy(p, &v, sizeof v); }
static inline void K(st_f64)(double *p, f64v v) { memcpy(p, &v, sizeof v); }

/* The entropy / KL-estimator terms ride along in the pass of every loss here that reads logp (AUX_BODY
 * of kernels.h, the same floats as the aux loop): ent may be NULL (no entropy), kind / check as there. */
#define AUX_PARAMS(T)                                                                                    \
    const T *ent, const T *ref, const T *e, int kind, int check, double *ent_out, double *kl_out,        \
        double *k2_out
#define AUX_CONSTS(S, T)                                                                                 \
    const S##v zero = SPLAT(S, T, 0), one = SPLAT(S, T, 1), half = SPLAT(S, T, 0.5);                     \
    const S##v lim = SPLAT(S, T, 20), ten = SPLAT(S, T, 10);                                             \
    dacc k2_acc[2] = {0}
#define AUX_PRE                                                                                          \
    dacc ea[2] = {0};                                                                                    \
    dacc ka[2] = {0}
#define AUX_AT(S, LP, M) AUX_BODY(S, ent + o + j, LP, ref + o + j, eo + j, M)
#define AUX_TAIL(S, T)                                                                                   \
    PAD(T, N_##S, ent, ent ? ent + o : NULL, j, width);                                                  \
    PAD(T, N_##S, ref, ref ? ref + o : NULL, j, width);                                                  \
    PAD(T, N_##S, e, eo, j, width);                                                                      \
    AUX_BODY(S, ent_pad, lp_pad, ref_pad, e_pad, m_pad)
#define AUX_POST                                                                                         \
    if (ent) ent_out[i] = K(acc_total)(ea);                                                              \
    if (kind > 0) kl_out[i] = K(acc_total)(ka)
#define AUX_END *k2_out = K(acc_total)(k2_acc)
/* LOOP compiled three times: for the usual terms (entropy and k3, no check: verl's low_var_kl), for
 * none, and for any; constant kind / check / ent let the compiler drop the untaken branches from the
 * vector loop (measured: gpg + entropy + k3 at (8, 16384) 5-8 % faster warm, 1-8 % from DRAM). */
#define AUX_SPECIALISED(T, LOOP)                                                                         \
    if (kind == 4 && ent && !check) {                                                                    \
        const int kind = 4, check = 0;                                                                   \
        if (!ent) __builtin_unreachable();                                                               \
        LOOP                                                                                             \
    } else if (kind == 0 && !ent && !check) {                                                            \
        const int kind = 0, check = 0;                                                                   \
        const T *const ent = NULL;                                                                       \
        LOOP                                                                                             \
    } else {                                                                                             \
        LOOP                                                                                             \
    }

/* The row loop of every kernel here: PRE(i) before row i (row accumulators), BODY on whole vectors at
 * offset o + j, TAIL on the zero-padded rest (it declares its pads), POST(i) after the row. A row runs in
 * chunks of EXP_CHUNK tokens: inside XP, BODY and TAIL, o is the chunk's offset and width its length.
 * EXP_CHUNK is a multiple of the vector width, so each lane sums the same tokens in the same order as
 * one sweep of the row would (the results do not depend on the chunking). XP runs before a chunk's
 * tokens: the inline exp (AUX_XP below), or nothing. */
#define ROW_LOOP(S, PRE, BODY, TAIL, POST) ROW_LOOP_X(S, (void)0, PRE, BODY, TAIL, POST)
#define ROW_LOOP_X(S, XP, PRE, BODY, TAIL, POST)                                                         \
    {                                                                                                    \
        const Py_ssize_t row_width = width;                                                              \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            PRE;                                                                                         \
            for (Py_ssize_t j0 = 0; j0 < row_width; j0 += EXP_CHUNK) {                                   \
                const Py_ssize_t o = i * row_width + j0;                                                 \
                const Py_ssize_t width = row_width - j0 < EXP_CHUNK ? row_width - j0 : EXP_CHUNK;        \
                XP;                                                                                      \
                Py_ssize_t j = 0;                                                                        \
                for (; j + N_##S <= width; j += N_##S) BODY;                                             \
                if (j < width) TAIL;                                                                     \
            }                                                                                            \
            POST;                                                                                        \
        }                                                                                                \
    }

/* [*b, *e): the n tokens at mask from the first to the last group of N with a valid token, in whole
 * groups (e may pass n by the tail group's padding); b = e = 0 with none valid */
#define DEFINE_VSPAN(S)                                                                                  \
    static inline void K(vspan_##S)(const uint8_t *mask, Py_ssize_t n, Py_ssize_t *b, Py_ssize_t *e) {   \
        Py_ssize_t first = -1, last = -1, j = 0;                                                         \
        for (; j + N_##S <= n; j += N_##S)                                                               \
            if (GROUP_BITS_##S(mask + j)) {                                                              \
                if (first < 0) first = j;                                                                \
                last = j;                                                                                \
            }                                                                                            \
        for (Py_ssize_t l = j; l < n; l++)                                                               \
            if (mask[l]) {                                                                               \
                if (first < 0) first = j;                                                                \
                last = j;                                                                                \
                break;                                                                                   \
            }                                                                                            \
        *b = first < 0 ? 0 : first;                                                                      \
        *e = first < 0 ? 0 : last + N_##S;                                                               \
    }
DEFINE_VSPAN(f32)
DEFINE_VSPAN(f64)

/* ---- exp inline (only with torch's own exp resolved and checked: set_exp in _fused.c) ----------------
 * A pass given no exp buffer (e NULL with k3; r NULL in cispo / sapo) takes exp per chunk into buffers
 * on the stack: xchunk writes r = exp(clamp(lp - old, -20, 20)) into R and e = exp(clamp(ref - lp, -20,
 * 20)) into E (either may be NULL) for the chunk's n tokens, from its first to its last group with a
 * valid token; the chunk's other entries are 0. Those are masked tokens, whose r and e only ever meet a
 * 0 mask: their terms stay 0, or NaN where delta or d (computed from the inputs in the pass) is NaN, as
 * with the exp of every token; a finite input's clamped exp is finite either way. */
#define DEFINE_XCHUNK(S, T)                                                                              \
    static inline void K(xlog_##S)(const T *a, const T *b, Py_ssize_t first, Py_ssize_t end, Py_ssize_t n, \
                                   T *x) {                                                               \
        const S##v lim = SPLAT(S, T, 20);                                                                \
        Py_ssize_t j = first;                                                                            \
        for (; j + N_##S <= end && j + N_##S <= n; j += N_##S)                                           \
            K(st_##S)(x + j, CLAMP(S, K(ld_##S)(a + j) - K(ld_##S)(b + j), -lim, lim));                  \
        for (; j < end; j++) {                                                                           \
            T d = j < n ? a[j] - b[j] : (T)0;                                                            \
            d = d < (T)-20 ? (T)-20 : d;                                                                 \
            x[j] = d > (T)20 ? (T)20 : d;                                                                \
        }                                                                                                \
    }                                                                                                    \
    static void K(xchunk_##S)(const T *lp, const T *old, const T *ref, const uint8_t *mask, Py_ssize_t n, \
                              T *R, T *E, T *tmp) {                                                      \
        const Py_ssize_t nr = (n + N_##S - 1) / N_##S * N_##S;                                           \
        Py_ssize_t b, e;                                                                                 \
        K(vspan_##S)(mask, n, &b, &e);                                                                   \
        T *const out[2] = {R, E};                                                                        \
        for (int k = 0; k < 2; k++) {                                                                    \
            T *const y = out[k];                                                                         \
            if (!y) continue;                                                                            \
            memset(y, 0, (size_t)b * sizeof(T));                                                         \
            memset(y + e, 0, (size_t)(nr - e) * sizeof(T));                                              \
            if (e == b) continue;                                                                        \
            if (k == 0)                                                                                  \
                K(xlog_##S)(lp, old, b, e, n, tmp);                                                      \
            else                                                                                         \
                K(xlog_##S)(ref, lp, b, e, n, tmp);                                                      \
            K(exp_##S)((int)(e - b), tmp + b, y + b);                                                    \
        }                                                                                                \
    }
DEFINE_XCHUNK(f32, float)
DEFINE_XCHUNK(f64, double)

/* y = exp(x) over the span of the n tokens at mask from the first to the last group with a valid
 * token, 0 elsewhere (the rest of the rounded-up chunk too); returns the first valid token's index,
 * or -1 (then y is all 0). For exp of the inputs themselves (rollout's debug metrics). */
#define DEFINE_XSPAN(S, T)                                                                               \
    static Py_ssize_t K(xspan_##S)(const uint8_t *mask, Py_ssize_t n, const T *x, T *y) {                \
        const Py_ssize_t nr = (n + N_##S - 1) / N_##S * N_##S;                                           \
        Py_ssize_t first, end;                                                                           \
        K(vspan_##S)(mask, n, &first, &end);                                                             \
        if (first == end) {                                                                              \
            memset(y, 0, (size_t)nr * sizeof(T));                                                        \
            return -1;                                                                                   \
        }                                                                                                \
        const Py_ssize_t e = end < n ? end : n;                                                          \
        memset(y, 0, (size_t)first * sizeof(T));                                                         \
        memset(y + e, 0, (size_t)(nr - e) * sizeof(T));                                                  \
        K(exp_##S)((int)(e - first), x + first, y + first);                                              \
        Py_ssize_t f = first;                                                                            \
        while (!mask[f]) f++;                                                                            \
        return f;                                                                                        \
    }
DEFINE_XSPAN(f32, float)
DEFINE_XSPAN(f64, double)

/* The exp buffers of a pass (XBUFS; XBUFS_R with the ratio) and, before each chunk, eo: k3's e for the chunk, the caller's
 * buffer or inline (AUX_XP); with the loss's ratio too, ro (AUX_XP_R). */
#define XBUFS(T) XBUF(T, E_); XBUF(T, X_)
#define XBUFS_R(T) XBUFS(T); XBUF(T, R_)
#define AUX_XP(S, T)                                                                                     \
    const T *const eo = e ? e + o : kind == 4 ? E_ : NULL;                                               \
    if (!e && kind == 4) K(xchunk_##S)(lp + o, NULL, ref + o, mask + o, width, NULL, E_, X_)
#define AUX_XP_R(S, T)                                                                                   \
    const T *const eo = e ? e + o : kind == 4 ? E_ : NULL;                                               \
    const T *const ro = r ? r + o : R_;                                                                  \
    if (!r || (!e && kind == 4))                                                                         \
    K(xchunk_##S)(lp + o, old + o, ref + o, mask + o, width, r ? NULL : R_, !e && kind == 4 ? E_ : NULL, X_)

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
        AUX_SPECIALISED(T, ROW_LOOP_X(S, AUX_XP(S, T), dacc acc[2] = {0}; AUX_PRE,                                                          \
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
        AUX_SPECIALISED(T, ROW_LOOP_X(S, AUX_XP(S, T), dacc acc[2] = {0}; AUX_PRE,                                                          \
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
        AUX_SPECIALISED(T, ROW_LOOP_X(S, AUX_XP_R(S, T), dacc acc[2] = {0}; S##m hc = {0}; AUX_PRE,                                           \
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
