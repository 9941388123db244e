/* Python entry points: rollout correction: IS weights, rejection masks, rollout_corr/* and training/rollout_* metrics.
 * Included by _fused.c after DISPATCH; ROLLOUT_METHODS lists the PyMethodDef entries. */
#define ROLLOUT_METHODS
