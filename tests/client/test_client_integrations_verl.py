"""verl integration: (a) the registered policy loss, (b) the recording ``ppo_loss``, (c) JSONL tail + logger.

What is tested how:

- With verl 0.9.1 importable (``/work/verl-venv/bin/python -m pytest tests/client/test_client_integrations_verl.py``;
  ray/datasets/PIL/pandas, imported by verl at top level but unused on these paths, are inert stubs), the
  integration runs inside verl's real ``register_policy_loss`` registry, real ``compute_policy_loss_vanilla``,
  real ``workers.utils.losses.ppo_loss`` on a real no-padding ``TensorDict`` built by verl's own
  ``left_right_2_no_padding``, real ``no_padding_2_padding``, and the real ``FileLogger``; verl's outputs
  must equal the golden fixture (``fixtures/verl_golden.json``), and ``VERL_USE_EXTERNAL_MODULES`` loading
  is checked in a subprocess. ``RLVITALS_REGEN_VERL_GOLDEN=1`` rewrites the fixture from real verl.
- Without verl (CI), the same integration functions run against replay doubles of the four verl functions
  they call (``get_policy_loss_fn``/``register_policy_loss``, ``losses.ppo_loss``, ``no_padding_2_padding``)
  that return what real verl returned for these exact inputs (the fixture). In both modes the batch the
  client receives must equal verl's padded tensors and its ``reported`` metrics must be verl's, and
  ``rlvitals.analyzers.recompute`` on the recorded batch must reproduce them.
- (c) needs no verl: the tailer reads lines written by verl's real ``FileLogger`` (kept in the fixture).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from rlvitals.client.integrations import _common
from rlvitals.client.testing import FakeServer
from safetensors.torch import load

import rlvitals

FIXTURE = Path(__file__).parent / "fixtures" / "verl_golden.json"
STUBBED = ("ray", "datasets", "PIL", "pandas")


class _InertModule(types.ModuleType):
    """A module whose every attribute is a do-nothing class (verl only references these names)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(
            name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None}
        )
        setattr(self, name, value)
        return value


class _InertFinder:
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


def _import_real_verl():
    if importlib.util.find_spec("verl") is None:
        return None
    if not any(isinstance(f, _InertFinder) for f in sys.meta_path):
        missing = [name for name in STUBBED if importlib.util.find_spec(name) is None]
        if missing:
            sys.meta_path.insert(0, _InertFinder())
    import verl.trainer.ppo.core_algos
    import verl.utils.tracking
    import verl.workers.utils.losses  # noqa: F401

    return sys.modules["verl"]


REAL_VERL = _import_real_verl()
MODE = "real verl 0.9.1" if REAL_VERL is not None else "replay doubles of verl (golden fixture)"

from rlvitals.client.integrations import verl as rv  # noqa: E402  (after verl, so it registers itself)

# ----------------------------------------------------------------------------------------- cases

POLICY_CASES = [
    {"seed": 0, "config": {}, "loss_agg_mode": "token-mean", "global_batch_info": {}},
    {
        "seed": 1,
        "config": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 10.0},
        "loss_agg_mode": "seq-mean-token-mean",
        "global_batch_info": {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 8},
    },
    {
        "seed": 2,
        "config": {"clip_ratio": 0.1, "loss_scale_factor": 8},
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "global_batch_info": {"loss_scale_factor": 8},
    },
]
PPO_CASES = [
    {"seed": 10, "config": {"use_kl_loss": True, "entropy_coeff": 0.01}, "prompt_lens": [3, 2, 3, 1],
     "resp_lens": [5, 3, 1, 4], "dp_size": 1},
    {"seed": 11, "config": {"use_kl_loss": True, "kl_loss_type": "k2", "loss_agg_mode": "seq-mean-token-mean",
     "clip_ratio_high": 0.28}, "prompt_lens": [2, 2, 1], "resp_lens": [2, 5, 3], "dp_size": 2},
]  # fmt: skip


def _policy_inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch, length = 4, 6
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    return {
        "old_log_prob": -torch.rand(batch, length, generator=g) * 2,
        "log_prob": -torch.rand(batch, length, generator=g) * 2,
        "advantages": torch.randn(batch, 1, generator=g).expand(batch, length).contiguous() * 2,
        "response_mask": mask,
    }


def _ppo_inputs(case: dict) -> dict:
    g = torch.Generator().manual_seed(case["seed"])
    prompt, resp = case["prompt_lens"], case["resp_lens"]
    batch, p_len, r_len = len(prompt), max(prompt), max(resp)
    attention = torch.zeros(batch, p_len + r_len, dtype=torch.long)
    for i in range(batch):
        attention[i, p_len - prompt[i] : p_len] = 1
        attention[i, p_len : p_len + resp[i]] = 1
    total = int(attention.sum())
    return {
        "attention_mask": attention,
        "input_ids": torch.randint(1, 100, (batch, p_len + r_len), generator=g) * attention,
        "old_log_probs": -torch.rand(batch, r_len, generator=g),
        "advantages": torch.randn(batch, 1, generator=g).expand(batch, r_len).contiguous(),
        "ref_log_prob": -torch.rand(batch, r_len, generator=g),
        "log_prob_values": -torch.rand(total, generator=g),
        "entropy_values": torch.rand(total, generator=g),
        "uid": [f"g{i // 2}" for i in range(batch)],
    }


def _nested(values: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    lens = attention.sum(-1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def _to_json(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "data": t.tolist()}


def _from_json(d: dict) -> torch.Tensor:
    return torch.tensor(d["data"], dtype=getattr(torch, d["dtype"]))


# ------------------------------------------------------------------------------ real verl pieces


def _actor_config(fields: dict, *, loss_mode: str = "vanilla", global_batch_info: dict | None = None):
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=2,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
        **fields,
    )
    config.global_batch_info.update(global_batch_info or {})
    return config


def _verl_tensordict(case: dict, inputs: dict):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    attention = inputs["attention_mask"]
    p_len = max(case["prompt_lens"])
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention[:, p_len:].clone()
    td = TensorDict(
        {
            "input_ids": inputs["input_ids"],
            "attention_mask": attention,
            "position_ids": position_ids,
            "prompts": inputs["input_ids"][:, :p_len],
            "responses": inputs["input_ids"][:, p_len:],
            "response_mask": response_mask,
            "old_log_probs": inputs["old_log_probs"],
            "advantages": inputs["advantages"],
            "ref_log_prob": inputs["ref_log_prob"],
        },
        batch_size=[attention.shape[0]],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td,
        dp_size=case["dp_size"],
        batch_num_tokens=int(response_mask.sum()) * case["dp_size"],
        global_batch_size=attention.shape[0] * case["dp_size"],
        update_lr_scheduler=False,
    )
    return td


def _generate_golden() -> dict:
    """Run real verl on every case (only with verl importable)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.utils.tracking import FileLogger
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    golden: dict = {"verl_version": REAL_VERL.__version__, "policy_loss": [], "ppo_loss": []}
    for case in POLICY_CASES:
        inputs = _policy_inputs(case["seed"])
        config = _actor_config(case["config"], global_batch_info=case["global_batch_info"])
        pg_loss, metrics = compute_policy_loss_vanilla(
            **inputs, loss_agg_mode=case["loss_agg_mode"], config=config
        )
        golden["policy_loss"].append(
            {
                "inputs": {k: _to_json(v) for k, v in inputs.items()},
                "pg_loss": pg_loss.item(),
                "metrics": metrics,
                "loss_config": rv.loss_config(config, case["loss_agg_mode"]),
            }
        )
    for case in PPO_CASES:
        inputs = _ppo_inputs(case)
        td = _verl_tensordict(case, inputs)
        config = _actor_config(case["config"])
        log_probs = _nested(inputs["log_prob_values"], inputs["attention_mask"])
        entropy = _nested(inputs["entropy_values"], inputs["attention_mask"])
        loss, metrics = ppo_loss(config, {"log_probs": log_probs, "entropy": entropy}, td)
        golden["ppo_loss"].append(
            {
                "inputs": {k: (_to_json(v) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()},
                "loss": loss.item(),
                "metrics": _common.scalars(metrics),
                "padded_log_prob": _to_json(no_padding_2_padding(log_probs, td)),
                "padded_entropy": _to_json(no_padding_2_padding(entropy, td)),
                "response_mask": _to_json(td["response_mask"]),
                "loss_config": rv.loss_config(config),
            }
        )
    path = FIXTURE.parent / "verl_file_logger.jsonl"
    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    try:
        logger = FileLogger("proj", "exp")
        for step in (1, 2, 3):
            logger.log({"actor/ppo_kl": 0.001 * step, "actor/pg_clipfrac": 0.1 + step / 100,
                        "critic/score/mean": float(step), "val/note": "text"}, step)  # fmt: skip
        logger.finish()
    finally:
        del os.environ["VERL_FILE_LOGGER_PATH"]
    golden["file_logger_lines"] = path.read_text().splitlines()
    path.unlink()
    return golden


if REAL_VERL is not None and os.environ.get("RLVITALS_REGEN_VERL_GOLDEN"):
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(_generate_golden(), indent=1) + "\n")

GOLDEN = json.loads(FIXTURE.read_text())

# -------------------------------------------------------------------------- replay doubles (CI)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.detach().to(b.dtype), b)


def _install_replay_doubles(monkeypatch) -> None:
    """verl modules whose functions return what real verl returned for the fixture's inputs."""
    registry: dict = {}

    def register_policy_loss(name):
        def decorator(func):
            registry[name] = func
            return func

        return decorator

    def get_policy_loss_fn(name):
        if name not in registry:
            raise ValueError(f"Unsupported loss mode: {name}. Supported modes are: {list(registry)}")
        return registry[name]

    def vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):  # fmt: skip
        for entry in GOLDEN["policy_loss"]:
            recorded = {k: _from_json(v) for k, v in entry["inputs"].items()}
            if _same(log_prob, recorded["log_prob"]) and _same(old_log_prob, recorded["old_log_prob"]):
                return log_prob.sum() * 0 + entry["pg_loss"], dict(entry["metrics"])
        for entry in GOLDEN["ppo_loss"]:
            if _same(log_prob, _from_json(entry["padded_log_prob"])):
                return log_prob.sum() * 0 + entry["metrics"]["actor/pg_loss"], {}
        raise AssertionError("replay double called with inputs real verl never saw")

    registry["vanilla"] = vanilla

    def no_padding_2_padding(tensor, data):
        for entry in GOLDEN["ppo_loss"]:
            inputs = entry["inputs"]
            if _same(tensor.values(), _from_json(inputs["log_prob_values"])):
                return _from_json(entry["padded_log_prob"])
            if _same(tensor.values(), _from_json(inputs["entropy_values"])):
                return _from_json(entry["padded_entropy"])
        raise AssertionError("no_padding_2_padding double called with an unknown tensor")

    def ppo_loss(config, model_output, data, dp_group=None):
        entry = data["__golden__"]
        loss_mode = config["policy_loss"]["loss_mode"]
        get_policy_loss_fn(loss_mode)(
            old_log_prob=data["old_log_probs"],
            log_prob=no_padding_2_padding(model_output["log_probs"], data).clone().requires_grad_(),
            advantages=data["advantages"],
            response_mask=data["response_mask"].bool(),
            loss_agg_mode=config["loss_agg_mode"],
            config=config,
        )
        loss = model_output["log_probs"].values().sum() * 0 + entry["loss"]
        return loss, dict(entry["metrics"])

    modules = {
        "verl": types.ModuleType("verl"),
        "verl.trainer": types.ModuleType("verl.trainer"),
        "verl.trainer.ppo": types.ModuleType("verl.trainer.ppo"),
        "verl.trainer.ppo.core_algos": types.ModuleType("verl.trainer.ppo.core_algos"),
        "verl.workers": types.ModuleType("verl.workers"),
        "verl.workers.utils": types.ModuleType("verl.workers.utils"),
        "verl.workers.utils.losses": types.ModuleType("verl.workers.utils.losses"),
        "verl.workers.utils.padding": types.ModuleType("verl.workers.utils.padding"),
    }
    core = modules["verl.trainer.ppo.core_algos"]
    core.POLICY_LOSS_REGISTRY = registry
    core.register_policy_loss = register_policy_loss
    core.get_policy_loss_fn = get_policy_loss_fn
    modules["verl.workers.utils.losses"].ppo_loss = ppo_loss
    modules["verl.workers.utils.padding"].no_padding_2_padding = no_padding_2_padding
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    rv.register()


@pytest.fixture
def verl_env(monkeypatch):
    """Real verl when importable, else the replay doubles; yields the mode string."""
    if REAL_VERL is None:
        _install_replay_doubles(monkeypatch)
    yield MODE


@pytest.fixture
def fake_run(tmp_path):
    server = FakeServer()
    run = rlvitals.init(
        project="verl", name="t", transport=server.transport, batch_every=1, spool_dir=tmp_path / "spool"
    )
    rv.configure(run, calls_per_step=1)
    yield server, run
    run.finish(timeout=5)
    rv.configure()


def _batches(server: FakeServer, run) -> list[tuple[dict, dict]]:
    run.finish(timeout=5)
    out = []
    for payload in server.batches[run.id]:
        header = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])
        out.append((load(payload), header["__metadata__"]))
    return out


def _policy_config(entry: dict, case: dict):
    if REAL_VERL is not None:
        return _actor_config(
            case["config"], loss_mode="rlvitals", global_batch_info=case["global_batch_info"]
        )
    config = {key: value for key, value in entry["loss_config"].items() if key not in _GLOBAL}
    config["global_batch_info"] = dict(case["global_batch_info"])
    config["policy_loss"] = {"loss_mode": "rlvitals"}
    return config


_GLOBAL = ("dp_size", "batch_num_tokens", "global_batch_size")

# --------------------------------------------------------------------------------------- tests


def test_golden_fixture_matches_real_verl():
    if REAL_VERL is None:  # CI: the fixture was written by the real-verl run; check it is complete
        assert GOLDEN["verl_version"] == "0.9.1"
        assert len(GOLDEN["policy_loss"]) == len(POLICY_CASES) and len(GOLDEN["ppo_loss"]) == len(PPO_CASES)
        return
    fresh = _generate_golden()
    assert fresh["verl_version"] == GOLDEN["verl_version"] == "0.9.1"
    for kind in ("policy_loss", "ppo_loss"):
        for new, old in zip(fresh[kind], GOLDEN[kind], strict=True):
            assert new["inputs"] == old["inputs"]
            for key in new["metrics"]:
                assert new["metrics"][key] == pytest.approx(old["metrics"][key], rel=1e-6, abs=1e-7)


def test_registered_loss_is_selectable_by_loss_mode(verl_env):
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn

    assert "rlvitals" in POLICY_LOSS_REGISTRY
    assert get_policy_loss_fn("rlvitals") is rv.policy_loss


@pytest.mark.parametrize("index", range(len(POLICY_CASES)))
def test_policy_loss_returns_vanilla_and_records_the_micro_batch(verl_env, fake_run, index):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    server, run = fake_run
    case, entry = POLICY_CASES[index], GOLDEN["policy_loss"][index]
    inputs = {k: _from_json(v) for k, v in entry["inputs"].items()}
    log_prob = inputs["log_prob"].clone().requires_grad_()
    config = _policy_config(entry, case)
    pg_loss, metrics = get_policy_loss_fn("rlvitals")(
        inputs["old_log_prob"], log_prob, inputs["advantages"], inputs["response_mask"],
        case["loss_agg_mode"], config,
    )  # fmt: skip
    assert pg_loss.item() == pytest.approx(entry["pg_loss"], rel=1e-6)
    assert metrics == pytest.approx(entry["metrics"], rel=1e-6)
    pg_loss.backward()  # the loss handed back to verl still carries the graph

    [(tensors, meta)] = _batches(server, run)
    for name in ("log_prob", "old_log_prob", "advantages"):
        assert torch.equal(tensors[name], inputs[name]), name
    assert torch.equal(tensors["response_mask"].bool(), inputs["response_mask"])
    reported = json.loads(meta["reported"])
    assert reported["actor/pg_loss"] == pytest.approx(entry["pg_loss"], rel=1e-6)
    for key, value in entry["metrics"].items():
        assert reported[key] == pytest.approx(value, rel=1e-6)
    recorded_config = json.loads(meta["config"])
    assert recorded_config["loss_agg_mode"] == case["loss_agg_mode"]
    for key, value in case["global_batch_info"].items():
        assert recorded_config[key] == value

    from rlvitals.analyzers import LossConfig, recompute

    again = recompute(LossConfig(**recorded_config), **{k: tensors[k] for k in inputs})
    assert again["pg_loss"] == pytest.approx(entry["pg_loss"], rel=1e-5, abs=1e-6)
    assert again["pg_clipfrac"] == pytest.approx(entry["metrics"]["actor/pg_clipfrac"], abs=1e-6)
    assert again["ppo_kl"] == pytest.approx(entry["metrics"]["actor/ppo_kl"], rel=1e-5, abs=1e-6)


def test_policy_loss_records_nothing_outside_training(verl_env, fake_run):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    server, run = fake_run
    inputs = {k: _from_json(v) for k, v in GOLDEN["policy_loss"][0]["inputs"].items()}
    config = _policy_config(GOLDEN["policy_loss"][0], POLICY_CASES[0])
    with torch.no_grad():
        get_policy_loss_fn("rlvitals")(**inputs, loss_agg_mode="token-mean", config=config)
    assert _batches(server, run) == []


def _ppo_data(index: int):
    case, entry = PPO_CASES[index], GOLDEN["ppo_loss"][index]
    inputs = {k: (_from_json(v) if isinstance(v, dict) else v) for k, v in entry["inputs"].items()}
    if REAL_VERL is not None:
        td = _verl_tensordict(case, inputs)
        return case, entry, inputs, td, _actor_config(case["config"], loss_mode="rlvitals")
    response_mask = _from_json(entry["response_mask"])
    data = {
        "response_mask": response_mask,
        "old_log_probs": inputs["old_log_probs"],
        "advantages": inputs["advantages"],
        "ref_log_prob": inputs["ref_log_prob"],
        "dp_size": case["dp_size"],
        "batch_num_tokens": int(response_mask.sum()) * case["dp_size"],
        "global_batch_size": response_mask.shape[0] * case["dp_size"],
        "update_lr_scheduler": False,
        "__golden__": entry,
    }
    config = {key: value for key, value in entry["loss_config"].items() if key not in _GLOBAL}
    config["global_batch_info"] = {k: data[k] for k in _GLOBAL}
    config["policy_loss"] = {"loss_mode": "rlvitals"}
    return case, entry, inputs, data, config


@pytest.mark.parametrize("index", range(len(PPO_CASES)))
def test_ppo_loss_wrapper_records_entropy_ref_and_global_batch_info(verl_env, fake_run, index):
    server, run = fake_run
    case, entry, inputs, data, config = _ppo_data(index)
    log_probs = _nested(inputs["log_prob_values"].clone().requires_grad_(), inputs["attention_mask"])
    entropy = _nested(inputs["entropy_values"], inputs["attention_mask"])
    loss, metrics = rv.ppo_loss(config, {"log_probs": log_probs, "entropy": entropy}, data)
    assert loss.item() == pytest.approx(entry["loss"], rel=1e-6)
    assert _common.scalars(metrics) == pytest.approx(entry["metrics"], rel=1e-6)

    [(tensors, meta)] = _batches(server, run)  # one batch: the inner registered loss stayed silent
    assert torch.equal(tensors["log_prob"], _from_json(entry["padded_log_prob"]))
    assert torch.equal(tensors["entropy"], _from_json(entry["padded_entropy"]))
    assert torch.equal(tensors["ref_log_prob"], inputs["ref_log_prob"])
    assert torch.equal(tensors["old_log_prob"], inputs["old_log_probs"])
    assert torch.equal(tensors["response_mask"].bool(), _from_json(entry["response_mask"]).bool())
    reported = json.loads(meta["reported"])
    assert reported["policy_loss"] == pytest.approx(entry["loss"], rel=1e-6)
    for key in ("actor/pg_loss", "actor/entropy_loss", "kl_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert reported[key] == pytest.approx(entry["metrics"][key], rel=1e-6), key
    recorded_config = json.loads(meta["config"])
    assert recorded_config["dp_size"] == case["dp_size"]
    assert recorded_config["batch_num_tokens"] == int(tensors["response_mask"].sum()) * case["dp_size"]
    assert recorded_config["global_batch_size"] == tensors["log_prob"].shape[0] * case["dp_size"]

    from rlvitals.analyzers import LossConfig, recompute

    names = ("log_prob", "old_log_prob", "advantages", "response_mask", "ref_log_prob", "entropy")
    again = recompute(LossConfig(**recorded_config), **{k: tensors[k] for k in names})
    assert again["policy_loss"] == pytest.approx(entry["loss"], rel=1e-5, abs=1e-6)
    assert again["kl_loss"] == pytest.approx(entry["metrics"]["kl_loss"], rel=1e-5, abs=1e-6)
    assert again["entropy_loss"] == pytest.approx(entry["metrics"]["actor/entropy_loss"], rel=1e-5)


def test_recording_failure_never_reaches_verl(verl_env, tmp_path):
    class Broken:
        settings = None

        def log(self, metrics, step):
            raise OSError("disk full")

        def log_batch(self, step, **batch):
            raise OSError("disk full")

    rv.configure(Broken(), calls_per_step=1)
    try:
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        entry, case = GOLDEN["policy_loss"][0], POLICY_CASES[0]
        inputs = {k: _from_json(v) for k, v in entry["inputs"].items()}
        inputs["log_prob"].requires_grad_()
        with pytest.warns(rv.RecordingError, match="disk full"):
            pg_loss, _ = get_policy_loss_fn("rlvitals")(**inputs, config=_policy_config(entry, case))
        get_policy_loss_fn("rlvitals")(**inputs, config=_policy_config(entry, case))  # silent, counted
        assert pg_loss.item() == pytest.approx(entry["pg_loss"], rel=1e-6)
        assert rv.recording_failures() == 2
    finally:
        rv.configure()


def test_loading_via_verl_use_external_modules(verl_env):
    if REAL_VERL is None:  # what verl's import_external_libs does: importlib.import_module(name)
        import importlib

        module = importlib.import_module("rlvitals.client.integrations.verl")
        module.register()
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        assert get_policy_loss_fn("rlvitals") is module.policy_loss
        return
    code = (
        f"exec({_STUB_SOURCE!r})\n"
        "import verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
        "import rlvitals.client.integrations.verl as rv\n"
        "assert POLICY_LOSS_REGISTRY['rlvitals'] is rv.policy_loss\n"
        "print('registered')\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "rlvitals.client.integrations.verl"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "registered" in out.stdout


_STUB_SOURCE = (
    "import importlib.machinery, sys, types\n"
    f"STUBBED = {STUBBED!r}\n"
    + inspect.getsource(_InertModule)
    + inspect.getsource(_InertFinder)
    + "sys.meta_path.insert(0, _InertFinder())\n"
)


# ---------------------------------------------------------------------------- (c) scalars, no verl


def test_tailer_follows_verl_file_logger_lines(tmp_path):
    server = FakeServer()
    run = rlvitals.init(project="verl", name="tail", transport=server.transport, spool_dir=tmp_path / "s")
    path = tmp_path / "exp.jsonl"
    lines = GOLDEN["file_logger_lines"]
    path.write_text(lines[0] + "\n" + lines[1][:10])  # second line still being written
    tailer = rv.JsonlTailer(path, run, interval=0.05)
    assert tailer.poll() == 1
    path.write_text(lines[0] + "\n" + lines[1] + "\n" + "{not json\n" + lines[2] + "\n")
    assert tailer.poll() == 2 and tailer.skipped == 1
    path.write_text(lines[0] + "\n")  # verl reopened the file with "wb": start over
    assert tailer.poll() == 1
    run.finish(timeout=5)
    assert server.series(run.id, "actor/ppo_kl") == pytest.approx({1: 0.001, 2: 0.002, 3: 0.003})
    assert server.series(run.id, "critic/score/mean") == {1: 1.0, 2: 2.0, 3: 3.0}
    assert server.series(run.id, "val/note") == {}  # text values are not metrics


def test_tailer_thread_and_env_path(tmp_path, monkeypatch):
    server = FakeServer()
    run = rlvitals.init(project="verl", name="tail2", transport=server.transport, spool_dir=tmp_path / "s")
    path = tmp_path / "exp.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tailer = rv.JsonlTailer(run=run, interval=0.02).start()
    path.write_text("\n".join(GOLDEN["file_logger_lines"]) + "\n")
    assert tailer.stop() == 3
    run.finish(timeout=5)
    assert sorted(server.series(run.id, "actor/pg_clipfrac")) == [1, 2, 3]


def test_read_verl_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(GOLDEN["file_logger_lines"][0] + '\n{"step": -1, "data": {}}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: step must be an int >= 0"):
        list(rv.read_verl_jsonl(path))


def test_tracking_logger_has_verl_backend_interface(tmp_path):
    server = FakeServer()
    run = rlvitals.init(project="verl", name="trk", transport=server.transport, spool_dir=tmp_path / "s")
    logger = rv.VerlTrackingLogger(
        "verl", "trk", {"actor_rollout_ref": {"actor": {"ppo_epochs": 1}}}, run=run
    )
    logger.log(data={"actor/pg_clipfrac": 0.2, "timing/gen": 1.5, "note": "x"}, step=7)
    logger.finish()
    assert server.series(run.id, "actor/pg_clipfrac") == {7: 0.2}
    assert server.series(run.id, "timing/gen") == {7: 1.5}


# ------------------------------------------------------------------------------- the step clock


def test_step_clock_precedence():
    now = [0.0]
    clock = _common.StepClock(gap_s=5.0, clock=lambda: now[0])
    assert [clock.tick() for _ in range(3)] == [1, 1, 1]
    now[0] = 10.0  # a rollout-long pause
    assert clock.tick() == 2
    assert clock.tick(new_step=True) == 3
    clock.set(42)
    now[0] = 100.0
    assert clock.tick() == 42 and clock.tick(new_step=True) == 42
    counted = _common.StepClock(calls_per_step=2)
    assert [counted.tick() for _ in range(5)] == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="calls_per_step"):
        _common.StepClock(calls_per_step=0)


def test_bad_step_settings_in_the_environment_are_ignored_with_a_warning(monkeypatch):
    monkeypatch.setenv(rv.ENV_CALLS_PER_STEP, "four")
    with pytest.warns(rv.RecordingError, match="ignoring RLVITALS_VERL_CALLS_PER_STEP='four'"):
        clock = rv._clock_from_env()
    assert clock.calls_per_step is None
    monkeypatch.setenv(rv.ENV_CALLS_PER_STEP, "4")
    assert rv._clock_from_env().calls_per_step == 4


def test_last_mini_batch_flag_flip_starts_a_step():
    recorder = rv._Recorder()
    flags = [False, False, True, True, False, True, False]
    assert [recorder.boundary(f) for f in flags] == [False, False, False, False, True, False, True]
