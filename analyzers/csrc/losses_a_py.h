/* Python entry points: gpg, dro, cispo, sapo, gspo, geo_mean.
 * Included by _fused.c after DISPATCH; LOSSES_A_METHODS lists the PyMethodDef entries. */
#define LOSSES_A_METHODS
