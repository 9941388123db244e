"""Real verl 0.9.1 training updates with the rlvitals hooks in them; run inside the verl side env.

``python tests/client/verl_side.py OUT_DIR [scenario ...]`` (``tests/client/test_client_integrations_verl.py``
runs it; ``PYTHONPATH`` = ``rlvitals_path()``). Each scenario writes ``OUT_DIR/<scenario>.json`` with what
verl returned and the batches the rlvitals client sent (safetensors payloads, hex), for the test module to
check in the project's own environment with ``rlvitals.analyzers``.

What is verl's own code here and what is not:

- verl's: ``RayPPOTrainer._update_actor`` (``DataProto.to_tensordict``, ``left_right_2_no_padding``,
  the mini-batch/epoch settings), ``TrainingWorker.train_mini_batch`` (``make_iterator`` over
  ``ppo_epochs`` with shuffling, the ``update_lr_scheduler`` flag), ``TrainingWorker.train_batch`` and
  ``_postprocess_output``, ``BaseEngine.train_batch``, ``FSDPEngine.forward_backward_batch``
  (``batch_num_tokens``/``dp_size``, ``prepare_micro_batches``, ``loss.backward()``),
  ``workers.utils.losses.ppo_loss``, every ``compute_policy_loss_*`` in ``POLICY_LOSS_REGISTRY``,
  ``ActorConfig``/``PolicyLossConfig``/``FSDPEngineConfig``, ``reduce_metrics``, ``Tracking`` with its
  ``file`` backend, and the ``VERL_USE_EXTERNAL_MODULES`` loading of ``rlvitals.client.integrations.verl``.
- Not verl's: the model. ``TinyEngine`` is an ``FSDPEngine`` whose ``forward_step`` runs a 16x16 logit
  table on the CPU instead of an FSDP-wrapped transformer (``prepare_model_inputs`` and the HF model are
  what FSDP/peft/flash-attn would need), whose optimizer is plain SGD, and whose data-parallel group is one
  gloo process. The worker and trainer objects are built without Ray (``__init__`` would start engines and
  Ray actors); their methods are verl's.
- Stubs: ray, datasets, PIL, pandas, peft, accelerate, uvicorn, fastapi, torchdata, cachetools are imported
  by these modules at top level and never used on these paths (inert modules, as in the golden loader);
  ``psutil`` is a two-line stand-in because ``_postprocess_output`` reads ``virtual_memory().used`` for a
  memory metric.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import json
import os
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "analyzers" / "golden"))

import verl_loader  # noqa: E402

EXTRA_STUBS = ("peft", "accelerate", "uvicorn", "fastapi", "torchdata", "cachetools")
verl_loader._STUBBED = (*verl_loader._STUBBED, *EXTRA_STUBS)
sys.modules["psutil"] = _psutil = types.ModuleType("psutil")
_psutil.__spec__ = importlib.machinery.ModuleSpec("psutil", None)
_psutil.virtual_memory = lambda: types.SimpleNamespace(used=0, total=1, available=1)
warnings.filterwarnings("ignore", message="megatron engine is not available")
core_algos, losses, _ = verl_loader.load_verl()  # VERL_USE_EXTERNAL_MODULES registers "rlvitals" here

from omegaconf import OmegaConf  # noqa: E402
from rlvitals.client.integrations import verl as rv  # noqa: E402
from rlvitals.client.settings import ClientSettings  # noqa: E402
from rlvitals.client.testing import FakeServer  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.plugin.platform.platform_cuda import PlatformCUDA  # noqa: E402
from verl.plugin.platform.platform_manager import set_platform  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import reduce_metrics  # noqa: E402
from verl.utils.tracking import Tracking  # noqa: E402
from verl.workers.config import ActorConfig, FSDPEngineConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine  # noqa: E402
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

import rlvitals  # noqa: E402

VOCAB = 16
BATCH = 8
GROUP = 4  # rollout.n: responses per prompt (one GRPO group per uid)
MINI_BATCH = 4  # ppo_mini_batch_size: 2 mini-batches per epoch
MICRO_BATCH = 2  # ppo_micro_batch_size_per_gpu: 2 micro-batches per mini-batch
EPOCHS = 2  # ppo_epochs: 8 loss calls per training step
STEPS = 6  # with batch_every=1 the sampler audits positions 0-5: epoch 0 and the start of epoch 1
CALLS = EPOCHS * BATCH // MICRO_BATCH  # loss calls per step (the update cycle)
LR = 10.0  # large enough that later mini-batches/epochs clip
# data-parallel processes of this job (the ``dp2`` scenario runs as two processes, RANK 0 and 1) and ours
DP = int(os.environ.get("RLVITALS_VERL_DP", "1"))
RANK = int(os.environ.get("RANK", "0"))


class CpuPlatform(PlatformCUDA):
    """verl has no CPU platform; this one answers "cpu" where the engine asks for its device."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return types.SimpleNamespace(max_memory_allocated=lambda: 0, max_memory_reserved=lambda: 0)

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return "cpu"


set_platform(CpuPlatform())


class TinyModel(torch.nn.Module):
    """Next-token log-probs from a (vocab, vocab) logit table, on verl's no-padding (jagged) layout."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g) * 0.5)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        ids = input_ids.values()
        logits = self.table[ids]  # (total_nnz, vocab): position t predicts token t + 1
        logp = torch.log_softmax(logits, dim=-1)
        labels = torch.roll(ids, shifts=-1)
        log_probs = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        offsets = input_ids.offsets()
        return {
            "log_probs": torch.nested.nested_tensor_from_jagged(log_probs, offsets=offsets),
            "entropy": torch.nested.nested_tensor_from_jagged(entropy, offsets=offsets),
        }


class TinyEngine(FSDPEngine):
    """verl's FSDPEngine training loop around ``TinyModel`` (no FSDP wrapping, one gloo rank)."""

    def __init__(self, model: TinyModel) -> None:  # FSDPEngine.__init__ would build an FSDP module
        self.module = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        self.ulysses_sequence_parallel_size = 1
        self.scaler = None

    def get_data_parallel_group(self):
        return torch.distributed.group.WORLD  # the gloo processes of this job (one, or DP)

    def get_data_parallel_size(self) -> int:
        return DP

    def get_data_parallel_rank(self) -> int:
        return RANK

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    @contextlib.contextmanager
    def train_mode(self, **kwargs):
        self.module.train()
        yield

    def _gradient_sync_context(self, is_last_micro_batch: bool):
        return contextlib.nullcontext()

    def optimizer_step(self):
        if DP > 1:  # what FSDP/DDP do before the step: average the gradients over the data-parallel ranks
            for p in self.module.parameters():
                torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM)
                p.grad /= DP
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), float("inf"))
        self.optimizer.step()
        return grad_norm

    def lr_scheduler_step(self):
        return LR

    def forward_step(self, micro_batch: TensorDict, loss_function, forward_only):
        model_output = self.module(micro_batch["input_ids"])
        loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=None)
        return loss, {"model_output": {}, "loss": loss.detach().item(), "metrics": metrics}


class _Flops:
    def estimate_flops(self, tokens, delta_time, images_seqlens=None):
        return 1.0, 1.0


class Worker(TrainingWorker):
    """verl's TrainingWorker methods on a TinyEngine (``__init__`` would start a Ray worker)."""

    def __init__(self, engine: TinyEngine, micro_batch: int = MICRO_BATCH) -> None:
        self.engine = engine
        self.loss_fn = None
        self.profiler = _Profiler()
        self.flops_counter = _Flops()
        self.device_name = "cpu"
        self.model_config = {"use_remove_padding": True, "use_fused_kernels": False}
        self.engine_config = FSDPEngineConfig(
            strategy="fsdp", use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch, forward_only=False
        )


class _Profiler:
    """What ``train_mini_batch`` and ``DistProfiler.annotate`` ask of verl's profiler: disabled."""

    rank = 0

    def step(self) -> None:
        pass

    def check_enable(self) -> bool:
        return False


def actor_config(loss_mode: str = "vanilla", **fields) -> ActorConfig:
    defaults = {
        "use_kl_loss": True,
        "kl_loss_type": "low_var_kl",
        "kl_loss_coef": 0.01,
        "entropy_coeff": 0.01,
    }
    return ActorConfig(
        strategy="fsdp",
        rollout_n=GROUP,
        ppo_mini_batch_size=MINI_BATCH // GROUP,  # prompts; verl's trainer multiplies by rollout.n
        ppo_micro_batch_size_per_gpu=MICRO_BATCH,
        ppo_epochs=EPOCHS,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.5),
        **{**defaults, **fields},
    )


def trainer_config(actor: ActorConfig, shuffle: bool = True):
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"n": GROUP, "temperature": 1.0, "multi_turn": {"enable": False}},
                "actor": {
                    "ppo_mini_batch_size": actor.ppo_mini_batch_size,
                    "ppo_epochs": actor.ppo_epochs,
                    "data_loader_seed": 7,
                    "shuffle": shuffle,
                    "calculate_entropy": True,
                    "entropy_coeff": actor.entropy_coeff,
                },
            },
        }
    )


def rollout(
    step: int, model: TinyModel, is_weights: bool = False, teacher: TinyModel | None = None
) -> DataProto:
    """One generation batch, padded as verl's trainer holds it, with old log-probs from the actor."""
    g = torch.Generator().manual_seed(1000 + step)
    prompt_lens = torch.randint(1, 4, (BATCH,), generator=g)
    resp_lens = torch.randint(2, 7, (BATCH,), generator=g)
    p_len, r_len = int(prompt_lens.max()), int(resp_lens.max())
    attention = torch.zeros(BATCH, p_len + r_len, dtype=torch.long)
    for i in range(BATCH):
        attention[i, p_len - prompt_lens[i] : p_len] = 1
        attention[i, p_len : p_len + resp_lens[i]] = 1
    input_ids = torch.randint(1, VOCAB, (BATCH, p_len + r_len), generator=g) * attention
    response_mask = attention[:, p_len:].clone()
    scores = torch.randint(0, 2, (BATCH,), generator=g).float()
    token_level_rewards = torch.zeros(BATCH, r_len)
    token_level_rewards[torch.arange(BATCH), resp_lens - 1] = scores
    uid = [f"s{step}g{i // GROUP}" for i in range(BATCH)]
    advantages = grpo_advantages(token_level_rewards, response_mask, uid)
    td = TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "prompts": input_ids[:, :p_len],
            "responses": input_ids[:, p_len:],
            "response_mask": response_mask,
        },
        batch_size=[BATCH],
    )
    nopad = left_right_2_no_padding(td.clone())
    with torch.no_grad():  # verl's compute_log_prob: the actor before this update
        out = model(nopad["input_ids"])
        old = no_padding_2_padding(out["log_probs"], nopad) * response_mask
    noise = torch.randn(BATCH, r_len, generator=g) * 0.05
    batch = {
        **{k: td[k] for k in td.keys()},  # noqa: SIM118 - iterating a TensorDict walks its batch
        "old_log_probs": old,
        "ref_log_prob": (old + torch.randn(BATCH, r_len, generator=g) * 0.1) * response_mask,
        "rollout_log_probs": (old + noise) * response_mask,  # the inference engine's (vLLM/SGLang) log-probs
        "advantages": advantages,
        "token_level_rewards": token_level_rewards,
    }
    if is_weights:  # what verl's decoupled rollout correction adds: clipped pi_old / pi_rollout per token
        batch["rollout_is_weights"] = (old - batch["rollout_log_probs"]).exp().clamp(max=2.0) * response_mask
    if teacher is not None:  # what verl's teacher workers add: (batch, seq_len, topk=1), left-right padded
        with torch.no_grad():
            scored = teacher(nopad["input_ids"])["log_probs"].values()
        padded = torch.zeros(attention.shape)
        padded[attention.bool()] = scored  # unpad_input's row-major order of the valid positions
        batch["teacher_logprobs"] = padded.unsqueeze(-1)
        batch["teacher_ids"] = torch.roll(input_ids, -1, dims=1).unsqueeze(-1)
    import numpy as np

    return DataProto.from_dict(tensors=batch, non_tensors={"uid": np.array(uid, dtype=object)})


def grpo_advantages(rewards, mask, uid):
    scores = rewards.sum(-1)
    out = torch.zeros_like(scores)
    for group in set(uid):
        idx = torch.tensor([i for i, u in enumerate(uid) if u == group])
        s = scores[idx]
        out[idx] = (s - s.mean()) / (s.std() + 1e-6)
    return out.unsqueeze(-1) * mask


def train(
    loss_fn,
    *,
    steps: int = STEPS,
    seed: int = 0,
    micro_batch: int = MICRO_BATCH,
    shuffle: bool = True,
    is_weights: bool = False,
    tracking: Tracking | None = None,
    rollout_correction=None,
    distillation=None,
) -> dict:
    """``steps`` verl actor updates with ``loss_fn`` bound through ``TrainingWorker.set_loss_fn``."""
    torch.manual_seed(seed)
    model = TinyModel(seed)
    worker = Worker(TinyEngine(model), micro_batch)
    TrainingWorker.set_loss_fn(worker, loss_fn)
    done, rollouts = [], []
    teacher = TinyModel(seed + 100) if distillation is not None else None
    for step in range(1, steps + 1):
        batch = rollout(step, model, is_weights, teacher)
        if rollout_correction is not None:  # as RayPPOTrainer.fit calls it: imported from its module
            from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

            batch, corr_metrics = compute_rollout_correction_and_add_to_batch(batch, rollout_correction)
        actor = actor_config()
        config = trainer_config(actor, shuffle)
        if distillation is not None:
            config.distillation = {"enabled": True}
        trainer = types.SimpleNamespace(
            config=config,
            distillation_config=distillation,
            actor_rollout_wg=types.SimpleNamespace(update_actor=_dispatched(worker.train_mini_batch)),
        )
        started = time.perf_counter()
        output = RayPPOTrainer._update_actor(trainer, batch)
        metrics = reduce_metrics(output.meta_info["metrics"])
        if rollout_correction is not None:
            metrics.update(corr_metrics)  # the driver logs them beside the actor's (RayPPOTrainer.fit)
        done.append({"step": step, "metrics": _plain(metrics), "seconds": time.perf_counter() - started})
        rollouts.append(
            {k: batch.batch[k].tolist() for k in ("old_log_probs", "rollout_log_probs", "advantages")}
        )
        if tracking is not None:
            tracking.log(data=metrics, step=step)
    return {"steps": done, "rollouts": rollouts, "table": model.table.detach().tolist()}


def _dispatched(update):
    """``update_actor`` as verl's worker group calls it: with DP ranks, each gets its chunk of the batch
    (``make_nd_compute_dataproto_dispatch_fn``: ``BatchData(td).chunk(dp_size)[dp_rank]``), as a copy of its
    own (Ray ships each worker a deserialised chunk; the chunk itself is a locked view)."""
    if DP == 1:
        return update
    from verl.protocol import BatchData

    def dispatch(td):
        chunk = BatchData(td).chunk(chunks=DP)[RANK].clone()
        return update(chunk.unlock_() if chunk.is_locked else chunk)

    return dispatch


def _plain(metrics: dict) -> dict:
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, (int, float)):
            out[key] = value
    return out


def _run(server: FakeServer, name: str, **settings):
    return rlvitals.init(
        project="verl-side", name=name, transport=server.transport, spool_dir=Path(tempfile.mkdtemp()),
        settings=ClientSettings(**settings),
    )  # fmt: skip


def _payloads(server: FakeServer, run) -> list[str]:
    return [p.hex() for p in server.batches.get(run.id, [])]


# ---------------------------------------------------------------------------------------- scenarios


def scenario_set_loss_fn(options: dict) -> dict:
    """(b) ``set_loss_fn(partial(ppo_loss, config=...))`` against verl's own ``ppo_loss``, same seeds."""
    plain = train(functools.partial(losses.ppo_loss, config=actor_config()))
    server = FakeServer()
    run = _run(server, "set-loss-fn", batch_every=1, **options)
    rv.configure(run)
    hooked = train(functools.partial(rv.ppo_loss, config=actor_config()))
    run.finish(timeout=10)
    failures = rv.recording_failures()
    rv.configure()
    return {"plain": plain, "hooked": hooked, "batches": _payloads(server, run), "failures": failures}


def scenario_registered(options: dict) -> dict:
    """(a) verl's own ``ppo_loss`` with ``policy_loss.loss_mode=rlvitals`` against ``loss_mode=vanilla``."""
    plain = train(functools.partial(losses.ppo_loss, config=actor_config("vanilla")), steps=3)
    server = FakeServer()
    run = _run(server, "registered", batch_every=1, **options)
    rv.configure(run, calls_per_step=CALLS)  # the registered loss never sees verl's mini-batch flag
    hooked = train(functools.partial(losses.ppo_loss, config=actor_config("rlvitals")), steps=3)
    run.finish(timeout=10)
    failures = rv.recording_failures()
    rv.configure()
    return {"plain": plain, "hooked": hooked, "batches": _payloads(server, run), "failures": failures}


def scenario_both(options: dict) -> dict:
    """(a) and (b) together: one batch per sampled micro-batch (the inner registered loss stays silent)."""
    server = FakeServer()
    run = _run(server, "both", batch_every=1, batch_micro_batches="all", **options)
    rv.configure(run)
    train(functools.partial(rv.ppo_loss, config=actor_config("rlvitals")), steps=2)
    run.finish(timeout=10)
    rv.configure()
    return {"batches": _payloads(server, run), "calls": 2 * CALLS}


def scenario_agg_modes(options: dict) -> dict:
    """(b) under every ``loss_agg_mode`` and the KL estimators: all 8 micro-batches of one update each."""
    results = {}
    for mode, kl in (("token-sum", "k1"), ("seq-mean-token-sum", "k2"), ("seq-mean-token-sum-norm", "k3"),
                     ("seq-mean-token-mean", "low_var_kl")):  # fmt: skip
        server = FakeServer()
        run = _run(server, f"agg-{mode}", batch_every=1, batch_micro_batches="all", **options)
        rv.configure(run)
        config = actor_config(loss_agg_mode=mode, kl_loss_type=kl, clip_ratio_high=0.28, loss_scale_factor=8)
        train(functools.partial(rv.ppo_loss, config=config), steps=1)
        run.finish(timeout=10)
        results[mode] = {"batches": _payloads(server, run), "failures": rv.recording_failures()}
        rv.configure()
    return results


def scenario_is_weights(options: dict) -> dict:
    """A batch carrying ``rollout_is_weights`` (token TIS at 2.0): verl's pg_loss includes them; they are
    sent with the batch and the algorithm section names the correction that made them."""
    server = FakeServer()
    run = _run(server, "is-weights", batch_every=1, batch_micro_batches="all", **options)
    rv.configure(run, algorithm={"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(functools.partial(rv.ppo_loss, config=actor_config()), steps=1, is_weights=True)
    run.finish(timeout=10)
    rv.configure()
    return {
        "batches": _payloads(server, run),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, rv.RecordingError)],
    }


ROLLOUT_CORRECTION = {  # token TIS + token-level k1 rejection: some tokens rejected, weights clipped
    "rollout_is": "token",
    "rollout_is_threshold": 1.04,
    "rollout_is_batch_normalize": False,
    "rollout_rs": "token_k1",
    "rollout_rs_threshold": "0.95_1.05",
    "bypass_mode": False,
    "loss_type": "ppo_clip",
}


def scenario_rollout_correction(options: dict) -> dict:
    """verl's real decoupled rollout correction (``rollout_corr_helper``) on the driver, through
    ``install_rollout_correction``, then the actor update with the IS weights and the mask after rejection
    through the ``ppo_loss`` hook, against the same steps without the hooks."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    def config():
        return RolloutCorrectionConfig(**ROLLOUT_CORRECTION)

    plain = train(
        functools.partial(losses.ppo_loss, config=actor_config()), steps=2, rollout_correction=config()
    )
    server = FakeServer()
    run = _run(server, "rollout-correction", batch_every=1, batch_micro_batches="all", **options)
    rv.configure(run, algorithm={"rollout_correction": config()})
    rv.install_rollout_correction()
    try:
        hooked = train(
            functools.partial(rv.ppo_loss, config=actor_config()), steps=2, rollout_correction=config()
        )
    finally:
        rv.uninstall_rollout_correction()
    run.finish(timeout=10)
    failures = rv.recording_failures()
    rv.configure()
    return {"plain": plain, "hooked": hooked, "batches": _payloads(server, run), "failures": failures,
            "config": ROLLOUT_CORRECTION}  # fmt: skip


def scenario_distillation(options: dict) -> dict:
    """verl's own ``distillation_ppo_loss`` (k3 reverse-KL estimator as a policy-gradient reward, with the
    task loss at coefficient 0.5) bound with ``set_loss_fn`` through the recording wrapper, against verl's."""
    from verl.trainer.distillation import losses as dl
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    results = {}
    for name, loss_cfg in (
        ("pg", {"loss_mode": "k3", "distillation_loss_coef": 0.5}),
        ("supervised", {"loss_mode": "k2", "use_policy_gradient": False, "loss_max_clamp": 0.5}),
    ):

        def distillation(loss_cfg=loss_cfg):
            return DistillationConfig(distillation_loss=DistillationLossConfig(**loss_cfg))

        bound = functools.partial(
            dl.distillation_ppo_loss, config=actor_config(), distillation_config=distillation()
        )
        plain = train(bound, steps=2, distillation=distillation())
        server = FakeServer()
        run = _run(server, f"distillation-{name}", batch_every=1, batch_micro_batches="all", **options)
        rv.configure(run)
        hooked = train(
            functools.partial(rv.distillation_ppo_loss, config=actor_config(), distillation_config=distillation()),
            steps=2, distillation=distillation(),
        )  # fmt: skip
        run.finish(timeout=10)
        results[name] = {"plain": plain, "hooked": hooked, "batches": _payloads(server, run),
                         "failures": rv.recording_failures()}  # fmt: skip
        rv.configure()
    return results


def scenario_groups(options: dict) -> dict:
    """Micro-batches of whole GRPO groups (micro-batch = rollout.n, no shuffling): ``uid`` is sent."""
    server = FakeServer()
    run = _run(server, "groups", batch_every=1, batch_micro_batches="all", **options)
    rv.configure(run)
    train(functools.partial(rv.ppo_loss, config=actor_config()), steps=1, micro_batch=GROUP, shuffle=False)
    run.finish(timeout=10)
    rv.configure()
    return {"batches": _payloads(server, run)}


class _BrokenRun:
    settings = types.SimpleNamespace(batch_every=1, batch_micro_batches="all")

    def log(self, metrics, step):
        raise OSError("disk full")

    def log_batch(self, step, **batch):
        raise OSError("disk full")


def scenario_broken(options: dict) -> dict:
    """A run whose every write fails: verl's update is unchanged, one warning, every failure counted."""
    plain = train(functools.partial(losses.ppo_loss, config=actor_config()), steps=1)
    rv.configure(_BrokenRun(), calls_per_step=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hooked = train(functools.partial(rv.ppo_loss, config=actor_config()), steps=1)
    failures = rv.recording_failures()
    rv.configure()
    return {
        "plain": plain,
        "hooked": hooked,
        "failures": failures,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, rv.RecordingError)],
    }


def scenario_delegates(options: dict) -> dict:
    """Every loss in verl's registry through the registered ``rlvitals`` loss, against verl calling it."""
    g = torch.Generator().manual_seed(5)
    shape = (6, 9)
    mask = torch.ones(shape, dtype=torch.bool)
    mask[1, 5:] = False
    mask[4, 2:] = False
    inputs = {
        "old_log_prob": -torch.rand(shape, generator=g) * 2,
        "log_prob": -torch.rand(shape, generator=g) * 2,
        "advantages": torch.randn(shape[0], 1, generator=g).expand(shape).contiguous(),
        "response_mask": mask,
    }
    results = {}
    for mode in sorted(core_algos.POLICY_LOSS_REGISTRY):
        if mode == rv.LOSS_MODE:
            continue
        config = actor_config(mode, tau_pos=1.5, tau_neg=2.5)  # SAPO's temperatures, off their defaults
        torch.manual_seed(0)
        log_prob = inputs["log_prob"].clone().requires_grad_()
        try:
            want_loss, want = core_algos.get_policy_loss_fn(mode)(
                **{**inputs, "log_prob": log_prob}, loss_agg_mode="token-mean", config=config
            )
        except Exception as exc:  # a mode verl itself cannot run on these inputs
            results[mode] = {"verl_error": f"{type(exc).__name__}: {exc}"}
            continue
        server = FakeServer()
        run = _run(server, f"delegate-{mode}", batch_every=1)
        rv.configure(run, delegate=mode, calls_per_step=1)
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got_loss, got = core_algos.get_policy_loss_fn(rv.LOSS_MODE)(
                **{**inputs, "log_prob": log_prob}, loss_agg_mode="token-mean", config=config
            )
        got_loss.backward()
        run.finish(timeout=10)
        failures = rv.recording_failures()
        results[mode] = {
            "same_loss": bool(torch.equal(want_loss.detach(), got_loss.detach())),
            "same_metrics": _plain(want) == _plain(got),
            "batches": _payloads(server, run),
            "failures": failures,
            "warnings": [str(w.message) for w in caught],
        }
        rv.configure()
    return {"modes": results, "inputs": {k: v.tolist() for k, v in inputs.items()}}


def scenario_tracking(options: dict) -> dict:
    """``VerlTrackingLogger`` inside verl's real ``Tracking``, next to its ``file`` backend."""
    path = Path(tempfile.mkdtemp()) / "exp.jsonl"
    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    server = FakeServer()
    run = _run(server, "tracking")
    tracking = Tracking("verl-side", "tracking", default_backend=["file"], config={"trainer": {"x": 1}})
    tracking.logger["rlvitals"] = rv.VerlTrackingLogger(run=run)
    result = train(functools.partial(losses.ppo_loss, config=actor_config()), steps=3, tracking=tracking)
    tracking.logger["file"].finish()
    tracking.logger["rlvitals"].finish()
    names = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/grad_norm")
    return {
        "steps": result["steps"],
        "file_lines": path.read_text().splitlines(),
        "series": {n: {str(k): v for k, v in server.series(run.id, n).items()} for n in names},
    }


def scenario_overhead(options: dict) -> dict:
    """Seconds of one real ``ppo_loss`` micro-batch call (the forward; backward follows untimed), verl's
    own vs through the recording wrapper, interleaved. Each call is one step (``calls_per_step=1``), so
    with ``batch_every=N`` every N-th wrapped call is sampled and captured; the rest cost the decision."""
    shape_b, resp, prompt = int(options.get("batch", 16)), int(options.get("resp", 1024)), 64
    g = torch.Generator().manual_seed(3)
    attention = torch.ones(shape_b, prompt + resp, dtype=torch.long)
    td = TensorDict(
        {
            "input_ids": torch.randint(1, VOCAB, (shape_b, prompt + resp), generator=g),
            "attention_mask": attention,
            "position_ids": torch.arange(prompt + resp).expand(shape_b, -1).contiguous(),
            "prompts": torch.ones(shape_b, prompt, dtype=torch.long),
            "responses": torch.ones(shape_b, resp, dtype=torch.long),
            "response_mask": torch.ones(shape_b, resp, dtype=torch.long),
            "old_log_probs": -torch.rand(shape_b, resp, generator=g),
            "advantages": torch.randn(shape_b, resp, generator=g),
            "ref_log_prob": -torch.rand(shape_b, resp, generator=g),
        },
        batch_size=[shape_b],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=shape_b * resp, global_batch_size=shape_b)
    values = -torch.rand(shape_b * (prompt + resp), generator=g)
    offsets = td["input_ids"].offsets()
    config = actor_config()
    server = FakeServer()
    every = int(options.get("batch_every", 10))
    run = _run(server, "overhead", batch_every=every)
    rv.configure(run, calls_per_step=1)
    timings: dict[str, list[float]] = {"verl": [], "rlvitals": []}
    for _ in range(int(options.get("reps", 100))):
        for name, fn in (("verl", losses.ppo_loss), ("rlvitals", rv.ppo_loss)):
            lp = torch.nested.nested_tensor_from_jagged(values.clone().requires_grad_(), offsets=offsets)
            ent = torch.nested.nested_tensor_from_jagged(values.abs(), offsets=offsets)
            t0 = time.perf_counter()
            loss, _ = fn(config=config, model_output={"log_probs": lp, "entropy": ent}, data=td)
            timings[name].append(time.perf_counter() - t0)
            loss.backward()
    run.finish(timeout=60)
    sent = len(_payloads(server, run))
    rv.configure()
    return {"timings": timings, "batch_every": every, "shape": [shape_b, resp], "sent": sent}


def scenario_dp2(options: dict) -> dict:
    """One process of a two-process data-parallel job (DP=2): the ``set_loss_fn`` hook against verl's own
    ``ppo_loss`` on the same chunks, under a seq-mean mode (``global_batch_size`` over both ranks) and
    token-mean (``batch_num_tokens`` all-reduced over both ranks)."""
    assert DP == 2 and torch.distributed.get_world_size() == 2
    results = {}
    for mode in ("token-mean", "seq-mean-token-sum"):
        config = actor_config(loss_agg_mode=mode, clip_ratio_high=0.28)
        plain = train(functools.partial(losses.ppo_loss, config=config), steps=2)
        server = FakeServer()
        run = _run(server, f"dp2-{mode}", batch_every=1, batch_micro_batches="all", **options)
        rv.configure(run)
        hooked = train(functools.partial(rv.ppo_loss, config=config), steps=2)
        run.finish(timeout=10)
        results[mode] = {
            "plain": plain,
            "hooked": hooked,
            "batches": _payloads(server, run),
            "failures": rv.recording_failures(),
        }
        rv.configure()
    return {"rank": torch.distributed.get_rank(), "modes": results}


SCENARIOS = {
    "set_loss_fn": scenario_set_loss_fn,
    "registered": scenario_registered,
    "both": scenario_both,
    "groups": scenario_groups,
    "agg_modes": scenario_agg_modes,
    "is_weights": scenario_is_weights,
    "rollout_correction": scenario_rollout_correction,
    "distillation": scenario_distillation,
    "broken": scenario_broken,
    "delegates": scenario_delegates,
    "tracking": scenario_tracking,
    "overhead": scenario_overhead,
    "dp2": scenario_dp2,
}


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    options = json.loads(os.environ.get("RLVITALS_VERL_SIDE_OPTIONS", "{}"))
    import torch.distributed as dist

    init = os.environ.get("RLVITALS_VERL_DP_INIT") or f"file://{tempfile.mktemp()}"
    dist.init_process_group("gloo", init_method=init, rank=RANK, world_size=DP)
    meta = {
        "verl": sys.modules["verl"].__version__,
        "registered": rv.LOSS_MODE in core_algos.POLICY_LOSS_REGISTRY,
    }
    (out / "meta.json").write_text(json.dumps(meta))
    for name in argv[2:] or [n for n in SCENARIOS if n not in ("overhead", "dp2")]:
        started = time.perf_counter()
        result = SCENARIOS[name](options.get(name, {}))
        result["seconds"] = time.perf_counter() - started
        (out / f"{name}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
