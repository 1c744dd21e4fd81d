# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""The tiny MoE policy: a decoder-only transformer, and batched sampling with a KV cache.

Architecture, Qwen-MoE / DeepSeek-MoE style: token embedding -> L x [RMSNorm -> causal attention
with RoPE -> RMSNorm -> MoE of SwiGLU experts behind a softmax top-k router] -> RMSNorm ->
vocabulary head. The expert weights are stacked tensors (E, ...), so that one einsum can run every
expert on a few tokens (departure 2). moe_switch.py's expert-parallel layers cut the stack into a
tensor per expert, each moved alone.

Sampling (`Sampler`, `generate`) is batched over prompts of different lengths, left-padded, with a
KV cache. It stops a row at EOS or at its budget, and returns each token's behaviour log-prob, log
softmax(logits / temperature): what grpo.token_logprobs recomputes in a training forward. It
continues rows cut part-way (a context is the prompt and the response so far, n_done its response
tokens). `Sampler` (keep=True, the default) keeps the cut rows' KV cache for its next call, so that
a scheduler decoding in chunks (stalesync.py) reads each prefix once per weight version. The prefill
reads the contexts in length buckets, one forward each, so that a long held row does not pad every
new prompt.

Departures from a production sampler, on purpose:
1. Randomness is counter-based: the uniform that picks a token is a hash of (the sample's seed, the
   token's position). A sample is then the same alone or in a batch, in one call or cut and
   continued, on one rank or another: the tests check exactly that.
2. For a few tokens at a time (a decode step of few rows), the MoE runs every expert densely and
   combines them with the (mostly zero) top-k gates: on 2 CPU cores that beats routing for a model
   this small (DENSE_MOE_WORK). For more tokens it routes each token to its k experts. The math is
   the same either way. Under EP (the default run) moe_switch.py's EPMoE does the same at EP 1.
3. Behaviour log-probs ignore the top-p truncation (as verl does): they are the log-probs the
   trainer recomputes. The default top-p is 1, where the two agree.

The options extend it where the run is built: options/tensor_parallel.py cuts the engine over
ranks, options/lockstep.py decodes an expert-parallel engine's ranks together, and
options/routing_replay.py records each token's experts. A Sampler subclass joins in at the hooks
its docstring names.

    python -m pytest tests/test_model.py

Shapes: B batch, T tokens, D model width, H heads, hd head width, E experts, K top-k,
F expert width, V vocabulary, L layers.
"""
from dataclasses import dataclass, field

import numpy as np
import torch
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
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)       # (hd/2,)
    angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)           # (maxT, hd/2)
    angles = torch.cat([angles, angles], -1)                                        # (maxT, hd)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x (B, H, T, hd); cos, sin (B, 1, T, hd) already gathered at each token's position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg, n_heads=None):
        super().__init__()
        self.n_heads = cfg.n_heads if n_heads is None else n_heads  # fewer under TP: a rank's heads
        self.head_dim = cfg.d_model // cfg.n_heads
        width = self.n_heads * self.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * width, bias=False)   # [q|k|v] x (H, hd) rows
        self.out = nn.Linear(width, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, mask=None, cache=None):
        B, T = x.shape[:2]
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)                     # (B, H, T, hd)
        if cache is not None:  # append to this layer's cache, attend over everything so far
            k, v = cache.append(k, v)                                               # (B, H, t, hd)
        if mask is None:  # training: right-padded rows, plain causal attention
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:             # sampling: left-padded rows, an explicit (B, 1, T, t) mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # (B, T, D)


# An MoE layer on N tokens runs every expert on every token while N x D x F <= DENSE_MOE_WORK: below
# it, a few batched matmuls cost less than each expert's gather, scatter and host sync, though they
# compute the experts a token did not choose too. A crossover fitted on CPU, for E = 4 to 16 experts
# (bench/prefill.py's MoE table); not measured on GPUs.
DENSE_MOE_WORK = 3 * 2 ** 18


class MoE(nn.Module):
    """Softmax router, top-k of E SwiGLU experts, gates renormalised over the chosen k. `routing`,
    an optional hook on the experts chosen, (N, K) -> (N, K): options/routing_replay.py records
    them, or replaces them by recorded ones (the gates stay this router's probabilities of
    those)."""

    def __init__(self, cfg, d_expert=None):
        super().__init__()
        E, D, Fx = cfg.n_experts, cfg.d_model, cfg.d_expert
        Fl = Fx if d_expert is None else d_expert  # fewer under TP: a rank's hidden units
        self.top_k = cfg.top_k
        self.dense_below = DENSE_MOE_WORK / (D * Fl)  # tokens
        self.routing = None
        self.router = nn.Linear(D, E, bias=False)
        self.w_gate = nn.Parameter(torch.randn(E, D, Fl) * D ** -0.5)
        self.w_up = nn.Parameter(torch.randn(E, D, Fl) * D ** -0.5)
        self.w_down = nn.Parameter(torch.randn(E, Fl, D) * Fx ** -0.5 / cfg.n_layers ** 0.5)

    def gates(self, x):
        """x (N, D) -> dense gates (N, E): the renormalised top-k probabilities, zero elsewhere."""
        probs = F.softmax(self.router(x).float(), dim=-1)                           # (N, E)
        top_p, top_i = probs.topk(self.top_k, dim=-1)                               # (N, K)
        if self.routing is not None:  # recorded, or replaced by a recorded choice
            top_i = self.routing(top_i)
            top_p = probs.gather(-1, top_i)                                         # (N, K)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        return torch.zeros_like(probs).scatter(-1, top_i, top_p).to(x.dtype)        # (N, E)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                                # (N, D)
        gates = self.gates(x)                                                       # (N, E)
        if x.shape[0] <= self.dense_below:  # a few tokens: every expert on every token
            h = F.silu(torch.einsum("nd,edf->enf", x, self.w_gate)) \
                * torch.einsum("nd,edf->enf", x, self.w_up)                         # (E, N, F)
            y = torch.einsum("enf,efd->end", h, self.w_down)                        # (E, N, D)
            out = torch.einsum("ne,end->nd", gates, y)
        else:  # more: each expert only on the tokens routed to it
            out = torch.zeros_like(x)
            for e in range(gates.shape[1]):
                idx = gates[:, e].nonzero().squeeze(-1)                   # (n_e,) a host sync
                xe = x[idx]                                                         # (n_e, D)
                ye = (F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])) @ self.w_down[e]
                out = out.index_add(0, idx, ye * gates[idx, e, None])               # (N, D)
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.d_model, cfg.norm_eps), Attention(cfg)
        self.moe_norm, self.moe = RMSNorm(cfg.d_model, cfg.norm_eps), MoE(cfg)

    def forward(self, x, cos, sin, mask=None, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.moe(self.moe_norm(x))


class Policy(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
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
        x = self.embed(tokens)                                                      # (B, T, D)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask, None if cache is None else cache.layer(i))
        return self.head(self.norm(x)).float()                                      # (B, T, V)

    @torch.no_grad()
    def load_weights(self, weights):
        """vLLM-style loader: weights is an iterable of (name, full tensor). Returns the names
        loaded (options/tensor_parallel.py's cuts each rank's piece first)."""
        params, loaded = dict(self.named_parameters()), set()
        for name, w in weights:
            if w.shape != params[name].shape:
                raise ValueError(f"{name}: got shape {tuple(w.shape)}, expected "
                                 f"{tuple(params[name].shape)}")
            params[name].copy_(w)
            loaded.add(name)
        return loaded


# ----------------------------------------------------------------------------- sampling, KV cache
class KVCache:
    """Preallocated keys and values, (L, B, H, Tmax, hd). Every row fills the same columns (rows
    are left-padded), so one write index serves the batch."""

    def __init__(self, cfg, batch, max_len, device, dtype, n_heads=None):
        hd = cfg.d_model // cfg.n_heads
        H = cfg.n_heads if n_heads is None else n_heads  # H/t under TP
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
        """Drop the finished rows, finished (B,) bool, from the batch. The naive way,
        self.k[:, live], copies every live row, up to once a decode step. Here only the live rows
        past the first B' are copied, into the finished slots among those, and the batch becomes the
        first B' rows, a view of the same memory. Returns order (B',): each row's index before, by
        which the caller reorders its per-row tensors. A row's place in the batch changes nothing
        but, in a small batch, a kernel's rounding: the same tokens, and log-probs the same or a few
        ulp apart (tests/test_model.py)."""
        done = finished.cpu()  # one host sync
        n = int((~done).sum())
        holes = done[:n].nonzero().squeeze(-1)                        # (m,) finished, staying
        movers = (~done[n:]).nonzero().squeeze(-1) + n                # (m,) live, leaving
        order = torch.arange(len(done))
        order[holes] = movers
        holes, movers = holes.to(self.k.device), movers.to(self.k.device)
        t = self.length  # columns >= t: empty
        self.k[:, holes, :, :t] = self.k[:, movers, :, :t]
        self.v[:, holes, :, :t] = self.v[:, movers, :, :t]
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
    # The nucleus: the tokens whose mass before them is under top_p (the top one always).
    p_sorted = p_sorted * ((p_sorted.cumsum(-1) - p_sorted) < top_p)            # (B, V)
    cdf = p_sorted.double().cumsum(-1)                                          # (B, V)
    j = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)      # (B, 1)
    tok = order.gather(-1, j.clamp(max=logits.shape[-1] - 1)).squeeze(-1)        # (B,)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


@dataclass
class Generation:
    tokens: list       # per row: the new response tokens, (n_i,) int64
    logprobs: list     # per row: their behaviour log-probs, (n_i,) float32
    done: list         # per row: True if it hit EOS or its budget, False if cut by max_steps
    per_token: dict = field(default_factory=dict)  # a subclass's per-token fields, name -> per
    #                                                row (n_i, ...) (options/routing_replay.py's)


# What one more prefill forward costs, in tokens of work: its fixed cost plus the batching a split
# loses. `python bench/prefill.py` measures the fixed cost, and what the split gains on the pools a
# stale rollout holds.
FORWARD_COST_TOKENS = 256


def _length_buckets(lens, forward_cost=FORWARD_COST_TOKENS):
    """Split rows into buckets prefilled one forward each, every bucket left-padded to its own
    longest row: the split of the rows sorted by length that minimises padded tokens + forward_cost
    per forward (a DP). A held long-tail row no longer makes every short new prompt pad to its
    length. lens: list of ints."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    longest = np.array([lens[i] for i in order], dtype=np.int64)              # (B,) descending
    best, cut = np.zeros(len(lens) + 1, dtype=np.int64), np.zeros(len(lens) + 1, dtype=np.int64)
    # best[j]: the least cost of the rows order[:j]. A last bucket order[i:j] pads to longest[i].
    for j in range(1, len(lens) + 1):
        cost = best[:j] + (j - np.arange(j)) * longest[:j] + forward_cost       # (j,) one per i
        cut[j] = int(cost.argmin())  # ties: the earliest i, the fewest buckets
        best[j] = cost[cut[j]]
    buckets, j = [], len(lens)
    while j > 0:
        buckets.append(sorted(order[cut[j]:j]))  # call order inside a bucket
        j = int(cut[j])
    return buckets[::-1]


def _left_pad(x, t, dim):
    """Zeros (False) before x along dim, to length t: left-padded rows line up on their last
    column."""
    shape = list(x.shape)
    shape[dim] = t - x.shape[dim]
    return torch.cat([x.new_zeros(shape), x], dim)


class Sampler:
    """Batched sampling as an object that may keep its KV cache between calls: the step_fn of a
    scheduler that decodes in chunks (stalesync.py). With keep=True a row cut by max_steps leaves
    its keys, values and next-token logits behind, keyed by its seed. A later call naming that seed
    continues from them instead of reading the prefix again, and rows new to the call are prefilled
    and merged in. The tokens are those of a fresh call (tests/test_model.py). reset() drops the
    cache: call it when the weights change (the prefix must be read again under the new weights)
    and when the rollout phase ends (it is engine memory).

    A subclass joins in at five hooks, each a no-op here: _before_prefill (which contexts a call
    reads afresh), _prefill_forward (one bucket's forward), _after_prefill, _decode_forward (one
    decode step's forward), _after_decode (the call's Generation, and how many decode forwards it
    ran). idle() is a call with no rows. options/lockstep.py and options/routing_replay.py are such
    subclasses. `fresh` gives a sampler of the same kind that keeps nothing (an evaluation's)."""

    def __init__(self, model, max_new_tokens, eos_id, pad_id=0, temperature=1.0, top_p=1.0,
                 keep=True):
        finite = float(temperature) >= 0 and float(temperature) < float("inf")
        if not finite or not 0 < top_p <= 1:
            raise ValueError(f"temperature={temperature!r} must be finite and >= 0 (0: greedy) and "
                             f"top_p={top_p!r} in (0, 1]")
        self.model, self.max_new_tokens = model, max_new_tokens
        self.eos_id, self.pad_id = eos_id, pad_id
        self.temperature, self.top_p, self.keep = temperature, top_p, keep
        self.state, self.steps = None, 0  # steps: decode forwards run, each over every live row

    def fresh(self, **changes):
        """A sampler of the same kind on the same model that keeps nothing, with `changes` (say
        temperature=0, greedy) to its settings."""
        settings = dict(max_new_tokens=self.max_new_tokens, eos_id=self.eos_id, pad_id=self.pad_id,
                        temperature=self.temperature, top_p=self.top_p, keep=False)
        return type(self)(self.model, **(settings | changes))

    def reset(self):
        """Drop the KV cache (new weights, or the end of a rollout phase)."""
        self.state = None

    def state_dict(self):
        """The held rows' cache (seeds, keys, values, validity, positions, next logits) and the step
        count. With it a resumed scheduler continues bit-exactly. Without it (reset()) the prefixes
        are read again: the same tokens, up to rounding of the log-probs."""
        st = None if self.state is None else {k: (v.clone() if torch.is_tensor(v) else list(v))
                                              for k, v in self.state.items()}
        return dict(state=st, steps=self.steps)

    def load_state_dict(self, sd):
        self.state, self.steps = sd["state"], sd["steps"]

    def budget(self, seeds, n_done):
        """Tokens each row may still make, (B,). Override it for per-row budgets
        (bench/stalesync.py)."""
        return (self.max_new_tokens - n_done).clamp(min=0)

    # --- the hooks (see the class docstring): here, plain forwards
    def _before_prefill(self, contexts, call, n_done, new):
        """Before the call's first forward. `new`: the call rows it prefills (the others are
        held)."""

    def _prefill_forward(self, tokens, positions, mask, cache, rows):
        """One prefill bucket: its tokens (b, Pb) -> next-token logits (b, V). rows: their call
        rows."""
        return self.model(tokens, positions, mask, cache)[:, -1]

    def _after_prefill(self):
        """After the prefill's forwards."""

    def _decode_forward(self, tok, pos, valid, cache, rows):
        """One decode step's forward of the live rows (call rows `rows`) -> next logits (B', V)."""
        return self.model(tok[:, None], pos[:, None], valid[:, None, None, :], cache)[:, -1]

    def _after_decode(self, out, forwards, call, n_done):
        """The call's Generation, after its `forwards` decode forwards: returned as it is here."""
        return out

    def idle(self):
        """A call with no rows (options/lockstep.py's StaleSync calls it when this rank has nothing
        in flight): the hooks still run, so that a lock-step rank joins its peers' forwards."""
        self._before_prefill([], [], None, [])
        self._after_prefill()
        return self._after_decode(Generation(tokens=[], logprobs=[], done=[]), 0, [], None)

    # --- the call
    def _check(self, contexts, budget, steps, call):
        """Refuse, before any work, an empty context, a row that would outgrow max_seq_len, and
        (keep=True) two rows with one seed."""
        B, max_len = len(contexts), self.model.cfg.max_seq_len
        if min(map(len, contexts)) == 0:
            empty = [len(c) for c in contexts].index(0)
            raise ValueError(f"row {empty}: an empty context (a prompt needs a token)")
        need = [len(c) + min(steps, int(b)) for c, b in zip(contexts, budget.tolist())]  # positions
        if max(need) > max_len:
            i = max(range(B), key=need.__getitem__)
            n_new = need[i] - len(contexts[i])
            raise ValueError(f"row {i}: context {len(contexts[i])} + {n_new} new tokens exceeds "
                             f"max_seq_len={max_len}")
        if self.keep and len(set(call)) != B:
            raise ValueError(f"Sampler(keep=True) keys rows by seed, but {B} rows have only "
                             f"{len(set(call))} distinct seeds")

    @torch.no_grad()
    def __call__(self, contexts, seeds, n_done=None, max_steps=None):
        B, dev = len(contexts), self.model.head.weight.device
        if B == 0:  # nothing to decode here (a subclass may still join its peers' forwards)
            return self.idle()
        n_done = torch.zeros(B, dtype=torch.long) if n_done is None else torch.as_tensor(n_done)
        seeds = torch.as_tensor(seeds, dtype=torch.long, device=dev)
        budget = self.budget(seeds, n_done).to(dev)                      # (B,) tokens left
        steps = int(budget.max()) if max_steps is None else min(max_steps, int(budget.max()))
        call = seeds.tolist()
        self._check(contexts, budget, steps, call)
        kept = set() if self.state is None else set(self.state["seeds"])
        held = [(i, s) for i, s in enumerate(call) if s in kept]
        new = [i for i, s in enumerate(call) if s not in kept]
        self._before_prefill(contexts, call, n_done, new)
        if held:  # cache row r is call row order[r]: the held rows first, then the new ones
            order = torch.tensor([i for i, _ in held] + new, device=dev)
            cache, logits, valid, next_pos = self._resume(contexts, held, new, steps)
        else:     # a fresh call: the naive path, one prefill of every context
            order = torch.arange(B, device=dev)
            cache, logits, valid, next_pos = self._prefill(contexts, list(range(B)), steps)
        self._after_prefill()
        out_tok, out_lp = [[] for _ in range(B)], [[] for _ in range(B)]
        done = (budget == 0).tolist()
        live = cache.compact(budget[order] == 0)                         # (B',) cache rows
        rows = order[live]                                               # (B',) call rows
        logits, valid, next_pos, left = logits[live], valid[live], next_pos[live], budget[rows]
        forwards = 0  # decode forwards run in this call
        for step in range(steps):
            if len(rows) == 0:
                break
            u = counter_uniform(seeds[rows], next_pos)                              # (B',)
            tok, lp = sample_tokens(logits, u, self.temperature, self.top_p)
            # One host sync per step: the stop test and the per-row outputs need the values.
            for b, t, l in zip(rows.tolist(), tok.tolist(), lp.tolist()):
                out_tok[b].append(t), out_lp[b].append(l)
            left = left - 1
            finished = (left == 0) if self.eos_id is None else (tok == self.eos_id) | (left == 0)
            for b in rows[finished].tolist():
                done[b] = True
            if bool(finished.any()):  # finished rows leave the batch and stop costing compute
                keep = cache.compact(finished)                                      # (B'',)
                rows, tok, next_pos = rows[keep], tok[keep], next_pos[keep]
                valid, left = valid[keep], left[keep]
            if len(rows) == 0 or (step == steps - 1 and not self.keep):  # kept rows need logits
                break
            valid = torch.cat([valid, valid.new_ones(len(rows), 1)], 1)             # (B', t)
            logits = self._decode_forward(tok, next_pos, valid, cache, rows)
            next_pos = next_pos + 1
            self.steps += 1
            forwards += 1
        # Held: copies of the live rows' keys and values (the batch views the whole cache), and
        # their contexts, to check against the next call's.
        self.state = None if not (self.keep and len(rows)) else dict(
            seeds=seeds[rows].tolist(), valid=valid, pos=next_pos, logits=logits,
            k=cache.k[:, :, :, :cache.length].clone(), v=cache.v[:, :, :, :cache.length].clone(),
            ctx=[torch.cat([contexts[b].cpu(), torch.tensor(out_tok[b], dtype=torch.long)])
                 for b in rows.tolist()])
        out = Generation([torch.tensor(t, dtype=torch.long) for t in out_tok],
                         [torch.tensor(lp, dtype=torch.float32) for lp in out_lp], done)
        return self._after_decode(out, forwards, call, n_done)

    def _prefill(self, contexts, which, extra, forward_cost=FORWARD_COST_TOKENS):
        """Left-pad contexts (list of (T_i,), `which`: their call rows) into (B, P) and read them
        into a fresh cache with room for `extra` more tokens, one forward per length bucket. A
        bucket padded to Pb fills the cache's last Pb columns, and the columns before them stay zero
        and invalid. Returns the cache, next-token logits (B, V) float32, validity (B, P) and
        lengths (B,)."""
        model = self.model
        B, dev, dtype = len(contexts), model.head.weight.device, model.head.weight.dtype
        n = [len(c) for c in contexts]
        P = max(n)
        cache = KVCache(model.cfg, B, P + extra, dev, dtype, model.blocks[0].attn.n_heads)
        logits = torch.empty(B, model.cfg.vocab_size, device=dev)  # (B, V) float32, as forward's
        buckets = _length_buckets(n, forward_cost)
        for rows in buckets:
            Pb = max(n[i] for i in rows)
            tokens = torch.full((len(rows), Pb), self.pad_id, dtype=torch.long, device=dev)
            for b, i in enumerate(rows):
                tokens[b, Pb - n[i]:] = contexts[i].to(dev)
            lens = torch.tensor([n[i] for i in rows], device=dev)                    # (b,)
            valid = torch.arange(Pb, device=dev)[None, :] >= (Pb - lens)[:, None]    # (b, Pb)
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)                   # (b, Pb)
            causal = torch.ones(Pb, Pb, dtype=torch.bool, device=dev).tril()
            # A pad query attends to itself only, so that its softmax is never over an empty set.
            mask = (causal & valid[:, None, :]) | torch.eye(Pb, dtype=torch.bool, device=dev)
            part = cache if len(buckets) == 1 else KVCache(model.cfg, len(rows), Pb, dev, dtype,
                                                           cache.k.shape[2])
            logits[rows] = self._prefill_forward(tokens, positions, mask.unsqueeze(1), part,
                                                 [which[i] for i in rows])          # (b, V)
            if part is not cache:  # into the cache's last Pb columns
                idx = torch.tensor(rows, device=dev)
                cache.k[:, idx, :, P - Pb:P], cache.v[:, idx, :, P - Pb:P] = part.k, part.v
        cache.length = P
        lens = torch.tensor(n, device=dev)                                           # (B,)
        valid = torch.arange(P, device=dev)[None, :] >= (P - lens)[:, None]          # (B, P)
        return cache, logits, valid, lens

    def _resume(self, contexts, held, new, extra):
        """The cache for held rows (from self.state) then new rows (prefilled), with room for
        `extra`."""
        st, model, dev = self.state, self.model, self.model.head.weight.device
        where = {s: i for i, s in enumerate(st["seeds"])}
        idx = torch.tensor([where[s] for _, s in held], device=dev)
        k, v = st["k"][:, idx], st["v"][:, idx]                          # (L, R, H, t, hd)
        valid = st["valid"][idx]                                         # (R, t)
        pos = st["pos"][idx]                                             # (R,)
        logits = st["logits"][idx]                                       # (R, V)
        if any(not torch.equal(contexts[i].cpu(), st["ctx"][where[s]]) for i, s in held):
            raise RuntimeError("Sampler: a held row's context is not the one it was cut with (its "
                               "prefix and the tokens it made); reset() after new weights or to "
                               "start a seed afresh")
        if new:
            c, lg, vd, ln = self._prefill([contexts[i] for i in new], new, 0)
            t = max(valid.shape[1], vd.shape[1])
            k = torch.cat([_left_pad(k, t, 3), _left_pad(c.k, t, 3)], 1)
            v = torch.cat([_left_pad(v, t, 3), _left_pad(c.v, t, 3)], 1)
            valid = torch.cat([_left_pad(valid, t, 1), _left_pad(vd, t, 1)], 0)
            pos, logits = torch.cat([pos, ln]), torch.cat([logits, lg])
        self.state = None  # gathered above: free the old cache before allocating the new one
        lead = int(valid.any(0).long().argmax())  # columns before it: padding in every row, dropped
        k, v, valid = k[:, :, :, lead:], v[:, :, :, lead:], valid[:, lead:]
        t = valid.shape[1]
        n_heads = model.blocks[0].attn.n_heads
        cache = KVCache(model.cfg, len(valid), t + extra, dev, k.dtype, n_heads)
        cache.k[:, :, :, :t], cache.v[:, :, :, :t], cache.length = k, v, t
        return cache, logits, valid, pos


def generate(model, contexts, seeds, max_new_tokens, eos_id, pad_id=0, temperature=1.0,
             top_p=1.0, n_done=None, max_steps=None):
    """Sample responses for a batch of contexts (prompt + any partial response) of mixed lengths.

    contexts: list of (T_i,) int64; seeds: (B,) int64, one per sample; n_done: response tokens each
    context already holds (they count toward max_new_tokens); max_steps: cut the round after this
    many decode steps (rows not done are returned with done=False, ready to be continued).
    eos_id None: rows stop at their budget only."""
    return Sampler(model, max_new_tokens, eos_id, pad_id, temperature, top_p, keep=False)(
        contexts, seeds, n_done, max_steps)
