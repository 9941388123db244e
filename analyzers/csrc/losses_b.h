/* Kernels: dppo_tv, dppo_kl, clip_cov, kl_cov (bypass_mode reuses vanilla and rollout).
 * Included by kernels.h once per instruction set (names through K(...), vectors as in kernels.h). */

/* The valid tokens' values that only torch can finish (exp, log) are packed, in row-major order, into
 * vectors of n_valid floats: torch then evaluates them on those tokens only (its exp / log of a value
 * does not depend on where in a tensor it sits: tested), and the main loop reads them back in the same
 * order. A group of N mask bytes is "all" (every byte 1, the bool mask's bytes), "none" (0) or mixed
 * (GROUP_BITS / GROUP_ALL, kernels.h). */

/* ---- DPPO-Binary-TV / -KL (verl's compute_policy_loss_dppo_tv / _dppo_kl) ---------------------------
 * dppo_pack writes, for the valid tokens, x = [clamp(lp - old, -20, 20) | lp | old] (3 blocks of
 * n_valid); torch takes exp of all of it: r = exp(clamp(lp - old)), p = exp(lp), q = exp(old), and for
 * KL the log of dppo_frac(p, q) = ((1 - q) + 1e-8) / ((1 - p) + 1e-8): L. The main loop, per token:
 *   tv:  pos = (p - q) <= hi,                     neg = (p - q) >= -lo
 *   kl:  b = q (old - lp) + (1 - q) L;  pos = b <= hi | p <= q,  neg = b <= lo | p >= q
 * valid = A > 0 ? pos : neg (as torch.where: NaN in A picks neg); v = valid as 0 / 1;
 * l = -A min(r, c) lp v, summed times the mask (the row sums are negated at the end: -(x) y = -(x y));
 * kl: masked sum of the clamped log-ratio; kept: valid tokens under the mask; lower: of those, r > c.
 * Masked tokens read r = p = q = L = 0: their loss is (A 0) lp v times 0, still NaN where A or lp is
 * not finite (and old's non-finite values reach the kl sum), so a non-finite input anywhere still
 * makes a sum non-finite. */
#define DPPO_PACK_BODY(S, T, LP, OLD, M)                                                                 \
    {                                                                                                    \
        const uint64_t bits = GROUP_BITS_##S(M);                                                          \
        if (bits == GROUP_ALL_##S && k + N_##S <= cap) {                                                  \
            const S##v lpv = K(ld_##S)(LP), oldv = K(ld_##S)(OLD);                                       \
            S##v d = lpv - oldv;                                                                         \
            d = CLAMP(S, d, -lim, lim);                                                                  \
            memcpy(xd + k, &d, sizeof d);                                                                \
            memcpy(xl + k, &lpv, sizeof lpv);                                                            \
            memcpy(xo + k, &oldv, sizeof oldv);                                                          \
            k += N_##S;                                                                                  \
        } else if (bits) {                                                                               \
            for (int l = 0; l < N_##S; l++)                                                              \
                if ((M)[l]) {                                                                            \
                    if (k < cap) {                                                                       \
                        T d = (LP)[l] - (OLD)[l];                                                        \
                        d = d < (T)-20 ? (T)-20 : d;                                                     \
                        d = d > (T)20 ? (T)20 : d;                                                       \
                        xd[k] = d, xl[k] = (LP)[l], xo[k] = (OLD)[l];                                    \
                    }                                                                                    \
                    k++;                                                                                 \
                }                                                                                        \
        }                                                                                                \
    }

#define DEFINE_DPPO_PACK(S, T)                                                                           \
    static Py_ssize_t K(dppo_pack_##S)(const T *lp, const T *old, const uint8_t *mask, Py_ssize_t rows,  \
                                       Py_ssize_t width, T *x, Py_ssize_t cap) {                         \
        const S##v lim = SPLAT(S, T, 20);                                                                \
        T *xd = x, *xl = x + cap, *xo = x + 2 * cap;                                                     \
        Py_ssize_t k = 0;                                                                                \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S) DPPO_PACK_BODY(S, T, lp + o + j, old + o + j, mask + o + j); \
            if (j < width) {                                                                             \
                PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, old, old + o, j, width);               \
                PAD(uint8_t, N_##S, m, mask + o, j, width);                                              \
                DPPO_PACK_BODY(S, T, lp_pad, old_pad, m_pad);                                            \
            }                                                                                            \
        }                                                                                                \
        return k;                                                                                        \
    }
DEFINE_DPPO_PACK(f32, float)
DEFINE_DPPO_PACK(f64, double)

/* rk, p, q, L of the N tokens at M from the packed vectors (0 where masked) */
#define DPPO_UNPACK(S, T, KL, M)                                                                         \
    const uint64_t bits = GROUP_BITS_##S(M);                                                              \
    S##v rk = zero, p = zero, q = zero, L = zero;                                                        \
    if (bits == GROUP_ALL_##S && k + N_##S <= cap) {                                                      \
        rk = K(ld_##S)(xr + k), p = K(ld_##S)(xp + k), q = K(ld_##S)(xq + k);                            \
        if (KL) L = K(ld_##S)(ll + k);                                                                   \
        k += N_##S;                                                                                      \
    } else if (bits) {                                                                                   \
        T tr[N_##S] = {0}, tp[N_##S] = {0}, tq[N_##S] = {0}, tl[N_##S] = {0};                            \
        for (int l = 0; l < N_##S; l++)                                                                  \
            if ((M)[l] && k < cap) {                                                                     \
                tr[l] = xr[k], tp[l] = xp[k], tq[l] = xq[k];                                             \
                if (KL) tl[l] = ll[k];                                                                   \
                k++;                                                                                     \
            }                                                                                            \
        memcpy(&rk, tr, sizeof rk), memcpy(&p, tp, sizeof p), memcpy(&q, tq, sizeof q);                  \
        memcpy(&L, tl, sizeof L);                                                                        \
    }

#define DPPO_BODY(S, T, KL, LP, OLD, ADV, M)                                                             \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##v lpv = K(ld_##S)(LP), oldv = K(ld_##S)(OLD);                                           \
        S##v d = lpv - oldv;                                                                             \
        d = CLAMP(S, d, -lim, lim);                                                                      \
        K(acc_##S)(kl_acc, d * m);                                                                       \
        DPPO_UNPACK(S, T, KL, M)                                                                         \
        const S##v a = K(ld_##S)(ADV);                                                                   \
        S##m pos, neg;                                                                                   \
        if (KL) {                                                                                        \
            const S##v b = q * (oldv - lpv) + (one - q) * L;                                             \
            pos = (b <= hi) | (p <= q);                                                                  \
            neg = (b <= lo) | (p >= q);                                                                  \
        } else {                                                                                         \
            const S##v diff = p - q;                                                                     \
            pos = diff <= hi;                                                                            \
            neg = diff >= nlo;                                                                           \
        }                                                                                                \
        const S##m g = a > zero;                                                                         \
        const S##m valid = (pos & g) | (neg & ~g);                                                       \
        const S##v v = K(sel_##S)(valid, one, zero);                                                     \
        const S##v loss = ((a * CLAMP_MAX(S, rk, c)) * lpv) * v;                                         \
        K(acc_##S)(acc, loss * m);                                                                       \
        const S##m kv = valid & (m != zero);                                                             \
        kc += kv;                                                                                        \
        lc += kv & (rk > c);                                                                             \
    }

/* x: dppo_pack's vectors after exp (cap = n_valid each), ll: L (KL only, n_valid) */
#define DEFINE_DPPO(NAME, KL, S, T)                                                                      \
    static void K(NAME##_##S)(const T *lp, const T *old, const T *x, const T *ll, Py_ssize_t cap,       \
                              const T *adv, const uint8_t *mask, Py_ssize_t rows, Py_ssize_t width,      \
                              T lo_, T hi_, T c_, double *row_out, double *kl_out, int64_t *kept_out,    \
                              int64_t *lower_out) {                                                      \
        const S##v lo = SPLAT(S, T, lo_), nlo = SPLAT(S, T, -lo_), hi = SPLAT(S, T, hi_);                \
        const S##v c = SPLAT(S, T, c_), zero = SPLAT(S, T, 0), one = SPLAT(S, T, 1);                     \
        const S##v lim = SPLAT(S, T, 20);                                                                \
        const T *xr = x, *xp = x + cap, *xq = x + 2 * cap;                                               \
        (void)lo, (void)nlo;                                                                             \
        dacc kl_acc[2] = {0};                                                                            \
        int64_t kept = 0, lower = 0;                                                                     \
        Py_ssize_t k = 0;                                                                                \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            dacc acc[2] = {0};                                                                           \
            S##m kc = {0}, lc = {0};                                                                     \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S)                                                       \
                DPPO_BODY(S, T, KL, lp + o + j, old + o + j, adv + o + j, mask + o + j);                 \
            if (j < width) {                                                                             \
                PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, old, old + o, j, width);               \
                PAD(T, N_##S, adv, adv + o, j, width) PAD(uint8_t, N_##S, m, mask + o, j, width);        \
                DPPO_BODY(S, T, KL, lp_pad, old_pad, adv_pad, m_pad);                                    \
            }                                                                                            \
            row_out[i] = -K(acc_total)(acc);                                                             \
            kept += K(count_##S)(kc);                                                                    \
            lower += K(count_##S)(lc);                                                                   \
        }                                                                                                \
        *kl_out = K(acc_total)(kl_acc);                                                                  \
        *kept_out = kept;                                                                                \
        *lower_out = lower;                                                                              \
    }
DEFINE_DPPO(dppo_tv, 0, f32, float)
DEFINE_DPPO(dppo_tv, 0, f64, double)
DEFINE_DPPO(dppo_kl, 1, f32, float)
DEFINE_DPPO(dppo_kl, 1, f64, double)

/* dppo_kl's log argument, ((1 - q) + 1e-8) / ((1 - p) + 1e-8), over n tokens (torch then takes the log) */
#define DEFINE_DPPO_FRAC(S, T)                                                                           \
    static void K(dppo_frac_##S)(const T *pp, const T *qq, Py_ssize_t n, T *out) {                       \
        const S##v one = SPLAT(S, T, 1), eps = SPLAT(S, T, 1e-8);                                        \
        Py_ssize_t j = 0;                                                                                \
        for (; j + N_##S <= n; j += N_##S) {                                                             \
            const S##v f = ((one - K(ld_##S)(qq + j)) + eps) / ((one - K(ld_##S)(pp + j)) + eps);        \
            memcpy(out + j, &f, sizeof f);                                                               \
        }                                                                                                \
        for (; j < n; j++) out[j] = ((T)1 - qq[j] + (T)1e-8) / ((T)1 - pp[j] + (T)1e-8);                 \
    }
DEFINE_DPPO_FRAC(f32, float)
DEFINE_DPPO_FRAC(f64, double)

/* Append the flat indices base + l of the lanes set in `take` to out[*k...] (row-major order): every
 * lane writes at out[*k] and only a set lane advances *k, so the writes need out to have N slots past
 * *k; nearer the end of out (cap) each write is checked, and *k goes on counting past cap (the caller
 * sees the true count). */
#define APPEND_LANES(N, take, base, out, k, cap, ...)                                                    \
    if ((k) + (N) <= (cap)) {                                                                            \
        for (int l = 0; l < (N); l++) {                                                                  \
            __VA_ARGS__;                                                                                 \
            (k) -= (take)[l];                                                                            \
        }                                                                                                \
    } else {                                                                                             \
        for (int l = 0; l < (N); l++)                                                                    \
            if ((take)[l]) {                                                                             \
                if ((k) < (cap)) {                                                                       \
                    __VA_ARGS__;                                                                         \
                }                                                                                        \
                (k)++;                                                                                   \
            }                                                                                            \
    }

/* ---- Clip-Cov (verl's compute_policy_loss_clip_cov) -------------------------------------------------
 * clip_cov_pack: A m and lp m of every token into am / lm (torch sums them: verl's masked means, the
 * same values in the same (rows, width) reduction), the masked sum of lp - old, and lp - old of the
 * valid tokens packed into vd (torch: r = exp(vd), verl's ratio there). Returns the packed count.
 * clip_cov: l = A- max(r, lo) - A+ min(r, hi) with a = A m (= verl's max(-A r, -A clamp(r, lo, hi)), as
 * in vanilla without the dual clip); z = a r + l > 0 where verl's pg_losses2 > pg_losses1. Candidates:
 * valid, not clipped, lb < cov < ub with cov = (A - mean_a) (lp - mean_lp); their flat indices go to
 * cand and their packed indices to cand_q, in row-major order (verl's torch.nonzero order), at most cap
 * of them (the count returned goes on past cap). Masked tokens read r = 0: l is then 0, or NaN where A
 * is not finite. The loss row sums are of every token: clip_cov_fix takes the drawn ones off. */
#define CLIP_COV_PACK_BODY(S, T, LP, OLD, ADV, M, AMP, LMP)                                              \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##v lpv = K(ld_##S)(LP), av = K(ld_##S)(ADV);                                             \
        const S##v d = lpv - K(ld_##S)(OLD);                                                             \
        K(acc_##S)(kl_acc, d * m);                                                                       \
        const S##v amv = av * m, lmv = lpv * m;                                                          \
        memcpy(AMP, &amv, sizeof amv);                                                                   \
        memcpy(LMP, &lmv, sizeof lmv);                                                                   \
        const uint64_t bits = GROUP_BITS_##S(M);                                                          \
        if (bits == GROUP_ALL_##S && k + N_##S <= cap) {                                                  \
            memcpy(vd + k, &d, sizeof d);                                                                \
            k += N_##S;                                                                                  \
        } else if (bits) {                                                                               \
            for (int l = 0; l < N_##S; l++)                                                              \
                if ((M)[l]) {                                                                            \
                    if (k < cap) vd[k] = (LP)[l] - (OLD)[l];                                             \
                    k++;                                                                                 \
                }                                                                                        \
        }                                                                                                \
    }

#define DEFINE_CLIP_COV_PACK(S, T)                                                                       \
    static Py_ssize_t K(clip_cov_pack_##S)(const T *lp, const T *old, const T *adv, const uint8_t *mask, \
                                           Py_ssize_t rows, Py_ssize_t width, T *am, T *lm, T *vd,       \
                                           Py_ssize_t cap, double *kl_out) {                             \
        dacc kl_acc[2] = {0};                                                                            \
        Py_ssize_t k = 0;                                                                                \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S)                                                       \
                CLIP_COV_PACK_BODY(S, T, lp + o + j, old + o + j, adv + o + j, mask + o + j, am + o + j, \
                                   lm + o + j);                                                          \
            if (j < width) {                                                                             \
                PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, old, old + o, j, width);               \
                PAD(T, N_##S, adv, adv + o, j, width) PAD(uint8_t, N_##S, m, mask + o, j, width);        \
                T am_pad[N_##S], lm_pad[N_##S];                                                          \
                CLIP_COV_PACK_BODY(S, T, lp_pad, old_pad, adv_pad, m_pad, am_pad, lm_pad);               \
                memcpy(am + o + j, am_pad, (size_t)(width - j) * sizeof(T));                             \
                memcpy(lm + o + j, lm_pad, (size_t)(width - j) * sizeof(T));                             \
            }                                                                                            \
        }                                                                                                \
        *kl_out = K(acc_total)(kl_acc);                                                                  \
        return k;                                                                                        \
    }
DEFINE_CLIP_COV_PACK(f32, float)
DEFINE_CLIP_COV_PACK(f64, double)

/* whether any lane of a 32-byte lane mask is set */
static inline int K(any_set)(const void *v, size_t n) {
    uint64_t w[4];
    memcpy(w, v, n < sizeof w ? n : sizeof w);
    return ((w[0] | w[1]) | (w[2] | w[3])) != 0;
}

#define CLIP_COV_BODY(S, T, IDX, LP, ADV, M)                                                             \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##v lpv = K(ld_##S)(LP), av = K(ld_##S)(ADV);                                             \
        const uint64_t bits = GROUP_BITS_##S(M);                                                          \
        const Py_ssize_t k0 = kq;                                                                        \
        S##v rk = zero;                                                                                  \
        if (bits == GROUP_ALL_##S && kq + N_##S <= n_packed) {                                            \
            rk = K(ld_##S)(xr + kq);                                                                     \
            kq += N_##S;                                                                                 \
        } else if (bits) {                                                                               \
            T tr[N_##S] = {0};                                                                           \
            for (int l = 0; l < N_##S; l++)                                                              \
                if ((M)[l] && kq < n_packed) tr[l] = xr[kq++];                                           \
            memcpy(&rk, tr, sizeof rk);                                                                  \
        }                                                                                                \
        const S##v a = av * m;                                                                           \
        const S##v ap = CLAMP_MIN(S, a, zero);                                                           \
        const S##v an = ap - a;                                                                          \
        const S##v loss = CLAMP_MIN(S, rk, lo) * an - CLAMP_MAX(S, rk, hi) * ap;                         \
        K(acc_##S)(acc, loss);                                                                           \
        const S##v z = a * rk + loss;                                                                    \
        const S##v cov = (av - mean_a) * (lpv - mean_lp);                                                \
        const S##m take = (m != zero) & ~(z > zero) & (cov < ub) & (cov > lb);                           \
        if (K(any_set)(&take, sizeof take)) { /* branch-free appends while N slots are left */           \
            Py_ssize_t q = k0;                                                                           \
            if (nc + N_##S <= cap) {                                                                     \
                for (int l = 0; l < N_##S; l++) {                                                        \
                    cand[nc] = (IDX) + l, cand_q[nc] = q;                                                \
                    nc -= take[l];                                                                       \
                    q += (M)[l] != 0;                                                                    \
                }                                                                                        \
            } else {                                                                                     \
                for (int l = 0; l < N_##S; l++) {                                                        \
                    if (take[l]) {                                                                       \
                        if (nc < cap) cand[nc] = (IDX) + l, cand_q[nc] = q;                              \
                        nc++;                                                                            \
                    }                                                                                    \
                    q += (M)[l] != 0;                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

#define DEFINE_CLIP_COV(S, T)                                                                            \
    static Py_ssize_t K(clip_cov_##S)(const T *lp, const T *adv, const T *xr, Py_ssize_t n_packed,      \
                                      const uint8_t *mask, Py_ssize_t rows, Py_ssize_t width, T lo_,     \
                                      T hi_, T mean_a_, T mean_lp_, T lb_, T ub_, double *row_out,       \
                                      int64_t *cand, int64_t *cand_q, Py_ssize_t cap) {                  \
        const S##v lo = SPLAT(S, T, lo_), hi = SPLAT(S, T, hi_), zero = SPLAT(S, T, 0);                  \
        const S##v mean_a = SPLAT(S, T, mean_a_), mean_lp = SPLAT(S, T, mean_lp_);                       \
        const S##v lb = SPLAT(S, T, lb_), ub = SPLAT(S, T, ub_);                                         \
        Py_ssize_t kq = 0, nc = 0;                                                                       \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            dacc acc[2] = {0};                                                                           \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S)                                                       \
                CLIP_COV_BODY(S, T, o + j, lp + o + j, adv + o + j, mask + o + j);                       \
            if (j < width) {                                                                             \
                PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, adv, adv + o, j, width);               \
                PAD(uint8_t, N_##S, m, mask + o, j, width);                                              \
                CLIP_COV_BODY(S, T, o + j, lp_pad, adv_pad, m_pad);                                      \
            }                                                                                            \
            row_out[i] = K(acc_total)(acc);                                                              \
        }                                                                                                \
        return nc;                                                                                       \
    }
DEFINE_CLIP_COV(f32, float)
DEFINE_CLIP_COV(f64, double)

/* clip_cov: take the drawn candidates' loss max(-A r, -A clamp(r, lo, hi)) (verl's floats) off their
 * rows; sel indexes cand / cand_q (n_cand of them). Returns -1 on an index out of range. */
#define DEFINE_CLIP_COV_FIX(S, T)                                                                        \
    static int K(clip_cov_fix_##S)(const T *adv, const T *xr, Py_ssize_t n_packed, Py_ssize_t n_tokens,  \
                                   Py_ssize_t width, const int64_t *cand, const int64_t *cand_q,         \
                                   Py_ssize_t n_cand, const int64_t *sel, Py_ssize_t k, T lo, T hi,      \
                                   double *row_out) {                                                    \
        for (Py_ssize_t s = 0; s < k; s++) {                                                             \
            const int64_t c = sel[s];                                                                    \
            if (c < 0 || c >= n_cand) return -1;                                                         \
            const int64_t at = cand[c], q = cand_q[c];                                                   \
            if (at < 0 || at >= n_tokens || q < 0 || q >= n_packed) return -1;                           \
            const T na = -adv[at], r = xr[q];                                                            \
            const T rc = r < lo ? lo : (r > hi ? hi : r);                                                \
            const T l1 = na * r, l2 = na * rc;                                                           \
            row_out[at / width] -= (double)(l2 > l1 ? l2 : l1);                                          \
        }                                                                                                \
        return 0;                                                                                        \
    }
DEFINE_CLIP_COV_FIX(f32, float)
DEFINE_CLIP_COV_FIX(f64, double)

/* ---- KL-Cov (verl's compute_policy_loss_kl_cov) -----------------------------------------------------
 * kl_cov_pack: the masked sum of |lp - old|, the masked sum of A (only its finiteness is used: a
 * non-finite A anywhere makes it non-finite) and verl's compaction advantages[mask], log_prob[mask]
 * (row-major) into va / vl, with d = lp - old of the same tokens into vd (at most cap tokens each; the
 * count is returned). torch then takes r = exp(vd) (verl's ratio on those tokens) and the two means;
 * kl_cov_rows: the row sums of -A r over each row's tokens (negated at the end) and verl's covariance
 * cov = (va - mean_a) (vl - mean_lp). */
#define KL_COV_PACK_BODY(S, T, LP, OLD, ADV, M)                                                          \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##v lpv = K(ld_##S)(LP), av = K(ld_##S)(ADV);                                             \
        const S##v d = lpv - K(ld_##S)(OLD);                                                             \
        K(acc_##S)(abs_acc, K(sel_##S)(d < zero, -d, d) * m);                                            \
        K(acc_##S)(a_acc, av * m);                                                                       \
        const uint64_t bits = GROUP_BITS_##S(M);                                                          \
        if (bits == GROUP_ALL_##S && k + N_##S <= cap) {                                                  \
            memcpy(va + k, &av, sizeof av);                                                              \
            memcpy(vl + k, &lpv, sizeof lpv);                                                            \
            memcpy(vd + k, &d, sizeof d);                                                                \
            k += N_##S;                                                                                  \
        } else if (bits) {                                                                               \
            for (int l = 0; l < N_##S; l++)                                                              \
                if ((M)[l]) {                                                                            \
                    if (k < cap) va[k] = (ADV)[l], vl[k] = (LP)[l], vd[k] = (LP)[l] - (OLD)[l];          \
                    k++;                                                                                 \
                }                                                                                        \
        }                                                                                                \
    }

#define DEFINE_KL_COV_PACK(S, T)                                                                         \
    static Py_ssize_t K(kl_cov_pack_##S)(const T *lp, const T *old, const T *adv, const uint8_t *mask,  \
                                         Py_ssize_t rows, Py_ssize_t width, T *va, T *vl, T *vd,         \
                                         Py_ssize_t cap, double *abs_out, double *a_out) {               \
        const S##v zero = SPLAT(S, T, 0);                                                                \
        dacc abs_acc[2] = {0}, a_acc[2] = {0};                                                           \
        Py_ssize_t k = 0;                                                                                \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S)                                                       \
                KL_COV_PACK_BODY(S, T, lp + o + j, old + o + j, adv + o + j, mask + o + j);              \
            if (j < width) {                                                                             \
                PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, old, old + o, j, width);               \
                PAD(T, N_##S, adv, adv + o, j, width) PAD(uint8_t, N_##S, m, mask + o, j, width);        \
                KL_COV_PACK_BODY(S, T, lp_pad, old_pad, adv_pad, m_pad);                                 \
            }                                                                                            \
        }                                                                                                \
        *abs_out = K(acc_total)(abs_acc);                                                                \
        *a_out = K(acc_total)(a_acc);                                                                    \
        return k;                                                                                        \
    }
DEFINE_KL_COV_PACK(f32, float)
DEFINE_KL_COV_PACK(f64, double)

/* n_row: each row's token count (they sum to n, the length of va, vl, r and cov_out) */
#define KL_COV_ROWS_BODY(S, VA, VL, R, OUT)                                                              \
    {                                                                                                    \
        const S##v a = K(ld_##S)(VA);                                                                    \
        K(acc_##S)(acc, a * K(ld_##S)(R));                                                               \
        const S##v cov = (a - mean_a) * (K(ld_##S)(VL) - mean_lp);                                       \
        memcpy(OUT, &cov, sizeof cov);                                                                   \
    }

#define DEFINE_KL_COV_ROWS(S, T)                                                                         \
    static void K(kl_cov_rows_##S)(const T *va, const T *vl, const T *r, const int64_t *n_row,          \
                                   Py_ssize_t rows, T mean_a_, T mean_lp_, double *row_out, T *cov_out) { \
        const S##v mean_a = SPLAT(S, T, mean_a_), mean_lp = SPLAT(S, T, mean_lp_);                       \
        Py_ssize_t o = 0;                                                                                \
        for (Py_ssize_t i = 0; i < rows; o += n_row[i], i++) {                                           \
            const Py_ssize_t w = n_row[i];                                                               \
            dacc acc[2] = {0};                                                                           \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= w; j += N_##S)                                                           \
                KL_COV_ROWS_BODY(S, va + o + j, vl + o + j, r + o + j, cov_out + o + j);                 \
            if (j < w) {                                                                                 \
                PAD(T, N_##S, a, va + o, j, w) PAD(T, N_##S, l, vl + o, j, w);                           \
                PAD(T, N_##S, r, r + o, j, w);                                                           \
                T c_pad[N_##S];                                                                          \
                KL_COV_ROWS_BODY(S, a_pad, l_pad, r_pad, c_pad);                                         \
                memcpy(cov_out + o + j, c_pad, (size_t)(w - j) * sizeof(T));                             \
            }                                                                                            \
            row_out[i] = -K(acc_total)(acc);                                                             \
        }                                                                                                \
    }
DEFINE_KL_COV_ROWS(f32, float)
DEFINE_KL_COV_ROWS(f64, double)

/* kl_cov: the top-k tokens' loss -A r becomes verl's -A r + coef |lp - old|. sel holds indices into
 * the packed vectors (r); the q-th packed token is the q-th valid one, row-major: its row by bisection
 * of the per-row counts' running sums, then that row's mask 8 bytes at a time (non-zero bytes counted by
 * folding each byte's bits onto its lowest), then byte by byte. Its row sum gets (-A r + coef |d|) - (-A r)
 * in float64 (verl sums the first in place of the second). Returns -1 (nothing written past the
 * offending index) when an index is out of range or a row's count does not match its mask. */
static inline int K(nonzero_bytes)(uint64_t w) {
    w |= w >> 4;
    w |= w >> 2;
    w |= w >> 1;
    return __builtin_popcountll(w & 0x0101010101010101ULL);
}
#define DEFINE_KL_COV_FIX(S, T)                                                                          \
    static int K(kl_cov_fix_##S)(const T *lp, const T *old, const T *adv, const uint8_t *mask,           \
                                 Py_ssize_t rows, Py_ssize_t width, const int64_t *offsets, const T *r,  \
                                 const int64_t *sel, Py_ssize_t k, T coef, double *row_out) {            \
        for (Py_ssize_t s = 0; s < k; s++) {                                                             \
            const int64_t q = sel[s];                                                                    \
            if (q < 0 || q >= offsets[rows]) return -1;                                                  \
            Py_ssize_t a = 0, b = rows; /* the row with offsets[a] <= q < offsets[a + 1] */              \
            while (b - a > 1) {                                                                          \
                const Py_ssize_t mid = a + (b - a) / 2;                                                  \
                if (offsets[mid] <= q) a = mid;                                                          \
                else b = mid;                                                                            \
            }                                                                                            \
            int64_t left = q - offsets[a], at = -1;                                                      \
            const uint8_t *row = mask + a * width;                                                       \
            Py_ssize_t j = 0;                                                                            \
            for (; j + 8 <= width; j += 8) {                                                             \
                const int c = K(nonzero_bytes)(K(group8)(row + j));                                       \
                if (c > left) break;                                                                     \
                left -= c;                                                                               \
            }                                                                                            \
            for (; j < width; j++)                                                                       \
                if (row[j] && left-- == 0) {                                                             \
                    at = a * width + j;                                                                  \
                    break;                                                                               \
                }                                                                                        \
            if (at < 0) return -1;                                                                       \
            const T base = -adv[at] * r[q];                                                              \
            T d = lp[at] - old[at];                                                                      \
            d = d < 0 ? -d : d;                                                                          \
            const T with_kl = base + coef * d;                                                           \
            row_out[a] += (double)with_kl - (double)base;                                                \
        }                                                                                                \
        return 0;                                                                                        \
    }
DEFINE_KL_COV_FIX(f32, float)
DEFINE_KL_COV_FIX(f64, double)
