"""A genuine GRPO trainer that runs on a CPU in seconds, instrumented with rlvitals.

The task is verifiable: the prompt is a target digit ``t``; the policy writes 1–8 digits and an end token,
and earns reward 1 when the digit sum ends in ``t`` (``sum % 10 == t``), else 0. The policy is a small MLP
that reads (target, running sum mod 10, position) and outputs logits over 10 digits + EOS; it has to
learn to steer the running sum and stop at the right moment. Random play scores ~0.1.

Each step: sample ``groups`` prompts × ``group_size`` responses, compute GRPO advantages within each
group (``rlvitals.analyzers.grpo_advantages``), keep the sampling log-probs as ``old_log_prob`` and the
frozen initial policy's as ``ref_log_prob``, then run ``ppo_epochs`` epochs of ``mini_batches`` clipped
updates with verl's loss (``rlvitals.analyzers.ppo_loss``: clip + dual clip + low_var_kl KL loss + entropy,
token-mean), each mini-batch holding whole groups. Scalars go to ``run.log`` every step under verl's names;
the first update's micro-batch (on-policy) and the last one's (clipped, after every epoch of reuse) go to
``run.log_batch`` (the client samples every ``batch_every`` steps, the first call of a step by default).
The ``goes-unstable`` preset trains healthily for half its steps, then with the unstable settings, and
reports one batch with the wrong aggregation mode on purpose (``misreport_step``).

    python examples/tiny_grpo.py                         # healthy: reward rises
    python examples/tiny_grpo.py --preset unstable       # high lr + many epochs: the health rules fire
    python examples/tiny_grpo.py --preset goes-unstable  # healthy, then unstable from mid-run
    python examples/tiny_grpo.py --url http://127.0.0.1:8000 --name my-run
    python examples/tiny_grpo.py --bench                 # step time with and without the hook
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from rlvitals.analyzers import LossConfig, group_diagnostics, grpo_advantages, ppo_loss
from torch import nn

VOCAB = 11  # digits 0-9 and EOS
EOS = 10


@dataclass(frozen=True)
class TinyGRPOConfig:
    """Trainer knobs; the loss ones use verl's names."""

    steps: int = 60
    groups: int = 8  # prompts per step
    group_size: int = 16  # responses per prompt (GRPO's G)
    max_len: int = 8
    hidden: int = 64
    lr: float = 4e-3
    ppo_epochs: int = 4
    mini_batches: int = 2
    clip_ratio: float = 0.07
    clip_ratio_c: float = 3.0
    kl_loss_coef: float = 0.4
    entropy_coeff: float = 0.02
    temperature: float = 1.0
    seed: int = 0
    # A run that goes wrong mid-way: from step ceil(steps * then_from) on, train with ``then``'s
    # lr, epochs, clip and loss settings (a learning-rate bump, more reuse of each batch).
    then: TinyGRPOConfig | None = None
    then_from: float = 0.5
    # A trainer bug on purpose: at this step the batch's reported metrics are computed with another
    # aggregation mode than the config it declares (the audit names it); 0 = never.
    misreport_step: int = 0
    misreport_agg_mode: str = "seq-mean-token-mean"

    def switch_step(self) -> int | None:
        """The first step trained with ``then`` (None: the run keeps its settings)."""
        return None if self.then is None else max(2, math.ceil(self.steps * self.then_from))

    def loss_config(self) -> LossConfig:
        return LossConfig(
            clip_ratio=self.clip_ratio,
            clip_ratio_c=self.clip_ratio_c,
            loss_agg_mode="token-mean",
            use_kl_loss=True,
            kl_loss_type="low_var_kl",
            kl_loss_coef=self.kl_loss_coef,
            entropy_coeff=self.entropy_coeff,
        )

    def run_config(self) -> dict[str, Any]:
        """The run's config in verl's layout (the health rules read ppo_epochs and batch sizes)."""
        batch = self.groups
        return {
            "trainer": "examples/tiny_grpo.py",
            "tiny_grpo": dataclasses.asdict(self),
            "data": {"train_batch_size": batch},
            "actor_rollout_ref": {
                "rollout": {"n": self.group_size},
                "actor": {
                    "ppo_epochs": self.ppo_epochs,
                    "ppo_mini_batch_size": batch // self.mini_batches,
                    "optim": {"lr": self.lr},
                    **self.loss_config().to_dict(),
                },
            },
        }


_UNSTABLE = dict(
    lr=4e-2, ppo_epochs=16, clip_ratio=0.2, clip_ratio_c=10.0, kl_loss_coef=0.01, entropy_coeff=0.0
)

PRESETS: dict[str, TinyGRPOConfig] = {
    "healthy": TinyGRPOConfig(),
    # Ten times the learning rate, four times the epochs over each batch, the usual clip range (0.2, dual
    # clip at 10) instead of the tight one, a token KL coefficient and no entropy bonus: every update
    # overshoots and nothing pulls the policy back. It still learns, but the rules fire and stay firing.
    "unstable": TinyGRPOConfig(**_UNSTABLE),
    # The demo's story: healthy settings for the first half, then the unstable ones (alerts start
    # mid-chart), and at step 30 one batch reported with the wrong aggregation mode (an audit mismatch).
    "goes-unstable": TinyGRPOConfig(steps=60, then=TinyGRPOConfig(**_UNSTABLE), misreport_step=30),
}


class Policy(nn.Module):
    """Logits over the next token from (target, running sum mod 10, position); ``(batch, len) -> (batch, len, 11)``."""

    def __init__(self, hidden: int, max_len: int) -> None:
        super().__init__()
        self.target = nn.Embedding(10, hidden)
        self.total = nn.Embedding(10, hidden)
        self.position = nn.Embedding(max_len, hidden)
        self.mlp = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, VOCAB))

    def forward(self, target: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(totals.shape[1]).expand_as(totals)
        features = self.target(target)[:, None, :] + self.total(totals) + self.position(positions)
        logits = self.mlp(features)
        logits[:, 0, EOS] = float("-inf")  # at least one digit
        return logits


@dataclass
class Rollout:
    """One step's samples. Tensors are ``(batch, max_len)`` unless noted."""

    target: torch.Tensor  # (batch,)
    tokens: torch.Tensor
    totals: torch.Tensor  # running sum mod 10 *before* each token (the policy's input)
    mask: torch.Tensor  # bool: generated tokens, EOS included
    rewards: torch.Tensor  # (batch,)
    group: torch.Tensor  # (batch,) int64 prompt ids


def rollout(policy: Policy, config: TinyGRPOConfig, generator: torch.Generator) -> Rollout:
    batch = config.groups * config.group_size
    prompts = torch.randint(0, 10, (config.groups,), generator=generator)
    target = prompts.repeat_interleave(config.group_size)
    tokens = torch.full((batch, config.max_len), EOS, dtype=torch.long)
    totals = torch.zeros(batch, config.max_len, dtype=torch.long)
    mask = torch.zeros(batch, config.max_len, dtype=torch.bool)
    alive = torch.ones(batch, dtype=torch.bool)
    total = torch.zeros(batch, dtype=torch.long)
    with torch.no_grad():
        for t in range(config.max_len):
            totals[:, t] = total
            logits = policy(target, totals[:, : t + 1])[:, t] / config.temperature
            token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)
            token = torch.where(alive, token, torch.full_like(token, EOS))
            tokens[:, t] = token
            mask[:, t] = alive
            total = torch.where(alive & (token != EOS), (total + token) % 10, total)
            alive = alive & (token != EOS)
    digits = torch.where(mask & (tokens != EOS), tokens, torch.zeros_like(tokens))
    rewards = (digits.sum(-1) % 10 == target).float()
    group = torch.arange(config.groups).repeat_interleave(config.group_size)
    return Rollout(target, tokens, totals, mask, rewards, group)


def token_log_probs(policy: Policy, data: Rollout, rows: torch.Tensor | slice = slice(None)):
    """``(log_prob, entropy)`` of the sampled tokens, each ``(rows, max_len)``."""
    logits = policy(data.target[rows], data.totals[rows])
    logp = torch.log_softmax(logits, -1)
    log_prob = logp.gather(-1, data.tokens[rows].unsqueeze(-1)).squeeze(-1)
    probs = logp.exp()
    entropy = -(probs * torch.where(probs > 0, logp, torch.zeros_like(logp))).sum(-1)
    return log_prob, entropy


@dataclass
class History:
    """What a training run produced, per step."""

    reward: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    hook_seconds: list[float] = field(default_factory=list)  # time spent inside run.log / run.log_batch


class Trainer:
    """GRPO on the digit-sum task; ``step()`` runs one rollout + update and returns its metrics."""

    def __init__(self, config: TinyGRPOConfig, run: Any = None) -> None:
        self.config = config
        self.run = run
        torch.manual_seed(config.seed)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.policy = Policy(config.hidden, config.max_len)
        self.reference = copy.deepcopy(self.policy).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=config.lr)
        self.loss_config = config.loss_config()
        self.history = History()
        self.global_step = 0

    def _switch(self) -> None:
        """From here on train with ``config.then``'s settings (the rollout shape stays)."""
        late = self.config.then
        keep = {
            f: getattr(self.config, f) for f in ("steps", "groups", "group_size", "max_len", "hidden", "seed")
        }
        self.config = dataclasses.replace(late, **keep, misreport_step=self.config.misreport_step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr
        self.loss_config = self.config.loss_config()

    def step(self) -> dict[str, float]:
        started = time.perf_counter()
        if self.global_step + 1 == self.config.switch_step():
            self._switch()
        config, step = self.config, self.global_step + 1
        data = rollout(self.policy, config, self.generator)
        token_rewards = torch.zeros(data.mask.shape)
        last = data.mask.sum(-1) - 1
        token_rewards[torch.arange(len(last)), last] = data.rewards
        advantages, _ = grpo_advantages(token_rewards, data.mask, data.group)
        with torch.no_grad():
            old_log_prob, _ = token_log_probs(self.policy, data)
            ref_log_prob, _ = token_log_probs(self.reference, data)

        sums: dict[str, float] = {}
        updates = 0
        hook = 0.0
        rows_of_group = torch.arange(data.mask.shape[0]).view(config.groups, config.group_size)
        for epoch in range(config.ppo_epochs):
            # mini-batches of whole groups (as verl's contiguous split of rollout.n-interleaved samples)
            order = rows_of_group[torch.randperm(config.groups, generator=self.generator)].flatten()
            chunks = order.chunk(config.mini_batches)
            for index, rows in enumerate(chunks):
                log_prob, entropy = token_log_probs(self.policy, data, rows)
                tensors = {
                    "log_prob": log_prob,
                    "old_log_prob": old_log_prob[rows],
                    "advantages": advantages[rows],
                    "response_mask": data.mask[rows],
                    "ref_log_prob": ref_log_prob[rows],
                    "entropy": entropy,
                }
                loss, metrics = ppo_loss(self.loss_config, **tensors)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                # The first update (on-policy: log_prob == old_log_prob, nothing clipped) and the last
                # (after ppo_epochs of reuse: clipped tokens, a real ppo_kl) go to the audits; the
                # client keeps the first unless ClientSettings(batch_micro_batches="all").
                last_update = epoch == config.ppo_epochs - 1 and index == len(chunks) - 1
                if self.run is not None and (updates == 0 or last_update):
                    hook_started = time.perf_counter()
                    reported = metrics
                    if step == config.misreport_step and last_update:
                        wrong = dataclasses.replace(self.loss_config, loss_agg_mode=config.misreport_agg_mode)
                        reported = ppo_loss(wrong, **{k: v.detach() for k, v in tensors.items()})[1]
                    self.run.log_batch(
                        step,
                        **{k: v.detach() for k, v in tensors.items()},
                        token_level_rewards=token_rewards[rows],
                        group_index=data.group[rows],
                        config=self.loss_config,
                        reported=reported,
                    )
                    hook += time.perf_counter() - hook_started
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + float(value)
                updates += 1

        groups = group_diagnostics(token_rewards, data.mask, data.group).to_dict()
        out = {f"actor/{name}": total / updates for name, total in sums.items()}
        out["actor/entropy"] = out.pop("actor/entropy_loss")
        out["critic/score/mean"] = float(data.rewards.mean())
        out["response_length/mean"] = float(data.mask.sum(-1).float().mean())
        out["grpo/zero_variance_frac"] = groups["zero_variance_frac"]
        if self.run is not None:
            hook_started = time.perf_counter()
            self.run.log(out, step)
            hook += time.perf_counter() - hook_started
        self.global_step = step
        self.history.reward.append(out["critic/score/mean"])
        self.history.metrics.append(out)
        self.history.step_seconds.append(time.perf_counter() - started)
        self.history.hook_seconds.append(hook)
        return out

    def train(self, steps: int | None = None, *, progress=None) -> History:
        for _ in range(self.config.steps if steps is None else steps):
            metrics = self.step()
            if progress is not None:
                progress(self.global_step, metrics)
        return self.history


def train(config: TinyGRPOConfig, run: Any = None, *, progress=None) -> History:
    """Train from scratch with ``config``; logs to ``run`` when given."""
    return Trainer(config, run).train(progress=progress)


def bench(config: TinyGRPOConfig, steps: int = 60, spool_dir: str | None = None) -> dict[str, float]:
    """The hook's cost, two ways, with an offline run (the client doing all it does online but the HTTP):

    - ``hook_pct``: time spent inside ``run.log``/``run.log_batch`` per step over the median step time —
      what the training loop pays. Per step = median over plain steps + median over the steps whose batch
      is captured / ``batch_every`` (medians, so a preemption on a shared machine is not billed to the hook);
    - ``overhead_pct``: median step time of a hooked and a bare trainer stepped alternately (same seed,
      same work) — includes the background thread's share of the CPU, but noisy on a shared machine.
    """
    import rlvitals

    every = 10
    with tempfile.TemporaryDirectory() as tmp:
        run = rlvitals.init(
            project="bench",
            name="tiny-grpo-bench",
            mode="offline",
            spool_dir=spool_dir or tmp,
            batch_every=every,
        )
        hooked, bare = Trainer(config, run), Trainer(config, None)
        for _ in range(3):  # warm up both
            hooked.step(), bare.step()
        for _ in range(steps):
            bare.step()
            hooked.step()
        run.finish(timeout=10)
    with_hook = statistics.median(hooked.history.step_seconds[3:])
    without = statistics.median(bare.history.step_seconds[3:])
    timed = list(enumerate(hooked.history.hook_seconds, start=1))[3:]
    plain = statistics.median(h for step, h in timed if step % every)
    captured = [h for step, h in timed if step % every == 0]
    hook = plain * (1 - 1 / every) + (statistics.median(captured) if captured else plain) / every
    return {
        "step_s_without_hook": without,
        "step_s_with_hook": with_hook,
        "hook_s_per_step": hook,
        "hook_pct": 100.0 * hook / with_hook,
        "overhead_pct": 100.0 * (with_hook - without) / without,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="healthy")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--ppo-epochs", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--url", help="rlvitals server (default: RLVITALS_URL); omit with --no-log")
    parser.add_argument("--project", default="tiny-grpo")
    parser.add_argument("--name")
    parser.add_argument("--offline", action="store_true", help="spool only; `rlvitals sync` sends it later")
    parser.add_argument("--no-log", action="store_true", help="train without the rlvitals client")
    parser.add_argument("--bench", action="store_true", help="measure the hook's overhead and exit")
    args = parser.parse_args(argv)
    overrides = {
        key: value
        for key, value in {
            "steps": args.steps,
            "lr": args.lr,
            "ppo_epochs": args.ppo_epochs,
            "seed": args.seed,
        }.items()
        if value is not None
    }
    config = dataclasses.replace(PRESETS[args.preset], **overrides)
    torch.set_num_threads(1)  # a tiny model: more threads only add synchronisation
    if args.bench:
        result = bench(config, steps=config.steps)
        print(
            f"tiny_grpo step: {result['step_s_with_hook'] * 1e3:.2f} ms; inside the hook "
            f"{result['hook_s_per_step'] * 1e6:.0f} us per step = {result['hook_pct']:.3f}% of the step\n"
            f"A/B median step time: {result['step_s_without_hook'] * 1e3:.2f} ms without the hook, "
            f"{result['step_s_with_hook'] * 1e3:.2f} ms with it ({result['overhead_pct']:+.2f}%, noisy)"
        )
        return 0
    run = None
    if not args.no_log:
        import rlvitals

        run = rlvitals.init(
            url=args.url,
            project=args.project,
            name=args.name or f"tiny-grpo-{args.preset}",
            config=config.run_config(),
            mode="offline" if args.offline else "online",
        )

    def progress(step: int, metrics: dict[str, float]) -> None:
        if step % 10 == 0 or step == 1:
            print(
                f"step {step:4d}  reward {metrics['critic/score/mean']:.3f}  "
                f"pg_clipfrac {metrics['actor/pg_clipfrac']:.3f}  ppo_kl {metrics['actor/ppo_kl']:+.4f}  "
                f"entropy {metrics['actor/entropy']:.3f}  kl_loss {metrics['actor/kl_loss']:.4f}"
            )

    history = train(config, run, progress=progress)
    first, last = history.reward[:10], history.reward[-10:]
    print(f"reward: first 10 steps {sum(first) / len(first):.3f}, last 10 steps {sum(last) / len(last):.3f}")
    if run is not None:
        print(run.finish())
    return 0


if __name__ == "__main__":
    sys.exit(main())
