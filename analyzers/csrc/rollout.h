/* Kernels: rollout correction: IS weights, rejection masks, rollout_corr/... and training/rollout_... metrics.
 * Included by kernels.h once per instruction set (names through K(...), vectors as in kernels.h).
 *
 * verl's rollout_corr_helper computes every statistic from d = old - rollout (the log-ratio), its
 * clamp to +-20 and exp of either; exp is torch's (e = exp(d), rho = exp(clamp(d, -20, 20)),
 * the same buffer when no |d| exceeds 20). Row sums and totals are float64 (acc_##S), counts exact,
 * max / min exact. rollout.py does the per-row and scalar arithmetic after, in verl's dtypes. */

/* A row's tail runs the vector body on zero-padded copies; an output row is written back from its pad. */
#define RC_STORE_TAIL(T, dst, pad, j, width) memcpy((dst) + (j), pad, (size_t)((width) - (j)) * sizeof(T))

/* ---- off-policy metrics (verl's compute_offpolicy_metrics) -------------------------------------------
 * rows: sum(old m), sum(rollout m), sum(d m) per row, and the row's valid-token count; d m written out
 * (torch's row sums of it are verl's masked_sum(log_ratio, axis=-1), bit for bit);
 * totals: sum(((e - d) - 1) m) (k3_kl) and sum((rho rho) m) (chi2_token);
 * big: some |d| > 20 (rho then is not e: the caller computes it and runs again).
 * e and rho NULL: exp inline (the checked exp only), e = rho = exp(d) per chunk of a row over its valid
 * span (RC_XOFF), 0 at the chunk's other tokens: masked ones, whose e and rho only ever meet a 0 mask.
 * That is the buffers' result exactly while no |d| > 20 (rho is e then, and every e is finite; a NaN d
 * still makes the k3 term NaN, so the sums say non-finite as they do with torch's exp of every token):
 * with big the caller runs the buffered pass instead. rho_out (inline only, may be NULL) receives those
 * e per token: the rho the downstream passes read (they too meet a masked token's only with a 0 mask). */
#define RC_OFF_BODY(S, OLD, RO, E, RHO, M, DM)                                                               \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##v vo = K(ld_##S)(OLD), vr = K(ld_##S)(RO);                                              \
        const S##v d = vo - vr;                                                                          \
        K(acc_##S)(a_lp, vo * m);                                                                        \
        K(acc_##S)(a_ro, vr * m);                                                                        \
        const S##v dm = d * m;                                                                           \
        memcpy(DM, &dm, sizeof dm);                                                                      \
        K(acc_##S)(a_d, dm);                                                                             \
        S##v k3 = K(ld_##S)(E) - d;                                                                      \
        k3 = k3 - one;                                                                                   \
        K(acc_##S)(t_k3, k3 * m);                                                                        \
        const S##v vh = K(ld_##S)(RHO);                                                                  \
        K(acc_##S)(t_rho, (vh * vh) * m);                                                                \
        cnt += (m != zero);                                                                              \
        big |= (d > lim) | (d < -lim);                                                                   \
    }

/* A whole group of N masked tokens adds +-0 to every sum and count (or NaN): it only writes d m (d 0),
 * tests |d| > 20, and adds (d 0) + (e 0) to guard, +0 or NaN: NaN exactly where one of its terms would
 * be (a non-finite old, rollout or d makes d 0 NaN; e = inf, exp of a finite d > 88, makes e 0 NaN;
 * rho, exp of a clamped d or e with no |d| > 20, is finite). guard joins the k3 total at the end. */
#define RC_OFF_MASKED(S, OLD, RO, E, DM)                                                                 \
    {                                                                                                    \
        const S##v d = K(ld_##S)(OLD) - K(ld_##S)(RO);                                                   \
        const S##v dz = d * zero;                                                                        \
        memcpy(DM, &dz, sizeof dz);                                                                      \
        guard = guard + (dz + K(ld_##S)(E) * zero);                                                      \
        big |= (d > lim) | (d < -lim);                                                                   \
    }

/* y = exp(old - ro) over the valid span of a chunk's n tokens (vspan), 0 at its other tokens (x: scratch) */
#define DEFINE_RC_XOFF(S, T)                                                                             \
    static inline void K(rc_xoff_##S)(const T *old, const T *ro, const uint8_t *mask, Py_ssize_t n, T *y, \
                                      T *x) {                                                            \
        Py_ssize_t b, end;                                                                               \
        K(vspan_##S)(mask, n, &b, &end);                                                                 \
        if (end > n) end = n;                                                                            \
        memset(y, 0, (size_t)b * sizeof(T));                                                             \
        memset(y + end, 0, (size_t)(n - end) * sizeof(T));                                               \
        if (end == b) return;                                                                            \
        Py_ssize_t j = b;                                                                                \
        for (; j + N_##S <= end; j += N_##S) K(st_##S)(x + j, K(ld_##S)(old + j) - K(ld_##S)(ro + j));   \
        for (; j < end; j++) x[j] = old[j] - ro[j];                                                      \
        K(exp_##S)((int)(end - b), x + b, y + b);                                                        \
    }
DEFINE_RC_XOFF(f32, float)
DEFINE_RC_XOFF(f64, double)

#define DEFINE_RC_OFF(S, T)                                                                              \
    static int K(rc_off_##S)(const T *old, const T *ro, const T *e_in, const T *rho_in, const uint8_t *mask, \
                             Py_ssize_t rows, Py_ssize_t width, T *dm_out, double *row_out,              \
                             int64_t *count_out, double *tot_out, T *rho_out) {                          \
        const S##v zero = SPLAT(S, T, 0), one = SPLAT(S, T, 1), lim = SPLAT(S, T, 20);                   \
        const int inl = !e_in;                                                                           \
        XBUF(T, E_); XBUF(T, X_);                                                                        \
        dacc t_k3[2] = {0}, t_rho[2] = {0};                                                              \
        S##m big = {0};                                                                                  \
        S##v guard = zero;                                                                               \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            dacc a_lp[2] = {0}, a_ro[2] = {0}, a_d[2] = {0};                                             \
            S##m cnt = {0};                                                                              \
            for (Py_ssize_t j0 = 0; j0 < width; j0 += EXP_CHUNK) {                                       \
                const Py_ssize_t o = i * width + j0;                                                     \
                const Py_ssize_t w = width - j0 < EXP_CHUNK ? width - j0 : EXP_CHUNK;                    \
                const T *e, *rho;                                                                        \
                if (inl) {                                                                               \
                    T *const y = rho_out ? rho_out + o : E_;                                             \
                    K(rc_xoff_##S)(old + o, ro + o, mask + o, w, y, X_);                                 \
                    e = rho = y;                                                                         \
                } else {                                                                                 \
                    e = e_in + o, rho = rho_in + o;                                                      \
                }                                                                                        \
                Py_ssize_t j = 0;                                                                        \
                for (; j + N_##S <= w; j += N_##S) {                                                     \
                    if (GROUP_BITS_##S(mask + o + j)) {                                                  \
                        RC_OFF_BODY(S, old + o + j, ro + o + j, e + j, rho + j, mask + o + j, dm_out + o + j); \
                    } else {                                                                             \
                        RC_OFF_MASKED(S, old + o + j, ro + o + j, e + j, dm_out + o + j);                \
                    }                                                                                    \
                }                                                                                        \
                if (j < w) {                                                                             \
                    PAD(T, N_##S, old, old + o, j, w) PAD(T, N_##S, ro, ro + o, j, w);                   \
                    PAD(T, N_##S, e, e, j, w) PAD(T, N_##S, rho, rho, j, w);                             \
                    PAD(uint8_t, N_##S, m, mask + o, j, w);                                              \
                    T dm_pad[N_##S];                                                                     \
                    RC_OFF_BODY(S, old_pad, ro_pad, e_pad, rho_pad, m_pad, dm_pad);                      \
                    RC_STORE_TAIL(T, dm_out + o, dm_pad, j, w);                                          \
                }                                                                                        \
            }                                                                                            \
            row_out[i] = K(acc_total)(a_lp);                                                             \
            row_out[rows + i] = K(acc_total)(a_ro);                                                      \
            row_out[2 * rows + i] = K(acc_total)(a_d);                                                   \
            count_out[i] = K(count_##S)(cnt);                                                           \
        }                                                                                                \
        K(acc_##S)(t_k3, guard);                                                                         \
        tot_out[0] = K(acc_total)(t_k3);                                                                 \
        tot_out[1] = K(acc_total)(t_rho);                                                                \
        return K(count_##S)(big) != 0;                                                                   \
    }
DEFINE_RC_OFF(f32, float)
DEFINE_RC_OFF(f64, double)

/* ---- token-level IS weights (verl's compute_rollout_correction_weights, rollout_is="token") ---------
 * raw = rho m; TIS: w = min(raw, hi); IcePop: w = raw where lo <= raw <= hi, else 0. w and (cl cl) m are
 * written out (torch sums them for the std: see rollout.py).
 * rows: sum(w m), sum(raw m); totals: sum(cl m), sum((cl cl) m) with cl = clamp(w, 0, hi);
 * counts of valid raw > hi and raw < lo; max / min of w over valid tokens. */
#define RC_IST_BODY(S, RHO, W, SQ, M)                                                                      \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##m mv = m != zero;                                                                       \
        const S##v raw = K(ld_##S)(RHO) * m;                                                             \
        S##v w;                                                                                          \
        if (icepop)                                                                                      \
            w = K(sel_##S)((raw >= lo) & (raw <= hi), raw, zero);                                        \
        else                                                                                             \
            w = CLAMP_MAX(S, raw, hi);                                                                   \
        memcpy(W, &w, sizeof w);                                                                         \
        K(acc_##S)(a_w, w * m);                                                                          \
        K(acc_##S)(a_raw, raw * m);                                                                      \
        const S##v cl = CLAMP(S, w, zero, hi);                                                           \
        K(acc_##S)(t_cl, cl * m);                                                                        \
        const S##v sq = (cl * cl) * m;                                                                   \
        memcpy(SQ, &sq, sizeof sq);                                                                      \
        K(acc_##S)(t_cl2, sq);                                                                           \
        c_hi += (raw > hi) & mv;                                                                         \
        c_lo += (raw < lo) & mv;                                                                         \
        S##v cand = K(sel_##S)(mv, w, ninf);                                                             \
        vmax = K(sel_##S)(cand > vmax, cand, vmax);                                                      \
        cand = K(sel_##S)(mv, w, pinf);                                                                  \
        vmin = K(sel_##S)(cand < vmin, cand, vmin);                                                      \
    }

#define DEFINE_RC_IST(S, T)                                                                              \
    static void K(rc_ist_##S)(const T *rho, const uint8_t *mask, Py_ssize_t rows, Py_ssize_t width,     \
                              int icepop, T lo_, T hi_, T *w_out, T *sq_out, double *row_out,            \
                              double *tot_out,                                                           \
                              int64_t *cnt_out, double *mm_out) {                                        \
        const S##v zero = SPLAT(S, T, 0), lo = SPLAT(S, T, lo_), hi = SPLAT(S, T, hi_);                  \
        const S##v ninf = SPLAT(S, T, -__builtin_inf()), pinf = SPLAT(S, T, __builtin_inf());            \
        dacc t_cl[2] = {0}, t_cl2[2] = {0};                                                              \
        S##v vmax = ninf, vmin = pinf;                                                                   \
        int64_t n_hi = 0, n_lo = 0;                                                                      \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            dacc a_w[2] = {0}, a_raw[2] = {0};                                                           \
            S##m c_hi = {0}, c_lo = {0};                                                                 \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S)                                                       \
                RC_IST_BODY(S, rho + o + j, w_out + o + j, sq_out + o + j, mask + o + j);                \
            if (j < width) {                                                                             \
                PAD(T, N_##S, rho, rho + o, j, width) PAD(uint8_t, N_##S, m, mask + o, j, width);        \
                T w_pad[N_##S], sq_pad[N_##S];                                                           \
                RC_IST_BODY(S, rho_pad, w_pad, sq_pad, m_pad);                                           \
                RC_STORE_TAIL(T, w_out + o, w_pad, j, width);                                            \
                RC_STORE_TAIL(T, sq_out + o, sq_pad, j, width);                                          \
            }                                                                                            \
            row_out[i] = K(acc_total)(a_w);                                                              \
            row_out[rows + i] = K(acc_total)(a_raw);                                                     \
            n_hi += K(count_##S)(c_hi);                                                                  \
            n_lo += K(count_##S)(c_lo);                                                                  \
        }                                                                                                \
        tot_out[0] = K(acc_total)(t_cl);                                                                 \
        tot_out[1] = K(acc_total)(t_cl2);                                                                \
        cnt_out[0] = n_hi;                                                                               \
        cnt_out[1] = n_lo;                                                                               \
        T mx = -__builtin_inf(), mn = __builtin_inf();                                                   \
        for (int l = 0; l < N_##S; l++) {                                                                \
            if (vmax[l] > mx) mx = vmax[l];                                                              \
            if (vmin[l] < mn) mn = vmin[l];                                                              \
        }                                                                                                \
        mm_out[0] = mx;                                                                                  \
        mm_out[1] = mn;                                                                                  \
    }
DEFINE_RC_IST(f32, float)
DEFINE_RC_IST(f64, double)

/* ---- the second look at token weights: the ESS sum and batch normalisation --------------------------
 * sum((q q) m) with q = clamp(w, 0, hi) / c (c = masked mean of the clamped weights + 1e-8);
 * norm: w = w / bn in place (verl's weights / weights_mean). */
#define RC_ESS_BODY(S, W, M)                                                                             \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        S##v x = K(ld_##S)(W);                                                                           \
        const S##v q = CLAMP(S, x, zero, hi) / c;                                                        \
        K(acc_##S)(t_q, (q * q) * m);                                                                    \
        if (norm) {                                                                                      \
            x = x / bn;                                                                                  \
            memcpy(W, &x, sizeof x);                                                                     \
        }                                                                                                \
    }

#define DEFINE_RC_ESS(S, T)                                                                              \
    static double K(rc_ess_##S)(T *w, const uint8_t *mask, Py_ssize_t rows, Py_ssize_t width, T hi_,    \
                                T c_, int norm, T bn_) {                                                 \
        const S##v zero = SPLAT(S, T, 0), hi = SPLAT(S, T, hi_), c = SPLAT(S, T, c_);                    \
        const S##v bn = SPLAT(S, T, bn_);                                                                \
        dacc t_q[2] = {0};                                                                               \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S) RC_ESS_BODY(S, w + o + j, mask + o + j);             \
            if (j < width) {                                                                             \
                PAD(T, N_##S, w, w + o, j, width) PAD(uint8_t, N_##S, m, mask + o, j, width);            \
                RC_ESS_BODY(S, w_pad, m_pad);                                                            \
                if (norm) RC_STORE_TAIL(T, w + o, w_pad, j, width);                                      \
            }                                                                                            \
        }                                                                                                \
        return K(acc_total)(t_q);                                                                        \
    }
DEFINE_RC_ESS(f32, float)
DEFINE_RC_ESS(f64, double)

/* ---- one value per row on its valid tokens: out = v[i] m (sequence-level weights) -------------------- */
#define RC_FILL_BODY(S, OUT, M)                                                                          \
    {                                                                                                    \
        const S##v x = v * K(mask_##S)(M);                                                               \
        memcpy(OUT, &x, sizeof x);                                                                       \
    }

#define DEFINE_RC_FILL(S, T)                                                                             \
    static void K(rc_fill_##S)(const T *vals, const uint8_t *mask, Py_ssize_t rows, Py_ssize_t width,   \
                               T *out) {                                                                 \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            const S##v v = SPLAT(S, T, vals[i]);                                                         \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S) RC_FILL_BODY(S, out + o + j, mask + o + j);          \
            if (j < width) {                                                                             \
                PAD(uint8_t, N_##S, m, mask + o, j, width);                                              \
                T out_pad[N_##S];                                                                        \
                RC_FILL_BODY(S, out_pad, m_pad);                                                         \
                RC_STORE_TAIL(T, out + o, out_pad, j, width);                                            \
            }                                                                                            \
        }                                                                                                \
    }
DEFINE_RC_FILL(f32, float)
DEFINE_RC_FILL(f64, double)

/* ---- rejection statistics (verl's compute_rollout_rejection_mask / compute_rs_metrics) --------------
 * safe = clamp(d, -20, 20); kind 1: s = -safe, 2: s = 0.5 (safe safe), 3: s = (rho - 1) - safe.
 * Always: row sums of s m and row maxima of s over valid tokens (-inf for a row without any).
 * token (a token-level option): totals sum(s m), sum(cl m), sum((cl cl) m), cl = clamp(s, clo, hi);
 * counts of valid s > hi and s < lo; max / min of s over valid tokens; keep = lo <= s <= hi (k1: lower
 * too) ANDed into keep_io (bytes), per row the count of valid tokens it rejects, and cl m, (cl cl) m
 * written out (torch sums them for the std). Not token: x1 (if given) receives s m (torch's row sums of it
 * are verl's seq_sum / seq_mean statistics, bit for bit). */
#define RC_RS_BODY(S, OLD, RO, RHO, M, KEEP, X1, X2)                                                             \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##m mv = m != zero;                                                                       \
        const S##v safe = CLAMP(S, K(ld_##S)(OLD) - K(ld_##S)(RO), -lim, lim);                           \
        S##v s;                                                                                          \
        if (kind == 1)                                                                                   \
            s = -safe;                                                                                   \
        else if (kind == 2)                                                                              \
            s = half * (safe * safe);                                                                    \
        else {                                                                                           \
            s = K(ld_##S)(RHO) - one;                                                                    \
            s = s - safe;                                                                                \
        }                                                                                                \
        K(acc_##S)(a_s, s * m);                                                                          \
        const S##v cand = K(sel_##S)(mv, s, ninf);                                                       \
        rmax = K(sel_##S)(cand > rmax, cand, rmax);                                                      \
        if (token) {                                                                                     \
            const S##v cl = CLAMP(S, s, clo, hi);                                                        \
            const S##v x1 = cl * m, x2 = (cl * cl) * m;                                                  \
            memcpy(X1, &x1, sizeof x1);                                                                  \
            memcpy(X2, &x2, sizeof x2);                                                                  \
            K(acc_##S)(t_cl, x1);                                                                        \
            K(acc_##S)(t_cl2, x2);                                                                       \
            c_hi += (s > hi) & mv;                                                                       \
            c_lo += (s < lo) & mv;                                                                       \
            const S##v cmin = K(sel_##S)(mv, s, pinf);                                                   \
            vmin = K(sel_##S)(cmin < vmin, cmin, vmin);                                                  \
            const S##m keep = k1 ? ((s >= lo) & (s <= hi)) : (s <= hi);                                  \
            c_rej += mv & ~keep;                                                                         \
            RC_KEEP_##S(KEEP, keep);                                                                     \
        } else if (X1) {                                                                                 \
            const S##v x1 = s * m;                                                                       \
            memcpy(X1, &x1, sizeof x1);                                                                  \
        }                                                                                                \
    }
#define RC_KEEP_f32(P, keep)                                                                             \
    {                                                                                                    \
        u8x8 kb;                                                                                         \
        memcpy(&kb, P, sizeof kb);                                                                       \
        kb &= __builtin_convertvector((keep) & 1, u8x8);                                                 \
        memcpy(P, &kb, sizeof kb);                                                                       \
    }
#define RC_KEEP_f64(P, keep)                                                                             \
    {                                                                                                    \
        u8x4 kb;                                                                                         \
        memcpy(&kb, P, sizeof kb);                                                                       \
        kb &= __builtin_convertvector((keep) & 1, u8x4);                                                 \
        memcpy(P, &kb, sizeof kb);                                                                       \
    }

#define DEFINE_RC_RS(S, T)                                                                               \
    static void K(rc_rs_##S)(const T *old, const T *ro, const T *rho, const uint8_t *mask,              \
                             Py_ssize_t rows, Py_ssize_t width, int kind, int token, int k1, T lo_, T hi_, \
                             T clo_, uint8_t *keep_io, T *x1_out, T *x2_out, double *row_out,            \
                             int64_t *rej_out,                                                           \
                             double *tot_out, int64_t *cnt_out, double *mm_out) {                        \
        const S##v zero = SPLAT(S, T, 0), one = SPLAT(S, T, 1), half = SPLAT(S, T, 0.5);                 \
        const S##v lim = SPLAT(S, T, 20), lo = SPLAT(S, T, lo_), hi = SPLAT(S, T, hi_);                  \
        const S##v clo = SPLAT(S, T, clo_);                                                              \
        const S##v ninf = SPLAT(S, T, -__builtin_inf()), pinf = SPLAT(S, T, __builtin_inf());            \
        dacc t_cl[2] = {0}, t_cl2[2] = {0};                                                              \
        S##v vmax = ninf, vmin = pinf;                                                                   \
        int64_t n_hi = 0, n_lo = 0;                                                                      \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            dacc a_s[2] = {0};                                                                           \
            S##v rmax = ninf;                                                                            \
            S##m c_hi = {0}, c_lo = {0}, c_rej = {0};                                                    \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S)                                                       \
                RC_RS_BODY(S, old + o + j, ro + o + j, rho + o + j, mask + o + j,                        \
                           token ? keep_io + o + j : NULL, x1_out ? x1_out + o + j : NULL,               \
                           token ? x2_out + o + j : NULL);                                               \
            if (j < width) {                                                                             \
                PAD(T, N_##S, old, old + o, j, width) PAD(T, N_##S, ro, ro + o, j, width);               \
                PAD(T, N_##S, rho, rho + o, j, width) PAD(uint8_t, N_##S, m, mask + o, j, width);        \
                PAD(uint8_t, N_##S, k, token ? keep_io + o : NULL, j, width);                            \
                T x1_pad[N_##S], x2_pad[N_##S];                                                          \
                RC_RS_BODY(S, old_pad, ro_pad, rho_pad, m_pad, k_pad, x1_pad, x2_pad);                   \
                if (token) {                                                                             \
                    RC_STORE_TAIL(uint8_t, keep_io + o, k_pad, j, width);                                \
                    RC_STORE_TAIL(T, x2_out + o, x2_pad, j, width);                                      \
                }                                                                                        \
                if (x1_out) RC_STORE_TAIL(T, x1_out + o, x1_pad, j, width);                              \
            }                                                                                            \
            row_out[i] = K(acc_total)(a_s);                                                              \
            T mx = -__builtin_inf();                                                                     \
            for (int l = 0; l < N_##S; l++)                                                              \
                if (rmax[l] > mx) mx = rmax[l];                                                          \
            row_out[rows + i] = mx;                                                                      \
            vmax = K(sel_##S)(rmax > vmax, rmax, vmax);                                                  \
            if (token) {                                                                                 \
                n_hi += K(count_##S)(c_hi);                                                              \
                n_lo += K(count_##S)(c_lo);                                                              \
                rej_out[i] = K(count_##S)(c_rej);                                                       \
            }                                                                                            \
        }                                                                                                \
        if (!token) return;                                                                              \
        tot_out[0] = K(acc_total)(t_cl);                                                                 \
        tot_out[1] = K(acc_total)(t_cl2);                                                                \
        cnt_out[0] = n_hi;                                                                               \
        cnt_out[1] = n_lo;                                                                               \
        T mx = -__builtin_inf(), mn = __builtin_inf();                                                   \
        for (int l = 0; l < N_##S; l++) {                                                                \
            if (vmax[l] > mx) mx = vmax[l];                                                              \
            if (vmin[l] < mn) mn = vmin[l];                                                              \
        }                                                                                                \
        mm_out[0] = mx;                                                                                  \
        mm_out[1] = mn;                                                                                  \
    }
DEFINE_RC_RS(f32, float)
DEFINE_RC_RS(f64, double)

/* ---- training/rollout_probs_diff_* and the Pearson correlation (verl's calculate_debug_metrics) ------
 * a = exp(old), r = exp(rollout) from torch; diff = |a - r| in the token dtype (verl's (a - r).abs()).
 * One pass, float64: out = [sum(a m), sum(r m), sum(diff m), max of diff over valid tokens (-inf for
 * none), valid tokens, then with x, y, e = a, r, diff minus their values at the first valid token (a
 * shift that keeps the moments from cancelling): sum(x m), sum(y m), sum(e m), sum((e e) m),
 * sum((x y) m), sum((x x) m), sum((y y) m)]. torch.std accumulates in float64 too, torch.corrcoef in the
 * token dtype: rollout.py rounds what these give. */
#define RC_ABS(S, x) ((S##v)((S##m)(x) & absbits))
#define RC_DBG_CORE(X, Y, E, M)                                                                          \
    {                                                                                                    \
        const f64v x = (X) - ka, y = (Y) - kr, e = (E) - kd, mm = (M);                                   \
        c_x += x * mm;                                                                                   \
        c_y += y * mm;                                                                                   \
        c_e += e * mm;                                                                                   \
        c_q += (e * e) * mm;                                                                             \
        c_c += (x * y) * mm;                                                                             \
        c_a += (x * x) * mm;                                                                             \
        c_r += (y * y) * mm;                                                                             \
    }
#define RC_LO(v) K(lo_f64)(v)
#define RC_HI(v) K(hi_f64)(v)
#define RC_DBG_WIDE_f32(va, vr, d, m)                                                                    \
    RC_DBG_CORE(RC_LO(va), RC_LO(vr), RC_LO(d), RC_LO(m));                                               \
    RC_DBG_CORE(RC_HI(va), RC_HI(vr), RC_HI(d), RC_HI(m))
#define RC_DBG_WIDE_f64(va, vr, d, m) RC_DBG_CORE(va, vr, d, m)
#define RC_DBG_BODY(S, A, R, M)                                                                          \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##v va = K(ld_##S)(A), vr = K(ld_##S)(R);                                                 \
        const S##v d = RC_ABS(S, va - vr);                                                               \
        K(acc_##S)(s_a, va * m);                                                                         \
        K(acc_##S)(s_r, vr * m);                                                                         \
        K(acc_##S)(s_d, d * m);                                                                          \
        const S##m mv = m != zero;                                                                       \
        cnt += mv;                                                                                       \
        const S##v cand = K(sel_##S)(mv, d, ninf);                                                       \
        vmax = K(sel_##S)(cand > vmax, cand, vmax);                                                      \
        RC_DBG_WIDE_##S(va, vr, d, m);                                                                   \
    }

/* a and r NULL: exp inline (the checked exp only), of la / lr per chunk of a row, over its valid span
 * (XSPAN); masked tokens then read 0, and only ever meet a 0 mask. The shift is the first valid token's
 * values either way. Groups of N tokens with none valid are skipped (verl's masked_select drops them:
 * a finite masked value adds 0, a non-finite one is not verl's either). */
#define DEFINE_RC_DBG(S, T, ABSBITS)                                                                     \
    static void K(rc_dbg_##S)(const T *a_in, const T *r_in, const T *la, const T *lr, const uint8_t *mask, \
                              Py_ssize_t rows, Py_ssize_t width, double *out) {                          \
        const S##v zero = SPLAT(S, T, 0), ninf = SPLAT(S, T, -__builtin_inf());                          \
        const S##m absbits = (S##m){0} + ABSBITS;                                                        \
        const int inl = !a_in;                                                                           \
        XBUF(T, A_); XBUF(T, R_);                                                                            \
        Py_ssize_t first = 0, n_all = rows * width;                                                      \
        f64v ka = {0}, kr = {0}, kd = {0};                                                               \
        int shifted = 0;                                                                                 \
        if (!inl) {                                                                                      \
            while (first < n_all - 1 && !mask[first]) first++;                                           \
            ka += (double)a_in[first], kr += (double)r_in[first];                                        \
            kd += (double)__builtin_fabs(a_in[first] - r_in[first]);                                     \
            shifted = 1;                                                                                 \
        }                                                                                                \
        dacc s_a[2] = {0}, s_r[2] = {0}, s_d[2] = {0};                                                   \
        f64v c_x = {0}, c_y = {0}, c_e = {0}, c_q = {0}, c_c = {0}, c_a = {0}, c_r = {0};                \
        S##v vmax = ninf;                                                                                \
        int64_t n = 0;                                                                                   \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            S##m cnt = {0};                                                                              \
            for (Py_ssize_t j0 = 0; j0 < width; j0 += EXP_CHUNK) {                                       \
                const Py_ssize_t o = i * width + j0;                                                     \
                const Py_ssize_t w = width - j0 < EXP_CHUNK ? width - j0 : EXP_CHUNK;                    \
                const T *a = inl ? A_ : a_in + o, *r = inl ? R_ : r_in + o;                              \
                if (inl) {                                                                               \
                    const Py_ssize_t f = K(xspan_##S)(mask + o, w, la + o, A_);                          \
                    K(xspan_##S)(mask + o, w, lr + o, R_);                                               \
                    if (!shifted && f >= 0) {                                                            \
                        ka += (double)A_[f], kr += (double)R_[f];                                        \
                        kd += (double)__builtin_fabs(A_[f] - R_[f]);                                     \
                        shifted = 1;                                                                     \
                    }                                                                                    \
                }                                                                                        \
                Py_ssize_t j = 0;                                                                        \
                for (; j + N_##S <= w; j += N_##S)                                                       \
                    if (GROUP_BITS_##S(mask + o + j)) RC_DBG_BODY(S, a + j, r + j, mask + o + j);        \
                if (j < w) {                                                                             \
                    PAD(T, N_##S, a, a, j, w) PAD(T, N_##S, r, r, j, w);                                 \
                    PAD(uint8_t, N_##S, m, mask + o, j, w);                                              \
                    RC_DBG_BODY(S, a_pad, r_pad, m_pad);                                                 \
                }                                                                                        \
            }                                                                                            \
            n += K(count_##S)(cnt);                                                                      \
        }                                                                                                \
        T mx = -__builtin_inf();                                                                         \
        for (int l = 0; l < N_##S; l++)                                                                  \
            if (vmax[l] > mx) mx = vmax[l];                                                              \
        out[0] = K(acc_total)(s_a), out[1] = K(acc_total)(s_r), out[2] = K(acc_total)(s_d);              \
        out[3] = mx, out[4] = (double)n;                                                                 \
        const f64v *acc[7] = {&c_x, &c_y, &c_e, &c_q, &c_c, &c_a, &c_r};                                 \
        for (int k = 0; k < 7; k++) out[5 + k] = ((*acc[k])[0] + (*acc[k])[1]) + ((*acc[k])[2] + (*acc[k])[3]); \
    }
DEFINE_RC_DBG(f32, float, 0x7fffffff)
DEFINE_RC_DBG(f64, double, 0x7fffffffffffffffLL)

/* ---- a 0/1 mask of another dtype as bytes (what rollout.py's _mask_bytes gives, in one pass) ---------
 * out[k] = src[k] != 0 for n values; returns 0 when some value is neither 0 nor 1 (then out is not the
 * mask: the caller takes verl's op path, which weighs by the values). Floats: -0.0 is 0, NaN is neither. */
#define DEFINE_RC_MASK(NAME, T, U, BAD, BYTE)                                                            \
    static int K(NAME)(const T *src, Py_ssize_t n, uint8_t *out) {                                       \
        U bad = 0;                                                                                       \
        for (Py_ssize_t k = 0; k < n; k++) {                                                             \
            const T v = src[k];                                                                          \
            bad |= BAD(v);                                                                               \
            out[k] = BYTE(v);                                                                            \
        }                                                                                                \
        return !bad;                                                                                     \
    }
/* branch-free tests (vectorised): an integer is 0 or 1 exactly when no bit but the lowest is set (a
 * negative one has the sign bit), and its low byte is then its value */
#define RC_BAD_INT(v) ((v) & ~1)
#define RC_BYTE_INT(v) ((uint8_t)(v))
#define RC_BAD_FLOAT(v) (((v) != 0) & ((v) != 1))
#define RC_BYTE_FLOAT(v) ((v) != 0)
DEFINE_RC_MASK(rc_mask_i64, int64_t, int64_t, RC_BAD_INT, RC_BYTE_INT)
DEFINE_RC_MASK(rc_mask_i32, int32_t, int32_t, RC_BAD_INT, RC_BYTE_INT)
DEFINE_RC_MASK(rc_mask_f32, float, uint8_t, RC_BAD_FLOAT, RC_BYTE_FLOAT)
DEFINE_RC_MASK(rc_mask_f64, double, uint8_t, RC_BAD_FLOAT, RC_BYTE_FLOAT)
