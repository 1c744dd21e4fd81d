# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""GRPO, the algorithm: group advantages, the clipped loss, log-probs, and the update.

Group Relative Policy Optimization (DeepSeekMath) samples G responses per prompt, scores them, and
uses each response's reward relative to its own group as the advantage: no value model. The policy
is updated with PPO's clipped surrogate on every response token.

Contents, the math first (pure functions of tensors plus a mask; slow loop references in the tests):
  group_advantages     rewards (N,) in groups of G -> (r - group mean) / (group std + eps), or
                       another of ESTIMATORS (finish_advantages: the part that needs the batch)
  grpo_loss, aggregate clipped surrogate + kl_coef * k3 per token, then a mean named in LOSS_AGGS
  off_policy_logprobs  which log-probs the ratio is taken against: behaviour, or decoupled proximal
  token_logprobs       log softmax(logits / temperature) at the targets
then the update, which any data-parallel model (FSDP2 or plain) can use:
  Samples, GRPOConfig  one rank's share of a batch, and the update's settings
  pad_responses        prompt + response rows, right-padded, with the mask of response positions
  length_chunks        rows split into k micro-batches of similar length (less padding)
  chunk_logprobs       a model's log-probs of every response token, chunk by chunk, no grad (the
                       frozen reference's, or the current weights' for the decoupled objective)
  grpo_update          optimizer steps on a batch: micro-batches accumulated, the mean over the
                       global batch whatever each rank holds, then clip and step
  batch_means          the update's sums over every rank -> the batch's figures
  cosine_lr            the learning rate along the run: a cosine down to a floor
  supervised_step      one cross-entropy step on reference answers (the warm-up)
Helpers: batch_normalize, sequence_logprobs, logprobs_and_entropy, loss_mask, finite_everywhere.

Departures from the GRPO paper, on purpose:
1. The loss is a mean over every response token of the global batch ("token-mean", as DAPO and
   Dr. GRPO advise), not a mean of per-sequence means. `loss_agg="seq-mean-token-mean"` gives the
   paper's form.
2. The KL penalty is off unless kl_coef > 0 (the run's default in plumbing/config.py turns it on).
   It is the k3 estimator, exp(d) - d - 1 with d = ref - logprob, added per token.
3. `old_logprobs` are the behaviour log-probs the sampler recorded, not recomputed. Under staleness
   S >= 1 (the run's default is S = 1) a sample's tokens may come from policy versions up to S
   behind the weights trained, and there the ratio pi_theta / pi_behaviour is not 1: the clipped
   ratio corrects for that lag. A token of the current version has ratio 1, up to float error.

    python -m pytest tests/test_grpo.py -k "loss or advantages"

Shapes: N samples, G group size, B rows on this rank, T padded tokens, n_i response tokens of row i.
"""
import math
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

ESTIMATORS = ("grpo", "dr-grpo", "rloo", "reinforce++")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- the math
def group_advantages(rewards, group_size, estimator="grpo", eps=1e-6):
    """rewards (N,) in contiguous groups of group_size -> advantages (N,), the part computed where
    the whole group is:
      grpo         (r - group mean) / (group std + eps), std unbiased (DeepSeekMath)
      dr-grpo      r - group mean, without the std scaling that favours groups of nearly equal
                   rewards (Dr. GRPO)
      rloo         r - the mean of the OTHER G - 1 rewards of the group, which is
                   G / (G - 1) (r - group mean)
      reinforce++  r itself: the baseline is the whole batch's, applied by batch_normalize where the
                   whole batch is (REINFORCE++)"""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}; valid: {', '.join(ESTIMATORS)}")
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"{group_size}")
    if group_size == 1 and estimator != "reinforce++":
        raise ValueError(f"group_size 1: a group of one has no baseline of its own (its std and "
                         f"its leave-one-out mean are undefined) for estimator {estimator!r}; use "
                         "groups of 2 or more, or estimator 'reinforce++' (a baseline from the "
                         "whole batch)")
    if estimator == "reinforce++" or rewards.numel() == 0:  # an empty share: nothing to baseline
        return rewards.clone()
    r = rewards.view(-1, group_size)                                               # (N/G, G)
    adv = r - r.mean(-1, keepdim=True)
    if estimator == "grpo":
        adv = adv / (r.std(-1, keepdim=True) + eps)
    elif estimator == "rloo":
        adv = adv * group_size / (group_size - 1)
    return adv.view(-1)


def batch_normalize(values, device="cpu", group=None, eps=1e-6):
    """(v - mean) / (std + eps) over the whole batch, whose rows are spread over the group's ranks
    (each passes its own (B,)): one all-reduce of the count, sum and sum of squares. The std is
    unbiased."""
    v = values.double()
    n, total, squares = _all_sum([v.numel(), float(v.sum()), float((v * v).sum())], device, group)
    mean = total / max(n, 1)
    var = (squares - n * mean * mean) / max(n - 1, 1)
    return ((v - mean) / (max(var, 0.0) ** 0.5 + eps)).to(values.dtype)


def finish_advantages(advantages, estimator, device="cpu", group=None):
    """The part of an estimator that needs the whole batch, on a trainer's share of it:
    reinforce++'s batch normalisation (collective over the group). The other estimators are done
    where their group was."""
    return batch_normalize(advantages, device, group) if estimator == "reinforce++" else advantages


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps=0.2, kl_coef=0.0,
              loss_agg="token-mean", token_weights=None, clip_eps_high=None, norm_len=None):
    """Clipped surrogate plus kl_coef * k3, per token, then aggregated.
    logprobs, old_logprobs, ref_logprobs, mask (B, T); advantages (B,). Returns (loss, metrics).
    clip_eps_high: the ratio's upper clip, 1 + clip_eps_high (DAPO's clip-higher); default clip_eps.
    token_weights (B, T), optional: multiplies each token's surrogate (the decoupled objective's
    pi_prox / pi_behaviour, see off_policy_logprobs).
    loss_agg: token-mean (over every token), seq-mean-token-mean (per response, then over the
    responses that have a token), seq-mean-token-sum-norm (per response, its sum over norm_len, a
    constant such as the response budget, then over the responses: Dr. GRPO's unbiased
    normaliser)."""
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -20, 20))              # (B, T)
    adv = advantages[:, None].to(logprobs.dtype)                                  # (B, 1)
    unclipped = ratio * adv
    high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv
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
    loss = aggregate(per_token, mask, loss_agg, norm_len)
    n_tok = mask.sum().clamp(min=1)
    with torch.no_grad():
        metrics = {"clip_frac": float(((clipped < unclipped).to(mask.dtype) * mask).sum() / n_tok),
                   "ratio_mean": float((ratio * mask).sum() / n_tok),
                   "k3_mean": float((k3 * mask).sum() / n_tok)}
    return loss, metrics


def aggregate(per_token, mask, loss_agg, norm_len=None):
    """per_token, mask (B, T) -> the scalar loss, by the named mode (see grpo_loss). Rows with no
    loss token count in no mean."""
    if loss_agg == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (per_token * mask).sum(-1)                                          # (B,)
    has = mask.sum(-1) > 0                                                        # (B,)
    if loss_agg == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif loss_agg == "seq-mean-token-sum-norm":
        if not norm_len or norm_len < 1:
            raise ValueError(f"loss_agg 'seq-mean-token-sum-norm' needs norm_len >= 1 "
                             f"(got {norm_len!r})")
        per_seq = per_seq / norm_len
    else:
        raise ValueError(f"loss_agg={loss_agg!r}; valid: {', '.join(LOSS_AGGS)}")
    return per_seq[has].sum() / has.sum().clamp(min=1)


def off_policy_logprobs(behaviour, proximal=None, decoupled=False, max_weight=None):
    """Which log-probs grpo_loss takes as old_logprobs, and a per-token weight.

    Coupled (default): old = behaviour, the recorded sampler log-probs (tokens of a partial rollout
    come from several versions). The clipped ratio pi_theta / pi_behaviour carries the whole
    correction.
    Decoupled (AReaL): old = proximal, recomputed with the current weights before the update, so
    the clip is around a recent policy. weight = pi_prox / pi_behaviour (optionally capped at
    max_weight: truncated importance sampling) multiplies each token's surrogate.
    behaviour, proximal (B, T) -> (old (B, T), weight (B, T) or None)."""
    if not decoupled:
        return behaviour, None
    if proximal is None:
        raise ValueError("decoupled=True needs proximal log-probs recomputed with the current "
                         "weights")
    w = torch.exp(torch.clamp(proximal - behaviour, -20, 20))                     # (B, T)
    if max_weight is not None:
        w = w.clamp(max=max_weight)
    return proximal, w


def token_logprobs(logits, targets, temperature=1.0):
    """log softmax(logits / temperature) at targets: (B, T, V), (B, T) -> (B, T)."""
    logp = F.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------- batches
@dataclass
class Samples:
    """One rank's share of a batch. Rows of one prompt group need not be together here: the
    advantages were computed where the whole group was."""
    prompts: list            # (B,) of (P_i,) int64
    responses: list          # (B,) of (n_i,) int64
    old_logprobs: list       # (B,) of (n_i,) float32, the behaviour log-probs
    advantages: torch.Tensor  # (B,)
    truncated: list = None   # (B,) bool: cut by the token budget, not ended by the model
    #                          (GRPOConfig.mask_truncated)
    per_token: dict = None   # the sampler's per-token fields, name -> (B,) of (n_i, ...)
    #                          (options/routing_replay.py's routes)
    around: object = None    # around(model, samples, rows, T, mask, sums): a context around each
    #                          forward over these rows (options/routing_replay.py's replay), or None
    order: list = None       # (B,) the update cuts its micro-batches from the rows sorted by this
    #                          key. None: by their lengths, the least padding. Where inputs arrive
    #                          late: the order they arrive in.

    def lengths(self):
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]

    def chunk_key(self):
        return self.lengths() if self.order is None else self.order


@dataclass
class GRPOConfig:
    clip_eps: float = 0.2          # PPO's clip: the ratio kept in [1 - clip_eps, 1 + clip_eps_high]
    clip_eps_high: float = None    # the upper clip (DAPO's clip-higher); None: clip_eps
    kl_coef: float = 0.0           # weight of the k3 penalty (needs reference log-probs)
    loss_agg: str = "token-mean"   # one of LOSS_AGGS
    norm_len: int = 0              # seq-mean-token-sum-norm divides by it: the response budget
    temperature: float = 1.0       # the sampler's: log-probs are of softmax(logits / temperature)
    updates_per_batch: int = 1     # optimizer steps (mini-batches) per batch
    micro_batches: int = 4         # micro-batches per mini-batch, cut by Samples.chunk_key
    grad_clip: float = 1.0         # global gradient norm clip
    decoupled: bool = False        # clip around recomputed proximal log-probs (off_policy_logprobs)
    tis_cap: float = None          # decoupled, pi_prox / pi_behaviour capped at this (truncated IS)
    mask_truncated: bool = False   # responses cut by the budget: no loss (DAPO's overlong filter)

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg={self.loss_agg!r}; valid: {', '.join(LOSS_AGGS)}")
        if self.loss_agg == "seq-mean-token-sum-norm" and not self.norm_len >= 1:
            raise ValueError(f"loss_agg 'seq-mean-token-sum-norm' needs norm_len >= 1 "
                             f"(got {self.norm_len})")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap={self.tis_cap} must be > 0 (or None: no cap)")

    @property
    def recompute(self):
        """The update needs the proximal log-probs: the current weights', before its first step."""
        return self.decoupled or self.tis_cap is not None


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


def length_chunks(rows, key, k):
    """Split rows into exactly k chunks, sorted by key (their lengths: each forward pads only to its
    own chunk's longest row). Every rank must run the same number of FSDP forwards and backwards, so
    an empty chunk becomes a stand-in row with weight 0. Returns [(rows, is_stand_in)]."""
    by_key = sorted(rows, key=lambda i: key[i])
    chunks = np.array_split(np.array(by_key, dtype=int), k)
    return [(list(c), False) if len(c) else ([0], True) for c in chunks]


def sequence_logprobs(model, tokens, temperature):
    """tokens (B, T) -> log-prob of each next token (B, T-1)."""
    return token_logprobs(model(tokens[:, :-1]), tokens[:, 1:], temperature)


def logprobs_and_entropy(model, tokens, temperature):
    """tokens (B, T) -> log-prob of each next token (B, T-1), and the policy's entropy there
    (B, T-1), detached: one forward for both."""
    logp = F.log_softmax(model(tokens[:, :-1]) / temperature, dim=-1)             # (B, T-1, V)
    lp = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)                  # (B, T-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)                                     # (B, T-1)
    return lp, entropy


def _all_sum(values, device, group):
    """A few floats summed over the group in one collective (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t.tolist()


def _world(group):
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _reshard(model):
    """FSDP2 leaves modules unsharded after a no-grad forward: reshard them (a plain model has
    none)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# ----------------------------------------------------------------------------- the update
def _plain(model, samples, rows, T, mask=None, sums=None):
    """No context around a forward (Samples.around's default)."""
    return nullcontext()


def _rows(samples, rows):
    """The prompts and the responses of these rows."""
    return [samples.prompts[i] for i in rows], [samples.responses[i] for i in rows]


@torch.no_grad()
def chunk_logprobs(model, samples, cfg, device, around=None):
    """Log-probs of every response token under `model`, in cfg.micro_batches chunks by length:
    (B,) of (n_i,). around: a context around each forward (the policy's proximal log-probs take
    samples.around, the frozen reference's none)."""
    out = [None] * len(samples.prompts)
    for rows, _ in length_chunks(range(len(out)), samples.lengths(), cfg.micro_batches):
        tokens, mask, _ = pad_responses(*_rows(samples, rows))
        with (around or _plain)(model, samples, rows, tokens.shape[1]):
            lp = sequence_logprobs(model, tokens.to(device), cfg.temperature)       # (b, T-1)
        for j, i in enumerate(rows):
            out[i] = lp[j][mask[j].to(device)].cpu()                                 # (n_i,)
    _reshard(model)
    return out


def grpo_update(model, optimizer, samples, cfg, device, group=None, ref_logprobs=None,
                clip_grads=None, arrive=None):
    """updates_per_batch optimizer steps on this rank's samples, data parallel over `group` (its
    gradients averaged over the group: FSDP2's reduce-scatter, or whatever the model does).
    ref_logprobs: (B,) of (n_i,), needed when kl_coef > 0. clip_grads(model, max_norm), optional:
    replaces clip_grad_norm_ (expert parallelism clips over experts that FSDP does not hold).
    arrive(rows), optional: called before each micro-batch's forward with its rows (indices into
    samples), the same number of times on every rank of the group (a stand-in micro-batch
    included), so it may hold a collective. A caller whose ref_logprobs or advantages are computed
    elsewhere fills those rows' entries in it, so that the first micro-batches (samples.order: the
    rows whose inputs come first) train while the last ones' inputs are still on their way.
    Returns sums over this rank's rows, to be summed over the ranks (maxima: keys ending in _max)
    and divided (`batch_means`)."""
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs")
    prox_logprobs = None
    if cfg.recompute:
        prox_logprobs = chunk_logprobs(model, samples, cfg, device, samples.around)
    sums = dict.fromkeys(("loss", "clip_frac", "ratio_mean", "k3_mean", "entropy", "items",
                          "tokens", "gap", "gap_tokens", "gap_max", "skipped_max"), 0.0)
    minis = np.array_split(np.arange(len(samples.prompts)), cfg.updates_per_batch)
    for i, mini in enumerate(minis):
        _accumulate(model, samples, mini, cfg, device, group, ref_logprobs, prox_logprobs, sums,
                    first=(i == 0), arrive=arrive)
        if clip_grads is None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        else:
            norm = clip_grads(model, cfg.grad_clip)
        if finite_everywhere(norm, device, group):
            optimizer.step()
        else:  # a non-finite loss or gradient on any rank: every rank skips, the weights untouched
            sums["skipped_max"] += 1
        optimizer.zero_grad(set_to_none=True)
    return sums


def finite_everywhere(norm, device, group=None):
    """True when the gradient norm is finite on every rank of the group (one MAX all-reduce of a
    flag): a NaN or inf anywhere makes every rank skip the same step."""
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else torch.as_tensor(norm)
    bad = torch.tensor([0.0 if bool(torch.isfinite(norm).all()) else 1.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return not bool(bad.item())


def loss_mask(samples, rows, mask, cfg):
    """The response mask (b, T-1) less the truncated rows, when cfg.mask_truncated asks."""
    if cfg.mask_truncated and samples.truncated is not None:
        cut = torch.tensor([bool(samples.truncated[i]) for i in rows], device=mask.device)   # (b,)
        mask = mask & ~cut[:, None]
    return mask


def _items(mask, cfg):
    """The loss's units in these rows: tokens (token-mean), or responses with a loss token."""
    return int(mask.sum()) if cfg.loss_agg == "token-mean" else int((mask.sum(-1) > 0).sum())


def _accumulate(model, samples, mini, cfg, device, group, ref_lp, prox_lp, sums, first,
                arrive=None):
    """Forward and backward of one mini-batch in sorted micro-batches (Samples.chunk_key), adding to
    sums. first: the batch's first mini-batch, before any step: its log-probs against the
    behaviour's give the gap. arrive(rows): see grpo_update."""
    chunks = length_chunks(mini, samples.chunk_key(), cfg.micro_batches)
    n_local = sum(_items(_loss_mask(samples, rows, cfg), cfg)
                  for rows, stand_in in chunks if not stand_in)
    n_global, = _all_sum([n_local], device, group)  # the loss is a mean over the global mini-batch
    for c, (rows, stand_in) in enumerate(chunks):
        if arrive is not None:  # this micro-batch's reference log-probs and advantages, if late
            arrive(rows)
        tokens, mask, fields = _padded(samples, rows, cfg, ref_lp, prox_lp)        # host tensors
        if isinstance(model, FSDPModule):
            # Reduce-scatter once, after the last micro-batch. The parameters stay gathered until
            # then (the usual trade: full-size gradients while accumulating).
            last = c == len(chunks) - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
        tokens, mask = tokens.to(device), mask.to(device)
        fields = {name: f.to(device) for name, f in fields.items()}                  # (b, T-1) each
        behaviour, ref = fields["behaviour"], fields.get("reference")
        proximal = fields.get("proximal")
        old, weights = off_policy_logprobs(behaviour, proximal, cfg.recompute, cfg.tis_cap)
        measure = mask if first and not stand_in else None  # the first mini-batch's figures
        with (samples.around or _plain)(model, samples, rows, tokens.shape[1], measure, sums):
            lp, entropy = logprobs_and_entropy(model, tokens, cfg.temperature)      # (b, T-1) each
        loss, m = grpo_loss(lp, old, ref, samples.advantages[rows].to(device), mask, cfg.clip_eps,
                            cfg.kl_coef, cfg.loss_agg, weights, cfg.clip_eps_high, cfg.norm_len)
        n_items = _items(mask, cfg)
        # This chunk's share of the global mean (the gradient is averaged over the group's ranks).
        scale = 0.0 if stand_in else n_items * _world(group) / max(n_global, 1.0)
        (loss * scale).backward()
        if not stand_in:
            gap = (lp.detach() - behaviour).abs() if first else None                 # (b, T-1)
            _add_figures(sums, loss, m, mask, entropy, gap, n_items)


def _loss_mask(samples, rows, cfg):
    """The loss mask (b, T-1) of these rows, without padding their per-token fields."""
    _, mask, _ = pad_responses(*_rows(samples, rows))
    return loss_mask(samples, rows, mask, cfg)


def _padded(samples, rows, cfg, ref_lp, prox_lp):
    """Tokens (b, T), the loss mask (b, T-1) and the per-token fields by name: behaviour, and
    reference and proximal when given, each (b, T-1)."""
    given = {"behaviour": samples.old_logprobs, "reference": ref_lp, "proximal": prox_lp}
    given = {name: f for name, f in given.items() if f is not None}
    fields = [[f[i] for i in rows] for f in given.values()]
    tokens, mask, per_token = pad_responses(*_rows(samples, rows), *fields)
    return tokens, loss_mask(samples, rows, mask, cfg), dict(zip(given, per_token))


def _add_figures(sums, loss, m, mask, entropy, gap, n_items):
    n_tok = float(mask.sum())
    sums["loss"] += loss.item() * n_items
    sums["items"] += n_items
    sums["tokens"] += n_tok
    for key in ("clip_frac", "ratio_mean", "k3_mean"):
        sums[key] += m[key] * n_tok
    sums["entropy"] += float((entropy * mask).sum())
    if gap is not None and n_tok:  # |log pi_train - log pi_rollout|, before any step on this batch
        sums["gap"] += float((gap * mask).sum())
        sums["gap_tokens"] += n_tok
        sums["gap_max"] = max(sums["gap_max"], float(gap[mask].max()))


def batch_means(sums):
    """Sums over every rank's rows -> the batch's means: the loss per item (token or sequence), the
    rest per token; the log-prob gap between the sampler and the trainer, mean and max."""
    items, tokens = max(sums["items"], 1.0), max(sums["tokens"], 1.0)
    gap_tokens = max(sums["gap_tokens"], 1.0)
    return {"loss": sums["loss"] / items, "clip_frac": sums["clip_frac"] / tokens,
            "ratio_mean": sums["ratio_mean"] / tokens, "k3_mean": sums["k3_mean"] / tokens,
            "entropy": sums["entropy"] / tokens,
            "rollout/logprob_gap_mean": sums["gap"] / gap_tokens,
            "rollout/logprob_gap_max": sums["gap_max"],
            "train/skipped_updates": sums["skipped_max"]}


def cosine_lr(optimizer, lr, floor, done):
    """Every param group's learning rate when `done` of the run is behind (0 to 1): a cosine from lr
    down to lr x floor, so that the policy settles as the run ends rather than stopping
    mid-swing."""
    cosine = 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))  # 1 at the start, 0 at the end
    for group in optimizer.param_groups:
        group["lr"] = lr * (floor + (1 - floor) * cosine)


def supervised_step(model, optimizer, prompts, targets, device, grad_clip, group=None,
                    clip_grads=None):
    """One cross-entropy step on (prompt, target) pairs, the mean over the group's global batch."""
    tokens, mask, _ = pad_responses(prompts, targets)
    tokens, mask = tokens.to(device), mask.to(device)
    nll = -sequence_logprobs(model, tokens, 1.0)                                     # (B, T-1)
    n_local = int(mask.sum())
    n_global, = _all_sum([n_local], device, group)
    loss = (nll * mask).sum() / mask.sum() * (n_local * _world(group) / max(n_global, 1.0))
    loss.backward()
    if clip_grads is None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        norm = clip_grads(model, grad_clip)
    if finite_everywhere(norm, device, group):  # else every rank skips it
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
