"""Real OpenRLHF 0.11.2 actor training steps with ``RecordingPolicyLoss`` in them; run in the openrlhf side env.

``python tests/client/openrlhf_side.py OUT_DIR`` (``tests/client/test_client_integrations_openrlhf.py`` runs
it; ``PYTHONPATH`` = ``rlvitals_path()``). Writes ``OUT_DIR/<scenario>.json``: what OpenRLHF returned and the
batches the rlvitals client sent (safetensors payloads, hex).

OpenRLHF's own code here: ``ActorPPOTrainer.training_step`` (the call of ``actor_loss_fn`` with
``rollout_log_probs`` and the loss normalisers, the KL and entropy terms, the metrics), ``PolicyLoss``
(``ppo`` and ``gspo``, dual clip, the vLLM importance-sampling correction), ``aggregate_loss``,
``compute_approx_kl``, ``iter_grad_accum_global_norm`` (the per-optimizer-step token counts) and the
``Experience`` dataclass. Not OpenRLHF's: the epoch/micro-batch loop of ``ppo_train`` (10 lines, below:
the real one needs CUDA for its replay buffer and device), the model (a logit table instead of a
DeepSpeed ``Actor``), plain SGD behind a two-method ``strategy``. Inert stubs stand for what those modules
import at top level and never use on this path: deepspeed, peft, transformers, flash_attn, ray, vllm,
aiohttp, pylatexenc, torchdata, PIL, tqdm, packaging.
"""

from __future__ import annotations

import importlib.metadata
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

import verl_loader  # noqa: E402  (its inert-module finder; nothing of verl is imported here)

verl_loader._STUBBED = (
    "deepspeed", "peft", "transformers", "flash_attn", "ray", "vllm", "aiohttp", "pylatexenc", "torchdata",
    "PIL", "tqdm", "packaging",
)  # fmt: skip
sys.meta_path.insert(0, verl_loader._InertFinder())

from openrlhf.models import PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer  # noqa: E402
from openrlhf.utils.loss_utils import iter_grad_accum_global_norm  # noqa: E402
from rlvitals.client.integrations import openrlhf as ro  # noqa: E402
from rlvitals.client.settings import ClientSettings  # noqa: E402
from rlvitals.client.testing import FakeServer  # noqa: E402

import rlvitals  # noqa: E402

VOCAB = 16
BATCH = 8
MICRO_BATCH = 2  # micro_train_batch_size
ACCUMULATION = 2  # micro-batches per optimizer step
EPOCHS = 2  # max_epochs: 8 loss calls per training step
CALLS = EPOCHS * BATCH // MICRO_BATCH
LR = 10.0
# data-parallel processes of this job (scenario ``dp2``: two processes, RANK 0 and 1, one gloo group) and ours
DP = int(os.environ.get("RLVITALS_OPENRLHF_DP", "1"))
RANK = int(os.environ.get("RANK", "0"))


class TinyActor(torch.nn.Module):
    """OpenRLHF's ``Actor.forward(sequences, action_mask, ...)`` contract on a (vocab, vocab) logit table."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g) * 0.5)

    def forward(
        self, sequences, action_mask, attention_mask=None, return_output=False, return_entropy=False, **_
    ):
        logp = torch.log_softmax(self.table[sequences[:, :-1]], dim=-1)
        log_probs = logp.gather(-1, sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        width = action_mask.shape[1]
        output = types.SimpleNamespace(entropy=entropy, aux_loss=None)
        return (log_probs[:, -width:], output) if return_output else log_probs[:, -width:]


class Strategy:
    """The four things ``training_step`` asks of OpenRLHF's DeepspeedStrategy, for one CPU process."""

    ring_attn_group = None
    accumulated_gradient = ACCUMULATION

    def __init__(self) -> None:
        self.calls = 0

    def backward(self, loss, model, optimizer) -> None:
        loss.backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model") -> None:
        self.calls += 1
        if self.calls % ACCUMULATION == 0:  # DeepSpeed steps once per accumulation window
            if DP > 1:  # and averages the gradients over the data-parallel ranks first
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM)
                    p.grad /= DP
            optimizer.step()
            optimizer.zero_grad()

    def get_grad_norm(self, model) -> float:
        return 0.0


def _args(**actor):
    return types.SimpleNamespace(
        train=types.SimpleNamespace(dynamic_batch_enable=False, max_epochs=EPOCHS),
        actor=types.SimpleNamespace(entropy_coef=actor.get("entropy_coef", 0.01), aux_loss_coef=0.0),
        algo=types.SimpleNamespace(
            kl=types.SimpleNamespace(use_loss=True, init_coef=0.01, estimator="k3", unbiased_gradient=False)
        ),
    )


def experiences(step: int, actor: TinyActor) -> list[Experience]:
    """One rollout, split into micro-batches as OpenRLHF's replay buffer hands them out (unshuffled); each
    data-parallel rank generates its own."""
    g = torch.Generator().manual_seed(1000 + step + 7919 * RANK)
    prompt, width = 3, 6
    sequences = torch.randint(1, VOCAB, (BATCH, prompt + width), generator=g)
    lengths = torch.randint(2, width + 1, (BATCH,), generator=g)
    action_mask = torch.arange(width).expand(BATCH, -1) < lengths.unsqueeze(1)
    with torch.no_grad():
        old = actor(sequences, action_mask) * action_mask
    out = []
    for start in range(0, BATCH, MICRO_BATCH):
        rows = slice(start, start + MICRO_BATCH)
        out.append(
            Experience(
                sequences=sequences[rows],
                attention_mask=torch.ones_like(sequences[rows]),
                action_mask=action_mask[rows],
                action_log_probs=old[rows],
                base_action_log_probs=(old[rows] + 0.1 * torch.randn(old[rows].shape, generator=g))
                * action_mask[rows],
                rollout_log_probs=(old[rows] + 0.05 * torch.randn(old[rows].shape, generator=g))
                * action_mask[rows],
                advantages=torch.randn(MICRO_BATCH, 1, generator=g).expand(-1, width) * action_mask[rows],
                info={},
            )
        )
    return out


def train(loss_fn, *, steps: int, seed: int = 0, on_step=None) -> dict:
    """``steps`` OpenRLHF actor updates: ``ppo_train``'s loop over epochs and micro-batches, with its real
    ``iter_grad_accum_global_norm`` and ``training_step``."""
    torch.manual_seed(seed)
    actor = TinyActor(seed)
    optim = torch.optim.SGD(actor.parameters(), lr=LR)
    trainer = types.SimpleNamespace(
        actor=actor,
        actor_loss_fn=loss_fn,
        actor_optim=optim,
        actor_scheduler=types.SimpleNamespace(get_last_lr=lambda: [LR]),
        strategy=Strategy(),
        args=_args(),
        aux_loss=False,
        ema_model=None,
        replay_buffer=None,
    )
    done = []
    for step in range(1, steps + 1):
        if on_step is not None:
            on_step(step)
        batch = experiences(step, actor)
        statuses = []
        for _epoch in range(EPOCHS):
            micro = iter_grad_accum_global_norm(
                batch, trainer.strategy, ACCUMULATION, lambda e: e.action_mask
            )
            for index, (experience, info) in enumerate(micro):
                status = ActorPPOTrainer.training_step(trainer, experience, 0.01, index, info)
                statuses.append(
                    {
                        k: float(v)
                        for k, v in status["metrics"].items()
                        if hasattr(v, "item") and v.numel() == 1
                    }
                )
        done.append({"step": step, "statuses": statuses})
    return {"steps": done, "table": actor.table.detach().tolist()}


def _run(server: FakeServer, name: str, **settings):
    return rlvitals.init(
        project="openrlhf-side", name=name, transport=server.transport, spool_dir=Path(tempfile.mkdtemp()),
        settings=ClientSettings(**settings),
    )  # fmt: skip


def _payloads(server: FakeServer, run) -> list[str]:
    return [p.hex() for p in server.batches.get(run.id, [])]


LOSSES = {
    "ppo": {},
    "asymmetric_dual_clip": {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip": 3.0},
    "seq_mean": {"token_level_loss": False},
    "gspo": {"policy_loss_type": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
    "vllm_is": {
        "is_correction_level": "token",
        "is_correction_mode": "clip",
        "is_correction_threshold": (0.5, 5.0),
    },
}


def scenario_losses() -> dict:
    """Each PolicyLoss setting: 4 (ppo: 6) steps unwrapped, then wrapped (same seed), every step sampled."""
    results = {}
    for name, kwargs in LOSSES.items():
        steps = 6 if name == "ppo" else 4  # ppo: audits reach positions 4-5, epoch 1
        plain = train(PolicyLoss(**kwargs), steps=steps)
        server = FakeServer()
        run = _run(server, name, batch_every=1)
        clock = {"step": 0}
        wrapped = ro.RecordingPolicyLoss(PolicyLoss(**kwargs), run, step_fn=lambda c=clock: c["step"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hooked = train(wrapped, steps=steps, on_step=lambda s, c=clock: c.__setitem__("step", s))
        run.finish(timeout=10)
        results[name] = {
            "plain": plain,
            "hooked": hooked,
            "batches": _payloads(server, run),
            "failures": wrapped.failures.count,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, ro.RecordingError)],
        }
    return results


def scenario_dp2() -> dict:
    """One rank of a two-process job: PolicyLoss (token-mean and per-sequence), unwrapped then wrapped; the
    normalisers come from OpenRLHF's ``iter_grad_accum_global_norm``, all-reduced over both ranks."""
    results = {}
    for name in ("ppo", "seq_mean"):
        plain = train(PolicyLoss(**LOSSES[name]), steps=2)
        server = FakeServer()
        run = _run(server, f"dp2-{name}", batch_every=1, batch_micro_batches="all")
        clock = {"step": 0}
        wrapped = ro.RecordingPolicyLoss(PolicyLoss(**LOSSES[name]), run, step_fn=lambda c=clock: c["step"])
        hooked = train(wrapped, steps=2, on_step=lambda s, c=clock: c.__setitem__("step", s))
        run.finish(timeout=10)
        results[name] = {
            "plain": plain,
            "hooked": hooked,
            "batches": _payloads(server, run),
            "failures": wrapped.failures.count,
        }
    return {"rank": torch.distributed.get_rank(), "losses": results}


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if DP > 1:
        torch.distributed.init_process_group(
            "gloo", init_method=os.environ["RLVITALS_OPENRLHF_DP_INIT"], rank=RANK, world_size=DP
        )
        (out / "dp2.json").write_text(json.dumps(scenario_dp2()))
        return 0
    version = importlib.metadata.version("openrlhf")
    (out / "meta.json").write_text(json.dumps({"openrlhf": version, "calls_per_step": CALLS}))
    started = time.perf_counter()
    result = scenario_losses()
    result["seconds"] = time.perf_counter() - started
    (out / "losses.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
