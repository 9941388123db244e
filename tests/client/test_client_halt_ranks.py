"""Halting a job of several processes: every rank stops at the same step boundary.

Two real processes in a gloo process group against a real ``rlvitals serve``: only rank 0 sends scalars,
so only rank 0 hears of the critical incident; ``run.should_stop()`` agrees across ranks, so both stop at
the same step (a rank that went on alone would wait forever in the step's all-reduce)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.ranks import run_two_ranks
from tests.support.servers import free_port

pytestmark = pytest.mark.heavy  # several trainer processes against a real server

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "halt_ranks.py"


def _job(url: str, tmp_path: Path, mode: str) -> dict[int, dict]:
    out = str(tmp_path / f"{mode}-rank{{rank}}.json")
    run_two_ranks([sys.executable, str(SCRIPT), "{rank}", str(free_port()), url, out, mode], {}, timeout=120)
    return {r: json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.timeout(300)
def test_every_rank_stops_at_the_same_step_boundary(serve, tmp_path):
    server = serve()
    ranks = _job(server.url, tmp_path, "agree")
    stopped = {r: ranks[r]["stopped"] for r in (0, 1)}
    assert stopped[0] is not None and 5 < stopped[0] <= 10, stopped
    assert stopped[1] == stopped[0], stopped
    mine, theirs = ranks[0]["halt_reason"], ranks[1]["halt_reason"]
    assert mine["cause"] == "non_finite" and mine["onset_step"] == 5
    assert theirs == {"id": mine["id"], "from_another_rank": True}


@pytest.mark.timeout(300)
def test_answering_for_one_process_leaves_the_other_ranks_running(serve, tmp_path):
    # what the agreement prevents: with all_ranks=False only the rank that sends scalars stops
    server = serve()
    ranks = _job(server.url, tmp_path, "local")
    assert ranks[0]["stopped"] is not None and 5 < ranks[0]["stopped"] <= 10
    assert ranks[1]["stopped"] is None and ranks[1]["halt_reason"] is None
