"""Real rollout-vs-training mismatches from a tiny PyTorch language model, for tests and screenshots.

A small causal transformer (plain PyTorch, seeded) learns by REINFORCE with group-normalised rewards
(GRPO-shaped batches) to emit a target token. Each step a *sampler* draws the responses and records
the log-probs of what it sampled (the rollout engine's ``rollout_log_probs``); the *trainer* scores
the same tokens in float32 (``old_log_prob``) and takes one Adam step. Three samplers:

- ``matched``: the trainer's own float32 weights (the healthy case: the two sides agree);
- ``bf16``: a bfloat16 copy of the current weights (precision mismatch, re-synced every step);
- ``stale``: a float32 copy whose weight sync stops after ``sync_until`` steps (stale weights).

Nothing is injected: every gap comes from the arithmetic or the weights the sampler really used.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 48
TARGET = 7
PROMPT = 4


class TinyLM(nn.Module):
    def __init__(
        self,
        vocab: int = VOCAB,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        width: int = 128,
        scale: float = 1.0,
    ):
        super().__init__()
        self.scale = scale  # logits of a trained LM are tens, not the ~1 of a fresh init
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(width, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(dim),
                    "qkv": nn.Linear(dim, 3 * dim),
                    "out": nn.Linear(dim, dim),
                    "norm2": nn.LayerNorm(dim),
                    "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
                }
            )
            for _ in range(layers)
        )
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``(batch, seq)`` -> logits ``(batch, seq, vocab)``."""
        b, t = ids.shape
        x = self.embed(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["out"](att.transpose(1, 2).reshape(b, t, -1))
            x = x + block["mlp"](block["norm2"](x))
        return self.head(self.norm(x)) * self.scale


def token_log_probs(model: nn.Module, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Log-probs ``(batch, seq - start)`` of ``ids[:, start:]`` under ``model`` (in the model's dtype)."""
    logits = model(ids)[:, start - 1 : -1]
    return (
        torch.log_softmax(logits.float() if logits.dtype == torch.float32 else logits, dim=-1)
        .gather(-1, ids[:, start:].unsqueeze(-1))
        .squeeze(-1)
    )


@dataclass
class Step:
    step: int
    tensors: dict[str, torch.Tensor]
    reward: float


def run(
    kind: str,
    *,
    steps: int = 16,
    prompts: int = 2,
    group: int = 4,
    length: int = 32,
    lr: float = 1e-3,
    sync_until: int = 5,
    scale: float = 12.0,
    seed: int = 0,
) -> Iterator[Step]:
    """Train ``steps`` steps with sampler ``kind`` (``matched``, ``bf16``, ``stale``); yields each step's
    batch (float32 tensors named as ``log_batch`` takes them) before the update."""
    if kind not in ("matched", "bf16", "stale"):
        raise ValueError(f"kind must be matched, bf16 or stale; got {kind!r}")
    torch.manual_seed(seed)
    model = TinyLM(scale=scale)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    sampler = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        if kind == "bf16":
            sampler = copy.deepcopy(model).to(torch.bfloat16)
        elif kind == "matched" or step < sync_until:
            sampler = copy.deepcopy(model)  # the weight sync; a stale sampler stops getting it
        batch = prompts * group
        prompt = torch.randint(0, VOCAB, (prompts, PROMPT), generator=gen).repeat_interleave(group, 0)
        ids = prompt
        with torch.no_grad():
            rollout = []
            for _ in range(length):  # the rollout engine: sample, and record the sampled token's log-prob
                logp = torch.log_softmax(sampler(ids)[:, -1], dim=-1)
                nxt = torch.multinomial(logp.float().exp(), 1, generator=gen)
                rollout.append(logp.gather(-1, nxt).float())
                ids = torch.cat([ids, nxt], dim=1)
            rollout_log_probs = torch.cat(rollout, dim=1)
            old = token_log_probs(model, ids, PROMPT)
        reward = (ids[:, PROMPT:] == TARGET).float().mean(dim=1)
        grouped = reward.view(prompts, group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(batch)
        mask = torch.ones(batch, length)
        yield Step(
            step,
            {
                "log_prob": old.clone(),
                "old_log_prob": old,
                "advantages": adv.unsqueeze(1).expand(batch, length).contiguous(),
                "response_mask": mask,
                "rollout_log_probs": rollout_log_probs,
                "token_level_rewards": torch.nn.functional.pad(reward.unsqueeze(1), (length - 1, 0)),
                "group_index": torch.arange(prompts).repeat_interleave(group),
            },
            float(reward.mean()),
        )
        logp = token_log_probs(model, ids, PROMPT)
        loss = -(adv.unsqueeze(1) * logp).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
