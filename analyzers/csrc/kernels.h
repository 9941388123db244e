/* The kernels of _fused.c, included once per instruction set: every name gets the ISA suffix (ISA),
 * so the AVX2 copy is compiled whole for AVX2, helpers included. */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define K(name) CAT(name, ISA)

#ifndef RLV_KERNEL_TYPES
#define RLV_KERNEL_TYPES
typedef float f32v __attribute__((vector_size(32)));
typedef int32_t f32m __attribute__((vector_size(32)));
typedef double f64v __attribute__((vector_size(32)));
typedef int64_t f64m __attribute__((vector_size(32)));
typedef float f32h __attribute__((vector_size(16)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x4 __attribute__((vector_size(4)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef f64v dacc;

#endif

/* Vectors of one 32-byte register (GCC vector extensions: AVX2 in the avx2 clone, SSE pairs in the
 * default one, NEON elsewhere). F: the token dtype's vector (8 floats / 4 doubles), I: its lane masks
 * (-1 / 0), D: the float64 accumulators (two per float vector). Each row runs in whole vectors; the
 * tail (width % lanes tokens) runs the same vector code on a zero-padded copy, whose padding lanes
 * contribute exactly 0 to every sum and count (mask 0, every value 0). */
#define N_f32 8
#define N_f64 4

static inline f32v K(ld_f32)(const float *p) {
    f32v v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline f64v K(ld_f64)(const double *p) {
    f64v v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void K(st_f32)(float *p, f32v v) { memcpy(p, &v, sizeof v); }
static inline void K(st_f64)(double *p, f64v v) { memcpy(p, &v, sizeof v); }
/* The mask bytes as 0 / 1 floats, and float32 lanes widened to float64. GCC 12 lowers these vector
 * conversions lane by lane (~30 instructions for the mask, 5 for a widening, through the stack), so
 * the AVX2 copy uses the one instruction each (vpmovzxbd + vcvtdq2ps, vcvtps2pd); both give the same
 * values exactly (0 / 1, and float -> double is exact). */
#ifdef RLV_AVX2_INTRINSICS
static inline f32v K(mask_f32)(const uint8_t *p) {
    return (f32v)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline f64v K(mask_f64)(const uint8_t *p) {
    int32_t w;
    memcpy(&w, p, sizeof w);
    return (f64v)_mm256_cvtepi32_pd(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(w)));
}
static inline f64v K(lo_f64)(f32v v) { return (f64v)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)v)); }
static inline f64v K(hi_f64)(f32v v) { return (f64v)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)v, 1)); }
#else
static inline f32v K(mask_f32)(const uint8_t *p) {
    u8x8 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, f32m), f32v); /* zero-extend, then convert */
}
static inline f64v K(mask_f64)(const uint8_t *p) {
    u8x4 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, i32x4), f64v);
}
static inline f64v K(half_f64)(f32v v, int k) { /* lanes 4k .. 4k + 3 as doubles */
    union {
        f32v v;
        f32h h[2];
    } u = {v};
    return __builtin_convertvector(u.h[k], f64v);
}
static inline f64v K(lo_f64)(f32v v) { return K(half_f64)(v, 0); }
static inline f64v K(hi_f64)(f32v v) { return K(half_f64)(v, 1); }
#endif
static inline f32v K(sel_f32)(f32m m, f32v a, f32v b) { return (f32v)(((f32m)a & m) | ((f32m)b & ~m)); }
static inline f64v K(sel_f64)(f64m m, f64v a, f64v b) { return (f64v)(((f64m)a & m) | ((f64m)b & ~m)); }
/* acc[0..1] += v in float64 (a float vector is two accumulators' worth) */
static inline void K(acc_f32)(dacc *acc, f32v v) {
    acc[0] += K(lo_f64)(v);
    acc[1] += K(hi_f64)(v);
}
static inline void K(acc_f64)(dacc *acc, f64v v) { acc[0] += v; }
static inline double K(acc_total)(const dacc *acc) {
    dacc s = acc[0] + acc[1];
    return (s[0] + s[1]) + (s[2] + s[3]);
}
/* counts: a lane mask is -1 where true; int32/int64 lanes, per row (a row has < 2^31 tokens) */
static inline int64_t K(count_f32)(f32m c) {
    int64_t s = 0;
    for (int l = 0; l < 8; l++) s += c[l];
    return -s;
}
static inline int64_t K(count_f64)(f64m c) {
    int64_t s = 0;
    for (int l = 0; l < 4; l++) s += c[l];
    return -s;
}

/* clamps that keep NaN, as torch.clamp does: compare, then select the bound where the test holds */
#define CLAMP(S, x, lo, hi) CLAMP_MAX(S, CLAMP_MIN(S, x, lo), hi)
#define CLAMP_MIN(S, x, lo) K(sel_##S)((x) < (lo), (lo), (x))
#define CLAMP_MAX(S, x, hi) K(sel_##S)((x) > (hi), (hi), (x))
#define SPLAT(S, T, x) ((S##v){0} + (T)(x))

/* The row loop: BODY(off, ...) handles the N lanes of the row at the pointers it is given. Whole
 * vectors read the row in place; the tail reads zero-padded copies (PAD declares one, `name_pad`). */
#define PAD(T, N, name, src, j, width)                                                                   \
    T name##_pad[N] = {0};                                                                               \
    if (src) memcpy(name##_pad, (src) + (j), (size_t)((width) - (j)) * sizeof(T));

/* ---- valid tokens per row ----------------------------------------------------------------------------
 * n_out[i]: the non-zero mask bytes of row i; len_out[i]: verl's T_i + 1e-8 in float32 (a float32 count
 * plus 1e-8 rounded to float32, as torch adds them), as a double. Returns the total.
 * Eight bytes at a time: ((x & 0x7f) + 0x7f) | x has a byte's top bit set exactly when the byte is not
 * zero (no carry leaves a byte), and those bits add up in byte lanes, 255 words at most before the lanes
 * are folded into the count (a byte-at-a-time loop with an int64 count took ~16 us at 8 x 16384). */
static int64_t K(count_nonzero_bytes)(const uint8_t *m, Py_ssize_t width) {
    const uint64_t low7 = 0x7f7f7f7f7f7f7f7fULL, ones = 0x0101010101010101ULL;
    const uint64_t even = 0x00ff00ff00ff00ffULL, lanes16 = 0x0001000100010001ULL;
    int64_t n = 0;
    Py_ssize_t j = 0;
    while (width - j >= 8) {
        Py_ssize_t stop = j + 8 * 255;
        if (stop > width - 7) stop = width - 7;
        uint64_t acc = 0; /* eight byte lanes, each at most 255 */
        for (; j < stop; j += 8) {
            uint64_t x;
            memcpy(&x, m + j, 8);
            acc += ((((x & low7) + low7) | x) >> 7) & ones;
        }
        acc = (acc & even) + ((acc >> 8) & even); /* four 16-bit lanes, each at most 510 */
        n += (int64_t)((acc * lanes16) >> 48);
    }
    for (; j < width; j++) n += m[j] != 0;
    return n;
}

static int64_t K(count_rows)(const uint8_t *mask, Py_ssize_t rows, Py_ssize_t width, int64_t *n_out,
                             double *len_out) {
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < rows; i++) {
        const int64_t n = K(count_nonzero_bytes)(mask + i * width, width);
        n_out[i] = n;
        volatile float len = (float)n + 1e-8f; /* rounded to float32, not kept in a wider register */
        len_out[i] = (double)len;
        total += n;
    }
    return total;
}

/* ---- entropy and KL-estimator row sums (verl's agg_loss inputs for entropy and kl_penalty) -----------
 * kind 0: none, 1: k1 (lp - ref), 2: abs |lp - ref|, 3: k2 ((lp - ref)^2 * 0.5),
 * 4: k3 (clamp(e - delta - 1, -10, 10), delta = clamp(ref - lp, -20, 20), e = exp(delta) from torch).
 * check: also the sum of (lp - ref)^2 over every token (a straight-through estimator's k2 must be
 * finite everywhere). ent may be NULL (no entropy); ent_out / kl_out are then not written. */
#define AUX_BODY(S, ENT, LP, REF, E, M)                                                                  \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                      \
        if (ent) K(acc_##S)(ea, K(ld_##S)(ENT) * m);                                                           \
        if (kind == 4) {                                                                                 \
            S##v delta = K(ld_##S)(REF) - K(ld_##S)(LP);                                                       \
            if (check) K(acc_##S)(k2_acc, delta * delta);                                                   \
            delta = CLAMP(S, delta, -lim, lim);                                                          \
            S##v v = K(ld_##S)(E) - delta;                                                                  \
            v = v - one;                                                                                 \
            K(acc_##S)(ka, CLAMP(S, v, -ten, ten) * m);                                                     \
        } else if (kind > 0 || check) {                                                                  \
            S##v v = K(ld_##S)(LP) - K(ld_##S)(REF);                                                           \
            if (check) K(acc_##S)(k2_acc, v * v);                                                           \
            if (kind == 2) v = K(sel_##S)(v < zero, -v, v);                                                 \
            if (kind == 3) v = (v * v) * half;                                                           \
            K(acc_##S)(ka, v * m);                                                                          \
        }                                                                                                \
    }


/* ---- vanilla PPO clip, dual clip (verl's compute_policy_loss_vanilla) ------------------------------
 * a = A m, a+ = max(a, 0), a- = a+ - a (exactly -A or 0);
 * l = a- clamp(r, lo, c) - a+ min(r, hi)   (one term is 0: the rounding of verl's separate products)
 * z = a r + l: z > 0 where verl's pg_losses2 > pg_losses1 (clipped), z < 0 where the dual clip won.
 * r = exp(clamp(lp - old, -20, 20)), by torch: either from inside the loop (vfused, below) or between
 * two passes over the valid tokens packed (vprep, vpacked). The entropy and KL-estimator row sums are
 * taken in the same loop, as AUX_BODY does. */

/* ---- vanilla over packed ratios: exp of the valid tokens only ---------------------------------------
 * The ratio (and k3's exp(delta)) is needed at valid tokens only, so vprep packs their log-ratios in
 * row-major order (torch's exp of a value does not depend on where it sits in a tensor) and the main
 * loop skips every group of N tokens with none valid. What a skipped token could still carry, a
 * non-finite value, goes into vprep's sums taken over every token: kl (d m; lp, old), k2 (check) and
 * guard = sum (A 0 + ent 0 + (ref - lp) 0), NaN exactly when some input is not finite.
 * vprep writes xd[q] = clamp(lp - old, -20, 20) and, with xk, xk[q] = clamp(ref - lp, -20, 20) for the
 * q-th valid token (q < cap); returns the valid-token count it saw. */
#define GROUP_BITS_f32(M) K(group8)(M)
#define GROUP_BITS_f64(M) K(group4)(M)
#define GROUP_ALL_f32 0x0101010101010101ULL
#define GROUP_ALL_f64 0x01010101ULL
static inline uint64_t K(group8)(const uint8_t *p) {
    uint64_t b;
    memcpy(&b, p, 8);
    return b;
}
static inline int K(any_byte)(const uint8_t *p, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i]) return 1;
    return 0;
}
static inline uint64_t K(group4)(const uint8_t *p) {
    uint32_t b;
    memcpy(&b, p, 4);
    return b;
}

#define VPREP_BODY(S, T, LP, OLD, REF, ADV, ENT, M)                                                      \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M), lpv = K(ld_##S)(LP);                                              \
        S##v d = lpv - K(ld_##S)(OLD);                                                                   \
        d = CLAMP(S, d, -lim, lim);                                                                      \
        K(acc_##S)(kl_acc, d * m);                                                                       \
        S##v g = K(ld_##S)(ADV) * zero;                                                                  \
        if (ent) g = g + K(ld_##S)(ENT) * zero;                                                          \
        S##v k = zero;                                                                                   \
        if (ref) {                                                                                       \
            k = K(ld_##S)(REF) - lpv;                                                                    \
            if (check) K(acc_##S)(k2_acc, k * k);                                                        \
            g = g + k * zero;                                                                            \
            k = CLAMP(S, k, -lim, lim);                                                                  \
        }                                                                                                \
        K(acc_##S)(guard_acc, g);                                                                        \
        const uint64_t bits = GROUP_BITS_##S(M);                                                         \
        if (bits == GROUP_ALL_##S && q + N_##S <= cap) {                                                 \
            memcpy(xd + q, &d, sizeof d);                                                                \
            if (xk) memcpy(xk + q, &k, sizeof k);                                                        \
            q += N_##S;                                                                                  \
        } else if (bits) {                                                                               \
            for (int l = 0; l < N_##S; l++)                                                              \
                if ((M)[l]) {                                                                            \
                    if (q < cap) {                                                                       \
                        xd[q] = d[l];                                                                    \
                        if (xk) xk[q] = k[l];                                                            \
                    }                                                                                    \
                    q++;                                                                                 \
                }                                                                                        \
        }                                                                                                \
    }

#define DEFINE_VPREP(S, T)                                                                               \
    static Py_ssize_t K(vprep_##S)(const T *lp, const T *old, const T *ref, const T *adv, const T *ent,  \
                                   const uint8_t *mask, Py_ssize_t rows, Py_ssize_t width, int check,    \
                                   T *xd, T *xk, Py_ssize_t cap, double *kl_out, double *k2_out,         \
                                   double *guard_out) {                                                  \
        const S##v lim = SPLAT(S, T, 20), zero = SPLAT(S, T, 0);                                         \
        dacc kl_acc[2] = {0}, k2_acc[2] = {0}, guard_acc[2] = {0};                                       \
        Py_ssize_t q = 0;                                                                                \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S)                                                       \
                VPREP_BODY(S, T, lp + o + j, old + o + j, ref + o + j, adv + o + j, ent + o + j,         \
                           mask + o + j);                                                                \
            if (j < width) {                                                                             \
                PAD(T, N_##S, lp, lp + o, j, width) PAD(T, N_##S, old, old + o, j, width);               \
                PAD(T, N_##S, ref, ref ? ref + o : NULL, j, width);                                      \
                PAD(T, N_##S, adv, adv + o, j, width) PAD(T, N_##S, ent, ent ? ent + o : NULL, j, width); \
                PAD(uint8_t, N_##S, m, mask + o, j, width);                                              \
                VPREP_BODY(S, T, lp_pad, old_pad, ref_pad, adv_pad, ent_pad, m_pad);                     \
            }                                                                                            \
        }                                                                                                \
        *kl_out = K(acc_total)(kl_acc);                                                                  \
        *k2_out = K(acc_total)(k2_acc);                                                                  \
        *guard_out = K(acc_total)(guard_acc);                                                            \
        return q;                                                                                        \
    }
DEFINE_VPREP(f32, float)
DEFINE_VPREP(f64, double)

/* r and e of the group at M from the packed vectors xr / xe (exp'd by torch), 0 where masked */
#define VGATHER(S, T, M)                                                                                 \
    S##v rk = zero, ek = zero;                                                                           \
    if (bits == GROUP_ALL_##S && q + N_##S <= cap) {                                                     \
        rk = K(ld_##S)(xr + q);                                                                          \
        if (kind == 4) ek = K(ld_##S)(xe + q);                                                           \
        q += N_##S;                                                                                      \
    } else {                                                                                             \
        T tr[N_##S] = {0}, te[N_##S] = {0};                                                              \
        for (int l = 0; l < N_##S; l++)                                                                  \
            if ((M)[l] && q < cap) {                                                                     \
                tr[l] = xr[q];                                                                           \
                if (kind == 4) te[l] = xe[q];                                                            \
                q++;                                                                                     \
            }                                                                                            \
        memcpy(&rk, tr, sizeof rk);                                                                      \
        memcpy(&ek, te, sizeof ek);                                                                      \
    }

/* vanilla's math on one group (m the mask, rk the ratios): the clipped loss into acc, the clip counts
 * into pc / nc, the entropy into ea (the loops of vpacked and vfused share it) */
#define VANILLA_GROUP(S, m, rk, ADV, ENT)                                                                \
    const S##v a = K(ld_##S)(ADV) * m;                                                                   \
    const S##v ap = CLAMP_MIN(S, a, zero);                                                               \
    const S##v an = ap - a;                                                                              \
    const S##v loss = CLAMP(S, rk, lo, c) * an - CLAMP_MAX(S, rk, hi) * ap;                              \
    K(acc_##S)(acc, loss);                                                                               \
    const S##v z = a * rk + loss;                                                                        \
    pc += (z > zero);                                                                                    \
    nc += (z < zero);                                                                                    \
    if (ent) K(acc_##S)(ea, K(ld_##S)(ENT) * m);

/* the KL estimators that need no exp (kind 1 k1, 2 abs, 3 k2) of one group into ka */
#define KL_PLAIN(S, m, LP, REF)                                                                          \
    {                                                                                                    \
        S##v v = K(ld_##S)(LP) - K(ld_##S)(REF);                                                         \
        if (kind == 2) v = K(sel_##S)(v < zero, -v, v);                                                  \
        if (kind == 3) v = (v * v) * half;                                                               \
        K(acc_##S)(ka, v * m);                                                                           \
    }

/* vanilla's and AUX_BODY's math on a group whose r and e are vectors (rk, ek) */
#define VPACKED_BODY(S, T, ADV, ENT, LP, REF, M)                                                         \
    {                                                                                                    \
        const uint64_t bits = GROUP_BITS_##S(M);                                                         \
        if (bits) {                                                                                      \
            VGATHER(S, T, M)                                                                             \
            const S##v m = K(mask_##S)(M);                                                               \
            VANILLA_GROUP(S, m, rk, ADV, ENT)                                                            \
            if (kind == 4) {                                                                             \
                S##v delta = K(ld_##S)(REF) - K(ld_##S)(LP);                                             \
                delta = CLAMP(S, delta, -lim, lim);                                                      \
                S##v v = ek - delta;                                                                     \
                v = v - one;                                                                             \
                K(acc_##S)(ka, CLAMP(S, v, -ten, ten) * m);                                              \
            } else if (kind > 0)                                                                         \
                KL_PLAIN(S, m, LP, REF)                                                                  \
        }                                                                                                \
    }

#define DEFINE_VPACKED(S, T)                                                                             \
    static inline __attribute__((always_inline)) void K(vpacked_rows_##S)(                               \
        const T *xr, const T *xe, Py_ssize_t cap, const T *adv, const uint8_t *mask, Py_ssize_t rows,    \
        Py_ssize_t width, T lo_, T hi_, T c_, double *row_out, int64_t *pos_out, int64_t *neg_out,       \
        const T *ent, const T *lp, const T *ref, const int kind, double *ent_out, double *kl_out) {      \
        const S##v lo = SPLAT(S, T, lo_), hi = SPLAT(S, T, hi_), c = SPLAT(S, T, c_);                    \
        const S##v zero = SPLAT(S, T, 0), one = SPLAT(S, T, 1), half = SPLAT(S, T, 0.5);                 \
        const S##v lim = SPLAT(S, T, 20), ten = SPLAT(S, T, 10);                                         \
        int64_t pos = 0, neg = 0;                                                                        \
        Py_ssize_t q = 0;                                                                                \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            dacc acc[2] = {0}, ea[2] = {0}, ka[2] = {0};                                                 \
            S##m pc = {0}, nc = {0};                                                                     \
            Py_ssize_t j = 0;                                                                            \
            for (; j + N_##S <= width; j += N_##S)                                                       \
                VPACKED_BODY(S, T, adv + o + j, ent + o + j, lp + o + j, ref + o + j, mask + o + j);     \
            if (j < width) {                                                                             \
                PAD(T, N_##S, adv, adv + o, j, width) PAD(uint8_t, N_##S, m, mask + o, j, width);        \
                PAD(T, N_##S, ent, ent ? ent + o : NULL, j, width);                                      \
                PAD(T, N_##S, lp, lp ? lp + o : NULL, j, width);                                         \
                PAD(T, N_##S, ref, ref ? ref + o : NULL, j, width);                                      \
                VPACKED_BODY(S, T, adv_pad, ent_pad, lp_pad, ref_pad, m_pad);                            \
            }                                                                                            \
            row_out[i] = K(acc_total)(acc);                                                              \
            if (ent) ent_out[i] = K(acc_total)(ea);                                                      \
            if (kind) kl_out[i] = K(acc_total)(ka);                                                      \
            pos += K(count_##S)(pc);                                                                     \
            neg += K(count_##S)(nc);                                                                     \
        }                                                                                                \
        *pos_out = pos;                                                                                  \
        *neg_out = neg;                                                                                  \
    }                                                                                                    \
    static void K(vpacked_##S)(const T *xr, const T *xe, Py_ssize_t cap, const T *adv,                   \
                               const uint8_t *mask, Py_ssize_t rows, Py_ssize_t width, T lo, T hi, T c,  \
                               double *row_out, int64_t *pos_out, int64_t *neg_out, const T *ent,        \
                               const T *lp, const T *ref, int kind, double *ent_out, double *kl_out) {   \
        switch (kind) {                                                                                  \
        VPACKED_CASE(S, 0) VPACKED_CASE(S, 1) VPACKED_CASE(S, 2) VPACKED_CASE(S, 3) VPACKED_CASE(S, 4)   \
        }                                                                                                \
    }
#define VPACKED_CASE(S, KIND)                                                                            \
    case KIND:                                                                                           \
        if (ent)                                                                                         \
            K(vpacked_rows_##S)(xr, xe, cap, adv, mask, rows, width, lo, hi, c, row_out, pos_out,        \
                                neg_out, ent, lp, ref, KIND, ent_out, kl_out);                           \
        else                                                                                             \
            K(vpacked_rows_##S)(xr, xe, cap, adv, mask, rows, width, lo, hi, c, row_out, pos_out,        \
                                neg_out, NULL, lp, ref, KIND, ent_out, kl_out);                          \
        break;
DEFINE_VPACKED(f32, float)
DEFINE_VPACKED(f64, double)


/* ---- vanilla in one pass, exp inline ------------------------------------------------------------------
 * Only with torch's own exp resolved and checked (see set_exp in _fused.c). Each row runs in chunks of
 * EXP_CHUNK tokens held in L1: pass A writes d = clamp(lp - old, -20, 20) and k = clamp(ref - lp, -20,
 * 20) of the chunk to local buffers (and the kl, k2 and non-finite guard sums, as vprep), exp turns them
 * into r and e (out of place: k is still delta), pass B does VANILLA + AUX's math. A chunk with no valid
 * token skips exp and pass B: its tokens add 0, and a non-finite one is in the guard sum. With skip
 * (ROW_LOOP_V's), both passes skip every group of N tokens with none valid, unread, and exp runs over
 * the chunk's span of valid groups only. */
#ifndef EXP_CHUNK
#define EXP_CHUNK 512
#endif
/* a chunk buffer on the stack, 64-byte aligned (as torch's tensors are: MKL's exp runs its aligned path) */
#define XBUF(T, name) T name[EXP_CHUNK + 8] __attribute__((aligned(64)))
static inline void K(exp_f32)(int n, const float *a, float *r) { torch_exp_f32(&n, a, r); }
static inline void K(exp_f64)(int n, const double *a, double *r) { torch_exp_f64(&n, a, r); }

#define VF_A(S, LP, OLD, REF, ADV, ENT, M, DOUT, KOUT)                                                   \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M), lpv = K(ld_##S)(LP);                                              \
        S##v d = lpv - K(ld_##S)(OLD);                                                                   \
        d = CLAMP(S, d, -lim, lim);                                                                      \
        memcpy((DOUT), &d, sizeof d);                                                                    \
        K(acc_##S)(kl_acc, d * m);                                                                       \
        S##v g = K(ld_##S)(ADV) * zero;                                                                  \
        if (ent) g = g + K(ld_##S)(ENT) * zero;                                                          \
        if (ref) {                                                                                       \
            S##v k = K(ld_##S)(REF) - lpv;                                                               \
            if (check) K(acc_##S)(k2_acc, k * k);                                                        \
            g = g + k * zero;                                                                            \
            k = CLAMP(S, k, -lim, lim);                                                                  \
            memcpy((KOUT), &k, sizeof k);                                                                \
        }                                                                                                \
        K(acc_##S)(guard_acc, g);                                                                        \
    }

#define VF_B(S, RV, EV, DV, ADV, ENT, LP, REF, M)                                                        \
    {                                                                                                    \
        const S##v m = K(mask_##S)(M);                                                                   \
        const S##v rk = K(ld_##S)(RV);                                                                   \
        VANILLA_GROUP(S, m, rk, ADV, ENT)                                                                \
        if (!skip) {                                                                                     \
            /* dense: verl's loss with A unmasked (its masked tokens' too; same floats as the loss's    \
             * fold, monotone rounding): an inf there is NaN in a seq-mean sum, so into the guard */     \
            const S##v ua = K(ld_##S)(ADV), uap = CLAMP_MIN(S, ua, zero);                                \
            K(acc_##S)(guard_acc, (CLAMP(S, rk, lo, c) * (uap - ua) - CLAMP_MAX(S, rk, hi) * uap) * zero); \
        }                                                                                                \
        if (kind == 4) {                                                                                 \
            S##v v = K(ld_##S)(EV) - K(ld_##S)(DV);                                                      \
            v = v - one;                                                                                 \
            K(acc_##S)(ka, CLAMP(S, v, -ten, ten) * m);                                                  \
        } else if (kind > 0)                                                                             \
            KL_PLAIN(S, m, LP, REF)                                                                      \
    }

#define DEFINE_VFUSED(S, T)                                                                              \
    static inline __attribute__((always_inline)) void K(vfused_rows_##S)(                                \
        const T *lp, const T *old, const T *ref, const T *adv, const T *ent, const uint8_t *mask,        \
        Py_ssize_t rows, Py_ssize_t width, T lo_, T hi_, T c_, const int kind, int check, int skip,      \
        double *row_out, double *ent_out, double *kl_out, int64_t *pos_out, int64_t *neg_out,            \
        double *kl_out_sum, double *k2_out, double *guard_out) {                                         \
        const S##v lo = SPLAT(S, T, lo_), hi = SPLAT(S, T, hi_), c = SPLAT(S, T, c_);                    \
        const S##v zero = SPLAT(S, T, 0), one = SPLAT(S, T, 1), half = SPLAT(S, T, 0.5);                 \
        const S##v lim = SPLAT(S, T, 20), ten = SPLAT(S, T, 10);                                         \
        XBUF(T, D); XBUF(T, KB); XBUF(T, R); XBUF(T, E);                                                 \
        dacc kl_acc[2] = {0}, k2_acc[2] = {0}, guard_acc[2] = {0};                                       \
        int64_t pos = 0, neg = 0;                                                                        \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                          \
            const Py_ssize_t o = i * width;                                                              \
            dacc acc[2] = {0}, ea[2] = {0}, ka[2] = {0};                                                 \
            S##m pc = {0}, nc = {0};                                                                     \
            for (Py_ssize_t j0 = 0; j0 < width; j0 += EXP_CHUNK) {                                       \
                const Py_ssize_t n = width - j0 < EXP_CHUNK ? width - j0 : EXP_CHUNK;                    \
                const Py_ssize_t b = o + j0;                                                             \
                Py_ssize_t j = 0, first = -1, end = 0;                                                   \
                for (; j + N_##S <= n; j += N_##S) {                                                     \
                    const int valid = GROUP_BITS_##S(mask + b + j) != 0;                                 \
                    if (skip && !valid) {                                                                \
                        K(st_##S)(D + j, zero);                                                          \
                        K(st_##S)(KB + j, zero);                                                         \
                        continue;                                                                        \
                    }                                                                                    \
                    VF_A(S, lp + b + j, old + b + j, ref + b + j, adv + b + j, ent + b + j, mask + b + j, \
                         D + j, KB + j);                                                                 \
                    if (valid) {                                                                         \
                        first = first < 0 ? j : first;                                                   \
                        end = j + N_##S;                                                                 \
                    }                                                                                    \
                }                                                                                        \
                if (j < n && (!skip || K(any_byte)(mask + b + j, n - j))) {                              \
                    PAD(T, N_##S, lp, lp + b, j, n) PAD(T, N_##S, old, old + b, j, n);                   \
                    PAD(T, N_##S, ref, ref ? ref + b : NULL, j, n);                                      \
                    PAD(T, N_##S, adv, adv + b, j, n) PAD(T, N_##S, ent, ent ? ent + b : NULL, j, n);    \
                    PAD(uint8_t, N_##S, m, mask + b, j, n);                                              \
                    VF_A(S, lp_pad, old_pad, ref_pad, adv_pad, ent_pad, m_pad, D + j, KB + j);           \
                    if (GROUP_BITS_##S(m_pad) != 0) {                                                    \
                        first = first < 0 ? j : first;                                                   \
                        end = j + N_##S;                                                                 \
                    }                                                                                    \
                }                                                                                        \
                if (first < 0) continue;                                                                 \
                /* every token's exp without skip (pass B reads them all); with it, the valid groups' */ \
                /* span's (pass B reads those, the padded tail too only when it is one of them) */       \
                const Py_ssize_t x0 = skip ? first : 0;                                                  \
                const int ne = (int)(skip ? end - first : (n + N_##S - 1) / N_##S * N_##S);              \
                K(exp_##S)(ne, D + x0, R + x0);                                                          \
                if (kind == 4) K(exp_##S)(ne, KB + x0, E + x0);                                          \
                j = 0;                                                                                   \
                for (; j + N_##S <= n; j += N_##S)                                                       \
                    if (!skip || GROUP_BITS_##S(mask + b + j))                                           \
                        VF_B(S, R + j, E + j, KB + j, adv + b + j, ent + b + j, lp + b + j, ref + b + j, \
                             mask + b + j);                                                              \
                if (j < n && (!skip || end > j)) {                                                       \
                    PAD(T, N_##S, adv, adv + b, j, n) PAD(T, N_##S, ent, ent ? ent + b : NULL, j, n);    \
                    PAD(T, N_##S, lp, lp + b, j, n) PAD(T, N_##S, ref, ref ? ref + b : NULL, j, n);      \
                    PAD(uint8_t, N_##S, m, mask + b, j, n);                                              \
                    VF_B(S, R + j, E + j, KB + j, adv_pad, ent_pad, lp_pad, ref_pad, m_pad);             \
                }                                                                                        \
            }                                                                                            \
            row_out[i] = K(acc_total)(acc);                                                              \
            if (ent) ent_out[i] = K(acc_total)(ea);                                                      \
            if (kind) kl_out[i] = K(acc_total)(ka);                                                      \
            pos += K(count_##S)(pc);                                                                     \
            neg += K(count_##S)(nc);                                                                     \
        }                                                                                                \
        *pos_out = pos;                                                                                  \
        *neg_out = neg;                                                                                  \
        *kl_out_sum = K(acc_total)(kl_acc);                                                              \
        *k2_out = K(acc_total)(k2_acc);                                                                  \
        *guard_out = K(acc_total)(guard_acc);                                                            \
    }                                                                                                    \
    static void K(vfused_##S)(const T *lp, const T *old, const T *ref, const T *adv, const T *ent,       \
                              const uint8_t *mask, Py_ssize_t rows, Py_ssize_t width, T lo, T hi, T c,   \
                              int kind, int check, int skip, double *row_out, double *ent_out,           \
                              double *kl_out,                                                            \
                              int64_t *pos_out, int64_t *neg_out, double *kl_sum, double *k2,            \
                              double *guard) {                                                           \
        switch (kind) {                                                                                  \
        VFUSED_CASE(S, 0) VFUSED_CASE(S, 1) VFUSED_CASE(S, 2) VFUSED_CASE(S, 3) VFUSED_CASE(S, 4)        \
        }                                                                                                \
    }
#define VFUSED_CASE(S, KIND)                                                                             \
    case KIND:                                                                                           \
        if (ent)                                                                                         \
            K(vfused_rows_##S)(lp, old, ref, adv, ent, mask, rows, width, lo, hi, c, KIND, check, skip,   \
                               row_out, ent_out, kl_out, pos_out, neg_out, kl_sum, k2, guard);           \
        else                                                                                             \
            K(vfused_rows_##S)(lp, old, ref, adv, NULL, mask, rows, width, lo, hi, c, KIND, check, skip,  \
                               row_out, ent_out, kl_out, pos_out, neg_out, kl_sum, k2, guard);           \
        break;
DEFINE_VFUSED(f32, float)
DEFINE_VFUSED(f64, double)

/* ---- shared by the passes below: the entropy / KL terms riding along, the chunked row loop, exp inline */

/* The entropy / KL-estimator terms ride along in the pass of every loss of losses_a.h that reads logp
 * (AUX_BODY above, the same floats as the aux loop): ent may be NULL (no entropy), kind / check as there. */
#define AUX_PARAMS(T)                                                                                    \
    const T *ent, const T *ref, const T *e, int kind, int check, double *ent_out, double *kl_out,        \
        double *k2_out, int skip
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

/* The row loop of the aux loop below and of the losses_a.h kernels: PRE(i) before row i (row
 * accumulators), BODY on whole vectors at offset o + j, TAIL on the zero-padded rest (it declares its
 * pads), POST(i) after the row. A row runs in chunks of EXP_CHUNK tokens: inside XP, BODY and TAIL, o is
 * the chunk's offset and width its length. EXP_CHUNK is a multiple of the vector width, so each lane sums
 * the same tokens in the same order as one sweep of the row would (the results do not depend on the
 * chunking). XP runs before a chunk's tokens: the inline exp (AUX_XP below), or nothing. */
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

/* ROW_LOOP_X that, with skip, runs BODY only on the groups of N tokens with a valid one: the others'
 * inputs are not read at all (right-padded responses are often half padding: the pass reads that much
 * less). A skipped token only ever meets a 0 mask, so with finite values it adds 0; what it holds
 * otherwise (NaN, inf, or an overflowing product) matters only where verl multiplies by the mask
 * instead of masking, in the seq-mean aggregations, and those take a pass without skip (the caller's
 * dense batch: kernels.TokenBatch). The padded tail group runs when one of its tokens is valid. */
#define ROW_LOOP_V(S, XP, PRE, BODY, TAIL, POST)                                                         \
    ROW_LOOP_X(S, XP, PRE, if (!skip || GROUP_BITS_##S(mask + o + j)) BODY,                              \
               if (!skip || K(any_byte)(mask + o + j, width - j)) TAIL, POST)

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
 * with the exp of every token; a finite input's clamped exp is finite either way. every_r: r of every
 * token (a dense pass: cispo's clamp(r) A logp and sapo's sigmoid gate times 4 / tau times A can
 * overflow under the mask as verl's do only with verl's r there; k3's e - delta - 1 is clamped). */
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
                              T *R, T *E, T *tmp, int every_r) {                                         \
        const Py_ssize_t nr = (n + N_##S - 1) / N_##S * N_##S;                                           \
        Py_ssize_t vb, ve;                                                                               \
        K(vspan_##S)(mask, n, &vb, &ve);                                                                 \
        T *const out[2] = {R, E};                                                                        \
        for (int k = 0; k < 2; k++) {                                                                    \
            T *const y = out[k];                                                                         \
            if (!y) continue;                                                                            \
            const Py_ssize_t b = k == 0 && every_r ? 0 : vb, e = k == 0 && every_r ? nr : ve;            \
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
    if (!e && kind == 4) K(xchunk_##S)(lp + o, NULL, ref + o, mask + o, width, NULL, E_, X_, 0)
#define AUX_XP_R(S, T)                                                                                   \
    const T *const eo = e ? e + o : kind == 4 ? E_ : NULL;                                               \
    const T *const ro = r ? r + o : R_;                                                                  \
    if (!r || (!e && kind == 4))                                                                         \
    K(xchunk_##S)(lp + o, old + o, ref + o, mask + o, width, r ? NULL : R_, !e && kind == 4 ? E_ : NULL, X_, \
                  !skip)

/* ---- the entropy / KL-estimator row sums on their own (AUX_BODY over the rows; k3's exp as above) ---- */
#define DEFINE_AUX(S, T)                                                                                 \
    static void K(aux_##S)(const uint8_t *mask, const T *ent, const T *lp, const T *ref, const T *e,     \
                           Py_ssize_t rows, Py_ssize_t width, int kind, int check, double *ent_out,      \
                           double *kl_out, double *k2_out, int skip) {                                   \
        AUX_CONSTS(S, T);                                                                                \
        XBUFS(T);                                                                                        \
        AUX_SPECIALISED(T, ROW_LOOP_V(S, AUX_XP(S, T), AUX_PRE,                                          \
                                      AUX_AT(S, lp + o + j, mask + o + j),                               \
                                      {                                                                  \
                                          PAD(T, N_##S, lp, lp ? lp + o : NULL, j, width);               \
                                          PAD(uint8_t, N_##S, m, mask + o, j, width);                    \
                                          AUX_TAIL(S, T);                                                \
                                      },                                                                 \
                                      AUX_POST))                                                         \
        AUX_END;                                                                                         \
    }
DEFINE_AUX(f32, float)
DEFINE_AUX(f64, double)

/* the other losses and the rollout correction, one file per group */
#include "losses_a.h"
#include "losses_b.h"
#include "rollout.h"
