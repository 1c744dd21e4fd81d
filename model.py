# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""The tiny MoE policy: a decoder-only transformer, and batched sampling with a KV cache.

Architecture, Qwen-MoE / DeepSeek-MoE style: token embedding -> L x [RMSNorm -> causal attention with
RoPE -> RMSNorm -> MoE of SwiGLU experts behind a softmax top-k router] -> RMSNorm -> vocabulary head.
The expert weights are stacked tensors `[E, ...]`, so that one einsum runs every expert (departure 2);
moe_switch.py's expert-parallel layers cut the stack into a tensor per expert, each moved and freed alone.

Sampling (`generate`) is batched over prompts of different lengths, left-padded, with a KV cache:
- temperature and top-p; greedy when temperature is 0;
- it stops a row at EOS or when its response reaches `max_new_tokens`;
- it returns, for every generated token, its behaviour log-prob: log softmax(logits / temperature),
  the same quantity that `grpo.token_logprobs` recomputes in a training forward;
- it continues sequences that were cut part-way: pass prompt + partial response as the context and
  the number of response tokens already made (`n_done`). A round can be cut after `max_steps`;
- the prefill reads the contexts in length buckets, one forward each: a partial rollout's long held
  rows do not pad every short new prompt to their length (`_length_buckets`);
- `Sampler(keep=True)` is the same sampler as an object that keeps the cut rows' KV cache for its next
  call, so that a scheduler decoding in chunks (stalesync.py) reads each prefix once per weight version;
- with its experts spread over ranks (moe_switch.py's EPMoE in the engine), every forward meets the peers'
  in all-to-alls, so the ranks decode in lock-step (`LockStep`): the same number of forwards on each, a
  rank with no rows running forwards of zero rows; one agreement per prefill and per decode chunk;
- `Sampler(routes=True)` records, per response token and MoE layer, the experts chosen as the decode forward
  that read it ran (a routing hook on each MoE layer); the training forward compares with them, or replays
  them (grpo.py's ReplayRoutes). The record is kept per seed until the row is done, and a prefix read again
  under new weights (a cut row's prefill after reset()) routes its response tokens with it (ReplayRecorded):
  what training replays is what the behaviour computed with.

Departures from a production sampler, on purpose:
1. Randomness is counter-based: the uniform that picks a token is a hash of (the sample's seed, the
   token's position). A sample is then the same whether it runs alone or in a batch, in one round or
   cut and continued, on one rank or another: the tests check exactly that.
2. For a few tokens at a time (decoding), the MoE computes every expert densely and combines them with
   the (mostly zero) top-k gates: on 2 CPU cores that beats routing for a model this small. For many
   tokens (training, prefill) it routes each token to its k experts. The math is the same either way,
   and the same as the dispatch across ranks that moe_switch.py implements.
3. Behaviour log-probs ignore the top-p truncation (as verl does): they are the log-probs the trainer
   recomputes. The default top-p is 1, where the two agree.
4. Tensor parallelism (`Policy(cfg, tp_group)`, t ranks) is for inference only (plain all_reduce, no
   autograd): attention keeps H/t heads (qkv cut by head, out by its input), every expert keeps F/t of
   its hidden width; router, embedding, norms and head are replicated. `load_weights` takes full or
   pre-cut weights by name, as vLLM's does, and cuts full ones per `tp_plan` (fusion.py feeds it).

Shapes: B batch, T tokens, D model width, H heads, hd head width, E experts, K top-k, F expert width,
V vocabulary, L layers.

    python -m pytest tests/test_model.py
"""
import datetime
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab_size: int = 14      # V: the task's alphabet (task.py defines it)
    d_model: int = 64         # D
    n_layers: int = 2         # L
    n_heads: int = 4          # H
    n_experts: int = 4        # E
    top_k: int = 2            # K experts per token
    d_expert: int = 128       # F: hidden width of one SwiGLU expert
    max_seq_len: int = 96     # longest prompt + response (RoPE table size)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model={self.d_model} must split into n_heads={self.n_heads} heads "
                             "of even width")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_table(cfg: ModelConfig):
    hd = cfg.d_model // cfg.n_heads
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)     # (hd/2,)
    angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)         # (maxT, hd/2)
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # (maxT, hd)


def apply_rope(x, cos, sin):
    """x (B, H, T, hd); cos, sin (B, 1, T, hd) already gathered at each token's position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def tp_rank_size(group):
    """(rank, size) in a tensor-parallel group; (0, 1) without one."""
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


@dataclass(frozen=True)
class TPLayout:
    """The rollout engine's layout over W ranks: rank grid arange(W).view(W // t, t), a TP group per row (t
    adjacent ranks: one replica), a DP group per column. (Training's is FSDP2's own, over all W ranks.)"""
    world_size: int     # W
    tp: int = 1         # t, the tensor-parallel degree: 1, 2 or 4
    n_heads: int = 0    # attention heads, which t must divide (0: not checked)

    def __post_init__(self):
        errors = []
        if self.world_size < 1:
            errors.append("the world size must be >= 1")
        if self.tp not in (1, 2, 4):
            errors.append(f"TP degree {self.tp} must be 1, 2 or 4")
        elif self.world_size % self.tp:
            errors.append(f"TP degree {self.tp} does not divide the world size {self.world_size}")
        if self.n_heads and self.n_heads % self.tp:
            errors.append(f"TP degree {self.tp} does not divide n_heads {self.n_heads}")
        if errors:
            raise ValueError(f"bad layout (world size {self.world_size}, tp {self.tp}, n_heads {self.n_heads}): "
                             + "; ".join(errors))

    def new_groups(self, timeout_s=300.0):
        """(TP group, DP group) of this rank (a row, a column of the grid; None: one rank). Collective."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.world_size:
            raise ValueError(f"layout world size {self.world_size} != process group size {world}")
        grid, mine = torch.arange(world).view(world // self.tp, self.tp), [None, None]  # (W / t, t)
        for kind, groups in enumerate((grid, grid.T)):  # the TP groups, then the DP groups
            for ranks in groups.tolist():
                if len(ranks) > 1:  # a group of one rank is None
                    group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
                    mine[kind] = group if dist.get_rank() in ranks else mine[kind]
        return tuple(mine)


class Attention(nn.Module):
    def __init__(self, cfg, tp_group=None):
        super().__init__()
        t = tp_rank_size(tp_group)[1]
        self.tp_group, self.n_heads, self.head_dim = tp_group, cfg.n_heads // t, cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model // t, bias=False)      # [q|k|v] x (H/t, hd) rows
        self.out = nn.Linear(cfg.d_model // t, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, mask=None, cache=None):
        B, T = x.shape[:2]
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)                  # (B, H, T, hd)
        if cache is not None:  # append to this layer's cache, attend over everything so far
            k, v = cache.append(k, v)                                            # (B, H, t, hd)
        if mask is None:  # training: right-padded rows, plain causal attention
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:             # sampling: left-padded rows, an explicit (B, 1, T, t) mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # (B, T, D)
        if self.tp_group is not None:  # each rank holds its heads' share of the output projection
            dist.all_reduce(y, group=self.tp_group)
        return y


# An MoE layer on N tokens runs every expert on every token while N x D x F <= DENSE_MOE_WORK: below it, a few batched
# matmuls cost less than each expert's gather, scatter and host sync, though they compute the experts a token did not
# choose too. A crossover fitted on CPU, for E = 4 to 16 experts (bench/prefill.py's MoE table); not measured on GPUs.
DENSE_MOE_WORK = 3 * 2 ** 18


class MoE(nn.Module):
    """Softmax router, top-k of E SwiGLU experts, gates renormalised over the chosen k."""

    def __init__(self, cfg, tp_group=None):
        super().__init__()
        E, D, Fx = cfg.n_experts, cfg.d_model, cfg.d_expert
        Fl = Fx // tp_rank_size(tp_group)[1]                                     # F/t hidden units here
        self.top_k, self.tp_group = cfg.top_k, tp_group
        self.dense_below = DENSE_MOE_WORK / (D * Fl)  # tokens; F/t hidden units here under TP
        self.routing = None  # optional hook: experts chosen (N, K) -> experts used (RecordRoutes, grpo.ReplayRoutes)
        self.router = nn.Linear(D, E, bias=False)
        self.w_gate = nn.Parameter(torch.randn(E, D, Fl) * D ** -0.5)
        self.w_up = nn.Parameter(torch.randn(E, D, Fl) * D ** -0.5)
        self.w_down = nn.Parameter(torch.randn(E, Fl, D) * Fx ** -0.5 / cfg.n_layers ** 0.5)

    def gates(self, x):
        """x (N, D) -> dense gates (N, E): the renormalised top-k probabilities, zero elsewhere."""
        probs = F.softmax(self.router(x).float(), dim=-1)                         # (N, E)
        top_p, top_i = probs.topk(self.top_k, dim=-1)                             # (N, K)
        if self.routing is not None:  # recorded, or replaced by a recorded choice (the gates stay this router's)
            top_i = self.routing(top_i)
            top_p = probs.gather(-1, top_i)                                       # (N, K)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        return torch.zeros_like(probs).scatter(-1, top_i, top_p).to(x.dtype)      # (N, E)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                              # (N, D)
        gates = self.gates(x)                                                     # (N, E)
        if x.shape[0] <= self.dense_below:  # a few tokens: every expert on every token, combined by gates
            h = F.silu(torch.einsum("nd,edf->enf", x, self.w_gate)) \
                * torch.einsum("nd,edf->enf", x, self.w_up)                       # (E, N, F)
            y = torch.einsum("enf,efd->end", h, self.w_down)                      # (E, N, D)
            out = torch.einsum("ne,end->nd", gates, y)
        else:  # more: each expert only on the tokens routed to it
            out = torch.zeros_like(x)
            for e in range(gates.shape[1]):
                idx = gates[:, e].nonzero().squeeze(-1)                           # (n_e,) host sync
                xe = x[idx]                                                       # (n_e, D)
                ye = (F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])) @ self.w_down[e]
                out = out.index_add(0, idx, ye * gates[idx, e, None])             # (N, D)
        out = out.reshape(shape)
        if self.tp_group is not None:  # a partial sum over this rank's F/t hidden units
            dist.all_reduce(out, group=self.tp_group)
        return out


class Block(nn.Module):
    def __init__(self, cfg, tp_group=None):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.d_model, cfg.norm_eps), Attention(cfg, tp_group)
        self.moe_norm, self.moe = RMSNorm(cfg.d_model, cfg.norm_eps), MoE(cfg, tp_group)

    def forward(self, x, cos, sin, mask=None, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.moe(self.moe_norm(x))


class Policy(nn.Module):
    # Tensor-parallel split of each weight, by name suffix -> (dim, groups): `dim` is viewed as
    # (groups, size / groups) and every group is cut into t contiguous pieces, piece r to TP rank r.
    # qkv's rows are [q | k | v] x (H, hd), so groups=3 hands each rank H/t whole heads of q, k and v.
    # Weights not listed (embed, norms, router, head) are replicated.
    tp_plan = {"attn.qkv.weight": (0, 3), "attn.out.weight": (1, 1),             # (3D, D), (D, D)
               "moe.w_gate": (2, 1), "moe.w_up": (2, 1), "moe.w_down": (1, 1)}    # (E, D, F) x2, (E, F, D)

    def __init__(self, cfg: ModelConfig, tp_group=None):
        super().__init__()
        t = tp_rank_size(tp_group)[1]
        if cfg.n_heads % t or cfg.d_expert % t:
            raise ValueError(f"TP degree {t} must divide n_heads={cfg.n_heads} and d_expert={cfg.d_expert}")
        self.cfg, self.tp_group = cfg, tp_group
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, tp_group) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_table(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens, positions=None, mask=None, cache=None):
        """tokens (B, T) -> logits (B, T, V). Training passes tokens alone (right-padded, causal);
        sampling passes each token's position (B, T), a (B, 1, T, t) mask and a KVCache."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        x = self.embed(tokens)                                                   # (B, T, D)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask, None if cache is None else cache.layer(i))
        return self.head(self.norm(x)).float()                                   # (B, T, V)

    @torch.no_grad()
    def load_weights(self, weights):
        """vLLM-style loader: weights is an iterable of (name, tensor), each the full weight or already
        this rank's TP piece; full split weights are cut here per tp_plan. Returns the names loaded."""
        params, (rank, t), loaded = dict(self.named_parameters()), tp_rank_size(self.tp_group), set()
        for name, w in weights:
            p = params[name]
            split = next((s for suffix, s in self.tp_plan.items() if name.endswith(suffix)), None)
            if w.shape != p.shape and split is not None:  # a full weight: view dim as (groups, n), cut n
                dim, groups = split
                p, w = p.unflatten(dim, (groups, -1)), w.unflatten(dim, (groups, -1))
                w = w.narrow(dim + 1, rank * p.shape[dim + 1], p.shape[dim + 1])
            if w.shape != p.shape:
                raise ValueError(f"{name}: got shape {tuple(w.shape)}, expected {tuple(p.shape)} "
                                 f"(or the full weight) on TP rank {rank} of {t}")
            p.copy_(w)
            loaded.add(name)
        return loaded


# ---------------------------------------------------------------------------------------------
# Sampling with a KV cache
# ---------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------- routing, recorded and replayed
class RecordRoutes:
    """A MoE layer's routing hook that keeps the experts each token chose, (N, K), and uses them: the engine
    records, per response token and layer, the choice made as it generated (Sampler(routes=True))."""

    def __init__(self):
        self.chosen = None

    def __call__(self, top_e):
        self.chosen = top_e
        return top_e


class ReplayRecorded:
    """A MoE layer's routing hook for the engine's prefill: a token with recorded experts, recorded (N, K) >= 0,
    uses them (gated by this router's probabilities of them), so that a prefix read again under new weights keeps
    the choice made when its tokens were generated; a token with -1 (a prompt token, a pad, a token no forward
    has read yet) routes freely. Keeps the experts each token used, (N, K): the free choices fill the record."""

    def __init__(self, recorded):
        self.recorded, self.chosen = recorded, None

    def __call__(self, top_e):
        has = self.recorded[:, 0] >= 0                                            # (N,)
        self.chosen = torch.where(has[:, None], self.recorded, top_e)             # (N, K)
        return self.chosen


def moe_layers(model):
    """The modules that take a routing hook (a `routing` attribute: this file's MoE, moe_switch's EPMoE), in order.
    The training forward's hook, which compares with the record or replays it, is grpo.ReplayRoutes."""
    return [m for m in model.modules() if hasattr(m, "routing")]


@contextmanager
def routing(model, hooks):
    """Each MoE layer's routing hook set to hooks[layer] for the duration (None: free routing)."""
    layers = moe_layers(model)
    for layer, hook in zip(layers, hooks):
        layer.routing = hook
    try:
        yield hooks
    finally:
        for layer in layers:
            layer.routing = None


class KVCache:
    """Preallocated keys and values, (L, B, H, Tmax, hd). Every row fills the same columns (rows
    are left-padded), so one write index serves the batch."""

    def __init__(self, cfg, batch, max_len, device, dtype, n_heads=None):
        hd, H = cfg.d_model // cfg.n_heads, cfg.n_heads if n_heads is None else n_heads  # H/t under TP
        self.k = torch.zeros(cfg.n_layers, batch, H, max_len, hd, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length, self._layer = 0, 0

    def layer(self, i):
        self._layer = i
        return self

    def append(self, k, v):
        """Write k, v (B, H, T, hd) after the filled columns; return the filled keys and values."""
        i, t0, t1 = self._layer, self.length, self.length + k.shape[2]
        self.k[i, :, :, t0:t1], self.v[i, :, :, t0:t1] = k, v
        if i == self.k.shape[0] - 1:
            self.length = t1
        return self.k[i, :, :, :t1], self.v[i, :, :, :t1]

    def compact(self, finished):
        """Drop the finished rows, finished (B,) bool, from the batch. The naive way, self.k[:, live], copies
        every live row, up to once a decode step. Here only the live rows past the first B' are copied, into
        the finished slots among those, and the batch becomes the first B' rows, a view of the same memory.
        Returns order (B',): each row's index before; the caller reorders its per-row tensors by it. A row's
        place in the batch changes nothing but, in a small batch, a kernel's rounding: the same tokens, and
        log-probs the same or a few ulp apart (tests/test_model.py)."""
        done = finished.cpu()  # one host sync
        n = int((~done).sum())
        holes = done[:n].nonzero().squeeze(-1)                                    # (m,) finished, staying
        movers = (~done[n:]).nonzero().squeeze(-1) + n                           # (m,) live, leaving
        order = torch.arange(len(done))
        order[holes] = movers
        holes, movers, t = holes.to(self.k.device), movers.to(self.k.device), self.length  # columns >= t: empty
        self.k[:, holes, :, :t], self.v[:, holes, :, :t] = self.k[:, movers, :, :t], self.v[:, movers, :, :t]
        self.k, self.v = self.k[:, :n], self.v[:, :n]
        return order[:n].to(finished.device)


def _mix32(x):
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors."""
    x = x & 0xFFFFFFFF
    for mult in (0x7FEB352D, 0x846CA68B):
        x = ((x ^ (x >> 16)) * mult) & 0xFFFFFFFF
    return x ^ (x >> 16)


def counter_uniform(seeds, positions):
    """A uniform in [0, 1) that depends only on (seed, position): (B,), (B,) int64 -> (B,) float64.
    A stateless hash instead of a stateful RNG, so batching and cutting change nothing."""
    x = _mix32(_mix32(seeds) + positions * 0x9E3779B1)
    return (x >> 8).double() / float(1 << 24)


def sample_tokens(logits, u, temperature=1.0, top_p=1.0):
    """logits (B, V), u (B,) uniforms -> tokens (B,), behaviour log-probs (B,).
    Inverse-CDF sampling over the top-p nucleus of softmax(logits / temperature)."""
    if temperature == 0:
        tok = logits.argmax(-1)
        return tok, F.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
    logp = F.log_softmax(logits / temperature, dim=-1)                           # (B, V)
    p_sorted, order = logp.exp().sort(dim=-1, descending=True, stable=True)      # (B, V)
    p_sorted = p_sorted * ((p_sorted.cumsum(-1) - p_sorted) < top_p)            # nucleus; keeps the top
    cdf = p_sorted.double().cumsum(-1)                                          # (B, V)
    j = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)      # (B, 1)
    tok = order.gather(-1, j.clamp(max=logits.shape[-1] - 1)).squeeze(-1)        # (B,)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


@dataclass
class Generation:
    tokens: list       # per row: the new response tokens, (n_i,) int64
    logprobs: list     # per row: their behaviour log-probs, (n_i,) float32
    done: list         # per row: True if it hit EOS or its budget, False if cut by max_steps
    per_token: dict = field(default_factory=dict)  # Sampler(routes=True): "routes", per row (n_i, L, K) experts,
                                                   # -1 for a token no forward of this call read (see Sampler)


# What one more prefill forward costs, in tokens of work: its fixed cost plus the batching a split loses.
# `python bench/prefill.py` measures the fixed cost and what the split gains on the pools a stale rollout holds.
FORWARD_COST_TOKENS = 256


def _length_buckets(lens, forward_cost=FORWARD_COST_TOKENS):
    """Split rows into buckets prefilled one forward each, every bucket left-padded to its own longest row:
    the split of the rows sorted by length that minimises padded tokens + forward_cost per forward (a DP).
    A held long-tail row no longer makes every short new prompt pad to its length. lens: list of ints."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    longest = np.array([lens[i] for i in order], dtype=np.int64)              # (B,) descending
    best, cut = np.zeros(len(lens) + 1, dtype=np.int64), np.zeros(len(lens) + 1, dtype=np.int64)
    for j in range(1, len(lens) + 1):  # best[j]: rows order[:j]; a last bucket order[i:j] pads to longest[i]
        cost = best[:j] + (j - np.arange(j)) * longest[:j] + forward_cost       # (j,) one per choice of i
        cut[j] = int(cost.argmin())  # ties: the earliest i, the fewest buckets
        best[j] = cost[cut[j]]
    buckets, j = [], len(lens)
    while j > 0:
        buckets.append(sorted(order[cut[j]:j]))  # call order inside a bucket
        j = int(cut[j])
    return buckets[::-1]


def _prefill(model, contexts, pad_id, extra, forward_cost=FORWARD_COST_TOKENS, routes=None):
    """Left-pad contexts (list of (T_i,)) into (B, P) and read them into a fresh cache with room for
    `extra` more tokens, one forward per length bucket: a bucket padded to Pb fills the cache's last Pb
    columns, and the columns before them stay zero and invalid. Returns the cache, next-token logits
    (B, V) float32, validity (B, P) and lengths (B,). routes, optional (Sampler(routes=True)): per context,
    (T_i, L, K) the experts each token must use, -1 where it routes freely; each is overwritten with the
    experts its tokens used (the free choices filled in)."""
    B, dev, dtype = len(contexts), model.head.weight.device, model.head.weight.dtype
    n = [len(c) for c in contexts]
    P = max(n)
    cache = KVCache(model.cfg, B, P + extra, dev, dtype, model.blocks[0].attn.n_heads)
    logits = torch.empty(B, model.cfg.vocab_size, device=dev)                 # (B, V) float32, as forward's
    buckets = _length_buckets(n, forward_cost)
    for rows in buckets:
        Pb = max(n[i] for i in rows)
        tokens = torch.full((len(rows), Pb), pad_id, dtype=torch.long, device=dev)
        for b, i in enumerate(rows):
            tokens[b, Pb - n[i]:] = contexts[i].to(dev)
        lens = torch.tensor([n[i] for i in rows], device=dev)                  # (b,)
        valid = torch.arange(Pb, device=dev)[None, :] >= (Pb - lens)[:, None]  # (b, Pb)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)                 # (b, Pb)
        causal = torch.ones(Pb, Pb, dtype=torch.bool, device=dev).tril()
        # A pad query attends to itself only, so that its softmax is never over an empty set.
        mask = (causal & valid[:, None, :]) | torch.eye(Pb, dtype=torch.bool, device=dev)  # (b, Pb, Pb)
        part = cache if len(buckets) == 1 else KVCache(model.cfg, len(rows), Pb, dev, dtype, cache.k.shape[2])
        recorded = None if routes is None else _bucket_routes(routes, rows, n, Pb).to(dev)  # (b, Pb, L, K)
        hooks = [] if routes is None else [ReplayRecorded(recorded[:, :, i].flatten(0, 1))
                                           for i in range(recorded.shape[2])]
        with routing(model, hooks) if hooks else nullcontext():
            logits[rows] = model(tokens, positions, mask.unsqueeze(1), part)[:, -1]  # (b, V)
        if hooks:  # what each token used, back into its context's routes
            used = torch.stack([h.chosen for h in hooks], 1).view(recorded.shape).cpu()  # (b, Pb, L, K)
            for b, i in enumerate(rows):
                routes[i].copy_(used[b, Pb - n[i]:])
        if part is not cache:  # into the cache's last Pb columns
            idx = torch.tensor(rows, device=dev)
            cache.k[:, idx, :, P - Pb:P], cache.v[:, idx, :, P - Pb:P] = part.k, part.v
    cache.length = P
    lens = torch.tensor(n, device=dev)                                        # (B,)
    valid = torch.arange(P, device=dev)[None, :] >= (P - lens)[:, None]        # (B, P)
    return cache, logits, valid, lens


def _bucket_routes(routes, rows, n, Pb):
    """A bucket's rows' routes (T_i, L, K) left-padded as their tokens are, -1 at the pads: (b, Pb, L, K)."""
    L, K = routes[rows[0]].shape[1:]
    out = torch.full((len(rows), Pb, L, K), -1, dtype=torch.long)
    for b, i in enumerate(rows):
        out[b, Pb - n[i]:] = routes[i]
    return out


def _left_pad(x, t, dim):
    """Zeros (False) before x along dim, to length t: left-padded rows line up on their last column."""
    shape = list(x.shape)
    shape[dim] = t - x.shape[dim]
    return torch.cat([x.new_zeros(shape), x], dim)


class LockStep:
    """Decoding in lock-step over a group of ranks whose forwards meet in collectives: an expert-parallel
    engine's MoE layers send each rank's tokens to the experts' owners and back (all-to-alls), every layer,
    every forward. A rank that stopped calling forward would leave its peers waiting for its experts, so
    every rank runs the same number of forwards. Each Sampler call agrees once on its number of prefill
    forwards (one per length bucket: data-dependent), and its decode agrees every `every` forwards whether
    any rank still has rows; meanwhile a rank with none runs "dummy" forwards of zero rows of its own, which
    still compute its experts on its peers' tokens (vLLM's data-parallel dummy batch, SGLang's idle batch).
    Each agreement is one all-reduce of one integer: per decode chunk, never per token. A rank with nothing
    to decode calls Sampler.idle() (StaleSync does, as does any caller that skips a call its peers make)."""

    def __init__(self, group, device, every=8):
        if every < 1:
            raise ValueError(f"every={every} must be >= 1 (decode forwards between agreements)")
        self.group, self.device, self.every = group, torch.device(device), every
        self.agreements = self.dummy_forwards = 0  # counted, for the run's figures

    def most(self, n):
        """The largest n over the group: one all-reduce MAX."""
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self.agreements += 1
        return int(t.item())

    def dummy(self, model):
        """One forward of zero rows through every layer: its MoE layers join their all-to-alls."""
        model(torch.zeros(0, 1, dtype=torch.long, device=model.head.weight.device))
        self.dummy_forwards += 1


class Sampler:
    """generate() as an object that may keep its KV cache between calls: the step_fn of a scheduler that
    decodes in chunks (stalesync.py). With keep=True a row cut by max_steps leaves its keys, values and
    next-token logits behind, keyed by its seed; a later call naming that seed continues from them instead
    of re-reading the prefix, and rows new to the call are prefilled and merged in. The tokens are those
    of a fresh call (tests/test_model.py). reset() drops the cache: call it when the weights change (the
    prefix must be read again under the new weights) and when the rollout phase ends (it is engine memory).
    lockstep (a LockStep): the engine's ranks run the same forwards (expert parallelism), each call agreeing
    with its peers'; call idle() where a peer calls the sampler and this rank has no rows. routes=True: each
    generated token's experts, per MoE layer, as the decode forward that reads it chose them (Generation's
    per_token["routes"]; what a training forward replays, grpo.ReplayRoutes). The sampler keeps them per seed
    (`recorded`) until the row is done: they do not depend on the weights, so reset() keeps them, and the
    prefill that reads a continued row's context again (new weights) routes its response tokens, the last
    n_done, with them (prompt tokens and pads route freely): the behaviour then computes with the experts that
    training replays. A row starting afresh (n_done 0) drops its seed's record; a record that is not the
    row's response is refused. -1, no experts, marks a token that no forward of the call that made it read:
    - a finished row's last token (EOS or budget): nothing reads it, and training never reads it either;
    - keep=False with max_steps, a cut row's last token (the call ends before the forward that would read
      it). The prefill of the next call, which first reads it, records its choice in `recorded` (later
      re-reads replay it), but the routes that call returned keep -1 there: training routes that token
      freely. keep=True reads it in the chunk's last decode forward: never -1 there.
    A row abandoned part-way (its seed never called again) leaves its record behind: a few bytes a token.
    on_step(), optional: called between decode forwards, for a caller that must answer others while it decodes
    (the hybrid's actor serves the queue there: a group it put is pulled within a forward, not a chunk)."""

    def __init__(self, model, max_new_tokens, eos_id, pad_id=0, temperature=1.0, top_p=1.0, keep=True,
                 lockstep=None, routes=False, on_step=None):
        if not (float(temperature) >= 0 and float(temperature) < float("inf")) or not 0 < top_p <= 1:
            raise ValueError(f"temperature={temperature!r} must be finite and >= 0 (0: greedy) and top_p={top_p!r} "
                             "in (0, 1]")
        self.model, self.max_new_tokens, self.eos_id, self.pad_id = model, max_new_tokens, eos_id, pad_id
        self.temperature, self.top_p, self.keep, self.lockstep = temperature, top_p, keep, lockstep
        self.state, self.steps = None, 0  # steps: decode forwards run, each over every live row
        self._prefills = 0  # lock-step: the peers' prefill forwards this call runs with zero rows
        self.routes = routes  # record each response token's experts as a decode forward reads it
        self.recorded = {}  # routes=True: seed -> (its response so far (n,), their experts (n, L, K), -1: unread)
        self.on_step = on_step

    def reset(self):
        """Drop the KV cache (new weights, or the end of a rollout phase); the recorded routes stay."""
        self.state = None

    def state_dict(self):
        """The held rows' cache (seeds, keys, values, validity, positions, next logits), the step count and
        the recorded routes: with it a resumed scheduler continues bit-exactly; without it (reset()) the
        prefixes are read again, the same tokens up to rounding of the log-probs. An engine that cannot export
        its cache resets."""
        st = None if self.state is None else {k: (v.clone() if torch.is_tensor(v) else list(v))
                                              for k, v in self.state.items()}
        recorded = {s: (t.clone(), r.clone()) for s, (t, r) in self.recorded.items()}
        return dict(state=st, steps=self.steps, recorded=recorded)

    def load_state_dict(self, sd):
        self.state, self.steps = sd["state"], sd["steps"]
        # A checkpoint from before the record holds none: its prefixes route freely when read again.
        self.recorded = {int(s): (t, r) for s, (t, r) in sd.get("recorded", {}).items()}

    def budget(self, seeds, n_done):
        """Tokens each row may still make, (B,). Override for per-row budgets (bench/stalesync.py)."""
        return (self.max_new_tokens - n_done).clamp(min=0)

    def _resume(self, contexts, held, new, extra, routes):
        """The cache for held rows (from self.state) then new rows (prefilled, `routes` replayed), with room for
        `extra`."""
        st, model, dev = self.state, self.model, self.model.head.weight.device
        where = {s: i for i, s in enumerate(st["seeds"])}
        idx = torch.tensor([where[s] for _, s in held], device=dev)
        k, v = st["k"][:, idx], st["v"][:, idx]                                    # (L, R, H, t, hd)
        valid, pos, logits = st["valid"][idx], st["pos"][idx], st["logits"][idx]     # (R, t), (R,), (R, V)
        if any(not torch.equal(contexts[i].cpu(), st["ctx"][where[s]]) for i, s in held):
            raise RuntimeError("Sampler: a held row's context is not the one it was cut with (its prefix and the "
                               "tokens it made); reset() after new weights or to start a seed afresh")
        if new:
            c, lg, vd, ln = _prefill(model, [contexts[i] for i in new], self.pad_id, 0,
                                     routes=None if routes is None else [routes[i] for i in new])
            t = max(valid.shape[1], vd.shape[1])
            k = torch.cat([_left_pad(k, t, 3), _left_pad(c.k, t, 3)], 1)
            v = torch.cat([_left_pad(v, t, 3), _left_pad(c.v, t, 3)], 1)
            valid = torch.cat([_left_pad(valid, t, 1), _left_pad(vd, t, 1)], 0)
            pos, logits = torch.cat([pos, ln]), torch.cat([logits, lg])
        self.state = None  # gathered above: free the old cache before allocating the new one
        lead = int(valid.any(0).long().argmax())  # columns before it are padding in every row: drop them
        k, v, valid = k[:, :, :, lead:], v[:, :, :, lead:], valid[:, lead:]
        t = valid.shape[1]
        cache = KVCache(model.cfg, len(valid), t + extra, dev, k.dtype, model.blocks[0].attn.n_heads)
        cache.k[:, :, :, :t], cache.v[:, :, :, :t], cache.length = k, v, t
        return cache, logits, valid, pos

    def _check(self, contexts, budget, steps, call):
        """Refuse, before any work, an empty context, a row that would outgrow max_seq_len, and (keep=True)
        two rows with one seed."""
        B, max_len = len(contexts), self.model.cfg.max_seq_len
        if min(map(len, contexts)) == 0:
            raise ValueError(f"row {[len(c) for c in contexts].index(0)}: an empty context (a prompt needs a token)")
        need = [len(c) + min(steps, int(b)) for c, b in zip(contexts, budget.tolist())]  # per row: positions used
        if max(need) > max_len:
            i = max(range(B), key=need.__getitem__)
            raise ValueError(f"row {i}: context {len(contexts[i])} + {need[i] - len(contexts[i])} new tokens "
                             f"exceeds max_seq_len={max_len}")
        if self.keep and len(set(call)) != B:
            raise ValueError(f"Sampler(keep=True) keys rows by seed, but {B} rows have only "
                             f"{len(set(call))} distinct seeds")

    @torch.no_grad()
    def __call__(self, contexts, seeds, n_done=None, max_steps=None):
        model, B, dev = self.model, len(contexts), self.model.head.weight.device
        if B == 0:  # nothing to decode here; in lock-step, this rank's share of its peers' forwards
            return self.idle()
        n_done = torch.zeros(B, dtype=torch.long) if n_done is None else torch.as_tensor(n_done)
        seeds = torch.as_tensor(seeds, dtype=torch.long, device=dev)
        budget = self.budget(seeds, n_done).to(dev)                                # (B,) tokens left
        steps = int(budget.max()) if max_steps is None else min(max_steps, int(budget.max()))
        call = seeds.tolist()
        self._check(contexts, budget, steps, call)
        prior = self._recorded_routes(contexts, call, n_done)  # per row (T_i, L, K), or None: routes=False
        kept = set() if self.state is None else set(self.state["seeds"])
        held = [(i, s) for i, s in enumerate(call) if s in kept]
        new = [i for i, s in enumerate(call) if s not in kept]
        self._agree_prefill([len(contexts[i]) for i in new])
        if held:  # cache row r is call row order[r]: the held rows first, then the new ones
            order = torch.tensor([i for i, _ in held] + new, device=dev)
            cache, logits, valid, next_pos = self._resume(contexts, held, new, steps, prior)
        else:     # a fresh call: the naive path, one prefill of every context
            order = torch.arange(B, device=dev)
            cache, logits, valid, next_pos = _prefill(model, contexts, self.pad_id, steps, routes=prior)
        self._join_prefill()
        out_tok, out_lp, routes = [[] for _ in range(B)], [[] for _ in range(B)], []
        done = (budget == 0).tolist()
        live = cache.compact(budget[order] == 0)                                   # (B',) cache rows
        rows = order[live]                                                         # (B',) their call rows
        logits, valid, next_pos, left = logits[live], valid[live], next_pos[live], budget[rows]
        forwards = 0  # decode forwards run in this call
        for step in range(steps):
            if len(rows) == 0:
                break
            tok, lp = sample_tokens(logits, counter_uniform(seeds[rows], next_pos), self.temperature, self.top_p)
            # One host sync per step: the stop test and the per-row outputs need the values.
            for b, t, l in zip(rows.tolist(), tok.tolist(), lp.tolist()):
                out_tok[b].append(t), out_lp[b].append(l)
            left = left - 1
            finished = (left == 0) if self.eos_id is None else (tok == self.eos_id) | (left == 0)  # (B',)
            for b in rows[finished].tolist():
                done[b] = True
            if bool(finished.any()):  # compact: finished rows leave the batch and stop costing compute
                keep = cache.compact(finished)                                     # (B'',) few rows copied
                rows, tok, next_pos, valid, left = rows[keep], tok[keep], next_pos[keep], valid[keep], left[keep]
            if len(rows) == 0 or (step == steps - 1 and not self.keep):  # kept rows need their next logits
                break
            self._before_forward(forwards)
            valid = torch.cat([valid, valid.new_ones(len(rows), 1)], 1)            # (B', t)
            logits = self._decode_forward(tok, next_pos, valid, cache, rows, routes)
            next_pos = next_pos + 1
            self.steps += 1
            forwards += 1
        self._join_decode(forwards)
        # Held: copies of the live rows' keys and values (the batch views the whole cache), and contexts to check.
        self.state = None if not (self.keep and len(rows)) else dict(
            seeds=seeds[rows].tolist(), valid=valid, pos=next_pos, logits=logits,
            k=cache.k[:, :, :, :cache.length].clone(), v=cache.v[:, :, :, :cache.length].clone(),
            ctx=[torch.cat([contexts[b].cpu(), torch.tensor(out_tok[b], dtype=torch.long)]) for b in rows.tolist()])
        per_token = self._routes_out(routes, out_tok)
        self._record(contexts, call, n_done, prior, out_tok, per_token, done)
        return Generation([torch.tensor(t, dtype=torch.long) for t in out_tok],
                          [torch.tensor(lp, dtype=torch.float32) for lp in out_lp], done, per_token)

    def _before_forward(self, forwards):
        """Before each decode forward: the lock-step agreement (expert parallelism), then on_step."""
        self._agree_decode(forwards, live=True)
        if self.on_step is not None:
            self.on_step()

    def _decode_forward(self, tok, pos, valid, cache, rows, routes):
        """One decode forward of the live rows' new tokens -> next logits (B', V); with routes=True, each token's
        experts per layer appended to its row's routes."""
        hooks = [RecordRoutes() for _ in moe_layers(self.model)] if self.routes else []
        with routing(self.model, hooks) if hooks else nullcontext():
            logits = self.model(tok[:, None], pos[:, None], valid[:, None, None, :], cache)[:, -1]
        if hooks:  # (B',) call rows, (B', L, K) their tokens' experts; sorted out per row once, at the end
            routes.append((rows, torch.stack([h.chosen for h in hooks], 1)))
        return logits

    def _recorded_routes(self, contexts, call, n_done):
        """routes=True: per row, (T_i, L, K) the experts its context's tokens must use if a prefill reads them: its
        seed's record at its response tokens (the last n_done), -1 elsewhere (prompt tokens route freely, as does a
        token without a record). A row starting afresh (n_done 0) drops its seed's old record; a record that is
        not the row's response (other tokens) is refused. None without routes=True."""
        if not self.routes:
            return None
        L, K = len(moe_layers(self.model)), self.model.cfg.top_k
        out = []
        for c, s, n in zip(contexts, call, n_done.tolist()):
            r = torch.full((len(c), L, K), -1, dtype=torch.long)
            if n == 0:
                self.recorded.pop(s, None)
            elif s in self.recorded:
                tokens, experts = self.recorded[s]
                if not torch.equal(tokens, c[len(c) - n:].cpu()):
                    raise RuntimeError(f"Sampler: seed {s}'s recorded routes are for a response of {len(tokens)} "
                                       f"tokens that is not this row's (its last n_done={n} tokens); a seed names one "
                                       "row from its first token to its last")
                r[len(c) - n:] = experts
            out.append(r)
        return out

    def _record(self, contexts, call, n_done, prior, out_tok, per_token, done):
        """routes=True: each row's record becomes its response so far and its tokens' experts (those a prefill of
        this call first read filled in); a finished row's is dropped."""
        if prior is None:
            return
        for i, s in enumerate(call):
            n = int(n_done[i])
            if done[i]:
                self.recorded.pop(s, None)
            else:
                made = torch.tensor(out_tok[i], dtype=torch.long)                          # (n_new,)
                tokens = torch.cat([contexts[i][len(contexts[i]) - n:].cpu(), made])          # (n + n_new,)
                experts = torch.cat([prior[i][len(prior[i]) - n:], per_token["routes"][i]])  # (n + n_new, L, K)
                self.recorded[s] = (tokens, experts)

    def _routes_out(self, routes, out_tok):
        """Per row (n_i, L, K): the experts of each token made in this call, -1 where no forward of it read the
        token (a finished row's last; keep=False, a cut row's last: see the class docstring). routes: per decode
        forward, (rows (B',), experts (B', L, K))."""
        if not self.routes:
            return {}
        L, K = len(moe_layers(self.model)), self.model.cfg.top_k
        out = [torch.full((len(t), L, K), -1, dtype=torch.long) for t in out_tok]
        if routes:
            rows = torch.cat([r for r, _ in routes]).cpu()                         # (M,) a row per token read
            chosen = torch.cat([c for _, c in routes]).cpu()                       # (M, L, K)
            order = rows.argsort(stable=True)                                      # by row, then by step
            counts = torch.bincount(rows, minlength=len(out)).tolist()
            for o, c in zip(out, chosen[order].split(counts)):
                o[:len(c)] = c
        return {"routes": out}

    # --- lock-step: the same number of forwards on every rank of the group (LockStep); no-ops without one
    def idle(self):
        """A call with no rows (StaleSync calls it when this rank has nothing in flight): in lock-step, this
        rank runs its peers' prefill and decode forwards with zero rows of its own; alone, nothing."""
        self._agree_prefill([])
        self._join_prefill()
        self._join_decode(0)
        return Generation(tokens=[], logprobs=[], done=[], per_token={"routes": []} if self.routes else {})

    def _agree_prefill(self, lens):
        """Before any forward: the group's most prefill forwards (this rank's: one per length bucket)."""
        self._prefills = 0
        if self.lockstep is not None:
            mine = len(_length_buckets(lens)) if lens else 0
            self._prefills = self.lockstep.most(mine) - mine

    def _join_prefill(self):
        for _ in range(self._prefills):  # the peers' extra prefill forwards, with zero rows here
            self.lockstep.dummy(self.model)

    def _agree_decode(self, forward, live):
        """Before decode forward number `forward`, every `every` forwards: does any rank still decode?"""
        if self.lockstep is None or forward % self.lockstep.every:
            return True
        return bool(self.lockstep.most(int(live)))

    def _join_decode(self, forward):
        """This rank's rows are done: dummy forwards until the group agrees that every rank's are."""
        while self.lockstep is not None and self._agree_decode(forward, live=False):
            self.lockstep.dummy(self.model)
            forward += 1


def generate(model, contexts, seeds, max_new_tokens, eos_id, pad_id=0, temperature=1.0,
             top_p=1.0, n_done=None, max_steps=None, lockstep=None):
    """Sample responses for a batch of contexts (prompt + any partial response) of mixed lengths.

    contexts: list of (T_i,) int64; seeds: (B,) int64, one per sample; n_done: response tokens each
    context already holds (they count toward max_new_tokens); max_steps: cut the round after this
    many decode steps (rows not done are returned with done=False, ready to be continued).
    eos_id None: rows stop at their budget only. lockstep: see LockStep."""
    return Sampler(model, max_new_tokens, eos_id, pad_id, temperature, top_p, keep=False, lockstep=lockstep)(
        contexts, seeds, n_done, max_steps)
