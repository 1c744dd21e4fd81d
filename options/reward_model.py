# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""An outcome reward model (ORM): a small transformer that scores (prompt, response) -> P(correct).

An outcome reward model reads a whole (prompt, response) and says how likely the response is right,
as the verifiers of Cobbe et al. (2021) do. This one is trained before RL on samples of the policy
itself, each labelled 0/1 by the task's rule, then frozen; during RL its probability is thresholded
into a 0/1 reward. Where the rule is free, the learned model makes scoring a real forward pass.

It can be gamed. The policy is rewarded for what the model scores high, not for what the rule
accepts, and the model is right only near the samples it was trained on. As RL moves the policy off
that distribution, it can find responses that score high and that the rule rejects (reward hacking,
or overoptimisation: Gao et al. 2022), and the agreement measured at training time no longer holds.
Measure `agreement` on fresh samples of the current policy, not on the training set.

Departures from an ORM in a production pipeline, on purpose:
1. The labels come from a rule (here task.score, an exact match), not from people: agreement with
   the truth can be measured exactly.
2. A small bidirectional encoder trained from scratch, not the policy's trunk with a value head:
   this file imports nothing of the project. Its positions are rotary (RoPE), counted outward from
   the boundary: the prompt's last token and the response's first are both 0. A reversal copies the
   prompt's j-th token from its end into the response's j-th place, so each answer token and the
   token it must match sit at one relative offset whatever j and the prompt's length: one attention
   pattern checks every digit, lengths rare in training included. This is the one bias chosen for
   the task (an answer that copies its prompt in order would count the prompt from its start). The
   head reads the mean and the max over the real tokens: one wrong digit is one token's feature,
   which the max keeps and a mean over 30 tokens dilutes. (Learned absolute offsets and a mean
   alone learnt a string's length but not its digits: one digit changed went unseen.)
3. A binary cross-entropy on each sample (a verifier), not a Bradley-Terry loss on pairs: every
   label is absolute. The loss is class-balanced: the policy's samples can be 80% right, and a model
   that always says "right" would then have 80% accuracy and learn nothing.

    python -m pytest tests/test_reward_model.py

Using this file elsewhere: torch only. Rows are 1-D int64 token tensors; labels are 0/1. Example
(tests/test_copy_alone.py runs it in a folder that holds only this file):

    import torch
    from reward_model import RMConfig, RewardModel, agreement, score, train_reward_model

    torch.manual_seed(0)
    # 3 tokens in 2..7 -> their reverse or a shuffle, labelled by the rule (reversed or not)
    def toy(n):
        prompts = [torch.randint(2, 8, (3,)) for _ in range(n)]
        responses = [p.flip(0) if i % 2 else p[torch.randperm(3)] for i, p in enumerate(prompts)]
        labels = [float(torch.equal(r, p.flip(0))) for p, r in zip(prompts, responses)]
        return prompts, responses, labels
    cfg = RMConfig(vocab_size=8, max_len=6, d_model=32, n_layers=1, steps=300, batch=64)
    model = RewardModel(cfg)
    print(train_reward_model(model, cfg, *toy(1024), device="cpu"))  # about 2 s on one core
    prompts, responses, labels = toy(512)  # held out
    held = agreement(score(model, prompts, responses), torch.tensor(labels))
    print("held out:", held)  # accuracy about 1.0
    assert held["accuracy"] > 0.9

Shapes: B rows, T tokens (prompt then response, right-padded), D model width, N training samples.
"""
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class RMConfig:
    vocab_size: int       # token ids are in [0, vocab_size)
    max_len: int          # the longest prompt + response row it reads
    d_model: int = 64     # model width D
    n_layers: int = 2     # pre-norm encoder blocks
    n_heads: int = 4      # attention heads; must divide d_model
    pad: int = 0          # the padding token id
    # training
    steps: int = 300      # optimizer steps
    batch: int = 64       # rows per step, drawn with replacement
    lr: float = 3e-3      # AdamW peak learning rate, cosine to 0 over the steps
    seed: int = 0         # seeds the draw of rows (the initial weights follow torch's global seed)

    def __post_init__(self):
        names = ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "steps", "batch")
        sizes = {k: getattr(self, k) for k in names}
        bad = [f"{k}={v}" for k, v in sizes.items() if not v >= 1]
        if bad:
            raise ValueError(f"{', '.join(bad)}: every size must be >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if not 0 <= self.pad < self.vocab_size:
            raise ValueError(f"pad={self.pad} must be a token id "
                             f"in [0, vocab_size={self.vocab_size})")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr} must be finite and > 0")


class Block(nn.Module):
    """Pre-norm encoder block: x + attention(norm(x)) over the real tokens, x + MLP(norm(x))."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x, real, rotate):
        B, T, D = x.shape
        hd = D // self.n_heads  # head width
        qkv = self.qkv(self.norm1(x)).view(B, T, 3, self.n_heads, hd)  # (B, T, 3, H, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                           # 3 x (B, H, T, hd)
        q, k = rotate(q), rotate(k)  # positions enter as rotations: q.k sees their difference
        mask = real[:, None, None, :]                                  # (B, 1, 1, T)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)    # (B, H, T, hd)
        x = x + self.out(a.transpose(1, 2).reshape(B, T, D))           # (B, T, D)
        return x + self.mlp(self.norm2(x))                             # (B, T, D)


def rotary(positions, head_dim, base=100.0):
    """Rotary positions (RoPE): a function that turns each (B, H, T, hd) query or key by angles
    proportional to its token's position (B, T), so that a query-key product depends on their
    positions' difference only."""
    half = head_dim // 2
    freq = base ** -(torch.arange(half, device=positions.device) / half)   # (hd/2,)
    angle = positions[:, None, :, None].float() * freq                     # (B, 1, T, hd/2)
    cos, sin = angle.cos(), angle.sin()

    def rotate(x):
        x1, x2 = x[..., :half], x[..., half:]                              # 2 x (B, H, T, hd/2)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)   # (B, H, T, hd)
    return rotate


class RewardModel(nn.Module):
    """tokens (B, T), lengths (B,), starts (B,) -> logits (B,): P(correct) = sigmoid(logit)."""

    def __init__(self, cfg: RMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.side = nn.Embedding(2, cfg.d_model)  # 0: a prompt token, 1: a response token
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.norm_mean, self.norm_max = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(2 * cfg.d_model, 1)

    def forward(self, tokens, lengths, starts):
        B, T = tokens.shape
        if T > self.cfg.max_len:
            raise ValueError(f"rows of {T} tokens: longer than max_len={self.cfg.max_len}")
        columns = torch.arange(T, device=tokens.device)[None, :]      # (1, T)
        real = columns < lengths[:, None]                             # (B, T) False at pads
        response = columns >= starts[:, None]                         # (B, T)
        # outward from the boundary: the prompt's last token and the response's first are both 0
        distance = torch.where(response, columns - starts[:, None], starts[:, None] - 1 - columns)
        rotate = rotary(distance, self.cfg.d_model // self.cfg.n_heads)
        x = self.embed(tokens) + self.side(response.long())           # (B, T, D)
        for block in self.blocks:
            x = block(x, real, rotate)                                # (B, T, D)
        mean = (x * real[..., None]).sum(1) / lengths[:, None]        # (B, D) over the real tokens
        most = x.masked_fill(~real[..., None], -math.inf).amax(1)     # (B, D) over the real tokens
        pooled = torch.cat([self.norm_mean(mean), self.norm_max(most)], -1)  # (B, 2D)
        return self.head(pooled).squeeze(-1)                          # (B,)


def pack(prompts, responses, pad, max_len=None):
    """B prompts and B responses (1-D int64) -> tokens (B, T) [prompt, response, pad...], lengths
    (B,) of the rows, starts (B,) the column of each response's first token; T is the longest row. A
    row longer than max_len (None: no limit), or an empty one, is refused."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    for what, seqs in (("prompts", prompts), ("responses", responses)):
        if torch.is_tensor(seqs):  # a padded (B, T) batch: its pads would be read as tokens
            raise ValueError(f"{what} is a {tuple(seqs.shape)} tensor: pass a list of 1-D token "
                             "tensors, each unpadded (its own tokens only)")
    rows = [torch.cat([p, r]) for p, r in zip(prompts, responses)]           # B x (P_i + n_i,)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)          # (B,)
    if max_len is not None and lengths.max() > max_len:
        i = int(lengths.argmax())
        raise ValueError(f"row {i} has {int(lengths[i])} tokens: longer than max_len={max_len}")
    if lengths.min() < 1 or min(len(r) for r in responses) < 1:
        i = min(range(len(rows)), key=lambda j: len(responses[j]))
        raise ValueError(f"row {i} has an empty response: there is nothing to score")
    tokens = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)  # (B, T)
    starts = torch.tensor([len(p) for p in prompts], dtype=torch.long)       # (B,)
    return tokens, lengths, starts


def check_labels(labels):
    """(N,) labels as float 0/1: anything else (the +-1 convention, a soft label) is refused."""
    labels = torch.as_tensor(labels, dtype=torch.float32)
    odd = labels[(labels != 0) & (labels != 1)].unique()
    if labels.dim() != 1 or len(odd):
        raise ValueError(f"labels of shape {tuple(labels.shape)} with values {odd.tolist()[:4]}: "
                         "they must be a 1-D list of 0 (wrong) and 1 (right); for -1/+1 labels "
                         "pass (y + 1) / 2")
    return labels


def class_weights(labels):
    """(N,) per-row loss weights: each class weighs half of the total, whatever its share."""
    positive = labels.mean().item()                                           # share of label 1
    if positive in (0.0, 1.0):
        raise ValueError(f"every label is {int(positive)}: a reward model needs both classes")
    return torch.where(labels > 0.5, 0.5 / positive, 0.5 / (1 - positive))  # (N,)


def train_reward_model(model, cfg, prompts, responses, labels, device, on_step=None):
    """AdamW (cosine to 0) on the class-balanced BCE, cfg.steps steps of cfg.batch rows drawn by a
    generator seeded by cfg.seed; the model is left frozen (eval mode, no grad). on_step(step),
    optional, is called before each step (a heartbeat for ranks that wait). Returns the figures
    of the training."""
    t0 = time.perf_counter()
    tokens, lengths, starts = pack(prompts, responses, cfg.pad, cfg.max_len)  # (N, T), (N,), (N,)
    labels = check_labels(labels)                                             # (N,)
    weights = class_weights(labels)                                           # (N,)
    tokens, lengths, starts = tokens.to(device), lengths.to(device), starts.to(device)
    labels, weights = labels.to(device), weights.to(device)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)  # the draw of rows, on CPU
    for step in range(cfg.steps):
        if on_step is not None:
            on_step(step)
        rows = torch.randint(len(labels), (cfg.batch,), generator=gen).to(device)  # (batch,)
        T = int(lengths[rows].max())  # trim the padding no drawn row needs (a device-to-host sync)
        logits = model(tokens[rows, :T], lengths[rows], starts[rows])         # (batch,)
        loss = F.binary_cross_entropy_with_logits(logits, labels[rows], weight=weights[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        cosine = 0.5 * (1 + math.cos(math.pi * step / cfg.steps))  # 1 to 0 over the steps
        opt.param_groups[0]["lr"] = cfg.lr * cosine
        opt.step()
    opt.zero_grad(set_to_none=True)  # frozen: no gradient stays allocated
    model.eval().requires_grad_(False)
    probs = score(model, prompts, responses)                                  # (N,)
    return {"rm/loss": loss.item(),
            "rm/train_agreement": agreement(probs, labels.cpu())["accuracy"],
            "rm/seconds": time.perf_counter() - t0}


@torch.no_grad()
def score(model, prompts, responses, batch_size=256):
    """(B,) float P(correct) for each (prompt, response), on CPU; batch_size rows per forward."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = slice(i, i + batch_size)
        rows = pack(prompts[chunk], responses[chunk], model.cfg.pad, model.cfg.max_len)
        logits = model(*(t.to(device) for t in rows))                         # (b,)
        out.append(torch.sigmoid(logits).float().cpu())
    return torch.cat(out) if out else torch.zeros(0)                          # (B,)


def agreement(probs, labels, threshold=0.5):
    """How the thresholded scores agree with the 0/1 labels: accuracy, true-positive rate (of the
    right responses, the share scored right), true-negative rate, the share of 1 labels, and n."""
    probs, labels = torch.as_tensor(probs), torch.as_tensor(labels)
    if probs.dim() != 1 or probs.shape != labels.shape:  # (B, 1) against (B,) would broadcast
        raise ValueError(f"probs {tuple(probs.shape)} and labels {tuple(labels.shape)}: both must "
                         "be 1-D of one length (squeeze a (B, 1) output)")
    said = probs >= threshold  # (B,) scored right
    truth = labels > 0.5       # (B,) right by the rule
    def rate(mask):
        return (said[mask] == truth[mask]).float().mean().item() if mask.any() else float("nan")
    return {"accuracy": rate(torch.ones_like(truth)), "true_positive_rate": rate(truth),
            "true_negative_rate": rate(~truth), "positive_share": truth.float().mean().item(),
            "n": len(truth)}
