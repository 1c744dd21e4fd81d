"""GRPO post-training of a tiny MoE policy, end to end, wiring the four mechanisms together.

    torchrun --standalone --nproc_per_node=2 train_grpo.py     # 2 ranks (gloo on CPU, nccl on GPUs)
    python train_grpo.py                                       # a world of one
    python train_grpo.py --help                                # every flag, grouped

By default every rank both generates and trains, one phase after the other (colocated, synchronous).
Each step:
  1. sample a global batch of prompts (every replica draws the same stream and keeps its slice);
  2. generate `group_size` responses per prompt: fusion.py switches the rank from TRAIN (FSDP2 shards,
     grads, AdamW state) to ROLLOUT (optimizer state on host, inference weights rebuilt in buckets,
     optionally tensor-parallel), and stalesync.py schedules the round (S = 0: wait for every sample);
  3. score them with `score` (exact match: a rule, not a model);
  4. compute group-normalised advantages (`group_advantages`), then put the rows into distqueue.py;
  5. each trainer reads a token-balanced share of the global batch, packed, and computes reference
     log-probs with the frozen initial policy when `kl_coef > 0` (or under --deploy colocated-all);
  6. take `updates_per_batch` optimizer steps on `grpo_loss`, data parallel with FSDP2.
--deploy separated gives half the ranks to training and half to generation instead, with the weights
pushed in buckets after each step; --staleness S lets rollouts run up to S versions ahead (separated:
the generators keep decoding while the trainers train, `generate_ahead`). --train-ep P --infer-ep 1
makes the MoE expert-parallel, re-sharded by moe_switch.py at every phase change (`ExpertParallel`).

The task: reverse a string of digits. "=" ends the prompt, EOS ends the answer. The string length is
lognormal, so answers run from 2 to 33 tokens with a long tail (median about 8): the tail that the
staleness and packing mechanisms are measured on. A held-out set of prompts, scored greedily, gives
the accuracy. A short supervised warm-up comes first (RL alone cannot start a tiny policy from
nothing); its held-out accuracy is the "before" figure.

Departures from the GRPO paper (DeepSeekMath), on purpose:
1. The KL penalty is off by default (`--kl-coef 0`), as in DAPO and Dr. GRPO; with it on, it is the
   k3 estimator added to the per-token loss.
2. The loss is a mean over all response tokens of the global batch ("token-mean"), not a mean of
   per-sequence means; `--loss-agg seq-mean-token-mean` gives the paper's form.
3. `old_logprobs` are the behaviour log-probs recorded by the sampler, not recomputed: with one update
   per batch the ratio is 1 up to float error (tested to 1e-5).
4. Sampling randomness is counter-based per sample (see model.py), so the samples do not depend on
   the world size or the deployment: every mode sees the same responses from the same weights.
5. Scoring runs on the rank that generated the group (a cheap rule, and the advantage needs the whole
   group), so reward and advantage travel through the queue with the sample; reference log-probs are
   computed by the trainer that reads the sample, which is where the reference model lives.

Outputs, in --out (default runs/<timestamp>/): metrics.jsonl (one object per step), summary.json,
and spans_rank<N>.jsonl (every timed phase of every rank, for a timeline).
"""
import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import distqueue
import fusion
import moe_switch
import stalesync
from model import ModelConfig, Policy, Sampler, generate, token_logprobs

# ---------------------------------------------------------------------------------------------
# The task: reverse a digit string. Tokens: PAD, EOS, BOS, "=", then the digits 0-9.
# ---------------------------------------------------------------------------------------------
PAD, EOS, BOS, SEP, DIGIT0 = 0, 1, 2, 3, 4
VOCAB = DIGIT0 + 10


def make_prompts(rng, n, max_digits, mu=2.0, sigma=0.6):
    """n prompts [BOS, d_1..d_k, "="], k = round(lognormal(mu, sigma)) clipped to [1, max_digits]."""
    ks = np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, max_digits).astype(int)
    return [torch.tensor([BOS, *(DIGIT0 + rng.integers(0, 10, size=k)), SEP]) for k in ks]


def answer(prompt):
    """The reference response: the digits reversed, then EOS."""
    return torch.cat([prompt[1:-1].flip(0), torch.tensor([EOS])])


def score(prompt, response):
    """The reward: 1.0 if the response is exactly the reversed digits followed by EOS, else 0.0."""
    return float(torch.equal(response, answer(prompt)))


# ---------------------------------------------------------------------------------------------
# GRPO math: pure functions of tensors and a mask (slow loop references live in the tests)
# ---------------------------------------------------------------------------------------------

def group_advantages(rewards, group_size, eps=1e-6, scale_by_std=True):
    """rewards (N,) in contiguous groups of group_size -> advantages (N,):
    (r - group mean) / (group std + eps), std unbiased; r - group mean if not scale_by_std (Dr. GRPO)."""
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)                                            # (N/G, G)
    adv = r - r.mean(-1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(-1, keepdim=True) + eps)
    return adv.view(-1)


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps=0.2, kl_coef=0.0,
              loss_agg="token-mean", token_weights=None):
    """Clipped surrogate plus kl_coef * k3, per token, then aggregated.
    logprobs, old_logprobs, ref_logprobs, mask (B, T); advantages (B,). Returns (loss, metrics).
    token_weights (B, T), optional: multiplies each token's surrogate (the decoupled objective's
    pi_prox / pi_behaviour, see stalesync.off_policy_logprobs)."""
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -20, 20))               # (B, T)
    adv = advantages[:, None].to(logprobs.dtype)                                   # (B, 1)
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.min(unclipped, clipped)                                     # (B, T)
    if token_weights is not None:
        per_token = per_token * token_weights
    if ref_logprobs is not None:
        d = torch.clamp(ref_logprobs - logprobs, -20, 20)
        k3 = torch.exp(d) - d - 1                                                  # (B, T)
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
        raise ValueError(f"loss_agg={loss_agg!r}; valid: 'token-mean', 'seq-mean-token-mean'")
    with torch.no_grad():
        metrics = {"clip_frac": float(((clipped < unclipped).to(mask.dtype) * mask).sum() / n_tok),
                   "ratio_mean": float((ratio * mask).sum() / n_tok),
                   "k3_mean": float((k3 * mask).sum() / n_tok)}
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Config, flags and their validation
# ---------------------------------------------------------------------------------------------

@dataclass
class Config:
    # task
    max_digits: int = 32           # longest digit string; answers are up to max_digits + 1 tokens
    eval_prompts: int = 512        # held-out prompts, scored greedily
    # model
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 4
    top_k: int = 2
    d_expert: int = 128
    # warm-up (supervised)
    warmup_steps: int = 400        # supervised steps before RL
    warmup_batch: int = 64         # global batch of (prompt, answer) pairs
    warmup_lr: float = 5e-3
    # GRPO
    steps: int = 600               # RL steps
    prompts_per_step: int = 16     # global prompts per step
    group_size: int = 8            # responses per prompt
    lr: float = 5e-4
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    loss_agg: str = "token-mean"
    scale_by_std: bool = True      # False: Dr. GRPO advantages
    updates_per_batch: int = 1     # optimizer steps (mini-batches) per rollout batch
    micro_batches: int = 4         # length-sorted chunks per mini-batch, gradients accumulated
    grad_clip: float = 1.0
    # staleness (stalesync.py)
    staleness: int = 0             # S: the most policy versions a trained sample may lag (0: synchronous)
    threshold: float = 0.5         # in (0, 1]: the decode pool holds prompts_per_step / threshold groups (S > 0)
    chunk_steps: int = 8           # decode steps between checks for a finished batch (S > 0)
    decoupled: bool = False        # decoupled objective: clip around recomputed proximal log-probs
    # rollout
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 40
    # deployment (fusion.py)
    deploy: str = "colocated"      # colocated, separated or colocated-all
    infer_tp: int = 1              # tensor-parallel degree of the rollout engine (colocated modes)
    bucket_kb: int = 256           # bucket size of the weight re-sharding and pushes, in KiB
    train_ep: int = 0              # expert-parallel degree in training (0: experts FSDP-sharded like the rest)
    infer_ep: int = 0              # expert-parallel degree of the rollout engine (with --train-ep)
    # run
    seed: int = 0
    eval_every: int = 100          # steps between held-out evaluations (also the first and last)
    out: str = ""                  # output folder; default runs/<timestamp>
    device: str = "auto"           # auto, cpu or cuda
    pg_timeout_s: int = 300        # timeout of every process group


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = Config()
    groups = {
        "task": [("max_digits", "longest digit string to reverse"),
                 ("eval_prompts", "held-out prompts, scored greedily")],
        "model": [("d_model", "model width"), ("n_layers", "transformer blocks"),
                  ("n_heads", "attention heads"), ("n_experts", "experts per MoE layer"),
                  ("top_k", "experts chosen per token"), ("d_expert", "hidden width of one expert")],
        "supervised warm-up": [("warmup_steps", "supervised steps before RL (0 to skip)"),
                               ("warmup_batch", "global (prompt, answer) pairs per warm-up step"),
                               ("warmup_lr", "warm-up learning rate")],
        "GRPO": [("steps", "RL steps"), ("prompts_per_step", "global prompts per step"),
                 ("group_size", "responses per prompt (>= 2)"), ("lr", "RL learning rate"),
                 ("clip_eps", "PPO clip range"), ("kl_coef", "k3 KL penalty weight (0: no reference model)"),
                 ("loss_agg", "token-mean or seq-mean-token-mean"),
                 ("scale_by_std", "divide advantages by the group std (0: Dr. GRPO)"),
                 ("updates_per_batch", "optimizer steps per rollout batch"),
                 ("micro_batches", "length-sorted chunks per mini-batch (less padding), gradients accumulated"),
                 ("grad_clip", "gradient norm clip")],
        "staleness": [("staleness", "S: most policy versions a trained sample may lag (0: synchronous)"),
                      ("threshold", "in (0, 1]: decode pool of prompts_per_step / threshold groups; a round "
                                    "ends when prompts_per_step groups are complete"),
                      ("chunk_steps", "decode steps between checks for a finished batch (S > 0)"),
                      ("decoupled", "1: decoupled objective (AReaL), clip around recomputed proximal log-probs")],
        "rollout": [("temperature", "sampling temperature (> 0)"), ("top_p", "nucleus mass, in (0, 1]"),
                    ("max_new_tokens", "response budget in tokens")],
        "deployment": [("deploy", "colocated: every rank trains and generates, switching phases (fusion.py); "
                              "separated: half the ranks train, half generate; colocated-all: colocated plus "
                              "the reference model, kept on host except while it computes"),
                       ("infer_tp", "tensor-parallel degree of the rollout engine: 1, 2 or 4 (colocated modes)"),
                       ("bucket_kb", "bucket size in KiB for building and pushing inference weights"),
                       ("train_ep", "expert-parallel degree in training, re-sharded at each phase change "
                                    "(moe_switch.py); 0: the experts are FSDP-sharded like every weight"),
                       ("infer_ep", "expert-parallel degree of the rollout engine (with --train-ep)")],
        "run": [("seed", "seed of prompts, init and sampling"), ("eval_every", "steps between evaluations"),
                ("out", "output folder (default runs/<timestamp>)"), ("device", "auto, cpu or cuda"),
                ("pg_timeout_s", "timeout in seconds of every process group")],
    }
    for title, fields in groups.items():
        g = p.add_argument_group(title)
        for name, help_ in fields:
            default = getattr(d, name)
            kind = (lambda s: bool(int(s))) if isinstance(default, bool) else type(default)
            extra = {"choices": ["token-mean", "seq-mean-token-mean"]} if name == "loss_agg" else {}
            extra = {"choices": ["auto", "cpu", "cuda"]} if name == "device" else extra
            extra = {"choices": ["colocated", "separated", "colocated-all"]} if name == "deploy" else extra
            g.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=help_, **extra)
    args = p.parse_args(argv)
    return p, Config(**vars(args))


def validate(cfg, world_size):
    """Check the config against the world size before any collective; raise a clear ValueError."""
    errors = []
    if cfg.group_size < 2:
        errors.append(f"--group-size {cfg.group_size}: GRPO needs at least 2 responses per prompt")
    separated = cfg.deploy == "separated"
    if separated and (world_size < 2 or world_size % 2 or cfg.infer_tp != 1):
        errors.append(f"--deploy separated needs an even world size >= 2 (got {world_size}) and --infer-tp 1 "
                      f"(got {cfg.infer_tp})")
    if (cfg.train_ep > 0) != (cfg.infer_ep > 0):
        errors.append(f"--train-ep {cfg.train_ep} and --infer-ep {cfg.infer_ep}: set both (EP on) or neither")
    elif cfg.train_ep:
        for flag, ep in (("--train-ep", cfg.train_ep), ("--infer-ep", cfg.infer_ep)):
            try:
                moe_switch.EPLayout(ep, world_size, cfg.n_experts)
            except ValueError as e:
                errors.append(f"{flag} {ep}: {e}")
        if cfg.deploy == "separated" or cfg.infer_tp != 1:
            errors.append(f"--train-ep needs a colocated deployment with --infer-tp 1 (got --deploy {cfg.deploy}, "
                          f"--infer-tp {cfg.infer_tp})")
        if cfg.infer_ep != 1:
            errors.append(f"--infer-ep {cfg.infer_ep}: an engine with experts spread over ranks needs every rank "
                          "to decode in lock-step, which this script's sampler does not do; use --infer-ep 1")
    try:
        stalesync.StaleConfig(cfg.staleness, 1, max(cfg.group_size, 1), cfg.threshold, cfg.chunk_steps)
    except (ValueError, TypeError) as e:
        errors.append(f"--staleness {cfg.staleness} / --threshold {cfg.threshold} / "
                      f"--chunk-steps {cfg.chunk_steps}: {e}")
    if cfg.infer_tp not in (1, 2, 4) or world_size % cfg.infer_tp or cfg.n_heads % cfg.infer_tp:
        errors.append(f"--infer-tp {cfg.infer_tp} must be 1, 2 or 4 and divide both the world size "
                      f"{world_size} and --n-heads {cfg.n_heads}")
    trainers = world_size // 2 if separated else world_size
    replicas = max(1, (world_size // 2 if separated else world_size) // max(1, cfg.infer_tp))
    if cfg.prompts_per_step < 1 or cfg.prompts_per_step % replicas:
        errors.append(f"--prompts-per-step {cfg.prompts_per_step} must be a positive multiple of the "
                      f"{replicas} rollout replicas (world size {world_size}, --deploy {cfg.deploy}, "
                      f"--infer-tp {cfg.infer_tp})")
    if cfg.updates_per_batch < 1 or cfg.updates_per_batch > cfg.prompts_per_step * cfg.group_size // trainers:
        errors.append(f"--updates-per-batch {cfg.updates_per_batch} must be in [1, samples per trainer]")
    if cfg.warmup_steps and (cfg.warmup_batch < trainers or cfg.warmup_batch % trainers):
        errors.append(f"--warmup-batch {cfg.warmup_batch} must be a positive multiple of the {trainers} "
                      "training ranks")
    if cfg.eval_prompts < world_size:
        errors.append(f"--eval-prompts {cfg.eval_prompts} must be at least the world size {world_size}")
    if not 1 <= cfg.max_digits <= 32:
        errors.append(f"--max-digits {cfg.max_digits} must be in [1, 32]")
    elif len(eval_set(cfg)[1]) >= sum(10 ** k for k in range(1, cfg.max_digits + 1)):
        errors.append(f"--eval-prompts {cfg.eval_prompts} with --max-digits {cfg.max_digits}: the held-out set "
                      "takes every possible prompt and leaves none to train on; allow more digits or fewer prompts")
    if cfg.max_new_tokens < cfg.max_digits + 1:
        errors.append(f"--max-new-tokens {cfg.max_new_tokens} cannot hold the longest answer "
                      f"({cfg.max_digits + 1} tokens); use at least {cfg.max_digits + 1}")
    if not cfg.temperature > 0:
        errors.append(f"--temperature {cfg.temperature} must be > 0")
    if not 0 < cfg.top_p <= 1:
        errors.append(f"--top-p {cfg.top_p} must be in (0, 1]")
    if cfg.kl_coef < 0 or cfg.clip_eps <= 0 or cfg.lr <= 0:
        errors.append(f"--kl-coef {cfg.kl_coef} must be >= 0, --clip-eps {cfg.clip_eps} and --lr {cfg.lr} > 0")
    if cfg.micro_batches < 1:
        errors.append(f"--micro-batches {cfg.micro_batches} must be >= 1")
    if not cfg.grad_clip > 0 or not cfg.warmup_lr > 0:
        errors.append(f"--grad-clip {cfg.grad_clip} and --warmup-lr {cfg.warmup_lr} must be > 0")
    if cfg.warmup_steps < 0 or cfg.seed < 0 or cfg.pg_timeout_s < 1:
        errors.append(f"--warmup-steps {cfg.warmup_steps} and --seed {cfg.seed} must be >= 0, "
                      f"--pg-timeout-s {cfg.pg_timeout_s} >= 1")
    if cfg.steps < 1 or cfg.eval_every < 1:
        errors.append(f"--steps {cfg.steps} and --eval-every {cfg.eval_every} must be >= 1")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        errors.append("--device cuda: no CUDA device is available; use --device cpu or auto")
    try:
        with torch.device("meta"):  # shapes only: the largest weight a bucket must hold
            params = dict(Policy(model_config(cfg)).named_parameters())
        biggest = max(((p.nbytes, n) for n, p in params.items() if not (cfg.train_ep and ".moe.w_" in n)),
                      key=lambda x: x[0])  # the first of the largest
        if cfg.bucket_kb * 1024 < biggest[0]:
            errors.append(f"--bucket-kb {cfg.bucket_kb} is smaller than the largest weight, {biggest[1]} "
                          f"({biggest[0]} bytes); use at least {-(-biggest[0] // 1024)}")
    except ValueError as e:
        errors.append(str(e))
    if errors:
        raise ValueError("bad arguments:\n  " + "\n  ".join(errors))


def model_config(cfg):
    return ModelConfig(vocab_size=VOCAB, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                       n_experts=cfg.n_experts, top_k=cfg.top_k, d_expert=cfg.d_expert,
                       max_seq_len=cfg.max_digits + 2 + cfg.max_new_tokens)


# ---------------------------------------------------------------------------------------------
# Helpers: timing spans, batching, distributed setup
# ---------------------------------------------------------------------------------------------

class Spans:
    """Times every phase through one helper. Keeps (name, start, end) for a per-rank timeline."""

    def __init__(self, device):
        self.device, self.spans = device, []

    @contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.spans.append((name, t0, time.perf_counter()))

    def total(self, name, since=0):
        return sum(t1 - t0 for n, t0, t1 in self.spans[since:] if n == name)


def response_batch(prompts, responses, *per_token):
    """Right-pad prompt + response rows. Returns tokens (B, T), a mask (B, T-1) over the positions
    that predict response tokens, and each per-token field (list of (n_i,)) aligned to that mask."""
    B, T = len(prompts), max(len(p) + len(r) for p, r in zip(prompts, responses))
    tokens = torch.full((B, T), PAD, dtype=torch.long)
    mask = torch.zeros(B, T - 1, dtype=torch.bool)
    fields = [torch.zeros(B, T - 1) for _ in per_token]
    for b, (p, r) in enumerate(zip(prompts, responses)):
        tokens[b, :len(p) + len(r)] = torch.cat([p, r])
        mask[b, len(p) - 1:len(p) + len(r) - 1] = True
        for f, values in zip(fields, per_token):
            f[b, len(p) - 1:len(p) + len(r) - 1] = values[b]
    return tokens, mask, fields


def policy_logprobs(model, tokens, temperature):
    """tokens (B, T) -> log-prob of each next token (B, T-1)."""
    return token_logprobs(model(tokens[:, :-1]), tokens[:, 1:], temperature)


def setup_distributed(cfg):
    """torchrun's environment, or a world of one. Returns rank, world size, device."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)  # before init_process_group
    timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
        else:  # plain `python train_grpo.py`: a world of one, no rendezvous needed
            dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def print0(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

EVAL_SEED = 20261129  # the held-out prompts' stream: fixed, whatever --seed says


def eval_set(cfg):
    """The held-out prompts: a fixed draw of --eval-prompts, and the set of distinct ones."""
    prompts = PromptStream(EVAL_SEED, cfg.max_digits).next(cfg.eval_prompts)
    return prompts, {tuple(p.tolist()) for p in prompts}


def prompt_streams(cfg):
    """(held-out prompts, warm-up stream, RL stream): the training streams never give a held-out prompt."""
    eval_prompts, held_out = eval_set(cfg)
    warm, rl = np.random.SeedSequence(cfg.seed).spawn(2)
    return eval_prompts, PromptStream(warm, cfg.max_digits, held_out), PromptStream(rl, cfg.max_digits, held_out)


class PromptStream:
    """An endless, seeded stream of prompts. Every rank draws the same global batch. exclude: prompts
    (tuples of tokens) redrawn whenever drawn: the training streams never give a held-out prompt."""

    def __init__(self, seed, max_digits, exclude=frozenset()):
        self.rng, self.max_digits, self.exclude = np.random.default_rng(seed), max_digits, exclude

    def next(self, n):
        out, tries = [], 0
        while len(out) < n:
            tries += n - len(out)
            if tries > 1000 * n + 10**5:
                raise RuntimeError(f"{tries} draws gave only {len(out)} of {n} prompts outside the held-out set")
            out += [p for p in make_prompts(self.rng, n - len(out), self.max_digits)
                    if tuple(p.tolist()) not in self.exclude]
        return out

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["rng"]


def sample_seeds(cfg, step, first, n, per_step):
    """One sampling seed per sample, from its global index: independent of the world size and of the
    deployment, so every mode generates the same responses from the same weights."""
    return cfg.seed * 1_000_003 + step * per_step + torch.arange(first, first + n)


def full_state_dict(model):
    """Gather the FSDP2 shards into plain tensors (every rank gets the whole model), in the dense model's
    names and order: EP experts (one tensor per expert, on their owners) come back stacked (E, ...)."""
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    ep = {name: m for name, m in model.named_modules() if isinstance(m, moe_switch.EPMoE)}
    out = {}
    for k, v in full.items():
        name = k.rsplit(".", 2)[0]
        if name in ep and f"{name}.w_gate" not in out:  # the dense MoE's state_dict order: its own
            # parameters (w_gate, w_up, w_down) before its submodule's (router.weight)
            m = ep[name]
            for n in moe_switch.EXPERT_NAMES:  # every expert broadcast by its first holder, then stacked
                like = getattr(m, n)[m.layout.owned(dist.get_rank())[0]]
                experts = [p.detach().clone() if p.numel() else torch.empty_like(like) for p in getattr(m, n)]
                for e, t in enumerate(experts):
                    dist.broadcast(t, src=m.layout.holders(e)[0])
                out[f"{name}.{n}"] = torch.stack(experts)                       # (E, ...)
        if name not in ep or k.endswith(".router.weight"):
            out[k] = v
    return out


def global_sum(*values, device, group=None):
    """All-reduce a few floats in one collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def mean_loss_scale(n_local, device, group=None):
    """FSDP averages gradients over its ranks; this factor turns a rank's mean over its own n_local items
    into its share of the mean over the global batch (ranks hold different token counts)."""
    n_global, = global_sum(n_local, device=device, group=group)
    return n_local * dist.get_world_size(group) / max(n_global, 1.0)


@torch.no_grad()
def count_correct(engine, prompts, cfg):
    """Greedy decoding on these held-out prompts: the number answered exactly."""
    gen = generate(engine, prompts, torch.zeros(len(prompts), dtype=torch.long), cfg.max_new_tokens,
                   EOS, PAD, temperature=0)
    return sum(score(p, r) for p, r in zip(prompts, gen.tokens))


def param_groups(model, experts=None):
    """The optimizer's parameters. Under EP, the FSDP shards (DTensors) and the experts (plain tensors) go
    in two groups: a multi-tensor (foreach) step, CUDA's default, refuses to mix the two kinds."""
    if experts is None:
        return list(model.parameters())
    own = set(experts.expert_params(model))
    return [{"params": [p for p in model.parameters() if p not in own]},
            {"params": [p for p in model.parameters() if p in own]}]


def finish_grads(model, max_norm, experts=None):
    """Before opt.step(): under EP, the expert grads are synced first; then the global norm is clipped."""
    if experts is None:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    experts.sync_grads(model)
    return experts.clip_grads(model, max_norm)


def warmup(model, stream, cfg, device, rank, n_ranks, group=None, experts=None, on_step=None):
    """Supervised warm-up: cross-entropy on the reference answers, data parallel over `group`.
    on_step(steps done), optional: a heartbeat for ranks that wait for the warm-up to end."""
    opt = torch.optim.AdamW(param_groups(model, experts), lr=cfg.warmup_lr, betas=(0.9, 0.98), weight_decay=0.0)
    n = cfg.warmup_batch // n_ranks
    for i in range(cfg.warmup_steps):
        if on_step:
            on_step(i)
        prompts = stream.next(cfg.warmup_batch)[rank * n:(rank + 1) * n]
        tokens, mask, _ = response_batch(prompts, [answer(p) for p in prompts])
        tokens, mask = tokens.to(device), mask.to(device)
        nll = -policy_logprobs(model, tokens, 1.0)                                 # (B, T-1)
        loss = (nll * mask).sum() / mask.sum() * mean_loss_scale(int(mask.sum()), device, group)
        loss.backward()
        finish_grads(model, cfg.grad_clip, experts)
        opt.step()
        opt.zero_grad(set_to_none=True)


@dataclass
class Roles:
    """Who does what. colocated: every rank trains and generates (rollout replicas of infer_tp ranks).
    separated: ranks [0, W/2) train, ranks [W/2, W) generate."""
    rank: int
    world: int
    deploy: str
    infer_tp: int

    @property
    def trainers(self):
        return list(range(self.world // 2 if self.deploy == "separated" else self.world))

    @property
    def generators(self):
        return list(range(self.world // 2, self.world)) if self.deploy == "separated" else list(range(self.world))

    @property
    def replicas(self):  # rollout replicas: each generates its own slice of the prompts
        return len(self.generators) // self.infer_tp

    @property
    def replica(self):
        return (self.rank - self.generators[0]) // self.infer_tp

    @property
    def writes_queue(self):  # one rank per TP group puts the (identical) samples
        return self.rank in self.generators and (self.rank - self.generators[0]) % self.infer_tp == 0


class ExpertParallel:
    """The wiring of moe_switch.py (--train-ep P --infer-ep Q). The training model's MoE layers become
    EPMoE layers under the training EP layout, outside FSDP (its ignored_params); the engine's under the
    inference layout. At each phase change the expert weights themselves move between the layouts,
    bucket by bucket (moe_switch.reshard): after fusion.py has offloaded their grads and Adam states,
    to_infer() re-shards them and the engine's experts alias the moved tensors (no copy); to_train()
    moves them back, bit for bit. The gradient of an owned expert sums its EP group's tokens: it is
    scaled to the mean over all ranks and summed over the layout's replicas (sync_grads)."""

    def __init__(self, cfg, world, timeout_s):
        E = cfg.n_experts
        self.train_layout = moe_switch.EPLayout(cfg.train_ep, world, E)
        self.infer_layout = moe_switch.EPLayout(cfg.infer_ep, world, E)
        self.train_groups = moe_switch.new_groups(self.train_layout, timeout_s)  # (EP, DP); collective
        self.infer_groups = moe_switch.new_groups(self.infer_layout, timeout_s)
        self.bucket_bytes, self.world, self.stats = cfg.bucket_kb * 1024, world, {}

    @staticmethod
    def layers(module):
        return [b.moe for b in module.blocks]

    def to_ep(self, model, engine):
        """Swap the dense MoE layers for EP ones: the model's keep its weights, the engine's stay empty."""
        for block in model.blocks:
            block.moe = moe_switch.EPMoE.from_dense(block.moe, self.train_layout, self.train_groups[0])
        if engine is not None:
            for block in engine.blocks:
                moe = block.moe
                block.moe = moe_switch.EPMoE(moe.w_gate.shape[1], moe.w_gate.shape[2], moe.w_gate.shape[0],
                                             moe.top_k, self.infer_layout, self.infer_groups[0])
                block.moe.to(moe.router.weight.device).requires_grad_(False)
                self._untie(block.moe)

    def expert_names(self, module):
        return {n for n, _ in module.named_parameters() if n.split(".")[-2] in moe_switch.EXPERT_NAMES}

    def expert_params(self, module):
        names = self.expert_names(module)
        return [p for n, p in module.named_parameters() if n in names]

    @staticmethod
    def _untie(moe):
        for n in moe_switch.EXPERT_NAMES:
            for p in getattr(moe, n):
                p.data = p.data.new_empty(0)

    @torch.no_grad()
    def to_infer(self, model, engine):
        t0, moved = time.perf_counter(), []
        for m, e in zip(self.layers(model), self.layers(engine)):
            moved.append(m.switch(self.infer_layout, self.infer_groups[0], self.bucket_bytes))
            for n in moe_switch.EXPERT_NAMES:
                for pm, pe in zip(getattr(m, n), getattr(e, n)):
                    pe.data = pm.data  # the engine's experts are the moved tensors themselves
        self._record("to_infer", t0, moved)

    @torch.no_grad()
    def to_train(self, model, engine):
        t0, moved = time.perf_counter(), []
        for m, e in zip(self.layers(model), self.layers(engine)):
            self._untie(e)  # the switch must hold the only reference, or nothing could be freed
            moved.append(m.switch(self.train_layout, self.train_groups[0], self.bucket_bytes))
        self._record("to_train", t0, moved)

    def _record(self, key, t0, moved):
        self.stats.update({f"time/ep_{key}_s": time.perf_counter() - t0,
                           f"ep/{key}_bytes_moved": sum(s["bytes_moved"] for s in moved),
                           f"ep/{key}_bytes_min": sum(s["bytes_min"] for s in moved),
                           f"ep/{key}_peak_extra_bytes": max(s["peak_extra_bytes"] for s in moved),
                           f"ep/{key}_layer_peak_switch_bytes": max(s["peak_switch_bytes"] for s in moved),
                           f"ep/{key}_layer_target_bytes": moved[0]["to_bytes"]})  # one layer at a time

    def sync_grads(self, model):
        """After backward: owned expert grads, summed over the EP group's tokens, become the mean over all
        ranks (what FSDP gives the dense weights): summed over the replicas, divided by the world."""
        grads = [p.grad for p in self.expert_params(model) if p.numel()]
        flat = torch.cat([g.flatten() for g in grads]) / self.world
        if self.train_layout.dp > 1:
            dist.all_reduce(flat, group=self.train_groups[1])
        for g, f in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(f.view_as(g))

    def clip_grads(self, model, max_norm):
        """clip_grad_norm_ over the FSDP shards and the owned experts together."""
        experts = self.expert_params(model)
        ids = set(map(id, experts))
        dense = [p.grad for p in model.parameters() if id(p) not in ids and p.grad is not None]
        norm = torch.nn.utils.get_total_norm(dense)
        sq = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double() ** 2
        own = sum(p.grad.double().pow(2).sum() for p in experts if p.numel())
        own = own.reshape(1)
        dist.all_reduce(own)  # every expert counted once per replica
        total = (sq + own[0] / self.train_layout.dp).sqrt()
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        return total


def build(cfg, roles, device):
    """The training model (FSDP2 over the trainers), the rollout engine and the process groups."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    W, separated = roles.world, cfg.deploy == "separated"
    timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)  # every group gets one: a dead peer must not hang us
    if separated:  # FSDP over the trainers only; generators get the weights through push_group
        train_group = dist.new_group(roles.trainers, timeout=timeout)
        train_mesh = DeviceMesh.from_group(train_group, device.type) if roles.rank in roles.trainers else None
        push_group, tp_group = dist.new_group([0] + roles.generators, timeout=timeout), None
    else:          # FSDP over everyone; the rollout engine is TP over groups of infer_tp ranks
        train_group, train_mesh, push_group = dist.group.WORLD, init_device_mesh(device.type, (W,)), None
        tp_group = fusion.Layout(W, tp=cfg.infer_tp, n_heads=cfg.n_heads).new_groups(cfg.pg_timeout_s)[0]
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = Policy(model_config(cfg)).to(device)
    rank_trains = roles.rank in roles.trainers
    engine = Policy(model_config(cfg), tp_group).to(device).eval().requires_grad_(False) \
        if roles.rank in roles.generators else None
    experts = ExpertParallel(cfg, W, cfg.pg_timeout_s) if cfg.train_ep else None
    if experts:  # the experts leave FSDP: EP shards them, moe_switch.py re-shards them
        experts.to_ep(model, engine)
    if rank_trains:  # sharded at rest; gathered from a forward to its backward (ZeRO-2's traffic, not ZeRO-3's)
        ignored = set(experts.expert_params(model)) if experts else None
        for block in model.blocks:
            fully_shard(block, mesh=train_mesh, ignored_params=ignored, reshard_after_forward=False)
        fully_shard(model, mesh=train_mesh, ignored_params=ignored)
    return (model if rank_trains else None), engine, train_group, tp_group, push_group, experts


def train(cfg, out_dir=None):
    """Run warm-up then GRPO on the already-initialised process group. Returns (summary, model)."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    rank, world, device = setup_distributed(cfg)
    roles, separated = Roles(rank, world, cfg.deploy, cfg.infer_tp), cfg.deploy == "separated"
    if out_dir is None:  # rank 0 names the folder, everyone uses it
        name = [cfg.out or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))]
        dist.broadcast_object_list(name, src=0)
        out_dir = name[0]
    os.makedirs(out_dir, exist_ok=True)
    spans = Spans(device)
    eval_prompts, warm_stream, rl_stream = prompt_streams(cfg)  # the held-out set is fixed, never trained on
    is_trainer, is_generator = rank in roles.trainers, rank in roles.generators
    model, engine, train_group, tp_group, push_group, experts = build(cfg, roles, device)
    # The queue between rollout and training: samples travel packed, token-balanced over the trainers.
    # Its keys live in the process group's store, under a prefix of this run's own (out_dir).
    # When the generators run ahead (separated, S > 0), the staleness facts travel with the rows too, so
    # that the trainers can log them: every cell costs the queue some work, so only then.
    ahead = separated and cfg.staleness > 0
    stale_cols = ("start_version", "n_versions", "regenerated") if ahead else ()
    columns = {"prompt": "int64", "response": "int64", "old_logprobs": "float32", "reward": "float32",
               "advantage": "float32", **{c: "int64" for c in stale_cols}}
    queue = distqueue.DistQueue(distqueue.QueueSpec(
        columns=columns, scalars=("reward", "advantage") + stale_cols, stages={"train": tuple(columns)},
        timeout_s=cfg.pg_timeout_s, name=f"dq:{out_dir}"), distqueue.default_store(), rank, world,
        pg=None if device.type == "cpu" else dist.new_group(backend="gloo", timeout=datetime.timedelta(
            seconds=cfg.pg_timeout_s)))

    # --deploy separated: trainer 0 counts its warm-up steps in the store (a heartbeat); the generators
    # wait on it rather than in the first weight push, whose broadcast would time out on a long warm-up.
    # --staleness S > 0: the generators run ahead, decoupled from the trainers' steps; trainer 0
    # announces each new version in the store and the generators take it between two decode chunks.
    store, wkey = distqueue.default_store(), f"w:{out_dir}"
    heartbeat = f"{wkey}/warmup_steps"
    if is_trainer:
        with spans("warmup"):
            warmup(model, warm_stream, cfg, device, roles.trainers.index(rank), len(roles.trainers), train_group,
                   experts, on_step=(lambda i: store.set(heartbeat, str(i))) if separated and rank == 0 else None)
        if separated and rank == 0:
            store.set(heartbeat, str(cfg.warmup_steps))
    elif cfg.warmup_steps:  # a generator: wait while the count moves, at most pg_timeout_s without a step
        seen, since = None, time.monotonic()
        while seen != str(cfg.warmup_steps):
            now = store.get(heartbeat).decode() if store.check([heartbeat]) else None
            seen, since = now, (time.monotonic() if now != seen else since)
            if time.monotonic() - since > cfg.pg_timeout_s:
                raise TimeoutError(f"rank {rank}: trainer 0's warm-up made no step in {cfg.pg_timeout_s}s "
                                   f"(last at {seen} of {cfg.warmup_steps}): is it alive?")
            time.sleep(0.05)
    opt = torch.optim.AdamW(param_groups(model, experts), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0) \
        if is_trainer else None
    ref = None
    if is_trainer and (cfg.kl_coef > 0 or cfg.deploy == "colocated-all"):  # the frozen initial policy
        ref = Policy(model_config(cfg)).to(device).eval().requires_grad_(False)
        ref.load_state_dict(full_state_dict(model))
        ref = fusion.HostOffloaded(ref) if cfg.deploy == "colocated-all" else ref
    actor = None if separated else fusion.FusedActor(
        model, opt, engine, fusion.Layout(world, fsdp=True),
        fusion.Layout(world, tp=cfg.infer_tp, n_heads=cfg.n_heads), bucket_bytes=cfg.bucket_kb * 1024,
        skip=experts.expert_names(model) if experts else ())

    def to_rollout():  # colocated: fusion.py's switch, then (EP) the experts' own re-sharding
        if actor:
            actor.to_rollout()
            if experts:
                experts.to_infer(model, engine)
                actor.record()  # mem/rollout_*: with the experts in their inference layout

    def to_train():
        if actor:
            if experts:
                experts.to_train(model, engine)
            actor.to_train()

    @contextmanager
    def rolled_out():
        to_rollout()
        try:
            yield
        finally:
            to_train()

    def push():  # separated: the trainers' weights to the generators, in buckets (every rank calls)
        with spans("switch"):
            fusion.push_weights(model, engine, 0, push_group, cfg.bucket_kb * 1024)

    def evaluate():
        """Greedy held-out accuracy from the current weights, split over the rollout replicas."""
        correct = 0.0
        if is_generator:
            with spans("eval"), rolled_out():
                i, n = roles.replica, roles.replicas
                correct = count_correct(engine, eval_prompts[i * len(eval_prompts) // n:
                                                             (i + 1) * len(eval_prompts) // n], cfg)
        correct, = global_sum(correct if roles.writes_queue else 0.0, device=device)
        return correct / len(eval_prompts)

    if separated:
        push()
    acc = acc_before = evaluate()
    print0(f"warm-up: {cfg.warmup_steps} steps in {spans.total('warmup'):.1f}s | held-out accuracy {acc:.3f}")
    metrics_file = open(os.path.join(out_dir, "metrics.jsonl"), "w") if rank == 0 else None
    if metrics_file:
        metrics_file.write(json.dumps({"step": 0, "eval/accuracy": acc}) + "\n")

    G, n_prompts = cfg.group_size, cfg.prompts_per_step // roles.replicas
    n_local, per_step = n_prompts * G, cfg.prompts_per_step * G
    sched = None
    if is_generator:  # the rollout scheduler; S = 0 is the synchronous round
        prompt_buffer = []

        def next_prompt():  # this replica's slice of each global batch, in order
            if not prompt_buffer:
                prompt_buffer.extend(rl_stream.next(cfg.prompts_per_step)[roles.replica * n_prompts:
                                                                          (roles.replica + 1) * n_prompts])
            return prompt_buffer.pop(0)

        def seed_of(i):  # sample i of this replica: the seed the synchronous step would give it
            return int(sample_seeds(cfg, i // n_local + 1, roles.replica * n_local + i % n_local, 1, per_step))

        # Decode chunks of a round continue from the engine's KV cache (S > 0); sched.update() drops it
        # (the new weights must read every prefix again).
        sampler = Sampler(engine, cfg.max_new_tokens, EOS, PAD, cfg.temperature, cfg.top_p)
        sched = stalesync.StaleSync(stalesync.StaleConfig(cfg.staleness, n_prompts, G, cfg.threshold,
                                                          cfg.chunk_steps), sampler, next_prompt, seed_of)
    regenerated = [0]  # this replica's regenerations already reported

    def put_batch(b):  # 2-4. score, group advantages (a group never spans replicas), into the queue
        rewards = torch.tensor([score(p, r) for p, r in zip(b.prompts, b.responses)])
        adv = group_advantages(rewards, G, scale_by_std=cfg.scale_by_std)
        new = b.metrics["stale/regenerated"] - regenerated[0]  # reported once, on the batch's first row
        regenerated[0] += new
        if roles.writes_queue:
            stale = {"start_version": b.start_versions, "n_versions": [len(set(v.tolist())) for v in b.token_versions],
                     "regenerated": [new] + [0] * (len(b.ids) - 1)}
            queue.put({"prompt": b.prompts, "response": b.responses, "old_logprobs": b.logprobs,
                       "reward": rewards.tolist(), "advantage": adv.tolist(), **{c: stale[c] for c in stale_cols}})
        return rewards, new

    def is_eval_step(step):
        return step == 1 or step % cfg.eval_every == 0 or step == cfg.steps

    posted = []  # colocated: not-ready flags in flight, (work, tensor)

    def all_ready(mine):  # colocated: a rank whose batch is ready keeps decoding its tail until all are
        flag = torch.tensor([float(mine)], device=device)
        if not mine:  # the MIN is 0 whatever the others say: post the flag and go on decoding, no wait
            posted.append((dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True), flag))
            return False
        with spans("idle"):  # a ready rank waits for the answer: idle time
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            for work, _ in posted:  # paired by now (collectives match in order): surface any error
                work.wait()
        posted.clear()
        return bool(flag.item())

    def wait_for(keys, what):  # poll the store, serving the queue all along; a dead peer times out
        deadline = time.monotonic() + cfg.pg_timeout_s
        while not store.check(keys):
            queue.serve()
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: no {what} after {cfg.pg_timeout_s}s (keys {keys})")
            time.sleep(0.001)

    def generate_ahead():
        """The generators' whole RL phase when they run ahead (separated, S > 0): decode chunks go on while
        the trainers train; new weights come in between two chunks (the in-flight samples continue under
        them, a partial rollout); each batch enters the queue as soon as StaleSync's cut allows."""
        while sched.version < cfg.steps:
            if store.check([f"{wkey}/{sched.version + 1}"]):
                push()
                sched.update(sched.version + 1)  # also drops the sampler's cache: prefixes are read again
                if is_eval_step(sched.version):  # scored here, read by trainer 0 when it logs that step
                    i, n = roles.replica, roles.replicas
                    with spans("eval"):
                        c = count_correct(engine, eval_prompts[i * len(eval_prompts) // n:
                                                                (i + 1) * len(eval_prompts) // n], cfg)
                    if roles.writes_queue:
                        store.set(f"{wkey}/eval/{sched.version}/{i}", str(c))
                continue
            n_tok = 0
            if sched.batches_out < cfg.steps:
                sched.admit()
                with spans("rollout"):
                    n_tok = sched.decode()
                while sched.ready() and sched.batches_out < cfg.steps:
                    put_batch(sched.take())
            queue.serve()
            if n_tok == 0:  # nothing admissible in flight: wait for the next version (age bound S)
                with spans("idle"):
                    wait_for([f"{wkey}/{sched.version + 1}"], f"weights of version {sched.version + 1}")

    if ahead and is_generator:
        generate_ahead()
        queue.drain()  # every row it put has reached the trainers (they read the last before the last push)
    rl_tokens, rl_time, regen_total, q_sent, q_padded = 0.0, 0.0, 0, 0.0, 0.0
    for step in tqdm(range(1, cfg.steps + 1) if not (ahead and is_generator) else [], disable=rank != 0,
                     desc="GRPO", dynamic_ncols=True):
        first_span, t0 = len(spans.spans), time.perf_counter()
        reward_sum, n_tok, age_max, age_sum, partial, regen, rec = 0.0, 0, 0.0, 0.0, 0, 0, {}
        if is_generator:  # 1-4. G responses per prompt of this replica's slice, scored, into the queue
            with spans("switch"):
                to_rollout()
            # S > 0: the round ends once every rank has enough complete groups; the rest continue later
            b = sched.rollout(spans, None if separated else all_ready)
            sampler.reset()  # free the engine's KV cache before TRAIN (update() would drop it only after)
            with spans("switch"):
                to_train()
            rewards, new_regen = put_batch(b)
            if roles.writes_queue:  # this replica's figures; summed (max for the age) over replicas below
                reward_sum, n_tok = float(rewards.sum()), sum(len(t) for t in b.responses)
                age_max, age_sum = b.metrics["stale/age_max"], b.metrics["stale/age_mean"] * len(b.ids)
                partial, regen = b.metrics["stale/partial_continued"], new_regen
                if separated:
                    queue.drain()  # serve the trainers' reads before blocking in the weight push
        stats = np.zeros(6)
        if is_trainer:  # 5-6. a token-balanced share of the global batch; reference log-probs; updates
            only = None
            if ahead:  # batch step - 1 of every replica, whichever replica runs furthest ahead (row ids:
                # a writer's j-th row is j * world + rank, and it puts n_local rows per batch, in order)
                writers = [r for r in roles.generators if (r - roles.generators[0]) % cfg.infer_tp == 0]
                only = {j * world + w for w in writers for j in range((step - 1) * n_local, step * n_local)}
            with spans("queue"):
                batch = queue.get("train", per_step, dp_group=train_group, only=only)
            with spans("train"):
                stats = train_on(model, opt, ref, batch, cfg, device, train_group, experts)
            if ahead:  # what the generators would have reported, from the rows themselves
                ages = [step - 1 - int(v) for v in batch.stack("start_version").tolist()]
                reward_sum, n_tok = float(batch.stack("reward").sum()), sum(len(r) for r in batch.cols["response"])
                age_max, age_sum = float(max(ages, default=0)), float(sum(ages))
                partial = int((batch.stack("n_versions") > 1).sum())  # continued under newer weights
                regen = int(batch.stack("regenerated").sum())
        if separated:
            if ahead and rank == 0:
                store.set(f"{wkey}/{step}", "1")  # the generators join the push at their next chunk boundary
            push()
        if sched:
            sched.update()  # the sampler now has the weights of version step
        qm = queue.metrics()  # cumulative per rank; summed over ranks below (over the trainers when ahead)
        group = train_group if ahead else None
        n_tok_all, reward_all, q_sent, q_padded, q_reads, age_all, partial_all, regen_all, *agg = global_sum(
            n_tok, reward_sum, qm["queue/bytes_sent"], qm["queue/bytes_padded_equiv"], qm["queue/reads"],
            age_sum, partial, regen, *stats, device=device, group=group)
        if cfg.staleness > 0:  # the oldest sample trained this step, over all replicas; the mean age
            t = torch.tensor([float(age_max)], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            rec["stale/age_max"], rec["stale/age_mean"] = t.item(), age_all / per_step
            regen_total += regen_all  # groups restarted because they would have aged past S, so far
            rec["stale/partial_continued"], rec["stale/regenerated"] = partial_all, regen_total
        step_s = time.perf_counter() - t0
        rl_tokens, rl_time = rl_tokens + n_tok_all, rl_time + step_s
        items, toks = max(agg[4], 1.0), max(agg[5], 1.0)  # token- (or sequence-) weighted over all trainers
        rec.update({"step": step, "reward/mean": reward_all / per_step, "loss": agg[0] / items,
                    "clip_frac": agg[1] / toks, "ratio_mean": agg[2] / toks, "k3_mean": agg[3] / toks,
                    "rollout/response_tokens": n_tok_all, "perf/tokens_per_s": n_tok_all / step_s,
                    "time/rollout_s": spans.total("rollout", first_span),
                    "time/train_s": spans.total("train", first_span),
                    "time/switch_s": spans.total("switch", first_span), "time/step_s": step_s,
                    # waiting: for samples (queue), or, ready first, for the other ranks' rollouts (idle)
                    "perf/idle_frac": sum(spans.total(n, first_span) for n in ("queue", "idle")) / step_s,
                    "queue/reads": q_reads,
                    # counted by the senders: the generators, which log nothing per step when ahead
                    **({} if ahead else {"queue/bytes_sent": q_sent, "queue/bytes_padded_equiv": q_padded}),
                    **(actor.metrics() if actor else {}), **(experts.stats if experts else {})})
        # after the step's figures are taken: the evaluation's own phase switch is not the step's
        if is_eval_step(step) and ahead:
            keys = [f"{wkey}/eval/{step}/{i}" for i in range(roles.replicas)]
            if rank == 0:
                wait_for(keys, f"held-out accuracy of version {step}")
                acc = rec["eval/accuracy"] = sum(float(store.get(k)) for k in keys) / len(eval_prompts)
        elif is_eval_step(step):
            acc = rec["eval/accuracy"] = evaluate()
        if metrics_file:
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
            tqdm.write(f"step {step} | reward {rec['reward/mean']:.2f} | acc {acc:.2f} | "
                       f"{rec['perf/tokens_per_s']:.0f} tok/s | rollout {rec['time/rollout_s']:.2f}s "
                       f"train {rec['time/train_s']:.2f}s")
    if ahead and is_generator:  # the queue's traffic is counted by its senders: they publish it
        store.set(f"{wkey}/queue/{rank}", json.dumps(queue.metrics()))
    if ahead and rank == 0:
        keys = [f"{wkey}/queue/{r}" for r in roles.generators]
        wait_for(keys, "the generators' queue counters")
        ms = [json.loads(store.get(k)) for k in keys]
        q_sent, q_padded = (sum(m[k] for m in ms) for k in ("queue/bytes_sent", "queue/bytes_padded_equiv"))
    summary = {"eval_accuracy_before": acc_before, "eval_accuracy_after": acc,  # rank 0's are the run's
               "wall_s": time.perf_counter() - t_start, "tokens_per_s": rl_tokens / max(rl_time, 1e-9),
               "queue_bytes_sent": q_sent, "queue_bytes_padded_equiv": q_padded,
               "world_size": world, "config": dataclasses.asdict(cfg)}
    with open(os.path.join(out_dir, f"spans_rank{rank}.jsonl"), "w") as f:
        for name, s0, s1 in spans.spans:
            f.write(json.dumps({"rank": rank, "name": name, "start": s0 - t_start, "end": s1 - t_start}) + "\n")
    if metrics_file:
        metrics_file.close()
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print0(f"held-out accuracy {acc_before:.3f} -> {acc:.3f} | {summary['wall_s']:.0f}s | "
               f"{summary['tokens_per_s']:.0f} tok/s | {out_dir}")
    return summary, model


def length_chunks(rows, lengths, k):
    """Split rows into exactly k chunks of similar length (sorted), so that each forward pads only to its
    own chunk's longest row. Every rank must run the same number of FSDP forwards and backwards, so an
    empty chunk becomes a stand-in row with weight 0. Returns [(rows, is_stand_in)]."""
    by_len = sorted(rows, key=lambda i: lengths[i])
    return [(list(c), False) if len(c) else ([0], True) for c in np.array_split(np.array(by_len, dtype=int), k)]


def train_on(model, opt, ref, batch, cfg, device, group, experts=None):
    """GRPO updates on this rank's share of the batch. Returns sums to be added over the ranks, then divided:
    [loss x items, clip_frac x tokens, ratio_mean x tokens, k3_mean x tokens, items, tokens] (items: the
    loss's unit, tokens or sequences), so that the logged figures are means over the whole batch."""
    P, R, B = batch.cols["prompt"], batch.cols["response"], len(batch.ids)
    lengths = [len(p) + len(r) for p, r in zip(P, R)]
    adv_all = batch.stack("advantage")                                              # (B,)

    def padded(rows, *per_row):  # tokens (b, T), response mask (b, T-1), then per-token fields (b, T-1)
        tokens, mask, fields = response_batch([P[i] for i in rows], [R[i] for i in rows],
                                              *[[f[i] for i in rows] for f in per_row])
        return tokens.to(device), mask.to(device), [f.to(device) for f in fields]

    # 5. Before any update: reference log-probs (colocated-all: the reference visits the device) and,
    # for the decoupled objective, the proximal log-probs of the current weights; kept per row.
    ref_lp, prox_lp = {}, {}
    if ref is not None or cfg.decoupled:
        with torch.no_grad(), (fusion.on_device(ref) if isinstance(ref, fusion.HostOffloaded)
                               else contextlib.nullcontext(ref)) as ref_module:
            for rows, _ in length_chunks(range(B), lengths, cfg.micro_batches):
                tokens, mask, _ = padded(rows)
                for store, m in ((ref_lp, ref_module), (prox_lp, model if cfg.decoupled else None)):
                    if m is not None:
                        lp = policy_logprobs(m, tokens, cfg.temperature)            # (b, T-1)
                        store.update({i: lp[j][mask[j]].cpu() for j, i in enumerate(rows)})  # (n_i,)
        fusion.reshard_all(model)  # FSDP2 leaves modules unsharded after a no-grad forward
    stats = np.zeros(6)
    # 6. optimizer steps over mini-batches, each accumulated over length-sorted micro-batches
    for mb in np.array_split(np.arange(B), cfg.updates_per_batch):
        token_mean = cfg.loss_agg == "token-mean"
        n_global, = global_sum(sum(len(R[i]) for i in mb) if token_mean else len(mb), device=device, group=group)
        chunks = length_chunks(mb, lengths, cfg.micro_batches)
        for i, (rows, stand_in) in enumerate(chunks):
            # FSDP2 gradient accumulation: gradients reduce-scattered once, after the last micro-batch, and
            # the parameters kept gathered in between (the usual trade: full-size grads while accumulating)
            last = i == len(chunks) - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            fields = [batch.cols["old_logprobs"]] + [f for f in (ref_lp, prox_lp) if f]
            tokens, mask, (old_lp, *rest) = padded(rows, *fields)
            ref_t = rest.pop(0) if ref_lp else None                                  # (b, T-1)
            lp = policy_logprobs(model, tokens, cfg.temperature)                    # (b, T-1)
            weights = None
            if cfg.decoupled:  # clip around the proximal policy, reweight by pi_prox / pi_behaviour
                old_lp, weights = stalesync.off_policy_logprobs(old_lp, rest.pop(0), decoupled=True)
            loss, m = grpo_loss(lp, old_lp, ref_t, adv_all[rows].to(device), mask, cfg.clip_eps, cfg.kl_coef,
                                cfg.loss_agg, weights)
            # This chunk's share of the mean over the global mini-batch (FSDP averages over ranks).
            n_items = int(mask.sum()) if token_mean else len(rows)
            (loss * (0.0 if stand_in else n_items * dist.get_world_size(group) / max(n_global, 1.0))).backward()
            if not stand_in:
                n_tok = float(mask.sum())
                stats += [loss.item() * n_items, m["clip_frac"] * n_tok, m["ratio_mean"] * n_tok,
                          m["k3_mean"] * n_tok, n_items, n_tok]
        finish_grads(model, cfg.grad_clip, experts)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return stats


def main(argv=None):
    parser, cfg = parse_args(argv)
    try:
        validate(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    except ValueError as e:
        parser.error(str(e))
    setup_distributed(cfg)
    try:
        train(cfg)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
