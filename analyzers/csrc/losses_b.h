/* Kernels: dppo_tv, dppo_kl, clip_cov, kl_cov (bypass_mode reuses vanilla and rollout).
 * Included by kernels.h once per instruction set (names through K(...), vectors as in kernels.h). */
