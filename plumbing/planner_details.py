# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""options/planner.py's details, which a reader can take on trust: the formulas it prices with.

options/planner.py teaches the method (one RL step's stages, the deployments, the search; its
constants measured by options/layout_auto.py); this file holds what it calls by name:
  - the checks of its dataclasses' fields: is_int, positive;
  - the byte counts and the memory model: a pipeline stage's weights, FSDP2's row shards, the
    experts under EP; train_bytes (a rank's shards), switch_bytes (the least a rank receives to
    build the engine: the run's switch/received_min_bytes), ep_bytes (the experts it receives: the
    run's ep/to_rollout_bytes_moved), engine_bytes, the switch's buckets; memory_over (rank 0's
    bytes by category, over the ranks given) and peak (the larger of its two phases);
  - the round replay: response_lengths (the responses' lengths: the workload's, or a geometric
    length's quantiles), response_length (sample j's), round_shape (StaleSync's rounds replayed
    under its rules: a round's decode forwards, row-steps, prefills);
  - each stage's time: collective (its steps at the link's latency, its bytes at the bandwidth),
    forward_s, rollout_s, padded_length and train_s, sync_s, switch_s, score_s, queue_s; and the
    deployments' own: push_s (separated's switch), aux_wait_s (hybrid's wait for the reference).

Each function takes the planner's Model, Machine, Workload and Layout as arguments and reads their
fields (a Machine may be a deployment's ranks: planner.py's actor_ranks). It imports the standard
library only, nothing of the project, never options/planner.py. Copy the two together, this one at
plumbing/planner_details.py beside planner.py (or change planner.py's one import line). A name
with a leading underscore is used only in this file. tests/test_planner.py holds the byte counts
equal to the run's own, and the replay's counts equal to one scheduler's.
"""
import functools
import itertools
import math


# ----------------------------------------------------------------------------- the input's checks
def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def positive(obj, name):
    value = getattr(obj, name)
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} {value!r} must be a finite number > 0")


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


def memory_over(model, machine, work, layout):
    """planner.py's memory (rank 0's bytes by category), over the ranks of `machine` as given."""
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
    mem = memory_over(model, machine, work, lay)
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


def push_s(model, machine, work, lay, trainers):
    """--deploy separated's switch, the push (options/push.py): per bucket, the trainers (their
    ranks: planner.py's actor_ranks) gather it from their FSDP shards as the colocated switch does,
    then trainer 0 broadcasts it to the W/2 generators (a group spanning the world). No offload:
    each side keeps its state. Left out: the store's round trips, and a generator's wait for its
    decode chunk's end before it joins."""
    W, sizes = machine.devices, buckets(model, lay, work.bucket_bytes)
    link = _link(machine, W // 2)
    gather = switch_bytes(model, trainers, lay) / link.bandwidth + len(sizes) * link.latency_s
    return gather + sum(collective(machine, "broadcast", b, W // 2 + 1, span=W) for b in sizes)


def aux_wait_s(model, machine, work, lay, t):
    """--deploy hybrid (options/hybrid.py): the actor (ranks [0, W - K)) runs the colocated step
    but the reference's forward. Its K auxiliary ranks take their share of the groups as they are
    put, one forward per piece of a micro-batch's groups, padded to the longest a row can be (put
    order). They work from the rollout's start (optimistic: groups complete late); the last
    piece's group is put at its end. The actor's wait, its "reference": what is left after the
    switch and the score, at least that piece (both halves of the switch are counted, though the
    one before the rollout comes before any group is put: a wait priced short by that half).
    Left out: the queue's transfers, a reward model."""
    per = max(1, work.prompts_per_step
              // (lay.micro_batches * work.updates_per_batch * work.aux_ranks))  # groups a piece
    pieces = math.ceil(work.prompts_per_step / work.aux_ranks / per)
    seq = work.max_prompt_tokens + work.max_new_tokens
    piece = forward_s(model, machine, per * work.group_size * seq, seq / 2, model.n_layers)
    lead = t["switch"] + t["score"]
    return max(0.0, piece - lead, pieces * piece - t["rollout"] - lead)
