"""Real TRL 1.16 ``GRPOTrainer`` runs on a tiny offline model, for the TRL integration tests and benchmark.

Runs inside the TRL side environment (``tests/support/sideenv.py``) with this checkout's rlvitals on
``PYTHONPATH``. Nothing is downloaded: a ``tokenizers`` WordLevel tokenizer wrapped as
``PreTrainedTokenizerFast``, a 2-layer ``LlamaConfig`` (hidden 64, random init), an in-memory
``datasets.Dataset`` of prompts and a reward that counts one word.

    python trl_tiny.py exact   OUT.json              every variant, every micro-batch captured and checked
    python trl_tiny.py recipe  OUT.json              the README recipe against $RLVITALS_URL, several ways
    python trl_tiny.py refuse  OUT.json              losses rlvitals cannot reproduce are refused
    python trl_tiny.py overhead OUT.json STEPS       step times with and without rlvitals
    accelerate launch --multi_gpu --num_processes 2 trl_tiny.py ddp OUT_PREFIX   (use_cpu: gloo)
                                                     one data-parallel job against $RLVITALS_URL
    python trl_tiny.py halt    OUT.json              a run that collapses on purpose, halted ($RLVITALS_URL)
    accelerate launch ... trl_tiny.py ddp-halt OUT_PREFIX    the same on two processes: both stop together

Each mode writes its findings as JSON; the pytest side asserts on them (and on what the server stored).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import typing
import warnings
from pathlib import Path

import torch

WORDS = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"]


def tiny_model_and_tokenizer(seed: int = 0):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config), tokenizer


def dataset(n: int = 16):
    from datasets import Dataset

    return Dataset.from_dict(
        {"prompt": [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(4)) for i in range(n)]}
    )


def count_a(completions, **kwargs):
    return [float(c.split().count("a")) + 0.1 * len(c.split()) for c in completions]


BASE = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    gradient_accumulation_steps=2,
    max_completion_length=6,
    learning_rate=0.05,
    logging_steps=1,
    max_steps=3,
    report_to="none",
    use_cpu=True,
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
    dataloader_num_workers=0,
)

# name -> GRPOConfig overrides. Every loss type and every option that changes TRL's loss.
VARIANTS: dict[str, dict] = {
    "grpo_kl_bias_corrected": dict(loss_type="grpo", beta=0.04, num_iterations=2),
    "grpo_kl_plain": dict(loss_type="grpo", beta=0.04, num_iterations=2, use_bias_correction_kl=False),
    "dapo_default": dict(num_iterations=2),
    "dapo_spg4_ga2": dict(loss_type="dapo", steps_per_generation=4, num_iterations=1, beta=0.04),
    "bnpo": dict(loss_type="bnpo", beta=0.04, num_iterations=2, epsilon_high=0.28),
    "dr_grpo": dict(loss_type="dr_grpo", num_iterations=2, epsilon_high=0.28),
    "luspo_sequence": dict(loss_type="luspo", importance_sampling_level="sequence", num_iterations=2),
    "gspo_grpo_sequence": dict(
        loss_type="grpo", importance_sampling_level="sequence", num_iterations=2, beta=0.04
    ),
    "cispo": dict(loss_type="cispo", epsilon_high=1.1, num_iterations=2, steps_per_generation=4),
    "sapo": dict(loss_type="sapo", num_iterations=2, beta=0.04),
    "vespo": dict(loss_type="vespo", num_iterations=2),
    "delta_two_sided": dict(loss_type="grpo", delta=1.1, epsilon_high=0.28, num_iterations=2),
    "top_entropy_quantile": dict(loss_type="grpo", top_entropy_quantile=0.5, num_iterations=2),
    "entropy_bonus": dict(loss_type="dapo", entropy_coef=0.01, num_iterations=2),
    "entropy_adaptive": dict(
        loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=10.0, num_iterations=2
    ),
    "off_policy_mask": dict(loss_type="grpo", off_policy_mask_threshold=0.001, num_iterations=3),
    "tool_mask": dict(loss_type="dapo", num_iterations=2, beta=0.04),
    "mask_truncated": dict(loss_type="bnpo", mask_truncated_completions=True, num_iterations=2),
}


def trainer_classes():
    from rlvitals.client.integrations.trl import RlvitalsGRPOMixin
    from trl import GRPOTrainer

    class Recipe(RlvitalsGRPOMixin, GRPOTrainer):  # the README recipe
        pass

    class WithToolMask(GRPOTrainer):
        """GRPOTrainer whose batches carry a ``tool_mask`` (as multi-turn tool calls make): TRL's own
        ``_compute_loss`` then trains on ``completion_mask * tool_mask``."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            mask = torch.ones_like(out["completion_mask"])
            mask[:, 1::3] = 0  # every third token came from a tool
            out["tool_mask"] = mask
            return out

    class RecipeWithTools(RlvitalsGRPOMixin, WithToolMask):
        pass

    return Recipe, RecipeWithTools


def spy(cls):
    """``cls`` with the loss ``_compute_loss`` returned recorded per (step, position), outside the mixin."""

    class Spy(cls):
        returned: typing.ClassVar[dict] = {}

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if self.model.training:
                cycle = self.args.steps_per_generation * self.num_iterations
                key = f"{self.state.global_step + 1}:{self._step % cycle}"
                Spy.returned[key] = float(loss.detach())
            return loss

    return Spy


def saved_model(out_dir: str) -> str:
    """The tiny model and tokenizer saved under ``out_dir`` (TRL builds its reference model from a path)."""
    path = Path(out_dir) / "tiny-llama"
    if not (path / "config.json").exists():
        model, tokenizer = tiny_model_and_tokenizer()
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


def make_trainer(cls, overrides: dict, out_dir: str, **kwargs):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig

    path = saved_model(out_dir)
    args = GRPOConfig(output_dir=out_dir, **{**BASE, **overrides})
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    return cls(model=model, args=args, processing_class=tokenizer, reward_funcs=count_a,
               train_dataset=dataset(), **kwargs)  # fmt: skip


def _decode(payload: bytes):
    from safetensors.torch import load

    header = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])["__metadata__"]
    return load(payload), header


def exact(out_path: str) -> None:
    """Every variant, every micro-batch: what TRL returned and logged vs ``trl_loss`` / ``trl_audit``."""
    from rlvitals.analyzers.reference.trl import TrlLossConfig, trl_loss
    from rlvitals.analyzers.verdicts.trl_audit import trl_audit
    from rlvitals.client.integrations.trl import RlvitalsCallback
    from rlvitals.client.settings import ClientSettings
    from rlvitals.client.testing import FakeServer
    from rlvitals.client.values import decode_value

    import rlvitals

    Recipe, RecipeWithTools = trainer_classes()
    results = {}
    for name, overrides in VARIANTS.items():
        server = FakeServer()
        with tempfile.TemporaryDirectory() as tmp:
            run = rlvitals.init(project="trl-exact", name=name, transport=server.transport, spool_dir=tmp,
                                settings=ClientSettings(batch_every=1, batch_micro_batches="all"))  # fmt: skip
            cls = spy(RecipeWithTools if name == "tool_mask" else Recipe)
            cls.returned = {}
            trainer = make_trainer(cls, overrides, tmp, callbacks=[RlvitalsCallback(run)])
            trainer.train()
            run.finish(timeout=30)
        worst, checked, moved, clipped, audits_ok, keys = 0.0, 0, 0, 0, True, set()
        explanations = []
        for payload in server.batches[run.id]:
            tensors, meta = _decode(payload)
            config = TrlLossConfig.from_dict(json.loads(meta["config"]))
            reported = {k: decode_value(v) for k, v in json.loads(meta["reported"]).items()}
            spied = cls.returned[f"{meta['step']}:{meta['micro_batch']}"]
            assert reported["loss"] == spied, (name, reported["loss"], spied)
            names = ("log_prob", "old_log_prob", "advantages", "response_mask", "ref_log_prob", "entropy")
            batch = {k: tensors[k] for k in names if k in tensors}
            again = trl_loss(config, **batch)
            for key, value in reported.items():
                b = again[key]
                err = (
                    0.0
                    if value == b or (math.isnan(value) and math.isnan(b))
                    else abs(value - b) / max(abs(b), 1e-30)
                )
                if abs(value - b) <= 1e-7:  # float32 noise around 0 (e.g. a loss of -1e-9)
                    err = min(err, 0.0)
                worst = max(worst, err)
                keys.add(key)
            checked += 1
            moved += int((batch["log_prob"] - batch["old_log_prob"]).abs().max() > 0)
            clipped += int(reported.get("clip_ratio/region_mean", reported.get("cispo_clip_ratio", 0.0)) > 0)
            report = trl_audit(config, tensors, reported)
            audits_ok &= report.ok
            if not report.ok:
                explanations.append(report.explanation)
        results[name] = {"batches": checked, "worst_rel_err": worst, "off_policy_batches": moved,
                         "clipped_batches": clipped, "audits_ok": audits_ok, "keys": sorted(keys),
                         "explanations": explanations[:2]}  # fmt: skip
    Path(out_path).write_text(json.dumps(results, indent=1))


def recipe(out_path: str) -> None:
    """The README recipe against a real server ($RLVITALS_URL), combined four ways; one run each."""
    from rlvitals.client.integrations.trl import RlvitalsCallback, RlvitalsGRPOMixin
    from trl import GRPOTrainer

    import rlvitals

    Recipe, _ = trainer_classes()
    seen = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["RLVITALS_SPOOL_DIR"] = tmp
        base = {"num_iterations": 2, "max_steps": 4}
        # 1. README recipe, name from GRPOConfig.run_name
        trainer = make_trainer(
            Recipe, {**base, "run_name": "recipe-run-name"}, tmp, callbacks=[RlvitalsCallback(batch_every=1)]
        )
        started_before_loss = {}

        original = GRPOTrainer._compute_loss

        def watch(self, model, inputs):
            if isinstance(self, RlvitalsGRPOMixin):
                started_before_loss.setdefault(self.args.run_name or "env", self.rlvitals_run is not None)
            return original(self, model, inputs)

        GRPOTrainer._compute_loss = watch
        trainer.train()
        # 2. the mixin given an explicit run (the callback added by the mixin shares it)
        run = rlvitals.init(project="default", name="explicit-run", batch_every=1)
        trainer = make_trainer(Recipe, base, tmp, rlvitals_run=run)
        trainer.train()
        seen["explicit_is_shared"] = trainer.rlvitals_run is run
        run.finish(timeout=30)
        # 3. RLVITALS_RUN_NAME, callback given no run, mixin none
        os.environ["RLVITALS_RUN_NAME"] = "env-run"
        trainer = make_trainer(Recipe, base, tmp, callbacks=[RlvitalsCallback(batch_every=1)])
        trainer.train()
        del os.environ["RLVITALS_RUN_NAME"]
        # 4. the callback alone (no mixin): metrics only
        trainer = make_trainer(
            GRPOTrainer, {**base, "run_name": "callback-only"}, tmp, callbacks=[RlvitalsCallback()]
        )
        trainer.train()
        GRPOTrainer._compute_loss = original
        seen["started_before_first_loss"] = started_before_loss
    Path(out_path).write_text(json.dumps(seen))


def refuse(out_path: str) -> None:
    """Losses rlvitals cannot reproduce: refused (warned once, tensors sent without reported numbers)."""
    from rlvitals.client.integrations.trl import NotAudited, RlvitalsGRPOMixin, unaudited_reason
    from rlvitals.client.testing import FakeServer
    from trl import GRPOTrainer

    import rlvitals

    class Custom(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs) * 2  # a user's own loss

    class Refused(RlvitalsGRPOMixin, Custom):
        pass

    out = {}
    server = FakeServer()
    with tempfile.TemporaryDirectory() as tmp:
        run = rlvitals.init(
            project="p", name="refused", transport=server.transport, spool_dir=tmp, batch_every=1
        )
        trainer = make_trainer(Refused, {"max_steps": 2}, tmp, rlvitals_run=run)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        run.finish(timeout=30)
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, NotAudited)]
        out["batches"] = []
        for payload in server.batches[run.id]:
            _, meta = _decode(payload)
            out["batches"].append(
                {"reported": json.loads(meta["reported"]), "config": json.loads(meta["config"])}
            )
        plain = make_trainer(GRPOTrainer, {}, tmp)
        out["plain"] = unaudited_reason(plain, {})
        plain.use_vllm, plain.vllm_importance_sampling_correction = True, True
        out["vllm_is"] = unaudited_reason(plain, {})
        plain.vllm_importance_sampling_correction = False
        plain.off_policy_mask_threshold = 0.5
        out["vllm_off_policy"] = unaudited_reason(plain, {"sampling_per_token_logps": None})
        plain.off_policy_mask_threshold = None
        plain.aux_loss_enabled = True
        out["aux_loss"] = unaudited_reason(plain, {})
    Path(out_path).write_text(json.dumps(out))


def overhead(out_path: str, steps: int) -> None:
    """Per optimizer step: wall time with and without the README recipe (interleaved runs of the same job),
    and the time spent inside rlvitals code itself (mixin around ``_compute_loss`` minus TRL's own, plus
    the callback), for ``batch_every`` 10 (the default) and 1 (a capture every step)."""
    from rlvitals.client.integrations.trl import RlvitalsCallback, RlvitalsGRPOMixin
    from rlvitals.client.testing import FakeServer
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    import rlvitals

    Recipe, _ = trainer_classes()
    inside = {"t": 0.0, "cpu": 0.0}  # wall and trainer-thread CPU time inside rlvitals code this step

    class Clock(TrainerCallback):
        def __init__(self):
            self.steps, self.own, self.cpu, self._t = [], [], [], None

        def on_step_begin(self, args, state, control, **kw):
            inside["t"] = inside["cpu"] = 0.0
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(time.perf_counter() - self._t)
            self.own.append(inside["t"])
            self.cpu.append(inside["cpu"])

    trl_loss_fn = GRPOTrainer._compute_loss
    mixin_loss_fn = RlvitalsGRPOMixin._compute_loss
    on_log = RlvitalsCallback.on_log

    def timed_trl(self, model, inputs):  # TRL's own time, subtracted from the mixin's
        t, c = time.perf_counter(), time.thread_time()
        try:
            return trl_loss_fn(self, model, inputs)
        finally:
            inside["t"] -= time.perf_counter() - t
            inside["cpu"] -= time.thread_time() - c

    def timed_mixin(self, model, inputs):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return mixin_loss_fn(self, model, inputs)
        finally:
            inside["t"] += time.perf_counter() - t
            inside["cpu"] += time.thread_time() - c

    def timed_log(self, *args, **kwargs):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return on_log(self, *args, **kwargs)
        finally:
            inside["t"] += time.perf_counter() - t
            inside["cpu"] += time.thread_time() - c

    settings = {"num_iterations": 2, "max_steps": steps, "beta": 0.04, "loss_type": "grpo"}
    out: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(2):
            for label in ("plain", "batch_every=10", "batch_every=1"):
                clock = Clock()
                if label == "plain":
                    make_trainer(GRPOTrainer, settings, tmp, callbacks=[clock]).train()
                else:
                    server = FakeServer()
                    every = int(label.split("=")[1])
                    run = rlvitals.init(project="bench", name=f"{label}-{rep}", transport=server.transport,
                                        spool_dir=tmp, batch_every=every)  # fmt: skip
                    GRPOTrainer._compute_loss = timed_trl
                    RlvitalsGRPOMixin._compute_loss = timed_mixin
                    RlvitalsCallback.on_log = timed_log
                    try:
                        make_trainer(Recipe, settings, tmp, callbacks=[clock, RlvitalsCallback(run)]).train()
                    finally:
                        GRPOTrainer._compute_loss = trl_loss_fn
                        RlvitalsGRPOMixin._compute_loss = mixin_loss_fn
                        RlvitalsCallback.on_log = on_log
                    run.finish(timeout=30)
                    captured = len(server.batches[run.id])
                entry = out.setdefault(
                    label, {"step_s": [], "rlvitals_s": [], "rlvitals_cpu_s": [], "captured": 0}
                )
                entry["captured"] += 0 if label == "plain" else captured
                entry["step_s"].extend(clock.steps[1:])  # the first step warms up
                entry["rlvitals_s"].extend(clock.own[1:])
                entry["rlvitals_cpu_s"].extend(clock.cpu[1:])
    Path(out_path).write_text(json.dumps(out))


# the data-parallel job's variants: a loss normalised by the global token count (dapo: num_items_in_batch
# over both processes) and one normalised per sequence (grpo with a KL term)
DDP_VARIANTS: dict[str, dict] = {
    "ddp-dapo": dict(num_iterations=2),
    "ddp-grpo-kl": dict(loss_type="grpo", beta=0.04, num_iterations=2, epsilon_high=0.28),
}


def ddp(out_prefix: str) -> None:
    """One process of an ``accelerate launch --num_processes 2`` job: the README recipe against a real
    server ($RLVITALS_URL), every micro-batch captured; each rank writes what ``_compute_loss`` returned
    per (variant, step, micro-batch) to ``OUT_PREFIX.rank<r>.json``."""
    import torch.distributed as dist
    from rlvitals.client.settings import ClientSettings

    import rlvitals

    Recipe, _ = trainer_classes()
    returned: dict[str, float] = {}
    rank = int(os.environ["RANK"])  # accelerate launch (torch.distributed.run) sets it for each process
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in DDP_VARIANTS.items():
            cls = spy(Recipe)
            cls.returned = {}
            run = rlvitals.init(
                project="ddp", name=name, spool_dir=f"{tmp}/spool-{rank}",
                settings=ClientSettings(batch_every=1, batch_micro_batches="all"),
            )  # fmt: skip
            # per-device batch 4 x 2 processes = 8 completions = 2 groups of 4 per step
            trainer = make_trainer(
                cls, {**overrides, "run_name": name, "max_steps": 2}, tmp, rlvitals_run=run
            )
            assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes
            assert trainer.accelerator.process_index == rank
            trainer.train()
            run.finish(timeout=60)
            returned.update({f"{name}:{key}": value for key, value in cls.returned.items()})
        backend = dist.get_backend() if dist.is_initialized() else None
    Path(f"{out_prefix}.rank{rank}.json").write_text(json.dumps({"returned": returned, "backend": backend}))


def _rlvitals_log_records() -> list[str]:
    """Every message the ``rlvitals`` loggers emit from now on (what the trainer's log shows of a halt)."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("rlvitals").addHandler(Keep())
    return records


def halt(out_path: str) -> None:
    """A run that collapses on purpose (learning rate 1e4: after the first update the policy is uniform
    and every gradient is exactly 0 while the rewards still differ) with ``halt_on=("critical",)`` and
    ``save_on_halt``, against $RLVITALS_URL: where it stopped, what the trainer logged, the checkpoint."""
    from rlvitals.client.integrations.trl import RlvitalsCallback
    from trl import GRPOTrainer

    records = _rlvitals_log_records()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["RLVITALS_SPOOL_DIR"] = tmp
        callback = RlvitalsCallback(halt_on=("critical",), save_on_halt=True)
        overrides = {
            "learning_rate": 1e4,
            "max_steps": 40,
            "num_iterations": 1,
            "run_name": "halt-on-collapse",
        }
        trainer = make_trainer(GRPOTrainer, overrides, tmp, callbacks=[callback])
        started = time.perf_counter()
        trainer.train()
        result = {
            "global_step": trainer.state.global_step,
            "max_steps": trainer.args.max_steps,
            "halted": callback.halted,
            "log": records,
            "checkpoints": sorted(p.name for p in Path(tmp).glob("checkpoint-*")),
            "logged_steps": [e["step"] for e in trainer.state.log_history if "loss" in e],
            "seconds": time.perf_counter() - started,
        }
    Path(out_path).write_text(json.dumps(result))


def ddp_halt(out_prefix: str) -> None:
    """One process of an ``accelerate launch --num_processes 2`` job that collapses on purpose (as
    ``halt``), with ``halt_on=("critical",)`` and ``save_on_halt``, and no run name shared by the
    processes: rank 0 records the run, rank 1 records none yet must stop with it. Each rank writes
    where it stopped to ``OUT_PREFIX.rank<r>.json``."""
    import torch.distributed as dist
    from rlvitals.client.integrations.trl import RlvitalsCallback
    from trl import GRPOTrainer

    rank = int(os.environ["RANK"])
    records = _rlvitals_log_records()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["RLVITALS_SPOOL_DIR"] = f"{tmp}/spool-{rank}"
        callback = RlvitalsCallback(halt_on=("critical",), save_on_halt=True)
        overrides = {"learning_rate": 1e4, "max_steps": 40, "num_iterations": 1, "run_name": None}
        out_dir = f"{tmp}/out"  # every rank writes the (collective) checkpoint to the same place
        if rank == 0:
            Path(out_dir).mkdir()
        dist.barrier() if dist.is_initialized() else None
        trainer = make_trainer(GRPOTrainer, overrides, out_dir, callbacks=[callback])
        assert trainer.accelerator.num_processes == 2
        trainer.train()
        result = {
            "global_step": trainer.state.global_step,
            "max_steps": trainer.args.max_steps,
            "halted": callback.halted,
            "run": None if callback.run_ref.current is None else callback.run_ref.current.name,
            "log": records,
            "checkpoints": sorted(p.name for p in Path(out_dir).glob("checkpoint-*")),
        }
    Path(f"{out_prefix}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    warnings.simplefilter("default")
    mode = sys.argv[1]
    if mode == "exact":
        exact(sys.argv[2])
    elif mode == "recipe":
        recipe(sys.argv[2])
    elif mode == "refuse":
        refuse(sys.argv[2])
    elif mode == "ddp":
        ddp(sys.argv[2])
    elif mode == "overhead":
        overhead(sys.argv[2], int(sys.argv[3]))
    elif mode == "halt":
        halt(sys.argv[2])
    elif mode == "ddp-halt":
        ddp_halt(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
