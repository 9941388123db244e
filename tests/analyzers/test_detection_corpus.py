"""Issue 9's targets, measured on the real-log corpus (labels in tests/data/real_logs/manifest.json, the
files in ../shared/real_logs/, see docs/detection.md): our health rules raise no
warning-or-worse alert on a healthy run and catch every labelled incident, scored exactly as
bench/detection.py scores them (rlvitals.analyzers.health.scoring)."""

from __future__ import annotations

import pytest
from rlvitals.analyzers.health.scoring import Alert, Incident, RunLabels, episodes, score_run, tally

from bench._detection import MISSING, corpus_dir, load_corpus, our_alerts, score

# The files are public data kept in the steering repo's shared/ folder, never committed here (see
# bench/_detection.py); without them these tests cannot measure anything and say so.
needs_corpus = pytest.mark.skipif(corpus_dir() is None, reason=MISSING)


@pytest.fixture(scope="module")
def scores():
    if corpus_dir() is None:
        pytest.skip(MISSING)
    return score(our_alerts, load_corpus())


@needs_corpus
def test_the_corpus_has_real_runs_of_both_kinds():
    runs = load_corpus()
    assert len(runs) >= 12
    assert sum(r.labels.healthy for r in runs) >= 5
    assert sum(len(r.labels.incidents) for r in runs) >= 20
    for run in runs:
        assert run.entry["source"]["commit"] and run.entry["source"]["url"].startswith("https://github.com/")
        assert len(run.history.points) >= 3, run.id


@needs_corpus
def test_no_warning_or_worse_alert_on_a_healthy_run(scores):
    noisy = {s.run_id: [(a.rule, a.step, a.severity) for a in s.false_alerts] for s in scores if s.healthy}
    assert noisy == {r: [] for r in noisy}


@needs_corpus
def test_every_labelled_incident_is_caught(scores):
    missed = {s.run_id: [(i.kind, i.onset) for i in s.missed] for s in scores if s.missed}
    assert missed == {}


# The first warning+ alert of the earliest peer on the incidents where one was earlier than our rules
# before (bench/detection.py with the peers, docs/detection.md): ours must be no later. (run, kind, onset)
# -> the peer's delay in steps.
EARLIEST_PEER = {
    ("trl_qwen3.5-9b_grpo_gsm8k_exp1a_rho1.00_seed42", "entropy_explosion", 40): 0,  # rldoctor
    ("trl_qwen3.5-9b_grpo_gsm8k_exp1a_rho1.00_seed42", "truncation", 40): 0,  # rldoctor
    ("trl_qwen3.5-9b_grpo_gsm8k_exp1a_rho1.00_seed42", "reward_collapse", 40): 0,  # rldoctor
    ("trl_qwen3.5-9b_grpo_gsm8k_exp1a_rho1.00_seed42", "reward_collapse", 135): 0,  # rlwatch
    ("trl_qwen3.5-9b_grpo_gsm8k_exp1a_rho1.00_seed42", "entropy_explosion", 140): -5,  # rlwatch
    ("trl_qwen3.5-9b_grpo_gsm8k_exp1a_rho1.00_seed42", "truncation", 145): -10,  # rlwatch
    ("trl_qwen3.5-9b_grpo_gsm8k_exp1a_rho0.30_seed42", "entropy_collapse", 115): 5,  # rldoctor
}


@needs_corpus
def test_no_later_than_the_earliest_peer_where_a_peer_was_earlier(scores):
    ours = {
        (s.run_id, r.incident.kind, r.incident.onset): r.delay
        for s in scores
        for r in s.incidents
        if r.caught
    }
    late = {key: (ours.get(key), peer) for key, peer in EARLIEST_PEER.items() if ours.get(key, 10**9) > peer}
    assert late == {}


@needs_corpus
def test_no_false_alert_outside_incident_windows_on_unhealthy_runs(scores):
    false = {s.run_id: [(a.rule, a.step) for a in s.false_alerts] for s in scores if not s.healthy}
    assert false == {r: [] for r in false}


# the scorer itself, on small hand-made cases
def test_an_alert_inside_the_window_catches_the_incident_and_reports_the_delay():
    labels = RunLabels("r", healthy=False, incidents=(Incident("truncation", 20, 40),), tolerance=10)
    result = score_run(labels, [Alert("a", 15), Alert("b", 30), Alert("c", 60)], last_step=100)
    assert [a.rule for a in result.true_alerts] == ["a", "b"]
    assert [a.rule for a in result.false_alerts] == ["c"]
    assert result.incidents[0].delay == -5 and result.incidents[0].rules == ("a", "b")


def test_info_alerts_never_catch_or_count_as_false():
    labels = RunLabels("r", healthy=True)
    result = score_run(labels, [Alert("x", 3, "info")], last_step=10)
    assert result.false_alerts == [] and len(result.info_alerts) == 1
    labels = RunLabels("r", healthy=False, incidents=(Incident("zero_grad", 5),))
    assert score_run(labels, [Alert("x", 6, "info")], last_step=10).missed


def test_a_rule_repeated_on_consecutive_points_is_one_episode():
    alerts = episodes([(1, [("k", "warning")]), (2, [("k", "critical")]), (3, []), (4, [("k", "warning")])])
    assert alerts == [Alert("k", 1, "critical"), Alert("k", 4, "warning")]


def test_tally_counts_per_rule_catches_and_delays():
    labels = RunLabels("r", healthy=False, incidents=(Incident("a", 10), Incident("b", 50)), tolerance=0)
    scored = score_run(labels, [Alert("x", 12), Alert("y", 55), Alert("x", 56)], last_step=100)
    overall, per_rule = tally([scored])
    assert (overall.caught, overall.missed, overall.median_delay) == (2, 0, 3.5)  # delays 2 and 5
    assert per_rule["x"].caught == 2 and per_rule["x"].delays == [2, 6]


def test_corpus_builder_trims_a_verl_log_to_what_the_importer_reads(tmp_path):
    from rlvitals.client.importers.console import read_verl_console

    from bench.build_corpus import trim_verl

    tag, other = "\x1b[36m(main_task pid=7)\x1b[0m ", "\x1b[36m(WorkerDict pid=9)\x1b[0m "
    log = "\n".join(
        [
            "commit:",
            "50ac725",
            "command:",
            "python3 -m verl.trainer.main_ppo data.train_batch_size=256 actor_rollout_ref.actor.ppo_epochs=1",
            "2024-12-10 15:05:25,198\tINFO worker.py:1792 -- Started a local Ray instance.",
            tag + "{'actor_rollout_ref': {'actor': {'ppo_mini_batch_size': 64,",
            other + "Flash Attention 2.0 only supports torch.float16",
            tag + "                                  'ppo_epochs': 1}},",
            tag + " 'data': {'train_batch_size': 256}}",
            tag + "validation generation end",
            tag
            + "step:0 - timing/gen:20.2 - actor/pg_clipfrac:0.001 - timing/ref:4.5 - critic/score/mean:0.004",
            other + "NCCL INFO comm 0x55 rank 0 nranks 2",
            tag + "step:1 - timing/gen:23.1 - actor/pg_clipfrac:0.002 - critic/score/mean:0.01",
        ]
    )
    trimmed = trim_verl(log)
    assert "timing/" not in trimmed and "NCCL" not in trimmed and "Flash" not in trimmed
    assert "validation generation end" not in trimmed and trimmed.startswith("commit:\n50ac725\n")
    (tmp_path / "raw.log").write_text(log)
    (tmp_path / "trimmed.log").write_text(trimmed)
    raw, cut = read_verl_console(tmp_path / "raw.log"), read_verl_console(tmp_path / "trimmed.log")
    assert cut.config == raw.config and cut.config["actor_rollout_ref.actor.ppo_mini_batch_size"] == 64
    strip = [(s, {k: v for k, v in m.items() if not k.startswith("timing/")}) for s, m in raw.points]
    assert cut.points == strip and [s for s, _ in cut.points] == [0, 1]
