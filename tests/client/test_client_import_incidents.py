"""``rlvitals import`` reports incidents: each transition as it happens and a summary line per incident."""

from __future__ import annotations

import io
import json

from rlvitals.client.importers import run_import


def test_import_prints_incidents_with_their_evidence(tmp_path):
    history = []
    for step in range(1, 121):
        late = step >= 40
        history.append(
            {
                "step": step,
                "loss": 0.1,
                "grad_norm": 0.3,
                "reward": (0.1 if late else 0.6) + 0.01 * (step % 5),  # a real reward moves
                "reward_std": 0.3,
                "entropy": 2.0 if late else 0.5,
                "completions/clipped_ratio": 1.0 if late else 0.0,
                "completions/mean_length": 512.0 if late else 150.0,
            }
        )
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"log_history": history, "global_step": 120}))
    out = io.StringIO()
    result = run_import("trl-state", path, out=out)
    text = out.getvalue()
    incidents = result.incidents
    paging = [i for i in incidents if i["severity"] != "info"]
    assert len(paging) == 1 and paging[0]["cause"] in ("truncation", "entropy_explosion", "policy_collapse")
    assert len(paging[0]["members"]) >= 2  # several rules, one incident
    assert f"=> incident #{paging[0]['number']} opened at step" in text
    assert f"{len(incidents)} incident(s), 1 at warning or worse:" in text
    summary = next(line for line in text.splitlines() if line.strip().startswith(f"#{paging[0]['number']} ["))
    assert paging[0]["primary"] in summary and "findings:" in summary
