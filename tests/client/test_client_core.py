"""The client's behaviour against the in-memory fake API: queueing, encoding, retries, spool, sampling, misuse."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings

import httpx
import numpy as np
import pytest
import torch
from rlvitals.client import ClientSettings, ClientWarning, Lifecycle, RetryPolicy, init
from rlvitals.client.sync import sync_spool
from rlvitals.client.testing import FakeServer
from safetensors import safe_open

import rlvitals

FAST = ClientSettings(flush_interval=0.01, retry=RetryPolicy(initial=0.01, maximum=0.05), batch_every=1)


@pytest.fixture
def fake() -> FakeServer:
    return FakeServer()


def start(fake: FakeServer, tmp_path, **kwargs):
    kwargs.setdefault("settings", FAST)
    return init(
        url="http://fake", project="p", name="r", spool_dir=tmp_path, transport=fake.transport, **kwargs
    )


def batch_arrays(rows: int = 4, cols: int = 8) -> dict:
    rng = np.random.default_rng(0)
    return {
        "log_prob": rng.normal(size=(rows, cols)).astype(np.float32),
        "old_log_prob": rng.normal(size=(rows, cols)).astype(np.float32),
        "advantages": rng.normal(size=(rows, cols)).astype(np.float32),
        "response_mask": np.ones((rows, cols), np.float32),
    }


def test_scalars_arrive_once_with_non_finite_values_kept(fake, tmp_path):
    run = start(fake, tmp_path)
    for step in range(50):
        run.log({"loss": step * 0.5, "np": np.float64(2.0), "pt": torch.tensor(3.0), "i": 7}, step=step)
    run.log({"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "none": None}, step=50)
    report = run.finish(timeout=5)
    assert report.complete and report.points_logged == report.points_sent == 204
    assert fake.series(run.run_id, "loss") == {s: s * 0.5 for s in range(50)}
    assert math.isnan(fake.series(run.run_id, "nan")[50])
    assert fake.series(run.run_id, "inf")[50] == math.inf
    assert fake.series(run.run_id, "ninf")[50] == -math.inf
    assert fake.series(run.run_id, "none") == {50: None}
    assert run.state is Lifecycle.FINISHED


def test_many_steps_share_one_request(fake, tmp_path):
    run = start(fake, tmp_path, settings=ClientSettings(flush_interval=0.2))
    for step in range(500):
        run.log({"x": 1.0}, step=step)
    run.finish(timeout=5)
    posts = [p for m, p in fake.requests if p.endswith("/metrics")]
    assert 1 <= len(posts) <= 5
    assert len(fake.series(run.run_id, "x")) == 500


@pytest.mark.parametrize(
    ("metrics", "step", "error"),
    [
        ([1.0], 0, TypeError),
        ({"x": "1.0"}, 0, TypeError),
        ({1: 1.0}, 0, TypeError),
        ({"": 1.0}, 0, TypeError),
        ({"x": torch.ones(3)}, 0, TypeError),
        ({"x": np.ones(2)}, 0, TypeError),
        ({"x": 1.0}, 1.5, TypeError),
        ({"x": 1.0}, "3", TypeError),
        ({"x": 1.0}, -1, ValueError),
    ],
)
def test_misuse_raises_at_once(fake, tmp_path, metrics, step, error):
    run = start(fake, tmp_path)
    with pytest.raises(error):
        run.log(metrics, step=step)
    run.finish(timeout=2)


def test_log_after_finish_raises(fake, tmp_path):
    run = start(fake, tmp_path)
    run.finish(timeout=2)
    with pytest.raises(RuntimeError, match="finished"):
        run.log({"x": 1.0}, step=0)
    assert run.finish(timeout=2) is run.finish(timeout=2)


def test_bad_mode_and_settings_raise(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        init(mode="sometimes", spool_dir=tmp_path)
    with pytest.raises(ValueError, match="batch_every"):
        ClientSettings(batch_every=0)


def test_5xx_is_retried_and_delivered_exactly_once(fake, tmp_path):
    run = start(fake, tmp_path)
    fake.fail_next(3, status=503)
    with pytest.warns(ClientWarning, match="HTTP 503"):
        for step in range(20):
            run.log({"x": float(step)}, step=step)
        report = run.finish(timeout=10)
    assert report.complete and report.points_sent == 20
    assert fake.series(run.run_id, "x") == {s: float(s) for s in range(20)}


def test_429_waits_for_retry_after(fake, tmp_path):
    run = start(fake, tmp_path)
    time.sleep(0.05)
    fake.fail_next(1, status=429, retry_after=0.5)
    begin = time.monotonic()
    with pytest.warns(ClientWarning, match="429"):
        run.log({"x": 1.0}, step=0)
        report = run.finish(timeout=10)
    assert time.monotonic() - begin >= 0.5
    assert report.complete and fake.series(run.run_id, "x") == {0: 1.0}


def test_server_down_spools_then_resends_and_warns_once(fake, tmp_path):
    run = start(fake, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fake.down = True
        for step in range(100):
            run.log({"x": float(step)}, step=step)
        time.sleep(0.3)
        assert list(run.spool_dir.glob("seg-*"))  # on disk while the server is down
        fake.down = False
        report = run.finish(timeout=10)
    ours = [w for w in caught if issubclass(w.category, ClientWarning)]
    assert len(ours) == 1 and "unreachable" in str(ours[0].message) and "spooling" in str(ours[0].message)
    assert report.complete, report
    assert fake.series(run.run_id, "x") == {s: float(s) for s in range(100)}
    assert not list(run.spool_dir.glob("seg-*"))


def test_init_with_server_down_keeps_everything_for_later(fake, tmp_path):
    fake.down = True
    with pytest.warns(ClientWarning) as caught:
        run = start(fake, tmp_path)
        assert run.run_id is None
        for step in range(10):
            run.log({"x": 1.0}, step=step)
        report = run.finish(timeout=0.5)
    assert report.points_pending == 10 and not report.complete
    assert "create run failed" in str(caught[0].message)
    assert "rlvitals sync" in str(caught[-1].message)
    fake.down = False
    result = sync_spool(tmp_path, url="http://fake", transport=fake.transport)
    assert result.ok and result.points_sent == 10
    assert len(fake.series("1", "x")) == 10
    assert sync_spool(tmp_path, url="http://fake", transport=fake.transport).points_sent == 0


def test_rejected_request_is_counted_not_retried(fake, tmp_path):
    run = start(fake, tmp_path)
    time.sleep(0.05)
    fake.fail_next(1, status=400)
    with pytest.warns(ClientWarning) as caught:
        run.log({"x": 1.0, "y": 2.0}, step=0)
        report = run.finish(timeout=5)
    assert report.points_rejected == 2 and not report.complete
    assert "HTTP 400" in str(caught[0].message) and "rejected 2 points" in str(caught[-1].message)


def test_offline_mode_only_spools_and_sync_sends(fake, tmp_path):
    run = start(fake, tmp_path, mode="offline")
    for step in range(30):
        run.log({"x": float(step)}, step=step)
    run.log_batch(0, **batch_arrays(), reported={"pg_loss": 0.0})
    report = run.finish(timeout=5)
    assert fake.requests == []
    assert report.points_pending == 30 and report.batches_pending == 1
    result = sync_spool(tmp_path, url="http://fake", transport=fake.transport)
    assert result.ok and result.points_sent == 30 and result.batches_sent == 1
    assert fake.series("1", "x") == {s: float(s) for s in range(30)}


def test_log_batch_samples_and_writes_safetensors(fake, tmp_path):
    settings = ClientSettings(flush_interval=0.01, batch_every=2)
    run = start(fake, tmp_path, settings=settings)
    sampled = []
    for step in range(4):
        for _ in range(3):  # micro-batches
            sampled.append(
                run.log_batch(step, **batch_arrays(), config={"clip_ratio": 0.2}, reported={"pg_loss": 0.5})
            )
    report = run.finish(timeout=5)
    assert sampled == [True, False, False, False, False, False, True, False, False, False, False, False]
    assert report.batches_sent == 2 and report.batches_skipped == 10
    payload = fake.batches[run.run_id][1]
    path = tmp_path / "b.safetensors"
    path.write_bytes(payload)
    with safe_open(str(path), framework="numpy") as handle:
        meta = handle.metadata()
        assert sorted(handle.keys()) == ["advantages", "log_prob", "old_log_prob", "response_mask"]
        np.testing.assert_array_equal(handle.get_tensor("log_prob"), batch_arrays()["log_prob"])
    assert meta["step"] == "2" and meta["rank"] == "0" and meta["micro_batch"] == "0"
    assert json.loads(meta["reported"]) == {"pg_loss": 0.5}
    assert json.loads(meta["config"])["clip_ratio"] == 0.2


def test_log_batch_torch_tensors_and_uid_groups(fake, tmp_path):
    run = start(fake, tmp_path)
    tensors = {k: torch.from_numpy(v) for k, v in batch_arrays().items()}
    uids = np.array(["b", "a", "b", "a"], dtype=object)
    run.log_batch(
        0,
        **tensors,
        entropy=torch.zeros(4, 8),
        token_level_rewards=torch.zeros(4, 8),
        group_index=uids,
        reported={"kl": torch.tensor(math.inf)},
    )
    tensors["log_prob"].add_(100.0)  # the trainer reuses its buffer: the captured copy must not change
    run.finish(timeout=5)
    path = tmp_path / "b.safetensors"
    path.write_bytes(fake.batches[run.run_id][0])
    with safe_open(str(path), framework="pt") as handle:
        assert handle.get_tensor("group_index").tolist() == [1, 0, 1, 0]
        assert handle.get_tensor("log_prob").abs().max() < 50
        assert json.loads(handle.metadata()["reported"]) == {"kl": "Infinity"}


def test_log_batch_sends_rollout_log_probs_and_verls_algorithm_section(fake, tmp_path):
    run = start(fake, tmp_path)
    rollout = batch_arrays()["old_log_prob"] - 0.01
    correction = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1",
                  "rollout_rs_threshold": "0.9_1.1"}  # fmt: skip
    verl = {"actor_rollout_ref": {"actor": {"clip_ratio": 0.25}},
            "algorithm": {"adv_estimator": "rloo", "rollout_correction": correction, "lam": 1.0}}  # fmt: skip
    run.log_batch(
        0, **batch_arrays(), rollout_log_probs=rollout, config=verl, reported={"rollout_corr/kl": 0.01}
    )
    run.finish(timeout=5)
    path = tmp_path / "b.safetensors"
    path.write_bytes(fake.batches[run.run_id][0])
    with safe_open(str(path), framework="numpy") as handle:
        np.testing.assert_array_equal(handle.get_tensor("rollout_log_probs"), rollout)
        config = json.loads(handle.metadata()["config"])
    assert config["clip_ratio"] == 0.25
    assert config["algorithm"] == {"adv_estimator": "rloo", "norm_adv_by_std_in_grpo": True, "gamma": 1.0,
                                   "rollout_correction": {**correction, "rollout_is_batch_normalize": False,
                                                          "bypass_mode": False, "loss_type": "ppo_clip"}}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"log_prob": [[0.0]]}, TypeError),
        ({"advantages": np.zeros((4, 9), np.float32)}, ValueError),
        ({"response_mask": np.zeros(4, np.float32)}, ValueError),
        ({"group_index": np.zeros(4, np.int64)}, TypeError),
        (
            {"group_index": np.zeros(3, np.int64), "token_level_rewards": np.zeros((4, 8), np.float32)},
            ValueError,
        ),
        ({"config": 3}, TypeError),
        ({"reported": [1.0]}, TypeError),
        ({"rollout_log_probs": np.zeros((4, 7), np.float32)}, ValueError),
        ({"rollout_log_probs": [[0.0] * 8] * 4}, TypeError),
        ({"config": {"algorithm": {"rollout_correction": {"rollout_rs": "token_k9"}}}}, ValueError),
    ],
)
def test_log_batch_misuse_raises(fake, tmp_path, change, error):
    run = start(fake, tmp_path)
    with pytest.raises(error):
        run.log_batch(0, **{**batch_arrays(), **change})
    run.finish(timeout=2)


def test_only_rank_zero_sends_scalars_by_default(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    run = start(fake, tmp_path)
    run.log({"x": 1.0}, step=0)
    run.log_batch(0, **batch_arrays())
    report = run.finish(timeout=5)
    assert report.points_logged == 0 and report.batches_sent == 1
    path = tmp_path / "b.safetensors"
    path.write_bytes(fake.batches[run.run_id][0])
    with safe_open(str(path), framework="numpy") as handle:
        assert handle.metadata()["rank"] == "3"


def test_finish_is_bounded_while_the_server_stays_down(fake, tmp_path):
    run = start(fake, tmp_path)
    fake.down = True
    with pytest.warns(ClientWarning, match="."):
        for step in range(10):
            run.log({"x": 1.0}, step=step)
        begin = time.monotonic()
        report = run.finish(timeout=1.0)
    assert time.monotonic() - begin < 10.0  # bounded by timeout=1.0, with room for a loaded machine
    assert report.points_pending == 10 and report.points_sent == 0


def test_context_manager_and_module_finish(fake, tmp_path):
    with start(fake, tmp_path) as run:
        run.log({"x": 1.0}, step=0)
    assert run.state is Lifecycle.FINISHED
    run2 = start(fake, tmp_path)
    run2.log({"x": 2.0}, step=1)
    assert rlvitals.finish(timeout=5).points_sent == 1
    assert run2.run_id == run.run_id  # same (project, name) resumes
    assert fake.series(run.run_id, "x") == {0: 1.0, 1: 2.0}


def test_forked_child_sends_its_own_records(fake, tmp_path):
    run = start(fake, tmp_path)
    run.log({"parent": 1.0}, step=0)
    pid = os.fork()
    if pid == 0:  # child: the in-memory fake is copied too, so report what reached the child's copy
        code = 1
        try:
            run.log({"child": 2.0}, step=1)
            report = run.finish(timeout=5)
            code = 0 if report.points_sent == 1 and fake.series(run.run_id, "child") == {1: 2.0} else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    report = run.finish(timeout=5)
    assert report.points_sent == 1 and fake.series(run.run_id, "parent") == {0: 1.0}
    assert "child" not in {name for (_, name) in fake.points[run.run_id]}


def test_client_import_pulls_no_web_stack():
    code = (
        "import sys, rlvitals, rlvitals.client, rlvitals.client.sync; rlvitals.init;"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('fastapi','sqlalchemy','plotly','uvicorn','starlette','pydantic') or m.startswith('rlvitals.service')];"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_sync_sends_a_crashed_trainers_open_segment_but_not_a_live_ones(fake, tmp_path):
    from rlvitals.client.spool import run_dir_name

    run_dir = tmp_path / run_dir_name("p", "crashed")
    run_dir.mkdir()
    (run_dir / "run.json").write_text(
        json.dumps({"project": "p", "name": "crashed", "config": {}, "tags": []})
    )
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    good = (
        b'{"step":0,"metrics":{"x":1.0},"wall_time":1.0}\n{"step":1,"metrics":{"x":"NaN"},"wall_time":1.0}\n'
    )
    torn = b'{"step":2,"metrics":{"x":3'  # the crash hit mid-append
    (run_dir / f"seg-{dead_pid}-aaaa-000001.jsonl.part").write_bytes(good + torn)
    (run_dir / f"seg-{os.getpid()}-bbbb-000001.jsonl.part").write_bytes(good)  # a live writer's segment
    result = sync_spool(tmp_path, url="http://fake", transport=fake.transport)
    assert result.ok and result.points_sent == 2
    series = fake.series("1", "x")
    assert series[0] == 1.0 and math.isnan(series[1]) and 2 not in series
    assert [p.name for p in run_dir.glob("seg-*")] == [f"seg-{os.getpid()}-bbbb-000001.jsonl.part"]


def test_memory_bound_spills_to_disk_while_the_server_is_healthy(fake, tmp_path):
    settings = ClientSettings(flush_interval=0.5, max_memory_points=50, max_steps_per_request=10)
    run = start(fake, tmp_path, settings=settings)
    for step in range(400):
        run.log({"a": 1.0, "b": 2.0}, step=step)
    report = run.finish(timeout=10)
    assert report.complete and report.points_sent == 800
    assert run.stats.points_spooled > 0  # over the bound: parked on disk, then sent from there
    assert len(fake.series(run.run_id, "b")) == 400


def test_url_and_key_come_from_the_environment(fake, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setenv("RLVITALS_URL", "http://from-env:9999")
    monkeypatch.setenv("RLVITALS_API_KEY", "secret-key")
    monkeypatch.setenv("RLVITALS_SPOOL_DIR", str(tmp_path / "env-spool"))
    handler = fake.transport.handler

    def spy(request):
        seen.append((str(request.url), request.headers.get("authorization")))
        return handler(request)

    run = rlvitals.init(project="p", name="env", transport=httpx.MockTransport(spy), settings=FAST)
    run.log({"x": 1.0}, step=0)
    run.finish(timeout=5)
    assert seen[0] == ("http://from-env:9999/api/v1/runs", "Bearer secret-key")
    assert run.spool_dir.parent == tmp_path / "env-spool"


def test_a_url_without_scheme_is_misuse(tmp_path):
    with pytest.raises(ValueError, match="http://"):
        rlvitals.init(url="localhost:8000", spool_dir=tmp_path)


def test_a_server_that_is_not_rlvitals_does_not_break_the_trainer(tmp_path):
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text="<html>hello</html>"))
    with pytest.warns(ClientWarning) as caught:
        run = rlvitals.init(url="http://other", project="p", name="n", spool_dir=tmp_path, transport=transport,
                            settings=FAST)  # fmt: skip
        run.log({"x": 1.0}, step=0)
        report = run.finish(timeout=0.5)
    assert "without a run id" in str(caught[0].message)
    assert report.points_pending == 1


def test_own_safetensors_writer_matches_the_official_reader():
    from rlvitals.client.capture import encode_safetensors
    from safetensors.torch import load

    gen = torch.Generator().manual_seed(1)
    tensors = {
        "log_prob": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "old_log_prob": torch.randn(5, 3, generator=gen).t(),  # non-contiguous
        "advantages": torch.randn(3, 5, generator=gen, dtype=torch.float64),
        "response_mask": torch.rand(3, 5, generator=gen) > 0.5,
        "group_index": np.array([0, 1, 1], np.int64),
        "entropy": np.zeros((3, 5), np.float16),
    }
    payload = b"".join(encode_safetensors(tensors, {"step": "7"}))
    back = load(payload)
    for name, value in tensors.items():
        expected = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
        assert back[name].dtype == expected.dtype and torch.equal(back[name], expected), name
