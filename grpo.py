# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""GRPO, the algorithm: group advantages, the clipped loss, log-probs, and the update.

Group Relative Policy Optimization (DeepSeekMath) samples G responses per prompt, scores them, and
uses each response's reward relative to its own group as the advantage: no value model. The policy
is updated with PPO's clipped surrogate on every response token.

Contents, the math first (pure functions of tensors plus a mask; slow loop references in the tests):
  group_advantages     rewards (N,) in groups of G -> (r - group mean) / (group std + eps)
  grpo_loss            clipped surrogate + kl_coef * k3 per token, aggregated by a named mode
  off_policy_logprobs  which log-probs the ratio is taken against: behaviour, or decoupled proximal
  token_logprobs       log softmax(logits / temperature) at the targets
then the update, which any data-parallel model (FSDP2 or plain) can use:
  pad_responses        prompt + response rows, right-padded, with the mask of response positions
  length_chunks        rows split into k micro-batches of similar length (less padding)
  reference_logprobs   a frozen model's log-probs of every response token, chunk by chunk, no grad
  grpo_update          optimizer steps on a batch: micro-batches accumulated, the mean over the global
                       batch whatever each rank holds, then clip and step
  supervised_step      one cross-entropy step on reference answers (the warm-up)

Departures from the GRPO paper, on purpose:
1. The loss is a mean over every response token of the global batch ("token-mean", as DAPO and
   Dr. GRPO advise), not a mean of per-sequence means; `loss_agg="seq-mean-token-mean"` gives the
   paper's form.
2. The KL penalty is off by default (kl_coef 0); with it on it is the k3 estimator, exp(d) - d - 1
   with d = ref - logprob, added per token.
3. `old_logprobs` are the behaviour log-probs the sampler recorded, not recomputed: with one update per
   batch the ratio is 1 up to float error.

    python -m pytest tests/test_grpo.py -k "loss or advantages"

Shapes: N samples, G group size, B rows on this rank, T padded tokens, n_i response tokens of row i.
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

LOSS_AGGS = ("token-mean", "seq-mean-token-mean")


# ----------------------------------------------------------------------------- the math
def group_advantages(rewards, group_size, eps=1e-6, scale_by_std=True):
    """rewards (N,) in contiguous groups of group_size -> advantages (N,):
    (r - group mean) / (group std + eps), std unbiased; r - group mean if not scale_by_std (Dr. GRPO)."""
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)                                               # (N/G, G)
    adv = r - r.mean(-1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(-1, keepdim=True) + eps)
    return adv.view(-1)


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps=0.2, kl_coef=0.0,
              loss_agg="token-mean", token_weights=None):
    """Clipped surrogate plus kl_coef * k3, per token, then aggregated.
    logprobs, old_logprobs, ref_logprobs, mask (B, T); advantages (B,). Returns (loss, metrics).
    token_weights (B, T), optional: multiplies each token's surrogate (the decoupled objective's
    pi_prox / pi_behaviour, see off_policy_logprobs)."""
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -20, 20))              # (B, T)
    adv = advantages[:, None].to(logprobs.dtype)                                  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.min(unclipped, clipped)                                    # (B, T)
    if token_weights is not None:
        per_token = per_token * token_weights
    if ref_logprobs is not None:
        d = torch.clamp(ref_logprobs - logprobs, -20, 20)
        k3 = torch.exp(d) - d - 1                                                 # (B, T)
    elif kl_coef != 0:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
    else:
        k3 = torch.zeros_like(logprobs)
    per_token = per_token + kl_coef * k3
    n_tok = mask.sum().clamp(min=1)
    if loss_agg == "token-mean":
        loss = (per_token * mask).sum() / n_tok
    elif loss_agg == "seq-mean-token-mean":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    else:
        raise ValueError(f"loss_agg={loss_agg!r}; valid: {', '.join(LOSS_AGGS)}")
    with torch.no_grad():
        metrics = {"clip_frac": float(((clipped < unclipped).to(mask.dtype) * mask).sum() / n_tok),
                   "ratio_mean": float((ratio * mask).sum() / n_tok),
                   "k3_mean": float((k3 * mask).sum() / n_tok)}
    return loss, metrics


def off_policy_logprobs(behaviour, proximal=None, decoupled=False, max_weight=None):
    """Which log-probs grpo_loss takes as old_logprobs, and a per-token weight. behaviour, proximal (B, T).

    Coupled (default): old = behaviour, the recorded sampler log-probs (tokens of a partial rollout come
    from several versions); the clipped ratio pi_theta / pi_behaviour carries the whole correction.
    Decoupled (AReaL): old = proximal, recomputed with the current weights before the update, so the clip
    is around a recent policy; weight = pi_prox / pi_behaviour (optionally capped) multiplies each
    token's surrogate. Returns (old (B, T), weight (B, T) or None)."""
    if not decoupled:
        return behaviour, None
    if proximal is None:
        raise ValueError("decoupled=True needs proximal log-probs recomputed with the current weights")
    w = torch.exp(torch.clamp(proximal - behaviour, -20, 20))                     # (B, T)
    return proximal, (w if max_weight is None else w.clamp(max=max_weight))


def token_logprobs(logits, targets, temperature=1.0):
    """log softmax(logits / temperature) at targets: (B, T, V), (B, T) -> (B, T)."""
    logp = F.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------- batches
@dataclass
class Samples:
    """One rank's share of a batch. Rows of one prompt group need not be together here: the advantages
    were computed where the whole group was."""
    prompts: list            # (B,) of (P_i,) int64
    responses: list          # (B,) of (n_i,) int64
    old_logprobs: list       # (B,) of (n_i,) float32, the behaviour log-probs
    advantages: torch.Tensor  # (B,)

    def lengths(self):
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]


@dataclass
class GRPOConfig:
    clip_eps: float = 0.2          # PPO clip range
    kl_coef: float = 0.0           # weight of the k3 penalty (needs reference log-probs)
    loss_agg: str = "token-mean"   # one of LOSS_AGGS
    temperature: float = 1.0       # the sampler's: log-probs are of softmax(logits / temperature)
    updates_per_batch: int = 1     # optimizer steps (mini-batches) per batch
    micro_batches: int = 4         # length-sorted chunks per mini-batch, gradients accumulated
    grad_clip: float = 1.0         # global gradient norm clip
    decoupled: bool = False        # clip around recomputed proximal log-probs (off_policy_logprobs)

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg={self.loss_agg!r}; valid: {', '.join(LOSS_AGGS)}")


def pad_responses(prompts, responses, *per_token, pad_id=0):
    """Right-pad prompt + response rows. Returns tokens (B, T), a mask (B, T-1) over the positions
    that predict response tokens, and each per-token field (list of (n_i,)) aligned to that mask."""
    B, T = len(prompts), max(len(p) + len(r) for p, r in zip(prompts, responses))
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T - 1, dtype=torch.bool)
    fields = [torch.zeros(B, T - 1) for _ in per_token]
    for b, (p, r) in enumerate(zip(prompts, responses)):
        tokens[b, :len(p) + len(r)] = torch.cat([p, r])
        span = slice(len(p) - 1, len(p) + len(r) - 1)  # position t predicts token t + 1
        mask[b, span] = True
        for f, values in zip(fields, per_token):
            f[b, span] = values[b]
    return tokens, mask, fields


def length_chunks(rows, lengths, k):
    """Split rows into exactly k chunks of similar length (sorted), so that each forward pads only to its
    own chunk's longest row. Every rank must run the same number of FSDP forwards and backwards, so an
    empty chunk becomes a stand-in row with weight 0. Returns [(rows, is_stand_in)]."""
    by_len = sorted(rows, key=lambda i: lengths[i])
    return [(list(c), False) if len(c) else ([0], True) for c in np.array_split(np.array(by_len, dtype=int), k)]


def sequence_logprobs(model, tokens, temperature):
    """tokens (B, T) -> log-prob of each next token (B, T-1)."""
    return token_logprobs(model(tokens[:, :-1]), tokens[:, 1:], temperature)


def _all_sum(values, device, group):
    """A few floats summed over the group in one collective (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t.tolist()


def _world(group):
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _reshard(model):
    """FSDP2 leaves modules unsharded after a no-grad forward: reshard them (a plain model: nothing)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# ----------------------------------------------------------------------------- the update
@torch.no_grad()
def chunk_logprobs(model, samples, cfg, device):
    """Log-probs of every response token under `model`, in the update's length chunks: (B,) of (n_i,)."""
    out = [None] * len(samples.prompts)
    for rows, _ in length_chunks(range(len(out)), samples.lengths(), cfg.micro_batches):
        tokens, mask, _ = pad_responses([samples.prompts[i] for i in rows], [samples.responses[i] for i in rows])
        lp = sequence_logprobs(model, tokens.to(device), cfg.temperature)           # (b, T-1)
        for j, i in enumerate(rows):
            out[i] = lp[j][mask[j].to(device)].cpu()                                 # (n_i,)
    _reshard(model)
    return out


def grpo_update(model, optimizer, samples, cfg, device, group=None, ref_logprobs=None, clip_grads=None):
    """updates_per_batch optimizer steps on this rank's samples, data parallel over `group` (its gradients
    averaged over the group: FSDP2's reduce-scatter, or whatever the model does). ref_logprobs: (B,) of
    (n_i,), needed when kl_coef > 0. clip_grads(model, max_norm), optional: replaces
    clip_grad_norm_ (expert parallelism clips over experts that FSDP does not hold).
    Returns sums over this rank's rows, to be summed over the ranks and divided (`batch_means`)."""
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs")
    prox_logprobs = chunk_logprobs(model, samples, cfg, device) if cfg.decoupled else None
    sums = dict.fromkeys(("loss", "clip_frac", "ratio_mean", "k3_mean", "items", "tokens"), 0.0)
    for mini in np.array_split(np.arange(len(samples.prompts)), cfg.updates_per_batch):
        _accumulate(model, samples, mini, cfg, device, group, ref_logprobs, prox_logprobs, sums)
        if clip_grads is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        else:
            clip_grads(model, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return sums


def _accumulate(model, samples, mini, cfg, device, group, ref_lp, prox_lp, sums):
    """Forward and backward of one mini-batch in length-sorted micro-batches; adds to sums."""
    token_mean = cfg.loss_agg == "token-mean"
    n_local = sum(len(samples.responses[i]) for i in mini) if token_mean else len(mini)
    n_global, = _all_sum([n_local], device, group)  # the loss is a mean over the global mini-batch
    chunks = length_chunks(mini, samples.lengths(), cfg.micro_batches)
    for c, (rows, stand_in) in enumerate(chunks):
        if isinstance(model, FSDPModule):  # reduce-scatter once, after the last micro-batch; the
            # parameters stay gathered until then (the usual trade: full-size grads while accumulating)
            model.set_requires_gradient_sync(c == len(chunks) - 1)
            model.set_reshard_after_backward(c == len(chunks) - 1)
        fields = [samples.old_logprobs] + [f for f in (ref_lp, prox_lp) if f is not None]
        tokens, mask, per_token = pad_responses([samples.prompts[i] for i in rows],
                                                [samples.responses[i] for i in rows],
                                                *[[f[i] for i in rows] for f in fields])
        tokens, mask = tokens.to(device), mask.to(device)
        old, *rest = [f.to(device) for f in per_token]                               # (b, T-1) each
        ref = rest.pop(0) if ref_lp is not None else None
        old, weights = off_policy_logprobs(old, rest.pop(0) if cfg.decoupled else None, cfg.decoupled)
        lp = sequence_logprobs(model, tokens, cfg.temperature)                        # (b, T-1)
        loss, m = grpo_loss(lp, old, ref, samples.advantages[rows].to(device), mask, cfg.clip_eps,
                            cfg.kl_coef, cfg.loss_agg, weights)
        n_items = int(mask.sum()) if token_mean else len(rows)
        # This chunk's share of the global mean (the gradient is averaged over the group's ranks).
        scale = 0.0 if stand_in else n_items * _world(group) / max(n_global, 1.0)
        (loss * scale).backward()
        if not stand_in:
            n_tok = float(mask.sum())
            sums["loss"] += loss.item() * n_items
            sums["items"] += n_items
            sums["tokens"] += n_tok
            for key in ("clip_frac", "ratio_mean", "k3_mean"):
                sums[key] += m[key] * n_tok


def batch_means(sums):
    """Sums over every rank's rows -> the batch's means: the loss per item (token or sequence), the
    rest per token."""
    items, tokens = max(sums["items"], 1.0), max(sums["tokens"], 1.0)
    return {"loss": sums["loss"] / items, "clip_frac": sums["clip_frac"] / tokens,
            "ratio_mean": sums["ratio_mean"] / tokens, "k3_mean": sums["k3_mean"] / tokens}


def supervised_step(model, optimizer, prompts, targets, device, grad_clip, group=None, clip_grads=None):
    """One cross-entropy step on (prompt, target) pairs, the mean over the group's global batch."""
    tokens, mask, _ = pad_responses(prompts, targets)
    tokens, mask = tokens.to(device), mask.to(device)
    nll = -sequence_logprobs(model, tokens, 1.0)                                     # (B, T-1)
    n_local = int(mask.sum())
    n_global, = _all_sum([n_local], device, group)
    loss = (nll * mask).sum() / mask.sum() * (n_local * _world(group) / max(n_global, 1.0))
    loss.backward()
    if clip_grads is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        clip_grads(model, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
