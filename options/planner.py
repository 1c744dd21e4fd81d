# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""Choosing the layouts: price every (training layout, inference layout) pair, the switch between
them included, and keep the fastest that fits in memory.

    python -m options.planner --machine bench/machines/h100x8.json --devices 16 --nodes 2
    python -m options.planner --machine bench/machines/h100x8.json --deploy hybrid --aux-ranks 4
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
  grad sync  FSDP's all-gather and reduce-scatter, EP's gradient sum over its replicas, the update.
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
or from a file for one we do not have (bench/machines/*.json). The formulas and the byte counts
(equal to the run's: tests/test_planner.py) are in plumbing/planner_details.py; copy the two.
"""
import argparse
import dataclasses
import itertools
import json
import math
from dataclasses import dataclass

from plumbing.planner_details import (
    aux_wait_s, is_int, memory_over, peak, positive, push_s, queue_s, rollout_s, score_s, switch_s,
    sync_s, train_s)


# ----------------------------------------------------------------------------- what is planned for
@dataclass(frozen=True)
class Link:
    latency_s: float   # one message, one hop
    bandwidth: float   # bytes/s, one direction of one rank's link

    def __post_init__(self):
        positive(self, "bandwidth")
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
        if not (is_int(self.cores) and self.cores >= 0):
            raise ValueError(f"cores {self.cores!r} must be an int >= 0 "
                             "(0: a device computes alone)")
        if self.devices < 1 or self.devices_per_node < 1 or self.devices % self.devices_per_node:
            raise ValueError(f"devices {self.devices} must be >= 1 and a multiple of "
                             f"devices_per_node {self.devices_per_node} (>= 1)")
        for name in ("memory_bytes", "flops", "host_bandwidth", "memory_bandwidth", "step_s",
                     "op_s", "batch_s", "update_s", "sample_s", "row_s", "queue_s",
                     "queue_row_s"):
            positive(self, name)

    @classmethod
    def load(cls, source, **changes):
        """A machine from a JSON file (bench/machines/*.json) or a dict of its fields (a key
        starting with _ is a note); `changes` override its fields."""
        if isinstance(source, str):
            with open(source) as f:
                source = json.load(f)
        raw = {k: v for k, v in source.items() if not k.startswith("_")}
        raw.update({k: v for k, v in changes.items() if v is not None})
        fields = dataclasses.fields(cls)
        unknown = set(raw) - {f.name for f in fields}
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in raw]
        if unknown or missing:
            wrong = [f"unknown machine fields {sorted(unknown)}"] * bool(unknown)
            raise ValueError(", ".join(wrong + [f"missing {missing}"] * bool(missing)))
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
# (colocated-all's copies of the reference to and from host are left out)


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
            if not self.lengths or not all(is_int(n) and 1 <= n <= self.max_new_tokens
                                           for n in self.lengths):
                raise ValueError(f"lengths {self.lengths} must be ints in 1 .. max_new_tokens "
                                 f"{self.max_new_tokens}")
        if not (is_int(self.staleness) and self.staleness >= 0):
            raise ValueError(f"staleness {self.staleness!r} must be an int >= 0")
        if not (is_int(self.chunk_steps) and self.chunk_steps >= 1):
            raise ValueError(f"chunk_steps {self.chunk_steps!r} must be an int >= 1")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold {self.threshold!r} must be in (0, 1]")
        if self.deploy not in DEPLOYS:
            raise ValueError(f"deploy {self.deploy!r} must be one of {', '.join(DEPLOYS)}")
        if not (is_int(self.aux_ranks) and self.aux_ranks >= 1):
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


# ----------------------------------------------------------------------------- the candidates
def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def actor_ranks(machine, work):
    """The ranks the colocated formulas price, as a Machine of their own: every rank (colocated);
    each side's W/2 (separated: as many trainers as generators); the actor's W - K (hybrid). Where
    they are not whole nodes (more ranks than a node holds, not a multiple of it), a group wider
    than gcd(ranks, devices_per_node) crosses nodes."""
    W, k = machine.devices, machine.devices_per_node
    n = {"separated": W // 2, "hybrid": W - work.aux_ranks}.get(work.deploy, W)
    if n < 1 or work.deploy == "separated" and W % 2:
        need = ("an even number of devices" if work.deploy == "separated"
                else f"more devices than aux_ranks {work.aux_ranks}")
        raise ValueError(f"deploy {work.deploy} needs {need} (got {W})")
    per = n if n <= k else math.gcd(n, k)
    return _busy(dataclasses.replace(machine, devices=n, devices_per_node=per), W, work)


def _busy(machine, world, work):
    """Where the devices share `cores` (ranks on one CPU), the constants were measured with every
    rank busy. Separated at S = 0 runs its sides in turn, each while the other waits: a side runs
    faster, up to a core a rank, its compute speeds scaled by its share of the cores over the
    world's. The hybrid is priced busy: its auxiliary ranks compute during the rollout, though
    they wait in the store while the actor trains (its training then priced slow)."""
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


# ----------------------------------------------------------------- one RL step, and what fits
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
        out["switch"] = push_s(model, machine, work, lay, actor)
        return separated_step(work, out)
    if work.deploy == "hybrid" and work.reference:
        out["reference"] = aux_wait_s(model, machine, work, lay, out)
    out["step"] = sum(out.values())
    return out


def separated_step(work, t):
    """--deploy separated (options/separated.py): the generators roll out and score, the trainers
    read their rows (queue), run the reference, train and sync, and both take part in the push
    (switch). At S = 0 a round waits for the last batch's weights, the trainers for its batch: the
    sum. At S >= 1 the generators decode the next batch while the trainers train, the faster side
    waiting for the slower: trainer 0's step (the run's) is the push and the slower side."""
    generate = t["rollout"] + t["score"]
    train = t["queue"] + t["reference"] + t["train"] + t["grad_sync"]
    t["step"] = t["switch"] + (max(generate, train) if work.staleness else generate + train)
    return t


def memory(model, machine, work, layout):
    """Rank 0's bytes by category: training (params, grads, optim, activations) and rollout
    (params: the shards and EP's inference experts; infer: the engine's; bucket; kv), over the
    deployment's ranks (actor_ranks). Separated: a generator holds the engine and the push's bucket,
    no shards. Hybrid: the auxiliary ranks' reference (one whole model) is not checked."""
    return memory_over(model, actor_ranks(machine, work), work, layout)


def overflow(model, machine, work, layout):
    """None if the layout fits in a device's memory, else a sentence naming what overflows."""
    mem = memory(model, machine, work, layout)
    need = peak(mem)
    if need <= machine.memory_bytes:
        return None
    parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in mem.items() if v)
    return (f"{layout.flags()} needs {need / 2**20:.1f} MiB a rank ({parts} MiB), more than the "
            f"{machine.memory_bytes / 2**20:.1f} MiB a device has")


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
