/* Python entry points: dppo_tv, dppo_kl, clip_cov, kl_cov (bypass_mode reuses vanilla and rollout).
 * Included by _fused.c after DISPATCH; LOSSES_B_METHODS lists the PyMethodDef entries. */
#define LOSSES_B_METHODS
