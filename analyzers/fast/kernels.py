"""The dispatch of the fast path: verl's policy loss function -> its fused pass (:data:`_FUSED`), and how
the passes stay exact. Fast, autograd-free recomputation of verl's loss metrics over one micro-batch.

:class:`TokenBatch` validates the tensors once, then reduces every per-token quantity to *row sums*
``(batch,)`` plus a few counts. Every aggregation mode, every global-normalisation variant and every
coefficient what-if is then scalar arithmetic on those row sums, so an audit that tries dozens of
alternatives pays for the token pass once per distinct clip setting and once per KL estimator.

How the token pass stays exact (the same per-token floats verl computes, in fewer passes):

- signs are folded up front into the masked advantages ``A+ = max(A m, 0)`` and ``A- = -min(A m, 0)``
  (``m`` the 0/1 mask). Because rounding is monotone, verl's ``max(-A r, -A clip(r))`` and
  ``min(-A c, ...)`` equal ``l = A- clamp(r, 1 - eps_low, c) - A+ min(r, 1 + eps_high)`` bit for bit.
- both clip fractions come from one tensor ``z = (A m) r + l``: ``z > 0`` exactly where verl's
  ``pg_losses2 > pg_losses1`` (clipped on either side), ``z < 0`` exactly where the dual clip bound won
  (``A < 0``, ``(-A) r > (-A) c``), comparing the same rounded products verl compares. Counted from
  the sum of ``sign(z)`` and its dot with itself (no bool tensors, no ``where``, no ``count_nonzero``).
- masked sums are sums of products with ``m`` (or dots): identical to verl's ``masked_sum`` whenever
  every value is finite. A non-finite value in a sum makes it non-finite; the batch then falls back to
  the op-for-op reference in :mod:`.losses`, which is what verl does with NaN/inf. Half precision always
  takes the reference ops, in the input dtype, as verl would.
- what lies under the mask: verl's token-mean / token-sum aggregations and its masked means take
  ``where(mask, x, 0)``, so a masked value never counts, NaN or not; its seq-mean aggregations sum
  ``loss * mask``, so a masked NaN, inf or overflowing product does. A batch made for one
  :func:`~rlvitals.analyzers.recompute` is *sparse*: the compiled passes skip every group of tokens with
  none valid, unread (right-padded responses are often half padding). Anything that aggregates by a
  seq-mean mode needs a *dense* batch, whose passes read every token as above: :meth:`TokenBatch.metrics`
  makes the batch dense first for such a config, an audit's batch is dense from the start, and
  :meth:`TokenBatch.aggregate` refuses a seq-mean mode on a sparse batch. Where a dense pass would
  still miss a masked token's overflowing loss (vanilla and clip_cov fold the mask into ``A`` first;
  clip_cov, kl_cov and dppo compute the valid tokens' loss only), it checks verl's loss there too
  (vanilla's guard; :func:`_masked_losses_finite`) and falls back when one is not finite.
"""

from __future__ import annotations

from ..reference import policy_losses as pl
from .modes import (
    _fused_cispo,
    _fused_dro,
    _fused_geo_mean,
    _fused_gpg,
    _fused_gspo,
    _fused_sapo,
    _fused_vanilla,
)
from .modes_cov import _fused_bypass, _fused_clip_cov, _fused_dppo, _fused_kl_cov

# verl's function -> its fused pass
_FUSED = {
    pl.compute_policy_loss_vanilla: _fused_vanilla,
    pl.compute_policy_loss_gpg: _fused_gpg,
    pl.compute_policy_loss_dro: _fused_dro,
    pl.compute_policy_loss_cispo: _fused_cispo,
    pl.compute_policy_loss_gspo: _fused_gspo,
    pl.compute_policy_loss_sapo: _fused_sapo,
    pl.compute_policy_loss_geo_mean: _fused_geo_mean,
    pl.compute_policy_loss_dppo_tv: lambda b, c: _fused_dppo(b, c, binary_kl=False),
    pl.compute_policy_loss_dppo_kl: lambda b, c: _fused_dppo(b, c, binary_kl=True),
    pl.compute_policy_loss_clip_cov: _fused_clip_cov,
    pl.compute_policy_loss_kl_cov: _fused_kl_cov,
    pl.compute_policy_loss_bypass_mode: _fused_bypass,
}
