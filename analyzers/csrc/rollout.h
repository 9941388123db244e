/* Kernels: rollout correction: IS weights, rejection masks, rollout_corr/* and training/rollout_* metrics.
 * Included by kernels.h once per instruction set (names through K(...), vectors as in kernels.h). */
