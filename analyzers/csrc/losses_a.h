/* Kernels: gpg, dro, cispo, sapo, gspo, geo_mean.
 * Included by kernels.h once per instruction set (names through K(...), vectors as in kernels.h). */
