"""Choosing the layouts: price every (training layout, inference layout) pair, the switch between
them included, and keep the fastest that fits in memory.

    python options/planner.py --machine bench/machines/h100x8.json --devices 16 --nodes 2
    python options/planner.py --machine bench/machines/h100x8.json --deploy hybrid --aux-ranks 4
    torchrun --standalone --nproc_per_node=4 train_grpo.py --layout auto   # plans, then runs it

An RL run has two layouts: training (FSDP over the data-parallel ranks, EP for the experts, PP
stages, micro-batches) and rollout (TP for the engine, EP for its experts), with a switch between
them at every step. The best training layout alone is not the best pair: EP 2 in training with EP 1
in rollout trains the experts apart yet decodes without an all-to-all, and a wide TP engine leaves
memory for the KV cache but pays two all-reduces per layer at every decode step. One RL step is
  rollout    StaleSync's rounds of the whole batch (the replicas cut together) replayed on the
             responses' lengths (S = 0 waits for the longest sample; S >= 1 cuts once a batch is
             complete, the tail carried on): each replica's share of the prefills and rows, each
             decode forward's fixed cost, the weights it reads, TP's and EP's collectives;
  switch     the Adam state to host and back, the engine's weights gathered from the FSDP shards
             (the least a rank can receive: switch_bytes), the experts re-sharded (ep_bytes);
  reference  a forward over the rank's share of the batch (when the KL penalty is on);
  train      a forward and a backward per micro-batch, EP's all-to-alls, PP's bubble;
  score      the rule on each sample;
  queue      the rows into the queue, their ids to every rank, each trainer's share read;
  grad sync  FSDP's all-gather and reduce-scatter (across the nodes' link where FSDP spans nodes),
             EP's gradient sum over each expert's replicas, the optimizer step.
A collective over n ranks costs its steps at the link's latency plus its bytes at the link's
bandwidth. Memory per rank: the training shards, their gradients and Adam state, the engine's
weights, the switch's bucket, the activations and the KV cache (the last two unchecked on a CPU).
The deployment (Workload.deploy: --deploy) sets each stage's ranks and how the stages add up:
colocated, all ranks, in turn; separated, W/2 trainers and W/2 generators (TP 1, no EP) joined by
a push, the sides overlapped at S >= 1; hybrid, an actor of W - K ranks, the reference on K others.

The search is exhaustive: every block is alike, so a layout is a handful of degrees (TP, EP in each
phase, PP, micro-batches, FSDP within or across nodes), each a divisor of the device count W, each
priced in under a millisecond: with d(W) divisors and m micro-batch counts, about 2 m d(W) layouts
without EP and m e(W)^2 with it (e: the EP degrees dividing W and the experts), 102 at W = 8. A
dynamic program over stages (Alpa's) earns its place where stages differ; here every one is alike.

The constants (Machine): measured on the machine planned for (options/layout_auto.py's calibrate),
or from a file for one we do not have (bench/machines/*.json). The standard library only: the
switch's byte counts are recomputed here (tests/test_planner.py holds them equal to the run's).
"""
import argparse
import dataclasses
import functools
import itertools
import json
import math
from dataclasses import dataclass


# ----------------------------------------------------------------------------- what is planned for
@dataclass(frozen=True)
class Link:
    latency_s: float   # one message, one hop
    bandwidth: float   # bytes/s, one direction of one rank's link

    def __post_init__(self):
        _positive(self, "bandwidth")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s {self.latency_s} must be a finite number >= 0")


@dataclass(frozen=True)
class Machine:
    devices: int           # W
    devices_per_node: int  # k: the ranks [i k, (i + 1) k) share a node's fast link
    memory_bytes: float    # per device
    flops: float           # per device, with every device busy (shared cores count here)
    host_bandwidth: float  # device <-> host copies, bytes/s (the Adam state's offload)
    memory_bandwidth: float  # the device's own memory, bytes/s (a decode step reads the weights)
    step_s: float          # a decode step's fixed cost: sampling, the host's sync, bookkeeping
    row_s: float           # a decode step's cost per row at TP 1: its compute, cache, sampling
    op_s: float            # a block's fixed cost per forward: kernel launches, dispatch
    batch_s: float         # a training micro-batch's fixed cost beyond its blocks: loss, copies
    update_s: float        # an optimizer update: the clip, AdamW's step, the zeroing
    sample_s: float        # scoring one sample
    queue_s: float         # a step's queue traffic, fixed: the store's round trips and waits
    queue_row_s: float     # a step's queue traffic per row a rank puts and reads
    intra: Link            # within a node
    inter: Link            # across nodes
    name: str = "machine"
    cores: int = 0         # the compute units all the devices share (a CPU's cores); 0: their own

    def __post_init__(self):
        if not (_is_int(self.cores) and self.cores >= 0):
            raise ValueError(f"cores {self.cores!r} must be an int >= 0 (0: a device computes alone)")
        if self.devices < 1 or self.devices_per_node < 1 or self.devices % self.devices_per_node:
            raise ValueError(f"devices {self.devices} must be >= 1 and a multiple of "
                             f"devices_per_node {self.devices_per_node} (>= 1)")
        for name in ("memory_bytes", "flops", "host_bandwidth", "memory_bandwidth", "step_s",
                     "op_s", "batch_s", "update_s", "sample_s", "row_s", "queue_s",
                     "queue_row_s"):
            _positive(self, name)

    @classmethod
    def load(cls, source, **changes):
        """A machine from a JSON file (bench/machines/*.json) or a dict of its fields (a key
        starting with _ is a note); `changes` override its fields."""
        if isinstance(source, str):
            with open(source) as f:
                source = json.load(f)
        raw = {k: v for k, v in source.items() if not k.startswith("_")}
        raw.update({k: v for k, v in changes.items() if v is not None})
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown machine fields {sorted(unknown)}")
        return cls(**{**raw, "intra": Link(**raw["intra"]), "inter": Link(**raw["inter"])})


@dataclass(frozen=True)
class Model:
    """The policy's shapes: a transformer whose MLP is an MoE of E experts, top-k, in float32."""
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_experts: int
    top_k: int
    d_expert: int
    dtype_bytes: int = 4

    def weights(self):
        """[(name, shape)] in the module's order, as the run's Policy names them."""
        D, H, E, V = self.d_model, self.d_expert, self.n_experts, self.vocab
        block = [("attn_norm.weight", (D,)), ("attn.qkv.weight", (3 * D, D)),
                 ("attn.out.weight", (D, D)), ("moe_norm.weight", (D,)), ("moe.w_gate", (E, D, H)),
                 ("moe.w_up", (E, D, H)), ("moe.w_down", (E, H, D)), ("moe.router.weight", (E, D))]
        blocks = [(f"blocks.{i}.{n}", s) for i in range(self.n_layers) for n, s in block]
        last = [("norm.weight", (D,)), ("head.weight", (V, D))]
        return [("embed.weight", (V, D))] + blocks + last

    def flops_per_token(self, context):
        """A forward's FLOPs for one token attending to `context` others: the weights it meets
        (k experts of E) and the attention's scores and sums."""
        D, H = self.d_model, self.d_expert
        per_block = 4 * D * D + self.n_experts * D + 3 * self.top_k * D * H + 2 * context * D
        return 2 * (self.n_layers * per_block + self.vocab * D)


DEPLOYS = ("colocated", "colocated-all", "separated", "hybrid")  # the first two price the same


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int
    group_size: int
    prompt_tokens: float     # mean, per sample
    response_tokens: float   # mean, per sample
    max_new_tokens: int      # the response budget
    max_prompt_tokens: float = None  # the longest prompt (default: the mean)
    staleness: int = 1
    reference: bool = True   # the KL penalty's frozen reference forward
    updates_per_batch: int = 1
    bucket_bytes: int = 256 * 1024
    chunk_steps: int = 8     # decode steps per sampler call at S >= 1 (and between EP agreements)
    threshold: float = 0.5   # StaleSync's: a replica decodes its share / threshold groups at once
    lengths: tuple = None    # the responses' lengths, equally likely; None: see response_lengths
    deploy: str = "colocated"  # the run's --deploy: one of DEPLOYS
    aux_ranks: int = 1       # --deploy hybrid: the ranks of the auxiliary stage (--aux-ranks)

    def __post_init__(self):
        if self.max_prompt_tokens is None:
            object.__setattr__(self, "max_prompt_tokens", self.prompt_tokens)
        if self.lengths is not None:
            object.__setattr__(self, "lengths", tuple(self.lengths))  # hashable, for the cache
            if not self.lengths or not all(_is_int(n) and 1 <= n <= self.max_new_tokens
                                           for n in self.lengths):
                raise ValueError(f"lengths {self.lengths} must be ints in 1 .. max_new_tokens "
                                 f"{self.max_new_tokens}")
        if not (_is_int(self.staleness) and self.staleness >= 0):
            raise ValueError(f"staleness {self.staleness!r} must be an int >= 0")
        if not (_is_int(self.chunk_steps) and self.chunk_steps >= 1):
            raise ValueError(f"chunk_steps {self.chunk_steps!r} must be an int >= 1")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold {self.threshold!r} must be in (0, 1]")
        if self.deploy not in DEPLOYS:
            raise ValueError(f"deploy {self.deploy!r} must be one of {', '.join(DEPLOYS)}")
        if not (_is_int(self.aux_ranks) and self.aux_ranks >= 1):
            raise ValueError(f"aux_ranks {self.aux_ranks!r} must be an int >= 1")


@dataclass(frozen=True)
class Layout:
    """One candidate: the training layout and the inference layout. EP 0: the experts are sharded
    by FSDP like every weight; nodes: FSDP within each of `nodes` groups (HSDP) instead of all."""
    infer_tp: int = 1
    train_ep: int = 0
    infer_ep: int = 0
    train_pp: int = 1
    micro_batches: int = 4
    nodes: int = 1  # the run's --nodes: FSDP within each of this many groups, averaged across

    def flags(self):
        """As train_grpo.py's flags."""
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in dataclasses.asdict(self).items())

    def short(self):
        ep = f"EP {self.train_ep}->{self.infer_ep}" if self.train_ep else "EP off"
        return (f"TP {self.infer_tp}, {ep}, PP {self.train_pp}, mb {self.micro_batches}"
                + (f", HSDP x{self.nodes}" if self.nodes > 1 else ""))


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _positive(obj, name):
    value = getattr(obj, name)
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} {value!r} must be a finite number > 0")


# ----------------------------------------------------------------------------- the candidates
def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def actor_ranks(machine, work):
    """The ranks the colocated formulas price, as a Machine of their own: every rank (colocated);
    each side's W/2 (separated: as many trainers as generators); the actor's W - K (hybrid). Where
    they are not whole nodes, a group wider than gcd(ranks, devices_per_node) crosses nodes."""
    W, k = machine.devices, machine.devices_per_node
    n = {"separated": W // 2, "hybrid": W - work.aux_ranks}.get(work.deploy, W)
    if n < 1 or work.deploy == "separated" and W % 2:
        need = ("an even number of devices" if work.deploy == "separated"
                else f"more devices than aux_ranks {work.aux_ranks}")
        raise ValueError(f"deploy {work.deploy} needs {need} (got {W})")
    per = min(n, k) if n % min(n, k) == 0 else math.gcd(n, k)
    return _busy(dataclasses.replace(machine, devices=n, devices_per_node=per), W, work)


def _busy(machine, world, work):
    """Where the devices share `cores` (ranks on one CPU), the constants were measured with every
    rank busy. Separated at S = 0 runs its sides in turn, each while the other waits: a side runs
    faster, up to a core a rank, its compute speeds scaled by its share of the cores over the
    world's. (The hybrid's auxiliary ranks serve and poll the queue: priced busy.)"""
    alone = work.deploy == "separated" and not work.staleness
    busy = machine.devices if alone else world
    if not machine.cores or busy == world:
        return machine
    f = min(1.0, machine.cores / busy) / min(1.0, machine.cores / world)  # >= 1
    times = {n: getattr(machine, n) / f for n in ("step_s", "row_s", "op_s", "batch_s",
                                                  "update_s", "sample_s")}
    return dataclasses.replace(machine, flops=machine.flops * f, **times,
                               memory_bandwidth=machine.memory_bandwidth * f)


def candidates(model, machine, work, micro_batches=(1, 2, 4, 8, 16, 32, 64), max_tp=4,
               max_pp=2):
    """Every layout the run can take: TP divides the heads and each expert's width; EP on in both
    phases or neither, dividing the experts, the degrees nesting, with TP 1, no PP and FSDP over
    every rank; PP divides the blocks, a micro-batch per stage at least; HSDP over the nodes. The
    ranks are the deployment's (actor_ranks); separated and hybrid run neither PP nor HSDP, and
    separated's generators are replicas of one rank each (TP 1), its experts in FSDP (no EP)."""
    machine = actor_ranks(machine, work)
    W, out = machine.devices, []
    hsdp = (1, W // machine.devices_per_node)  # FSDP over every rank, or within each node
    for tp, pp, nodes, mb in itertools.product(divisors(W), divisors(W), set(hsdp), micro_batches):
        tp_ok = tp <= max_tp and model.n_heads % tp == 0 and model.d_expert % tp == 0
        pp_ok = pp <= max_pp and model.n_layers % pp == 0 and mb >= pp and (pp == 1 or nodes == 1)
        shares = work.prompts_per_step % (W // tp) == 0  # each replica an equal share of prompts
        if tp_ok and pp_ok and shares:
            out.append(Layout(tp, 0, 0, pp, mb, nodes))
    eps = [e for e in divisors(W) if model.n_experts % e == 0]
    for te, ie, mb in itertools.product(eps, eps, micro_batches):
        if max(te, ie) % min(te, ie) == 0 and work.prompts_per_step % W == 0:
            out.append(Layout(1, te, ie, 1, mb, 1))
    if work.deploy in ("separated", "hybrid"):
        out = [lay for lay in out if lay.train_pp == 1 and lay.nodes == 1]
    if work.deploy == "separated":
        out = [lay for lay in out if lay.infer_tp == 1 and not lay.train_ep]
    return out


# ----------------------------------------------------------------------------- bytes and memory
def _rows(rows, n, i):
    """FSDP2's dim-0 shard: rank i of n holds rows [i c, (i + 1) c), c = ceil(rows / n)."""
    c = -(-rows // n)
    return max(0, min(c, rows - i * c))


def _nbytes(model, shape):
    return math.prod(shape) * model.dtype_bytes


def _is_expert(name):
    return ".moe.w_" in name


def _stage_weights(model, layout, stage):
    """The weights of pipeline stage `stage`: the first holds the embedding, the last the head."""
    per = model.n_layers // layout.train_pp
    keep = {f"blocks.{i}." for i in range(stage * per, (stage + 1) * per)}
    first, last = stage == 0, stage == layout.train_pp - 1
    return [(n, s) for n, s in model.weights()
            if any(n.startswith(b) for b in keep) or (first and n.startswith("embed"))
            or (last and (n.startswith("norm") or n.startswith("head")))]


def _shard_ranks(machine, layout):
    """The ranks FSDP shards rank 0's weights over."""
    return machine.devices // layout.train_pp // layout.nodes


def _gathered(model, layout):
    """The weights the switch gathers for the engine: every one but EP's experts (EP moves them)."""
    return [(n, s) for n, s in model.weights() if not (layout.train_ep and _is_expert(n))]


def _experts(model, ep):
    """The bytes of the experts a rank holds at EP degree ep, every layer."""
    return model.n_experts // ep * 3 * model.d_model * model.d_expert * model.dtype_bytes \
        * model.n_layers


def train_bytes(model, machine, layout, rank=0):
    """This rank's training shards, bytes: FSDP rows of its stage's weights, and under EP its
    experts (train_ep blocks of E / train_ep)."""
    n, W, pp = _shard_ranks(machine, layout), machine.devices, layout.train_pp
    mine = set(_gathered(model, layout)) & set(_stage_weights(model, layout, rank // (W // pp)))
    total = sum(_rows(s[0], n, rank % n) * _nbytes(model, s) // s[0] for _, s in mine)
    return total + (_experts(model, layout.train_ep) if layout.train_ep else 0)


def switch_bytes(model, machine, layout, rank=0):
    """The least a rank can receive to build the engine from the shards (the run's
    switch/received_min_bytes): every weight the engine gathers (the experts are EP's to move),
    less the rows the rank holds itself."""
    whole = sum(_nbytes(model, s) for _, s in _gathered(model, layout))
    experts = _experts(model, layout.train_ep) if layout.train_ep else 0
    return whole - (train_bytes(model, machine, layout, rank) - experts)


def ep_bytes(model, machine, layout, rank=0):
    """The experts a rank receives at the switch to rollout (the run's ep/to_rollout_bytes_moved,
    every layer): those of its inference block that its training block lacks."""
    if not layout.train_ep:
        return 0
    E, W = model.n_experts, machine.devices

    def block(ep):
        per, p = E // ep, rank // (W // ep)
        return set(range(p * per, (p + 1) * per))
    per_expert = 3 * model.d_model * model.d_expert * model.dtype_bytes
    return len(block(layout.infer_ep) - block(layout.train_ep)) * per_expert * model.n_layers


def engine_bytes(model, layout):
    """The engine's weights on a rank: at TP t, the heads and the experts' hidden units cut t ways
    (the rest whole); under EP, the experts are the moved ones, not the engine's own."""
    cut = [layout.infer_tp if ("attn." in n or _is_expert(n)) else 1
           for n, _ in _gathered(model, layout)]
    return sum(_nbytes(model, s) // c for (_, s), c in zip(_gathered(model, layout), cut))


def buckets(model, layout, bucket_bytes):
    """The switch's buckets (consecutive weights, at most bucket_bytes each): their sizes."""
    sizes = []
    for _, shape in _gathered(model, layout):
        nb = _nbytes(model, shape)
        if not sizes or sizes[-1] + nb > bucket_bytes:
            sizes.append(0)
        sizes[-1] += nb
    return sizes


def memory(model, machine, work, layout):
    """Rank 0's bytes by category: training (params, grads, optim, activations) and rollout
    (params: the shards and EP's inference experts; infer: the engine's; bucket; kv), over the
    deployment's ranks (actor_ranks). Separated: a generator holds the engine and the push's bucket,
    no shards. Hybrid: the auxiliary ranks' reference (one whole model) is not checked."""
    return _memory(model, actor_ranks(machine, work), work, layout)


def _memory(model, machine, work, layout):
    """memory, over the ranks of `machine` as given."""
    params = train_bytes(model, machine, layout)
    tensors = sum(1 for n, _ in _stage_weights(model, layout, 0)
                  if not (layout.train_ep and _is_expert(n)))
    if layout.train_ep:  # each expert its own tensors
        tensors += 3 * model.n_layers * model.n_experts // layout.train_ep
    optim = 2 * params + 4 * tensors  # AdamW's two moments, and a step count per tensor
    inferred = params  # the shards, the training experts swapped for the inference ones
    if layout.train_ep:
        inferred += _experts(model, layout.infer_ep) - _experts(model, layout.train_ep)
    rows = work.prompts_per_step * work.group_size
    dp = machine.devices // layout.train_pp
    tokens = rows / dp * padded_length(work, layout) / layout.micro_batches  # a micro-batch's
    in_flight = min(layout.train_pp, layout.micro_batches)  # 1F1B: stage 0 holds pp of them
    per_token = 12 * model.d_model + 4 * model.top_k * model.d_expert  # a block's saved tensors
    activations = in_flight * tokens * model.n_layers / layout.train_pp * per_token \
        * model.dtype_bytes
    replica_rows = rows * layout.infer_tp / machine.devices
    if work.staleness:  # StaleSync's pool: its share / threshold groups in flight at once
        replica_rows = math.ceil(replica_rows / work.group_size / work.threshold - 1e-9) \
            * work.group_size
    kv = replica_rows * (work.prompt_tokens + work.max_new_tokens) * model.n_layers * 2 \
        * model.d_model / layout.infer_tp * model.dtype_bytes
    bucket = max(buckets(model, layout, work.bucket_bytes)) if layout.infer_tp > 1 else 0
    if work.deploy == "separated":  # a generator: the engine only; the push lands bucket by bucket
        inferred, bucket = 0, max(buckets(model, layout, work.bucket_bytes))
    # FSDP keeps its stage's parameters gathered from an update's first forward to its last
    # backward; a TP engine's load_weights takes one flat bucket at a time (in place: none)
    stage = set(_gathered(model, layout)) & set(_stage_weights(model, layout, 0))
    experts = _experts(model, layout.train_ep) if layout.train_ep else 0
    unsharded = sum(_nbytes(model, s) for _, s in stage) - (params - experts)
    return {"params": params, "grads": params, "optim": optim, "unsharded": unsharded,
            "activations": activations,
            "rollout_params": inferred, "infer": engine_bytes(model, layout), "bucket": bucket,
            "kv": kv}


def peak(mem):
    """The larger phase: training (shards, grads, Adam, the gathered parameters, activations) or
    rollout (shards with the inference experts, engine, bucket, KV cache; Adam's state on host)."""
    train = mem["params"] + mem["grads"] + mem["optim"] + mem["unsharded"] + mem["activations"]
    rollout = mem["rollout_params"] + mem["infer"] + mem["bucket"] + mem["kv"]
    return max(train, rollout)


def overflow(model, machine, work, layout):
    """None if the layout fits in a device's memory, else a sentence naming what overflows."""
    mem = memory(model, machine, work, layout)
    need = peak(mem)
    if need <= machine.memory_bytes:
        return None
    parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in mem.items() if v)
    return (f"{layout.flags()} needs {need / 2**20:.1f} MiB a rank ({parts} MiB), more than the "
            f"{machine.memory_bytes / 2**20:.1f} MiB a device has")


# ----------------------------------------------------------------------------- a round of rollout
def response_lengths(work, n=256):
    """The responses' lengths as n equally likely values: work.lengths, or the quantiles of a
    geometric length (an end token with the same chance p at every step: sampled text's long
    tail), capped at the budget, p such that the mean is response_tokens. The longest quantile
    is 1 - 0.5 / n: a batch of far more than n rows would have a longer longest row."""
    if work.lengths is not None:
        return list(work.lengths)
    budget, mean = work.max_new_tokens, min(work.response_tokens, work.max_new_tokens)
    lo, hi = 1e-9, 1 - 1e-9  # the capped mean (1 - (1 - p)^budget) / p falls as p grows
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if (1 - (1 - p) ** budget) / p > mean else (lo, p)
    return [min(budget, max(1, math.ceil(math.log(1 - (i + 0.5) / n) / math.log(1 - p))))
            for i in range(n)]


def response_length(lengths, j):
    """Sample j's length: lengths' (j x stride) mod n-th, the stride near 0.618 n and prime to n,
    so that consecutive samples (a group) mix short and long."""
    n = len(lengths)
    return lengths[j * _stride(n) % n]


@functools.lru_cache(maxsize=None)
def _stride(n):
    return next(s for s in itertools.count(int(0.618 * n) or 1) if math.gcd(s, n) == 1)


def round_shape(work, groups, rounds=12):
    """The rounds of a scheduler that cuts `groups` groups a batch, under StaleSync's rules,
    sample j of response_length(response_lengths(work), j) tokens. Per round, the mean over the
    rounds after the first S + 1: the decode forwards, the row-steps they carry (a finished row
    leaves the batch), the sampler calls that prefill and the rows and tokens they read. A token
    counts as a decode step, the first included (the engine takes it from the prefill's logits;
    the calibration's decode step is timed the same way). No filter: a dropped group is not
    priced.
    S = 0: one call decodes every row to its end.
    S >= 1: calls of chunk_steps. Between them the pool is refilled to groups / threshold groups
    in flight, within the admission bound (S + k + 1) x groups at batch k. The cut comes once
    `groups` groups are complete, the due ones (started S or more batches back, the oldest
    `groups` of them) among them. A due group left out restarts.
    The sampler keeps its KV cache within a round. New weights drop it, so a carried row's prefix
    is read again."""
    return dict(_round_shape(work, groups, rounds))  # a copy: the cached one stays as it is


@functools.lru_cache(maxsize=64)  # the same for every layout of one replica size
def _round_shape(work, groups, rounds):
    lengths, S, G = response_lengths(work), work.staleness, work.group_size
    pool_groups = math.ceil(groups / work.threshold - 1e-9)
    drawn = itertools.count()  # sample ids, in the order the scheduler makes them

    def fresh():
        ids = [next(drawn) for _ in range(G)]
        left = [response_length(lengths, j) for j in ids]
        return dict(id=ids[0], left=left, made=[0] * G, start=None)

    names = ("forwards", "row_steps", "prefills", "prefill_rows", "prefill_tokens")
    counted = dict.fromkeys(names, 0.0)
    pool = []  # groups admitted and not taken, in slot order
    opened = 0
    for k in range(S + 1 + rounds):
        read = set()  # the groups whose rows the sampler holds (read in this round)
        while True:
            due = [g for g in pool if g["start"] is not None and g["start"] <= k - S]
            complete = [g for g in pool if not any(g["left"])]
            if all(not any(g["left"]) for g in due[:groups]) and len(complete) >= groups:
                break
            while (sum(1 for g in pool if any(g["left"])) < pool_groups
                   and opened < (S + k + 1) * groups):
                pool.append(fresh())
                opened += 1
            live = [(g, i) for g in pool for i in range(G) if g["left"][i]]
            steps = max(g["left"][i] for g, i in live)
            steps = steps if S == 0 else min(steps, work.chunk_steps)
            new = [(g, i) for g, i in live if g["id"] not in read]
            if k > S:
                counted["forwards"] += steps
                counted["row_steps"] += sum(min(g["left"][i], steps) for g, i in live)
                counted["prefills"] += bool(new)
                counted["prefill_rows"] += len(new)
                counted["prefill_tokens"] += sum(work.prompt_tokens + g["made"][i] for g, i in new)
            for g, i in live:
                g["start"] = k if g["start"] is None else g["start"]
                n = min(g["left"][i], steps)
                g["left"][i] -= n
                g["made"][i] += n
            read.update(g["id"] for g, _ in live)
        needed = due[:groups]
        spare = [g for g in complete if all(g is not n for n in needed)]  # in slot order
        taken = needed + spare[:groups - len(needed)]
        pool = [g for g in pool if all(g is not t for t in taken)]
        for i, g in enumerate(pool):
            if any(g is d for d in due):  # due and left out: it starts again, fresh samples
                pool[i] = fresh()
    return {name: value / rounds for name, value in counted.items()}


# ----------------------------------------------------------------------------- time
def _link(machine, span):
    """The link a group of `span` consecutive ranks uses: the node's, or the one across nodes."""
    return machine.intra if span <= machine.devices_per_node else machine.inter


def collective(machine, kind, nbytes, n, span=None):
    """Seconds for one collective over n ranks, its steps at the link's latency and its bytes at
    the bandwidth: a ring's all_reduce 2 (n - 1) steps and 2 (n - 1) / n of the bytes, all_gather
    (and reduce_scatter) n - 1 and (n - 1) / n; all_to_all one step (every message sent at once)
    and (n - 1) / n; p2p one and all; broadcast (a chain, pipelined) n - 1 and all."""
    if n <= 1:
        return 0.0
    link = _link(machine, span or n)
    steps, share = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "p2p": (1, 1.0),
                    "all_to_all": (1, (n - 1) / n), "all_gather": (n - 1, (n - 1) / n),
                    "reduce_scatter": (n - 1, (n - 1) / n), "broadcast": (n - 1, 1.0)}[kind]
    return steps * link.latency_s + share * nbytes / link.bandwidth


def forward_s(model, machine, tokens, context, layers, tp=1):
    """A forward over `tokens` tokens through `layers` blocks, compute cut tp ways."""
    share = layers / model.n_layers
    compute = tokens * model.flops_per_token(context) * share / tp / machine.flops
    return layers * machine.op_s + compute


def rollout_s(model, machine, work, lay):
    """A replica's rounds, as round_shape counts them for the whole batch: the replicas cut one
    batch together (the shared cut), so each decodes until the union's cut, holding its share of
    the rows. Its prefills (the new rows' prompts, and at S >= 1 the carried rows' prefixes read
    again under new weights), then its decode forwards, each a fixed cost, the weights it reads,
    its live rows' cost split over TP, TP's all-reduces and EP's all-to-alls (an EP group spans
    the world: a rank from each row of the rank grid); the cut's all-gather at every loop turn
    (a decode chunk) and its spare slots' at the end."""
    W, D, k, B, L = machine.devices, model.d_model, model.top_k, model.dtype_bytes, model.n_layers
    replicas = W // lay.infer_tp
    shape = round_shape(work, work.prompts_per_step)
    for name in ("row_steps", "prefill_rows", "prefill_tokens"):
        shape[name] /= replicas  # a replica's share
    rows = shape["row_steps"] / max(shape["forwards"], 1)  # live rows in a mean decode forward
    weights = engine_bytes(model, lay) + (_experts(model, lay.infer_ep) if lay.train_ep else 0)
    step = machine.step_s + L * machine.op_s + weights / machine.memory_bandwidth
    step += 2 * L * collective(machine, "all_reduce", rows * D * B, lay.infer_tp)
    if lay.infer_ep > 1:  # per MoE layer the counts, the rows out, the rows back
        a2a = collective(machine, "all_to_all", rows * k * D * B, lay.infer_ep, span=W)
        counts = collective(machine, "all_to_all", 8 * model.n_experts, lay.infer_ep, span=W)
        step += L * (2 * a2a + counts)
        step += collective(machine, "all_reduce", 8, lay.infer_ep) / work.chunk_steps  # lock-step
    decode = shape["forwards"] * step + shape["row_steps"] * machine.row_s / lay.infer_tp
    tokens = shape["prefill_tokens"]
    context = tokens / max(shape["prefill_rows"], 1)
    prefill = shape["prefills"] * L * machine.op_s
    prefill += tokens * model.flops_per_token(context) / lay.infer_tp / machine.flops
    prefill += 2 * L * shape["prefills"] * collective(  # TP's all-reduces over the contexts
        machine, "all_reduce", tokens / max(shape["prefills"], 1) * D * B, lay.infer_tp)
    turns = 1 if work.staleness == 0 else max(shape["forwards"] / work.chunk_steps, 1)
    cut = (turns + 1) * collective(machine, "all_gather", 8 * 7, W)  # the shared cut's facts
    return prefill + decode + cut


def padded_length(work, lay):
    """A micro-batch's length, padded to its longest row: the rows sorted by length and cut into
    m micro-batches, lengths spread evenly up to the longest, pad to mean + (longest - mean) / m;
    under PP every micro-batch to the longest (a stage's shapes are fixed)."""
    mean = work.prompt_tokens + work.response_tokens
    longest = work.max_prompt_tokens + work.max_new_tokens
    return longest if lay.train_pp > 1 else mean + (longest - mean) / lay.micro_batches


def train_s(model, machine, work, lay, backward=True):
    """Forward (and backward: 2 more forwards' cost) over the rank's share, micro-batch by
    micro-batch; EP's all-to-alls (3 forward, 2 backward per MoE layer); PP's bubble, its
    micro-batches padded to the longest sample (a stage's shapes are fixed)."""
    dp, pp = machine.devices // lay.train_pp, lay.train_pp
    seq = padded_length(work, lay)
    tokens = work.prompts_per_step * work.group_size / dp * seq / lay.micro_batches  # one's
    passes = 3 if backward else 1
    mb = passes * forward_s(model, machine, tokens, seq / 2, model.n_layers // pp)
    mb += machine.batch_s if backward else 0.0
    if lay.train_ep > 1:
        rows_out = tokens * model.top_k * model.d_model * model.dtype_bytes
        mb += (5 if backward else 3) * model.n_layers * collective(
            machine, "all_to_all", rows_out, lay.train_ep, span=machine.devices)
    if pp > 1:  # (m + pp - 1) slots of a stage's micro-batch; activations out, gradients back
        hop = collective(machine, "p2p", tokens * model.d_model * model.dtype_bytes, 2, span=dp + 1)
        hops = lay.micro_batches * (2 if backward else 1)
        return (lay.micro_batches + pp - 1) * mb + hops * hop
    return lay.micro_batches * mb


def sync_s(model, machine, work, lay):
    """FSDP's all-gather of the shards and reduce-scatter of the gradients, once per update (the
    parameters stay gathered between micro-batches), over the ranks FSDP spans; HSDP adds an
    all-reduce of each node's shard across the nodes; EP, each expert's gradient over its
    replicas; the update (machine.update_s: the clip, AdamW's step, the zeroing)."""
    n = _shard_ranks(machine, lay)
    full = sum(_nbytes(model, s) for _, s in set(_gathered(model, lay))
               & set(_stage_weights(model, lay, 0)))
    t = collective(machine, "all_gather", full, n) + collective(machine, "reduce_scatter", full, n)
    if lay.nodes > 1:
        t += collective(machine, "all_reduce", full / n, lay.nodes, span=machine.devices)
    if lay.train_ep:  # each expert's gradient summed over its replicas; the clip's norm
        replicas = machine.devices // lay.train_ep
        t += collective(machine, "all_reduce", _experts(model, lay.train_ep), replicas)
        t += collective(machine, "all_reduce", 8, machine.devices)
    return work.updates_per_batch * (t + machine.update_s)


def switch_s(model, machine, work, lay):
    """Both switches of a step: the Adam state to host and back (the gradients are freed after
    each update); the engine gathered from the shards, a broadcast per bucket, over the ranks
    FSDP shards over (every rank's, under PP: the other stage's weights); the experts re-sharded
    and back (where they move)."""
    mem = _memory(model, machine, work, lay)
    offload = 2 * mem["optim"] / machine.host_bandwidth
    span = machine.devices if lay.train_pp > 1 else _shard_ranks(machine, lay)
    link = _link(machine, span)
    gather = switch_bytes(model, machine, lay) / link.bandwidth
    gather += len(buckets(model, lay, work.bucket_bytes)) * link.latency_s
    experts = 0.0
    if lay.train_ep:  # the ranks agree on the plan; each layer's experts in rounds, then back
        per_layer = ep_bytes(model, machine, lay) / model.n_layers
        experts = 2 * model.n_layers * collective(machine, "p2p", per_layer, 2, machine.devices)
        experts += 2 * collective(machine, "all_gather", 8 * machine.devices, machine.devices)
    return offload + gather + experts


def score_s(model, machine, work, lay):
    """Scoring the replica's samples, and the step's small all-reduces (the curriculum's counts,
    the step's figures)."""
    rows = work.prompts_per_step * work.group_size * lay.infer_tp / machine.devices
    return rows * machine.sample_s + 3 * collective(machine, "all_reduce", 8, machine.devices)


def queue_s(model, machine, work, lay):
    """The rows into the queue (one writer a replica), their ids to every rank, each trainer's
    share read: the measured fixed cost, and the cost per row of the mean of the rows a writer
    puts and a trainer reads (the calibration's ranks put and read alike)."""
    batch = work.prompts_per_step * work.group_size
    put, read = batch * lay.infer_tp / machine.devices, batch * lay.train_pp / machine.devices
    return machine.queue_s + machine.queue_row_s * (put + read) / 2


def stages(model, machine, work, lay):
    """Predicted seconds of each stage of one RL step, each priced on the deployment's ranks
    (actor_ranks); the step their sum, but where the deployment overlaps them (separated_step)."""
    actor = actor_ranks(machine, work)
    out = {"rollout": rollout_s(model, actor, work, lay),
           "switch": switch_s(model, actor, work, lay),
           "score": score_s(model, actor, work, lay),
           "queue": queue_s(model, actor, work, lay),
           "reference": train_s(model, actor, work, lay, backward=False) * work.reference,
           "train": work.updates_per_batch * train_s(model, actor, work, lay),
           "grad_sync": sync_s(model, actor, work, lay)}
    if work.deploy == "separated":
        out["switch"] = push_s(model, machine, work, lay)
        return separated_step(work, out)
    if work.deploy == "hybrid" and work.reference:
        out["reference"] = aux_wait_s(model, machine, work, lay, out)
    out["step"] = sum(out.values())
    return out


def push_s(model, machine, work, lay):
    """--deploy separated's switch, the push (options/push.py): per bucket, the trainers gather it
    from their FSDP shards as the colocated switch does, then trainer 0 broadcasts it to the W/2
    generators (a group spanning the world). No offload: each side keeps its state. Left out: the
    store's round trips, and a generator's wait for its decode chunk's end before it joins."""
    W, sizes = machine.devices, buckets(model, lay, work.bucket_bytes)
    trainers = actor_ranks(machine, work)
    link = _link(machine, W // 2)
    gather = switch_bytes(model, trainers, lay) / link.bandwidth + len(sizes) * link.latency_s
    return gather + sum(collective(machine, "broadcast", b, W // 2 + 1, span=W) for b in sizes)


def separated_step(work, t):
    """--deploy separated (options/separated.py): the generators roll out and score, the trainers
    read their rows (queue), run the reference, train and sync, and both take part in the push (switch). At S = 0 a round
    waits for the last batch's weights, the trainers for its batch: the sum. At S >= 1 the
    generators decode the next batch while the trainers train, the faster side waiting for the
    slower: trainer 0's step (the run's) is the push and the slower side."""
    generate = t["rollout"] + t["score"]
    train = t["queue"] + t["reference"] + t["train"] + t["grad_sync"]
    t["step"] = t["switch"] + (max(generate, train) if work.staleness else generate + train)
    return t


def aux_wait_s(model, machine, work, lay, t):
    """--deploy hybrid (options/hybrid.py): the actor (ranks [0, W - K)) runs the colocated step
    but the reference's forward. Its K auxiliary ranks take their share of the groups as they are
    put, one forward per piece of a micro-batch's groups, padded to its longest row (put order).
    They work from the rollout's start (optimistic: groups complete late); the last piece's group
    is put at its end. The actor's wait, its "reference": what is left after the switch and the
    score, at least that piece. Left out: the queue's transfers, a reward model."""
    per = max(1, work.prompts_per_step
              // (lay.micro_batches * work.updates_per_batch * work.aux_ranks))  # groups a piece
    pieces = math.ceil(work.prompts_per_step / work.aux_ranks / per)
    seq = work.max_prompt_tokens + work.max_new_tokens
    piece = forward_s(model, machine, per * work.group_size * seq, seq / 2, model.n_layers)
    lead = t["switch"] + t["score"]
    return max(0.0, piece - lead, pieces * piece - t["rollout"] - lead)


# ----------------------------------------------------------------------------- the search
def plan(model, machine, work, runnable=None):
    """Every candidate priced, fastest first: [(layout, stage seconds, memory, overflow or None)].
    runnable(layout) -> bool narrows the candidates (the run's own checks)."""
    rows = []
    for lay in candidates(model, machine, work):
        if runnable is not None and not runnable(lay):
            continue
        rows.append((lay, stages(model, machine, work, lay), memory(model, machine, work, lay),
                     overflow(model, machine, work, lay)))
    rows.sort(key=lambda r: (r[3] is not None, r[1]["step"], peak(r[2])))  # ties: less memory
    if not rows:
        raise ValueError(f"no layout of {machine.devices} devices runs this model "
                         f"(deploy {work.deploy})")
    if rows[0][3] is not None:
        smallest = min(rows, key=lambda r: peak(r[2]))
        raise ValueError(f"no layout fits: the smallest, {smallest[3]}")
    return rows


def table(rows, top=10):
    """The candidates as text, the choice first: each stage's predicted seconds, peak MiB."""
    cols = ("step", "rollout", "switch", "score", "queue", "reference", "train", "grad_sync")
    lines = [f"{'':7} {'layout':<36}" + "".join(f"{c:>10}" for c in cols) + f"{'MiB':>10}"]
    for i, (lay, t, mem, over) in enumerate(rows[:top]):
        mark = "chosen" if i == 0 else ("no fit" if over else "")
        lines.append(f"{mark:7} {lay.short():<36}" + "".join(f"{t[c]:10.4f}" for c in cols)
                     + f"{peak(mem) / 2**20:10.1f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="plan the layouts of a machine from its constants")
    p.add_argument("--machine", required=True, help="a JSON file of Machine's fields")
    p.add_argument("--devices", type=int, help="override the file's device count")
    p.add_argument("--nodes", type=int, help="nodes the devices are spread over")
    p.add_argument("--deploy", choices=DEPLOYS, default="colocated", help="as train_grpo.py's")
    p.add_argument("--aux-ranks", type=int, default=1, help="--deploy hybrid's")
    for name, default in [("vocab", 14), ("d_model", 64), ("n_layers", 2), ("n_heads", 4),
                          ("n_experts", 4), ("top_k", 2), ("d_expert", 128),
                          ("prompts_per_step", 16), ("group_size", 8), ("prompt_tokens", 18.0),
                          ("response_tokens", 18.0), ("max_new_tokens", 40),
                          ("max_prompt_tokens", 34.0), ("staleness", 1)]:
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    a = p.parse_args(argv)
    model = Model(a.vocab, a.d_model, a.n_layers, a.n_heads, a.n_experts, a.top_k, a.d_expert)
    try:  # a bad workload or machine, or one no layout fits: the reason, no traceback
        work = Workload(a.prompts_per_step, a.group_size, a.prompt_tokens, a.response_tokens,
                        a.max_new_tokens, max_prompt_tokens=a.max_prompt_tokens,
                        staleness=a.staleness, deploy=a.deploy, aux_ranks=a.aux_ranks)
        devices = a.devices or Machine.load(a.machine).devices
        per_node = devices // a.nodes if a.nodes else None
        machine = Machine.load(a.machine, devices=devices, devices_per_node=per_node)
        rows = plan(model, machine, work)
    except ValueError as e:
        p.error(str(e))
    nodes = machine.devices // machine.devices_per_node
    print(f"{machine.name}: {machine.devices} devices, {nodes} node(s), --deploy {work.deploy}; "
          f"{len(rows)} candidates, predicted seconds per RL step")
    print(table(rows))
    print(json.dumps({"machine": machine.name, "chosen": rows[0][0].flags(),
                      "rl_step_s": rows[0][1]["step"], "candidates": len(rows)}))


if __name__ == "__main__":
    main()
