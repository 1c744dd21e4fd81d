# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""Pipeline-parallel training: the policy's blocks split into stages on different ranks.

Micro-batches go through torch's own schedule (torch.distributed.pipelining), the GRPO loss on the
last stage.

Naive form first: one process runs every block (`pp = 1`, grpo.grpo_update). With `pp` stages, stage
s holds blocks [s L/pp, (s+1) L/pp) (the first also the embedding, the last the final norm and the
head) under the whole model's parameter names, so that a checkpoint, a gather or the engine finds
each weight by the name it has in one process. A batch is cut into micro-batches; stage s computes
micro-batch i while stage s + 1 computes micro-batch i - 1, and the activations and their gradients
cross ranks point to point. The schedule is 1F1B (torch's Schedule1F1B): once the pipeline is full
each stage alternates one forward and one backward, so a stage holds at most pp micro-batches'
activations (GPipe, every forward then every backward, would hold all M). Stages may also be data
parallel: FSDP2 over the ranks of a stage.

Ranks are laid out stage-outer: stage s is ranks [s D, (s+1) D) (D = W / pp pipelines); pipeline j
is ranks {j, D + j, ...}. A pipeline reads its rows once (SelectiveQueue's model-parallel group) and
every stage of it sees the same micro-batches: the first stage needs the tokens, the last the tokens
and every per-token field.

Known limits of the schedule, and what this file does about them:
  - a stage's shapes are fixed at its first step (a new micro-batch shape fails): every micro-batch
    of a step is padded to one shape, (rows per micro-batch, T), T the step's longest row rounded up
    to a multiple of SHAPE_STEP; a schedule is built per shape, each on the same stage module, so a
    run has a few. Against one process's length-sorted micro-batches (each padded to its own longest
    row) that computes more padding: `python bench/pp_padding.py` measures how much;
  - loss_fn(output, target) takes one target: the GRPO fields are packed along its last dim
    (FIELDS); each micro-batch's loss is already its share of the global mean, so the schedule does
    not scale it;
  - the log-prob recompute and the frozen reference run through the schedule's eval (forward only).

    python -m pytest tests/test_pipeline.py

Shapes: B rows, T padded tokens, D model width, V vocabulary, M micro-batches, F packed fields.
"""
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import grpo

# rows are padded to a multiple of this many tokens: one schedule per shape, few shapes
SHAPE_STEP = 16

# The per-token fields packed into the schedule's one target tensor, (B, T-1, F): position t
# predicts token t + 1.
FIELDS = ("next_token", "mask", "behaviour", "advantage", "reference", "proximal")


@dataclass(frozen=True)
class PPLayout:
    """pp stages over W ranks, stage-outer: stage s holds ranks [s D, (s+1) D), D = W / pp."""
    pp: int
    world_size: int
    n_layers: int

    def __post_init__(self):
        if self.pp < 1 or self.world_size % self.pp or self.n_layers % self.pp:
            raise ValueError(f"{self.pp} pipeline stages must divide "
                             f"the world size {self.world_size} and the {self.n_layers} blocks "
                             "(each stage holds n_layers / pp of them)")

    @property
    def dp(self):
        return self.world_size // self.pp

    def stage(self, rank):
        return rank // self.dp

    def stage_ranks(self, s):
        return list(range(s * self.dp, (s + 1) * self.dp))

    def pipe_ranks(self, rank):
        return [s * self.dp + rank % self.dp for s in range(self.pp)]

    def blocks(self, s):
        n = self.n_layers // self.pp
        return list(range(s * n, (s + 1) * n))


def new_groups(layout, timeout_s=300.0, backend=None):
    """This rank's (stage group: FSDP's ranks, pipe group: one rank per stage). Collective."""
    timeout, rank, mine = datetime.timedelta(seconds=timeout_s), dist.get_rank(), [None, None]

    def stage_ranks(r):
        return layout.stage_ranks(layout.stage(r))

    for kind, ranks_of in enumerate((stage_ranks, layout.pipe_ranks)):
        for ranks in sorted({tuple(ranks_of(r)) for r in range(layout.world_size)}):
            g = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            if rank in ranks:
                mine[kind] = g
    return tuple(mine)


class Stage(nn.Module):
    """Stage s of a model.Policy: its blocks (under their names in the whole model: blocks.<i>), the
    embedding if first, the final norm and head if last. forward: tokens (B, T) or hidden (B, T, D)
    -> hidden, or logits (B, T, V) float32 on the last stage. Shares the policy's modules."""

    def __init__(self, policy, blocks, first, last):
        super().__init__()
        self.names = list(policy.state_dict())  # the whole model's, in its order: full_state_dict's
        self.embed = policy.embed if first else None
        self.blocks = nn.ModuleDict({str(i): policy.blocks[i] for i in blocks})
        self.norm, self.head = (policy.norm, policy.head) if last else (None, None)
        self.register_buffer("rope_cos", policy.rope_cos, persistent=False)
        self.register_buffer("rope_sin", policy.rope_sin, persistent=False)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)  # (T,) right-padded rows
        cos, sin = self.rope_cos[pos][None, None], self.rope_sin[pos][None, None]
        if self.embed is not None:
            x = self.embed(x)                                                     # (B, T, D)
        for block in self.blocks.values():
            x = block(x, cos, sin)
        return x if self.head is None else self.head(self.norm(x)).float()  # (B, T, V) on the last


def split(policy, layout, rank):
    """This rank's Stage of the policy."""
    s = layout.stage(rank)
    stage = Stage(policy, layout.blocks(s), first=s == 0, last=s == layout.pp - 1)
    # the rank of the stage that full_state_dict takes it from
    stage.first_rank = layout.stage_ranks(s)[0]
    return stage


class Pipeline:
    """One stage's side of a pipeline: its module (FSDP2 over the stage's ranks, or plain), the pipe
    group, and a 1F1B schedule per micro-batch shape. train() and logits() are collective over the
    pipe group; every stage passes the same (B, T) tokens. stage_group: this stage's ranks (one per
    pipeline), over which padded_length agrees (None: one pipeline)."""

    def __init__(self, module, layout, rank, pipe_group, micro_batches, length, device,
                 stage_group=None):
        self.module, self.layout, self.group = module, layout, pipe_group
        self.stage_group = stage_group
        self.device = torch.device(device)
        self.length = length  # the longest a row can be (the longest prompt + the response budget)
        self.stage, self.micro_batches = layout.stage(rank), micro_batches
        self.first, self.last = self.stage == 0, self.stage == layout.pp - 1
        self.schedules, self._loss = {}, None

    def padded_length(self, rows):
        """T for these rows (each a sequence of tokens): their longest, rounded up to a multiple of
        SHAPE_STEP and at most `length`: a few shapes, hence a few schedules, and less padding than
        always padding to `length`. The same on every stage (they hold the same rows), and on every
        pipeline: a new shape's schedule runs its stage once at its first step to learn the shapes
        (FSDP's collectives over the stage's ranks included), so the stage's ranks must meet a new
        shape at the same step. Collective over stage_group."""
        longest = max(len(r) for r in rows)
        if self.stage_group is not None:  # the longest of every pipeline's rows
            t = torch.tensor([longest], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.stage_group)
            longest = int(t[0])
        return min(self.length, -(-longest // SHAPE_STEP) * SHAPE_STEP)

    def _schedule(self, shape, train):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        key = (tuple(shape), train)
        # a stage's shapes are fixed at its first step: one schedule per shape
        if key not in self.schedules:
            stage = PipelineStage(self.module, self.stage, self.layout.pp, self.device,
                                  group=self.group)
            # the step's, set by train()
            loss_fn = (lambda out, target: self._loss(out, target)) if train else None
            self.schedules[key] = Schedule1F1B(stage, self.micro_batches, loss_fn=loss_fn,
                                               scale_grads=False)
        return self.schedules[key]

    def train(self, tokens, target, loss_fn):
        """Forward and backward of tokens (B, T) in micro-batches; loss_fn(logits (b, T, V), target
        (b, ...)) is each micro-batch's loss on the last stage, already scaled (its gradient is
        accumulated as is)."""
        self._loss = loss_fn
        schedule = self._schedule(tokens.shape, train=True)
        if self.first:
            schedule.step(tokens.to(self.device), return_outputs=False)
        else:
            schedule.step(target=target.to(self.device), losses=[], return_outputs=False)

    @torch.no_grad()
    def logits(self, tokens):
        """The last stage's logits (B, T, V) of tokens (B, T), by the schedule's eval; else None."""
        schedule = self._schedule(tokens.shape, train=False)
        out = schedule.eval(tokens.to(self.device)) if self.first else schedule.eval()
        return out if self.last else None


def full_state_dict(stage):
    """The whole model on every rank, in one process's names and order: each stage's full tensors
    (its FSDP shards gathered), exchanged over the default group. Collective on every rank."""
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in stage.state_dict().items()}
    mine = full if dist.get_rank() == stage.first_rank else {}  # one rank of each stage sends it
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {k: v for d in every for k, v in d.items()}
    return {k: merged[k] for k in stage.names}


def padded_rows(prompts, responses, T):
    """Right-padded (B, T) tokens and the response mask (B, T-1): pad_responses' rows, T long."""
    tokens, mask, _ = grpo.pad_responses(prompts, responses)
    pad = T - tokens.shape[1]
    if pad < 0:
        raise ValueError(f"a row of {tokens.shape[1]} tokens "
                         f"exceeds the pipeline's fixed length {T}")
    return nn.functional.pad(tokens, (0, pad)), nn.functional.pad(mask, (0, pad))


# --- the updates, through the schedule ------------------------------------------------------------
def pack(samples, rows, cfg, T, ref_lp=None, prox_lp=None):
    """Rows of a batch as the schedule takes them: tokens (b, T), packed target (b, T-1, F)."""
    prompts = [samples.prompts[i] for i in rows]
    responses = [samples.responses[i] for i in rows]
    tokens, mask = padded_rows(prompts, responses, T)  # (b, T), (b, T-1)
    mask = grpo.loss_mask(samples, rows, mask, cfg)
    target = torch.zeros(len(rows), T - 1, len(FIELDS))              # (b, T-1, F)
    target[..., FIELDS.index("next_token")] = tokens[:, 1:].float()  # ids < 2^24: exact
    target[..., FIELDS.index("mask")] = mask.float()
    target[..., FIELDS.index("advantage")] = samples.advantages[rows].float()[:, None]
    given = {"behaviour": samples.old_logprobs, "reference": ref_lp, "proximal": prox_lp}
    for name, values in given.items():
        if values is None:
            continue
        for b, (p, i) in enumerate(zip(prompts, rows)):
            target[b, len(p) - 1:len(p) - 1 + len(values[i]), FIELDS.index(name)] = values[i]
    return tokens, target, mask


def _fields(target):
    return {name: target[..., i] for i, name in enumerate(FIELDS)}  # name -> (b, T-1)


def _logprobs_entropy(logits, next_token, temperature):
    """logits (b, T, V) of the whole padded rows -> next tokens' log-probs, entropies: (b, T-1)."""
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)                 # (b, T-1, V)
    lp = logp.gather(-1, next_token.long().unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def grpo_update(pipe, model, optimizer, samples, cfg, device, group=None, ref_logprobs=None,
                clip_grads=None, arrive=None):
    """grpo.grpo_update through the pipeline: this pipeline's rows (the same on every stage) in
    updates_per_batch optimizer steps of `micro_batches` micro-batches each, every one padded to
    (rows, pipe's T). The loss is the global batch's mean, as in one process: each micro-batch's
    share is n_items x D / n_global (FSDP averages a stage's gradients over its D ranks). group:
    every rank (the counts and the finite check). Returns sums over this rank's rows (the last
    stage's; on the others only skipped_max)."""
    if arrive is not None:
        raise ValueError("arrive: the pipeline schedules every micro-batch at once; "
                         "give it complete inputs")
    # every stage decides alike: logprobs() gives them all a list
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs")
    prox = logprobs(pipe, samples, cfg) if cfg.recompute else None
    sums = dict.fromkeys(("loss", "clip_frac", "ratio_mean", "k3_mean", "entropy", "items",
                          "tokens", "gap", "gap_tokens", "gap_max", "skipped_max", "route_tokens",
                          "route_mismatch", "route_free_mismatch"), 0.0)
    minis = torch.arange(len(samples.prompts)).tensor_split(cfg.updates_per_batch)
    for i, mini in enumerate(minis):
        rows = mini.tolist()
        T = pipe.padded_length([samples.prompts[j].tolist() + samples.responses[j].tolist()
                                for j in rows])
        tokens, target, mask = pack(samples, rows, cfg, T, ref_logprobs if pipe.last else None,
                                    prox if pipe.last else None)
        n_local = grpo._items(mask, cfg) if pipe.last else 0
        n_global, = grpo._all_sum([n_local], device, group)
        # each loss_fn call's figures; a schedule's first step also calls it once to infer shapes
        calls = []
        scale = pipe.layout.dp / max(n_global, 1.0)
        pipe.train(tokens, target, _loss_fn(cfg, calls, scale, first=i == 0))
        for figures in calls[-pipe.micro_batches:]:  # the micro-batches' own
            grpo._add_figures(sums, *figures)
        norm = clip_grads(model, cfg.grad_clip)
        if grpo.finite_everywhere(norm, device, group):
            optimizer.step()
        else:
            sums["skipped_max"] += 1.0
        optimizer.zero_grad(set_to_none=True)
    return sums


def _loss_fn(cfg, calls, scale, first):
    """The last stage's loss of one micro-batch, (b, T, V) logits and (b, T-1, F) target -> its
    scaled share; the call's figures appended to calls."""
    def loss_fn(logits, target):
        f = _fields(target)
        mask = f["mask"] > 0                                                       # (b, T-1)
        lp, entropy = _logprobs_entropy(logits, f["next_token"], cfg.temperature)
        proximal = f["proximal"] if cfg.recompute else None
        old, weights = grpo.off_policy_logprobs(f["behaviour"], proximal, cfg.recompute,
                                                cfg.tis_cap)
        reference = f["reference"] if cfg.kl_coef > 0 else None
        loss, m = grpo.grpo_loss(lp, old, reference, f["advantage"][:, 0], mask, cfg.clip_eps,
                                 cfg.kl_coef, cfg.loss_agg, weights, cfg.clip_eps_high,
                                 cfg.norm_len)
        n_items = grpo._items(mask, cfg)
        gap = (lp.detach() - f["behaviour"]).abs() if first else None
        calls.append((loss.detach(), m, mask, entropy, gap, n_items))
        return loss * n_items * scale
    return loss_fn


@torch.no_grad()
def logprobs(pipe, samples, cfg):
    """Each row's response log-probs under the pipeline's weights, (B,) of (n_i,), on the last stage
    (B Nones on the others): the decoupled objective's proximal log-probs, or the frozen
    reference's."""
    rows = list(range(len(samples.prompts)))
    pairs = list(zip(samples.prompts, samples.responses))
    T = pipe.padded_length([p.tolist() + r.tolist() for p, r in pairs])
    tokens, target, _ = pack(samples, rows, cfg, T)
    logits = pipe.logits(tokens)  # (B, T, V) on the last
    grpo._reshard(pipe.module)
    if logits is None:
        return [None] * len(rows)
    lp, _ = _logprobs_entropy(logits, _fields(target)["next_token"], cfg.temperature)  # (B, T-1)
    return [lp[b, len(p) - 1:len(p) - 1 + len(r)].cpu() for b, (p, r) in enumerate(pairs)]


def supervised_step(pipe, model, optimizer, prompts, targets, device, grad_clip, group=None,
                    clip_grads=None):
    """grpo.supervised_step through the pipeline: cross-entropy on this pipeline's (prompt, target)
    pairs, the mean over every pipeline's tokens."""
    T = pipe.padded_length([p.tolist() + t.tolist() for p, t in zip(prompts, targets)])
    tokens, mask = padded_rows(prompts, targets, T)  # (b, T), (b, T-1)
    target = torch.zeros(len(prompts), T - 1, len(FIELDS))
    target[..., FIELDS.index("next_token")] = tokens[:, 1:].float()
    target[..., FIELDS.index("mask")] = mask.float()
    n_global, = grpo._all_sum([float(mask.sum()) if pipe.last else 0.0], device, group)
    scale = pipe.layout.dp / max(n_global, 1.0)

    def loss_fn(logits, target):
        f = _fields(target)
        lp, _ = _logprobs_entropy(logits, f["next_token"], 1.0)
        return -(lp * f["mask"]).sum() * scale
    pipe.train(tokens, target, loss_fn)
    norm = clip_grads(model, grad_clip)
    if grpo.finite_everywhere(norm, device, group):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def clip_grads(model, max_norm, group):
    """clip_grad_norm_ over every stage: this stage's norm (over its FSDP shards), squared, summed
    over the pipe group's stages; every gradient scaled by the same factor."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    sq = ((norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2).reshape(1)
    dist.all_reduce(sq, group=group)
    total = sq[0].sqrt()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    for g in grads:
        g.mul_(coef)
    return total
