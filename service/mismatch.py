"""A run's rollout-vs-training mismatch for the API and the dashboard: the ``rlvitals/mismatch/*``
series the audits wrote (and the gap metrics the trainer logged under the other frameworks' names),
the audits that carry a mismatch report, and one of those reports in full (the latest, or a chosen one).
"""

from __future__ import annotations

from typing import Any

from rlvitals.service.errors import NotFound
from rlvitals.service.storage import repository as repo

SERIES_PREFIX = "rlvitals/mismatch/"
# the canonical gap signals of the trend rule: a run without tensors still has its framework's summary
_GAP_SIGNALS = frozenset(
    {
        "logprob_abs_diff",
        "token_mult_prob_error",
        "gen_kl",
        "rollout_logp_diff_mean",
        "rollout_kl",
        "rollout_probs_diff_mean",
        "rollout_is_mean",
        "rollout_ess",
        "rollout_chi2",
    }
)


def _gap_names(names: list[str]) -> list[str]:
    from rlvitals.analyzers.health.signals import signal_of

    return [n for n in names if n.startswith(SERIES_PREFIX) or signal_of(n) in _GAP_SIGNALS]


def run_mismatch(ctx, run_id: int, *, audit_id: int | None = None) -> dict[str, Any]:
    """``{"run_id", "series": {name: {"steps", "values"}}, "audits": [{"id", "step",
    "token_mult_prob_error", "abs_gap_mean"}], "selected": {"id", "step", "mismatch"} | None}``."""
    with ctx.db.read() as session:
        if not repo.run_exists(session=session, run_id=run_id):
            raise NotFound(f"run {run_id} does not exist")
        names = _gap_names(repo.metric_names(session=session, run_id=run_id))
        columns = repo.series_columns(session=session, run_id=run_id, names=names)
        rows, _ = repo.list_audits(session=session, run_id=run_id, limit=10_000)
    audits, reports = [], {}
    for row in rows:
        report = (row.get("result") or {}).get("mismatch")
        if not report or "token_mult_prob_error" not in report:
            continue
        reports[row["id"]] = (row["step"], report)
        audits.append(
            {
                "id": row["id"],
                "step": row["step"],
                "token_mult_prob_error": report["token_mult_prob_error"],
                "abs_gap_mean": (report.get("abs_gap") or {}).get("mean"),
            }
        )
    if audit_id is not None and audit_id not in reports:
        raise NotFound(f"run {run_id} has no audit {audit_id} with a mismatch report")
    chosen = audit_id if audit_id is not None else (audits[-1]["id"] if audits else None)
    selected = None
    if chosen is not None:
        step, report = reports[chosen]
        selected = {"id": chosen, "step": step, "mismatch": report}
    return {
        "run_id": run_id,
        "series": {name: {"steps": steps, "values": values} for name, (steps, values) in columns.items()},
        "audits": audits,
        "selected": selected,
    }
