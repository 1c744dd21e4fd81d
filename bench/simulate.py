"""Simulate the RL loop on N nodes from the stage costs measured here: why synchronous RL scales worse than StaleSync.

    python bench/simulate.py             # the N = 1 check, then N = 1, 2, 4: a few seconds, numpy only
    python bench/simulate.py --nodes 1 2 4 8 --staleness 1 2 4 --seed 1 --steps 96 --groups-per-node 8
    python bench/simulate.py --lengths fixed:24      # the control: no tail, and sync scales as StaleSync does

The source article's scaling table: from 1 to 4 supernodes, fully synchronous RL went 25k -> 85k
tokens/s (about 85% linearity) and StaleSync 35k -> 127k (91%). This file replays the RL loop as events on N
nodes, with the stage costs this project's benchmarks measured on its 2-core machine, first checks that at N = 1
it predicts what bench/stalesync.py and bench/fusion.py measured, then prints tokens/s, idle share and linearity
(tokens/s(N) / (N x tokens/s(1))) against N, and where a step's time goes at the smallest and the largest N.
The figures it comes to belong in bench/RESULTS.md, not here.

What is modelled. A node is the 2 ranks the benchmarks ran on: colocated, both generate their half of the node's
share and then both train; separated, rank 0 generates and rank 1 trains.
  lengths     a sample's response length is drawn per global sample id exactly as bench/stalesync.py draws it
              (a numpy Generator seeded [salt, id]; salt 1234, the bench's, for the check and for --seed 0), ids
              laid out as that bench lays them out: every deployment and every N sees the same samples.
  scheduler   stalesync.StaleSync's rules in decode-step units (Pool): admission capacity (S + v + 1) x gps
              groups, a pool of (S + 1) x gps, sampler calls of --chunk decode steps (S = 0: one call to the longest
              sample), the cut once gps groups are complete and the due ones done (due first, then the oldest),
              regeneration of groups that would age past S, partial rollouts, the KV cache dropped at every new
              weight version (every held prefix prefilled again). With the bench's lengths it counts the
              bench's critical-path decode steps to the digit.
  decode      a call costs call_ms + its prefill (model._prefill's length buckets, the same DP) + per forward
              decode_ms + sample_ms + row_ms x live rows + ctx_ms x live rows x KV width (left-padded to the
              longest context); exact per call, the rows' lengths being known.
  colocated   a round ends at the first turn at which every rank of every node is ready (stalesync.AllReady: a
              ready rank waits for the others' flags and meanwhile decodes its tail); a barrier; each rank trains
              its batch; the gradient all-reduce waits for the slowest rank.
  separated   bench/stalesync.py's generator loop: new weights taken between calls, a batch sent as the cut
              releases it, idle when the bound S stops admission; the trainer waits for a batch, trains, pushes
              the weights. With N nodes a trainer step needs every generator's batch.
  training    train_micro_ms per packed micro-batch (<= 512 tokens, as bench/stalesync.py packs them) +
              train_tok_ms per prompt + response token.
  contention  a node's 2 ranks share 2 CPU cores: while both work each is `contention` x slower (decode and
              training alike, though the probe measured decode only; separated: the trainer when S >= 1, the
              generator while a training runs).
  N nodes     weak scaling: the global batch is N x the node's, every node a replica of the 2-rank node; the
              gradients all-reduced across nodes in a ring (2 (N - 1) / N x their bytes at gloo's measured
              all_reduce bandwidth); a straggler factor per node per step, lognormal(0, --straggler), multiplies
              all that node's work (an assumption: the host only shows that a figure moves by several percent
              between runs). The table's node adds what a training run has to the bench's regime: the phase
              switch colocated (--switch-s), the weight push separated (--push-s).
Not modelled: the learning (a sample's age costs nothing here), scoring and the queue (a small share of a
default step), memory, a network beyond one bandwidth, faults, a reward model, a cut global across ranks (each
rank cuts its own share, as stalesync.py does).

Calibration, constant by constant (the MEASURED block below holds each figure and names its benchmark):
  contention      PROBE_SLOWDOWN: bench/stalesync.py's decode probe, both ranks decoding / alone; the mean of
                  its two probes, before and after the runs (it drifts with the host).
  row_ms, ctx_ms  DECODE_MS, bench/prefill.py's decode table: 1 -> 64 rows at KV width 32 and at 256.
  decode_ms       so that the probe's step (8 rows, KV width 1 -> 150, alone) costs PROBE_ALONE_MS.
  prefill_ms, prefill_tok_ms  PREFILL_MS + PREFILL_TOK_MS x n: bench/prefill.py's forward of 1 row x n tokens.
  train_micro_ms  3 x prefill_ms (a forward and a backward): an assumption.
  FITTED, on bench/stalesync.py (lognormal(2.5, 1.2) clipped to 256, 48 steps x 4 groups x 4 samples):
    train_tok_ms  rank 0's training time in colocated S = 0 (CO_S0_TRAIN_S);
    sample_ms     rank 0's rollout time in the same run (CO_S0_ROLLOUT_S): what a decode step costs beyond
                  the probe's bare forward (sampling, one host sync, per-row Python);
    call_ms       separated S = 1's tokens/s: per sampler call, the KV gather, contexts, bookkeeping; if
                  that fit comes out below 0, call_ms is 0 and sample_ms is fitted on the rollout alone.
    So colocated S = 0 and (when call_ms > 0) separated S = 1 are fitted, not predicted (the check says so).
  PREDICTED (the check, within --tolerance): bench/stalesync.py's 6 other tokens/s (colocated S = 1, 2, 4,
    separated S = 0, 2, 4) and its decode-step gains sync / stale (device-independent: the scheduler alone).
  bench/fusion.py (d_model 128, 64 prompts x 8 responses, max_new_tokens 33, no warm-up): its policy is
    untrained, so a response ends at EOS with probability about 1/14 a token (vocabulary 14), capped at 33,
    which its measured separated tokens/s x step time bears out. FITTED on its separated run: a per row-token
    rollout cost (decode steps at decode_ms + sample_ms) and a per-token training cost. PREDICTED: colocated
    rollout, training and tokens/s, from those, the contention, FSDP2's 3 collectives per micro-batch at
    gloo's all_gather bandwidth and its measured switch; separated tokens/s, which checks only the length
    law and that the stages add up.

Reading the output. The decomposition splits a colocated step: the rollout an equal-length batch of the same
tokens would take; the rest of the rollout, the wait for the tail (synchronous: for the longest sample); training
(the slowest rank's) + switch + all-reduce; and the slowest node (the step with stragglers minus without).
Weak scaling multiplies a step's tokens by N, so linearity ~ step(1) / step(N): the growth of each term is the
linearity it costs. The last line printed is one JSON object: table, linearity, source_linearity, shape_holds
(colocated sync below every stale row), check (rows of predicted, measured, rel_err, kind, pass; pass),
decomposition, linearity_lost_by_term, constants, regime.

Shapes: N nodes, W ranks, G group size, gps groups per step per generating rank, S staleness bound, v policy
version, R live rows, L response length.
"""
import argparse
import json
import textwrap
from dataclasses import dataclass, replace

import numpy as np

# ----------------------------------------------------------------------------- measured figures
# MEASURED: each figure as bench/RESULTS.md reported it at d87c140, with the benchmark that measures it.
# bench/stalesync.py --lengths lognormal:2.5,1.2 --repeats 3, tokens per second
STALESYNC_TPS = {("colocated", 0): 1132, ("colocated", 1): 1769, ("colocated", 2): 2267, ("colocated", 4): 2847,
                 ("separated", 0): 1163, ("separated", 1): 1750, ("separated", 2): 2207, ("separated", 4): 2605}
STALESYNC_GAIN = {1: 1.821, 2: 2.543, 4: 4.015}  # its critical-path decode steps, colocated sync / stale
PROBE_ALONE_MS = 2.161                            # its decode probe: 8 rows, 150 steps, alone
PROBE_SLOWDOWN = (1.016, 1.222)                   # ... both ranks at once / alone, before and after the runs
CO_S0_ROLLOUT_S, CO_S0_TRAIN_S = 14.10, 2.22      # its rank 0, colocated S = 0, 48 steps
# bench/prefill.py (1 thread): ms per decode step by (live rows, KV width); a prefill forward of 1 x n tokens
DECODE_MS = {(1, 32): 1.51, (64, 32): 3.48, (1, 256): 1.93, (64, 256): 4.36}
PREFILL_MS, PREFILL_TOK_MS = 1.92, 0.0231
# bench/fusion.py, per step
FUSION = dict(sep_tps=2213, col_tps=3857, sep_rollout_s=1.19, sep_train_s=1.65, col_rollout_s=0.65,
              col_train_s=0.84, switch_s=0.033)
LINK_GIB_S = 0.85   # the link between nodes, GiB/s: an assumption, gloo's all_reduce between 2 ranks of this
                    # machine kind as measured outside these benchmarks (no benchmark here times all_reduce)
PUSH_GIB_S = 1.44   # gloo point to point, GiB/s (the separated weight push): bench/moe_switch.py's p2p
                    # bound, 96 MiB in 0.065 s (the median of its three runs on commit d87c140)
SWITCH_S = 0.027    # the default run's phase switches per step (its metrics.jsonl: time/switch_s, median)
PARAMS = 232_000    # the default policy's parameters: model.Policy(model.ModelConfig())
SOURCE = {"sync": (25e3, 85e3), "stalesync": (35e3, 127e3)}  # the source's tokens/s on 1 and 4 supernodes


@dataclass
class Costs:
    """One rank's stage costs (ms unless named); the module docstring says where each comes from."""
    decode_ms: float              # one decode forward, fixed part
    row_ms: float                 # ... per live row
    ctx_ms: float                 # ... per live row per KV column
    contention: float             # slowdown while both ranks of a node work
    prefill_ms: float = PREFILL_MS          # one prefill forward, fixed part
    prefill_tok_ms: float = PREFILL_TOK_MS  # ... per (padded) token
    sample_ms: float = 0.0        # per decode step, what the probe skips: sampling, host sync, Python (fitted)
    call_ms: float = 0.0          # per sampler call: Python and torch bookkeeping, AllReady (fitted)
    train_tok_ms: float = 0.1     # training, per packed token (fitted)
    train_micro_ms: float = 3 * PREFILL_MS  # training, per packed micro-batch: a forward and a backward
    pack: int = 512               # tokens per packed micro-batch
    prompt_len: int = 16          # prompt tokens
    switch_ms: float = 0.0        # colocated phase switch per step (bench/stalesync.py has none)
    push_ms: float = 4 * PARAMS / (PUSH_GIB_S * 2 ** 30) * 1e3  # separated weight push: fp32 weights, p2p
    grad_bytes: float = 4 * PARAMS  # gradient bytes all-reduced across nodes: the policy's fp32 parameters
    link_gib_s: float = LINK_GIB_S  # the link between nodes
    straggler: float = 0.0        # sigma of a node's lognormal slowdown per step


def calibrated_from_table():
    """row_ms and ctx_ms from bench/prefill.py's decode table, decode_ms from the 8-row probe."""
    row_ctx32 = (DECODE_MS[64, 32] - DECODE_MS[1, 32]) / 63       # ms per row at 32 KV columns
    row_ctx256 = (DECODE_MS[64, 256] - DECODE_MS[1, 256]) / 63    # ms per row at 256 KV columns
    ctx_ms = (row_ctx256 - row_ctx32) / 224                       # ms per row per column
    row_ms = row_ctx32 - 32 * ctx_ms
    decode_ms = PROBE_ALONE_MS - 8 * row_ms - 8 * 75.5 * ctx_ms  # the probe's width runs 1 -> 150
    return Costs(decode_ms=decode_ms, row_ms=row_ms, ctx_ms=ctx_ms, contention=sum(PROBE_SLOWDOWN) / 2)


# ----------------------------------------------------------------------------- lengths and costs
class Lengths:
    """Response length of each global sample id: bench/stalesync.py's length_law, cached (one numpy
    Generator per id, seeded [salt, id]: the bench's very samples when salt = 1234)."""

    def __init__(self, spec, max_len, salt=1234):
        kind, _, params = spec.partition(":")
        a = [float(x) for x in params.split(",")]
        self.draw = {"lognormal": lambda r, n=None: r.lognormal(a[0], a[1], n),
                     "uniform": lambda r, n=None: r.uniform(a[0], a[1], n),
                     "pareto": lambda r, n=None: a[1] * (1 + r.pareto(a[0], n)),
                     "fixed": lambda r, n=None: np.full(n, a[0]) if n else a[0]}[kind]
        self.max_len, self.salt, self.cache = max_len, salt, {}

    def mean(self, n=200_000):
        """The law's mean length, clipped and rounded as the draws are (one seeded stream of n draws)."""
        return float(np.clip(np.round(self.draw(np.random.default_rng(self.salt), n)), 1, self.max_len).mean())

    def __call__(self, ids):
        out = np.empty(len(ids), dtype=np.int64)                                  # (G,) tokens
        for k, i in enumerate(ids):
            if i not in self.cache:
                x = self.draw(np.random.default_rng([self.salt, int(i)]))
                self.cache[i] = int(np.clip(round(x), 1, self.max_len))
            out[k] = self.cache[i]
        return out


def length_buckets(lens, forward_cost=256):
    """model._length_buckets: split rows sorted by length to minimise padded tokens + forward_cost per
    forward. Returns [(rows, padded length)] per bucket."""
    longest = np.sort(np.asarray(lens))[::-1]                                     # (R,) descending
    best, cut = np.zeros(len(lens) + 1), np.zeros(len(lens) + 1, dtype=np.int64)
    for j in range(1, len(lens) + 1):
        cost = best[:j] + (j - np.arange(j)) * longest[:j] + forward_cost           # (j,)
        cut[j] = int(cost.argmin())
        best[j] = cost[cut[j]]
    out, j = [], len(lens)
    while j > 0:
        out.append((j - cut[j], int(longest[cut[j]])))
        j = int(cut[j])
    return out


@dataclass
class Call:
    """What one sampler call did, in units: the cost model turns it into ms."""
    forwards: int        # decode forwards (every live row at once)
    row_fwd: int         # sum over forwards of live rows
    ctx_work: float      # sum over forwards of live rows x KV width
    prefill: list        # context lengths read by a prefill (new rows; every row after new weights)
    tokens: int          # response tokens made


def call_ms(c: Costs, call):
    """ms of one sampler call, alone on its node."""
    pre = sum(c.prefill_ms + c.prefill_tok_ms * rows * width for rows, width in length_buckets(call.prefill)) \
        if len(call.prefill) else 0.0
    return (c.call_ms + pre + (c.decode_ms + c.sample_ms) * call.forwards + c.row_ms * call.row_fwd
            + c.ctx_ms * call.ctx_work)


def train_ms(c: Costs, sample_tokens):
    """ms of one optimizer step on samples of these prompt + response token counts, packed as
    bench/stalesync.py packs them (length-sorted micro-batches of at most c.pack tokens)."""
    micro, used = 1, 0
    for n in sorted(sample_tokens):
        if used and used + n > c.pack:
            micro, used = micro + 1, 0
        used += n
    return c.train_micro_ms * micro + c.train_tok_ms * sum(sample_tokens)


def pair(d0, d1, kappa):
    """Durations of two jobs started together on one node, d0 and d1 alone: while both run each is kappa
    x slower, so the shorter takes kappa x its own and the longer kappa - 1 times the shorter more."""
    if min(d0, d1) == 0:
        return d0, d1
    return (kappa * d0, d1 + (kappa - 1) * d0) if d0 <= d1 else (d0 + (kappa - 1) * d1, kappa * d1)


def stragglers(c: Costs, steps, nodes, seed):
    """Each node's slowdown factor per step, (steps, N): lognormal(0, c.straggler), 1 when it is 0."""
    if not c.straggler:
        return np.ones((steps, nodes))
    return np.random.default_rng(seed).lognormal(0.0, c.straggler, (steps, nodes))


def allreduce_ms(c: Costs, nodes):
    """Ring all-reduce of the gradients across nodes: 2 (N - 1) / N x the bytes at the link bandwidth."""
    return 2 * (nodes - 1) / nodes * c.grad_bytes / (c.link_gib_s * 2 ** 30) * 1e3


# ----------------------------------------------------------------------------- the scheduler, in decode steps
class Pool:
    """stalesync.StaleSync on known lengths: groups of G samples, admitted within the capacity, decoded in
    calls of `chunk` steps (S = 0: to the end), cut at gps complete groups with the due ones done.
    A group's rows start together and every call advances all of them, so one number, its progress p
    (tokens made by its longest-running row), says where each row is: row i has min(L_i, p) tokens.
    id_of(i): this rank's i-th sample -> its global id (the bench's layout)."""

    def __init__(self, S, gps, G, chunk, lengths, id_of, prompt_len):
        self.S, self.gps, self.G, self.chunk, self.prompt_len = S, gps, G, chunk, prompt_len
        self.lengths, self.id_of = lengths, id_of
        self.version = self.batches_out = self.started = self.next_id = self.regenerated = 0
        self.groups = []  # admission order: dict(start, length (G,), lmax, p, cached)

    def _fresh(self, g):
        length = self.lengths([self.id_of(self.next_id + j) for j in range(self.G)])  # (G,) tokens
        self.next_id += self.G
        g.update(start=None, length=length, lmax=int(length.max()), p=0, cached=False)
        return g

    def in_flight(self):
        return [g for g in self.groups if g["p"] < g["lmax"]]

    def admit(self):
        """Start groups while the capacity (S + v + 1) x gps and the pool of (S + 1) x gps allow."""
        while self.started < (self.S + self.version + 1) * self.gps and \
                len(self.in_flight()) < (self.S + 1) * self.gps:
            self.groups.append(self._fresh({}))
            self.started += 1

    def decode(self):
        """One sampler call on every in-flight row. Returns a Call, or None with nothing in flight."""
        live = self.in_flight()
        if not live:
            return None
        for g in live:
            g["start"] = self.version if g["start"] is None else g["start"]
        length = np.concatenate([g["length"] for g in live])                      # (G',) tokens
        p = np.repeat([g["p"] for g in live], self.G)                             # (G',) progress
        cached = np.repeat([g["cached"] for g in live], self.G)                   # (G',)
        on = length > p                                                           # rows still decoding
        rem, ctx, cached = (length - p)[on], self.prompt_len + p[on], cached[on]  # (R,)
        steps = int(rem.max()) if self.S == 0 else min(self.chunk, int(rem.max()))
        made = np.minimum(rem, steps)                                             # (R,) tokens this call
        fwd = made - (made == rem)  # a row that ends here needs no forward after its last token
        width = int(ctx.max())      # KV columns at the first forward: left-padded to the longest context
        for g in live:
            g["p"], g["cached"] = g["p"] + steps, True
        return Call(steps if (made < rem).any() else steps - 1, int(fwd.sum()),
                    float((fwd * width + fwd * (fwd - 1) / 2).sum()), ctx[~cached].tolist(), int(made.sum()))

    def _due(self):
        k = self.batches_out
        return [g for g in self.groups if g["start"] is not None and g["start"] <= k - self.S]

    def ready(self):
        """gps groups complete, and the oldest gps due groups among them."""
        complete = sum(g["p"] >= g["lmax"] for g in self.groups)
        return complete >= self.gps and all(g["p"] >= g["lmax"] for g in self._due()[:self.gps])

    def take(self):
        """Emit batch k: due groups first, then the oldest complete; regenerate those now too old.
        Returns the batch's samples' prompt + response token counts, (gps x G,)."""
        k = self.batches_out
        due = self._due()[:self.gps]
        rest = [g for g in self.groups if g["p"] >= g["lmax"] and all(g is not d for d in due)]
        chosen = due + rest[:self.gps - len(due)]
        self.groups = [g for g in self.groups if all(g is not c for c in chosen)]
        self.batches_out += 1
        for g in self.groups:  # trained at >= k + 1 they would be older than S: restart them
            if g["start"] is not None and g["start"] <= k - self.S:
                self._fresh(g)
                self.regenerated += 1
        return np.concatenate([self.prompt_len + g["length"] for g in chosen])

    def update(self):
        """New weights: version + 1, and the KV cache dropped (every held prefix is read again)."""
        self.version += 1
        for g in self.groups:
            g["cached"] = False


def id_layout(rank, world, gps, G):
    """bench/stalesync.py's global ids: rank r's local group g is global group (g // gps) W gps + r gps + g % gps."""
    def id_of(i):
        g, j = divmod(i, G)
        return ((g // gps) * gps * world + rank * gps + g % gps) * G + j
    return id_of


# ----------------------------------------------------------------------------- colocated
@dataclass
class Run:
    """What one simulated run measured, as bench/stalesync.py measures it."""
    tokens: int           # response tokens trained
    wall_s: float         # the slowest rank's wall time
    busy_s: np.ndarray    # (W,) each rank's working time
    rollout_s: float      # rank 0's rollout time (its rounds, its waits in them included)
    train_s: float        # rank 0's training time (the all-reduce waits for the slowest rank)
    crit_steps: int       # critical-path decode forwards: per round the max over ranks (separated: generator 0's)

    @property
    def tokens_per_s(self):
        return self.tokens / self.wall_s

    @property
    def idle(self):
        return 1 - float(self.busy_s.sum()) / (len(self.busy_s) * self.wall_s)


def colocated_round(c, pools, t0, slow):
    """One round on W = 2N ranks (rank r on node r // 2): decode turns until every rank is ready.
    Returns (end time, work per rank (W,), decode forwards per rank (W,)), times in ms."""
    W = len(pools)
    clock, work, fwd = np.full(W, t0), np.zeros(W), np.zeros(W, dtype=np.int64)
    while True:
        flags = [p.ready() for p in pools]  # posted at the turn's start (AllReady)
        if all(flags):
            return clock.max(), work, fwd
        answer = clock.max()  # a ready rank waits for every flag of this turn; the others post and go on
        dt = np.zeros(W)
        for r, p in enumerate(pools):
            clock[r] = answer if flags[r] else clock[r]
            p.admit()
            call = p.decode()
            if call is not None:
                dt[r], fwd[r] = call_ms(c, call), fwd[r] + call.forwards
        for n in range(W // 2):  # the node's two ranks decode at the same time: contention
            dt[2 * n], dt[2 * n + 1] = pair(dt[2 * n], dt[2 * n + 1], c.contention)
        dt *= np.repeat(slow, 2)
        clock, work = clock + dt, work + dt


def colocated(c, S, nodes, steps, lengths, gps_node=4, G=4, chunk=16, seed=0):
    """bench/stalesync.py's colocated deployment on N nodes of 2 ranks: every rank generates gps_node / 2
    groups a step, then all train on them. Returns a Run."""
    W, gps = 2 * nodes, gps_node // 2
    pools = [Pool(S, gps, G, chunk, lengths, id_layout(r, W, gps, G), c.prompt_len) for r in range(W)]
    slow = stragglers(c, steps, nodes, seed)                                    # (steps, N)
    t, busy, tokens, rollout, train, crit = 0.0, np.zeros(W), 0, 0.0, 0.0, 0
    for step in range(steps):
        end, work, fwd = colocated_round(c, pools, t, slow[step])
        rollout, crit = rollout + end - t, crit + int(fwd.max())
        batches = [p.take() for p in pools]
        dt = np.array([train_ms(c, b) for b in batches])                         # (W,) alone
        for n in range(nodes):
            dt[2 * n], dt[2 * n + 1] = pair(dt[2 * n], dt[2 * n + 1], c.contention)
        dt = dt * np.repeat(slow[step], 2) + c.switch_ms
        step_train = dt.max() + allreduce_ms(c, nodes)  # the gradient all-reduce waits for the slowest
        t, train, busy = end + step_train, train + step_train, busy + work + dt
        tokens += int(sum(b.sum() for b in batches)) - c.prompt_len * sum(len(b) for b in batches)
        for p in pools:
            p.update()
    return Run(tokens, t / 1e3, busy / 1e3, rollout / 1e3, train / 1e3, crit)


# ----------------------------------------------------------------------------- separated
def separated(c, S, nodes, steps, lengths, gps_node=4, G=4, chunk=16, seed=0):
    """bench/stalesync.py's separated deployment on N nodes: each node's rank 0 generates gps_node groups
    a step (its own scheduler), rank 1 trains; a trainer step takes the batch of every generator (gradients
    all-reduced across nodes) and pushes the weights to every generator. Returns a Run (ranks: generators,
    then trainers). Generators move in time order, so a weight version is known before anyone could see it."""
    pools = [Pool(S, gps_node, G, chunk, lengths, id_layout(n, nodes, gps_node, G), c.prompt_len)
             for n in range(nodes)]
    slow = stragglers(c, steps + 1, nodes, seed)                                # (steps + 1, N)
    clock, busy = np.zeros(nodes), np.zeros(2 * nodes)
    sent = [[] for _ in range(nodes)]      # per generator: (time, sample token counts) of each batch sent
    trains, arrive = [], {}                # trains: (start, end) ms of trainer step v; arrive[v]: weights v
    waiting, crit = {}, 0                  # generator -> version it idles for; decode forwards
    while any(p.batches_out < steps for p in pools):
        movable = [n for n in range(nodes) if n not in waiting and pools[n].batches_out < steps]
        n = min(movable, key=lambda n: clock[n])  # the generator furthest behind in time moves next
        p = pools[n]
        if arrive.get(p.version + 1, np.inf) <= clock[n]:  # new weights, between two decode calls
            p.update()
        p.admit()
        call = p.decode()
        if call is not None:
            busy_trainer = bool(trains) and trains[-1][0] <= clock[n] < trains[-1][1]
            dt = call_ms(c, call) * (c.contention if busy_trainer else 1.0) * slow[min(p.version, steps), n]
            clock[n], busy[n], crit = clock[n] + dt, busy[n] + dt, crit + call.forwards * (n == 0)
        while p.ready() and p.batches_out < steps:
            sent[n].append((clock[n], p.take()))
            v = len(trains)
            if all(len(s) > v for s in sent):  # every generator's batch v is in: the trainers' step v
                train_step(c, S, nodes, v, steps, sent, trains, arrive, busy, slow[v])
                for m, u in list(waiting.items()):  # generators idle for these weights wake up
                    if u in arrive:
                        clock[m] = max(clock[m], arrive[u])
                        del waiting[m]
        if call is None and not p.ready() and p.batches_out < steps:
            if p.version + 1 in arrive:
                clock[n] = max(clock[n], arrive[p.version + 1])
            else:
                waiting[n] = p.version + 1
    tokens = sum(int(b.sum()) - c.prompt_len * len(b) for s in sent for _, b in s)
    return Run(tokens, trains[-1][1] / 1e3, busy / 1e3, busy[0] / 1e3, busy[nodes] / 1e3, crit)


def train_step(c, S, nodes, v, steps, sent, trains, arrive, busy, slow):
    """Trainer step v: starts when the trainers are free and every batch v is in, each trainer its node's
    batch (contended when S >= 1: its generator decodes meanwhile), then the all-reduce and the push."""
    start = max(trains[-1][1] if trains else 0.0, max(s[v][0] for s in sent))
    dt = np.array([train_ms(c, s[v][1]) for s in sent]) * (c.contention if S else 1.0) * slow   # (N,)
    end = start + dt.max() + allreduce_ms(c, nodes)
    busy[nodes:] += dt
    if v + 1 < steps:  # the last version is not sent
        busy[nodes:] += c.push_ms
        arrive[v + 1] = end + c.push_ms
        end += c.push_ms
    trains.append((start, end))


# ----------------------------------------------------------------------------- calibration and the N = 1 check
def policy_params(d, f, layers=2, experts=4, vocab=14):
    """Parameters of model.Policy: embedding and head, per layer qkv + out + router + SwiGLU experts + 2 norms."""
    return 2 * vocab * d + d + layers * (4 * d * d + d * experts + 3 * experts * d * f + 2 * d)


def fit(c, lengths, steps=48):
    """Fit train_tok_ms on rank 0's training time in colocated S = 0, then (sample_ms, call_ms) on rank 0's
    rollout time in that run and on separated S = 1's wall time (a Newton step with a finite-difference
    Jacobian: both are near linear in the two). The costs are of bench/stalesync.py's regime."""
    r0, r1 = (colocated(replace(c, train_tok_ms=x), 0, 1, steps, lengths) for x in (0.0, 0.1))
    c = replace(c, train_tok_ms=float(0.1 * (CO_S0_TRAIN_S - r0.train_s) / (r1.train_s - r0.train_s)))

    def residual(x):  # seconds off the two measured times
        cx = replace(c, sample_ms=x[0], call_ms=x[1])
        co, sep = colocated(cx, 0, 1, steps, lengths), separated(cx, 1, 1, steps, lengths)
        return np.array([co.rollout_s - CO_S0_ROLLOUT_S, sep.wall_s - sep.tokens / STALESYNC_TPS[("separated", 1)]])

    x = np.array([0.5, 5.0])  # ms: a first guess
    for _ in range(2):
        f0 = residual(x)
        jac = np.stack([(residual(x + dx) - f0) / dx.sum() for dx in np.eye(2)], axis=1)  # (2, 2) s per ms
        x = x - np.linalg.solve(jac, f0)
    if x[1] < 0:  # a call cannot cost less than nothing: call_ms = 0, sample_ms on the colocated rollout alone
        x[1] = 0.0
        for _ in range(2):
            f0 = residual(x)[0]
            x[0] -= f0 / ((residual(x + [1.0, 0.0])[0] - f0) / 1.0)
    return replace(c, sample_ms=float(x[0]), call_ms=float(x[1]))


def stalesync_check(c, lengths, steps=48):
    """bench/stalesync.py's 8 configurations at N = 1, and its decode-step gains. Returns check rows."""
    rows, runs = [], {}
    for (deploy, S), measured in STALESYNC_TPS.items():
        runs[deploy, S] = (colocated if deploy == "colocated" else separated)(c, S, 1, steps, lengths)
        fitted = (deploy, S) == ("colocated", 0) or ((deploy, S) == ("separated", 1) and c.call_ms > 0)
        rows.append(dict(name=f"stalesync {deploy} S={S} tok/s", predicted=runs[deploy, S].tokens_per_s,
                         measured=measured, kind="fitted" if fitted else "predicted"))
    for S, measured in STALESYNC_GAIN.items():
        gain = runs["colocated", 0].crit_steps / runs["colocated", S].crit_steps
        rows.append(dict(name=f"stalesync decode-step gain S={S}", predicted=gain, measured=measured,
                         kind="predicted"))
    return rows


def fusion_check(c):
    """bench/fusion.py per step (d_model 128, 64 x 8 responses, max_new_tokens 33), one direct computation:
    rollout = 33 decode steps x (decode_ms + sample_ms) + row_ms_f x row-tokens, training = tok_ms_f x
    prompt + response tokens, both FITTED on the separated run; colocated halves both per rank, contended,
    plus FSDP2's 3 collectives per micro-batch (4) at the gloo all_gather bandwidth. Returns check rows."""
    R, cap, V = 512, 33, 14
    mean_len = sum((1 - 1 / V) ** k for k in range(cap))  # E[min(geometric(1/V), cap)]: an untrained policy
    draws = np.random.default_rng(0).lognormal(2.0, 0.6, 100_000)
    prompt = 2 + np.clip(np.round(draws), 1, 32).mean()  # BOS + digits + '=' (task.py)
    fixed = cap * (c.decode_ms + c.sample_ms)                                       # ms per rollout
    row_ms = (FUSION["sep_rollout_s"] * 1e3 - fixed) / (R * mean_len)              # FITTED, ms per row-token
    tok_ms = FUSION["sep_train_s"] * 1e3 / (R * (prompt + mean_len))               # FITTED, ms per token
    fsdp = 4 * 3 * 4 * policy_params(128, 256) / 2 / (0.7 * 2 ** 30) * 1e3          # ms, 2 ranks
    col_rollout = c.contention * (fixed + row_ms * R / 2 * mean_len)               # ms
    col_train = c.contention * tok_ms * R / 2 * (prompt + mean_len) + fsdp         # ms
    switch = FUSION["switch_s"] * 1e3
    sep_step = FUSION["sep_rollout_s"] * 1e3 + FUSION["sep_train_s"] * 1e3 + switch
    implied = FUSION["sep_tps"] * sep_step / 1e3 / R  # response tokens per sample the measured figures imply
    return [dict(name="fusion mean response length (tokens)", predicted=mean_len, measured=implied,
                 kind="predicted"),
            dict(name="fusion separated tok/s", predicted=R * mean_len / sep_step * 1e3, measured=FUSION["sep_tps"],
                 kind="predicted (length law only: its stages are fitted)"),
            dict(name="fusion colocated rollout s", predicted=col_rollout / 1e3, measured=FUSION["col_rollout_s"],
                 kind="predicted"),
            dict(name="fusion colocated train s", predicted=col_train / 1e3, measured=FUSION["col_train_s"],
                 kind="predicted"),
            dict(name="fusion colocated tok/s", predicted=R * mean_len / (col_rollout + col_train + switch) * 1e3,
                 measured=FUSION["col_tps"], kind="predicted")]


# ----------------------------------------------------------------------------- N nodes
def deployments(staleness):
    """The table's rows: (name, deployment function, S)."""
    return ([("separated sync", separated, 0), ("colocated sync", colocated, 0)]
            + [(f"colocated S={S}", colocated, S) for S in staleness])


def scaling(c, args, lengths):
    """Weak scaling: every deployment on each N, the global batch N x the node's. Returns {name: {N: Run}}."""
    return {name: {N: f(c, S, N, args.steps, lengths, args.groups_per_node, args.group_size, args.chunk, args.seed)
                   for N in args.nodes}
            for name, f, S in deployments(args.staleness)}


def equal_length_rollout_s(c, args, mean_len):
    """A colocated rollout of one rank's rows all of the law's mean length (the same tokens, no tail),
    both ranks of the node at once: what a step's rollout would cost if no sample were longer than the rest."""
    R, n = args.groups_per_node // 2 * args.group_size, int(round(mean_len))
    fwd = (n - 1) * np.ones(R)                                                    # (R,) forwards per row
    ctx_work = float((fwd * c.prompt_len + fwd * (fwd - 1) / 2).sum())
    call = Call(n - 1, int(fwd.sum()), ctx_work, [c.prompt_len] * R, R * n)
    return c.contention * call_ms(c, call) / 1e3


def decomposition(c, args, lengths, runs):
    """Where a step's time goes at N = 1 and at the largest N, synchronous and stale (colocated): the
    rollout of an equal-length batch, the wait for the longest sample beyond it, training + switch +
    all-reduce, and the slowest node (the step with stragglers minus the step without). The stale rows
    count the wait the same way: their rollout beyond the equal-length one. Returns {name: {N: parts}}."""
    eq = equal_length_rollout_s(c, args, lengths.mean())
    calm = replace(c, straggler=0.0)
    out = {}
    for name, f, S in deployments(args.staleness[:1]):
        if f is not colocated:
            continue
        out[name] = {}
        for N in (args.nodes[0], args.nodes[-1]):
            r = runs[name][N]
            r0 = f(calm, S, N, args.steps, lengths, args.groups_per_node, args.group_size, args.chunk)
            step, step0, roll0 = r.wall_s / args.steps, r0.wall_s / args.steps, r0.rollout_s / args.steps
            out[name][N] = {"step_s": step, "equal_length_rollout_s": eq, "wait_longest_s": roll0 - eq,
                            "train_switch_allreduce_s": step0 - roll0, "slowest_node_s": step - step0,
                            "longest_sample_tokens": r0.crit_steps / args.steps + 1 if S == 0 else None,
                            "wait_longest_share": (roll0 - eq) / step}
    return out


# ----------------------------------------------------------------------------- report
def print_check(rows, tol):
    """The N = 1 check, one line per figure; returns whether every predicted figure is within tol."""
    print("N = 1 check against MEASURED (d87c140's bench/RESULTS.md; bench/stalesync.py's regime, then fusion's):")
    for r in rows:
        r["predicted"], r["measured"] = float(r["predicted"]), float(r["measured"])
        r["rel_err"] = r["predicted"] / r["measured"] - 1
        r["pass"] = bool(abs(r["rel_err"]) <= tol)
        print(f"  {r['name']:40s} predicted {r['predicted']:8.3f}  measured {r['measured']:8.3f}  "
              f"error {r['rel_err']:+6.1%}  {r['kind']}{'' if r['pass'] else '  OFF'}")
    ok = all(r["pass"] for r in rows if r["kind"].startswith("predicted"))
    print(f"  every predicted figure within {tol:.0%}: {'PASS' if ok else 'FAIL'}")
    return ok


def print_table(args, runs):
    """tokens/s, idle share and linearity per deployment and N. Returns the table as a dict."""
    n1, table = args.nodes[0], {}
    print(f"\nweak scaling: {args.groups_per_node} groups x {args.group_size} samples per node per step (global "
          f"batch x N), lengths {args.lengths} clipped to {args.max_len}, {args.steps} steps, seed {args.seed}, "
          f"stragglers lognormal(0, {args.straggler}) per node per step, switch {args.switch_s} s, "
          f"push {args.push_s} s")
    print(f"{'deployment':16s}" + "".join(f" | N={N:<2d} tok/s  idle  linear" for N in args.nodes))
    for name, by_n in runs.items():
        table[name] = {str(N): dict(tokens_per_s=round(r.tokens_per_s, 1), idle_share=round(r.idle, 3),
                                    linearity=round(r.tokens_per_s / (N / n1 * by_n[n1].tokens_per_s), 3))
                       for N, r in by_n.items()}
        print(f"{name:16s}" + "".join(f" | {t['tokens_per_s']:10.0f} {t['idle_share']:5.2f} {t['linearity']:7.2f}"
                                       for t in table[name].values()))
    return table


def print_decomposition(dec, nodes):
    """Per step, colocated, at the smallest and the largest N: where the time goes."""
    a, b = nodes[0], nodes[-1]
    labels = {"step_s": "step", "equal_length_rollout_s": "rollout of an equal-length batch",
              "wait_longest_s": "the rest of the rollout: waiting for the tail",
              "wait_longest_share": "... share of the step",
              "train_switch_allreduce_s": "training (slowest rank) + switch + all-reduce",
              "slowest_node_s": "the slowest node (stragglers)", "longest_sample_tokens": "longest sample (tokens)"}
    print(f"\nwhere a step's time goes, colocated, s per step: N = {a} | N = {b}")
    for name, parts in dec.items():
        for k, label in labels.items():
            x, y = parts[a][k], parts[b][k]
            if x is not None:
                fmt = "{:8.0%}" if k.endswith("share") else "{:8.0f}" if k.endswith("tokens") else "{:8.3f}"
                print(f"  {name if k == 'step_s' else '':15s} {label:46s}" + fmt.format(x) + " |" + fmt.format(y))


def print_term(dec, nodes):
    """Linearity lost from the smallest to the largest N, term by term: weak scaling multiplies the tokens
    of a step by N, so 1 - linearity ~ (step(N) - step(1)) / step(N), each term's growth its share."""
    a, b, out = nodes[0], nodes[-1], {}
    for name, parts in dec.items():
        p, q = parts[a], parts[b]
        out[name] = {k: round(float((q[k] - p[k]) / q["step_s"]), 3) for k in
                     ("wait_longest_s", "slowest_node_s", "train_switch_allreduce_s")}
        lost = out[name]
        print(f"  {name:15s} linearity lost, N = {a} -> {b}: {lost['wait_longest_s']:.1%} waiting for the tail, "
              f"{lost['slowest_node_s']:.1%} the slowest node, {lost['train_switch_allreduce_s']:.1%} training "
              f"+ switch + all-reduce")
    (sync, s), (stale, t) = list(dec.items())[:2]
    print(textwrap.fill(
        f"the term: waiting for the longest sample of the batch. A synchronous step draws N x the samples from a "
        f"heavy tail and waits for the longest, whose expected length grows with the draws "
        f"({s[a]['longest_sample_tokens']:.0f} -> {s[b]['longest_sample_tokens']:.0f} tokens): {sync} waits "
        f"{s[b]['wait_longest_s'] - s[a]['wait_longest_s']:+.3f} s a step more at N = {b}; {stale}, cut at the "
        f"threshold with its tail carried over, {t[b]['wait_longest_s'] - t[a]['wait_longest_s']:+.3f} s (its round "
        f"still waits for every rank's due groups, the tails it carried over). The slowest of N nodes adds "
        f"{s[b]['slowest_node_s'] - s[a]['slowest_node_s']:+.3f} s and "
        f"{t[b]['slowest_node_s'] - t[a]['slowest_node_s']:+.3f} s.",
        110))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("scaling")
    g.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4],
                   help="node counts, 1 among them (the baseline of the linearity)")
    g.add_argument("--staleness", type=int, nargs="+", default=[1, 2],
                   help="bounds S >= 1 of the colocated stale rows")
    g.add_argument("--steps", type=int, default=96, help="optimizer steps simulated per configuration")
    g.add_argument("--seed", type=int, default=0, help="lengths (salt 1234 + seed) and stragglers")
    g.add_argument("--straggler", type=float, default=0.05, help="sigma of a node's lognormal slowdown per step")
    g = p.add_argument_group("workload per node (the check always runs bench/stalesync.py's)")
    g.add_argument("--lengths", default="lognormal:2.5,1.2", help="response length law: lognormal:MU,SIGMA, "
                   "uniform:A,B, pareto:ALPHA,MIN or fixed:N")
    g.add_argument("--max-len", type=int, default=256, help="longest response, tokens")
    g.add_argument("--groups-per-node", type=int, default=4, help="prompt groups per node per step (even: 2 ranks)")
    g.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    g.add_argument("--chunk", type=int, default=16, help="decode steps per sampler call (S >= 1)")
    g.add_argument("--switch-s", type=float, default=SWITCH_S, help="colocated phase switch per step, s")
    g.add_argument("--push-s", type=float, default=FUSION["switch_s"], help="separated weight push per step, s")
    g = p.add_argument_group("the N = 1 check")
    g.add_argument("--tolerance", type=float, default=0.15, help="the N = 1 check's bound on the relative error")
    args = p.parse_args(argv)
    args.nodes = sorted(set(args.nodes))
    bad = min(args.staleness) < 1 or args.groups_per_node % 2 or min(args.steps, args.group_size, args.chunk) < 1
    if args.nodes[0] != 1 or bad:
        p.error(f"--nodes {args.nodes} must include 1, --staleness {args.staleness} be >= 1, --groups-per-node "
                f"{args.groups_per_node} even (a node's 2 ranks share it), --steps, --group-size and --chunk >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    bench_lengths = Lengths("lognormal:2.5,1.2", 256, salt=1234)  # bench/stalesync.py's samples
    c = fit(calibrated_from_table(), bench_lengths)
    print("costs (ms): " + ", ".join(f"{k} {v:.4g}" for k, v in vars(c).items()
                                     if k in ("decode_ms", "row_ms", "ctx_ms", "contention", "sample_ms",
                                              "call_ms", "train_tok_ms", "train_micro_ms")))
    rows = stalesync_check(c, bench_lengths) + fusion_check(c)
    ok = print_check(rows, args.tolerance)
    same = (args.lengths, args.max_len, args.seed) == ("lognormal:2.5,1.2", 256, 0)
    lengths = bench_lengths if same else Lengths(args.lengths, args.max_len, salt=1234 + args.seed)
    c = replace(c, switch_ms=args.switch_s * 1e3, push_ms=args.push_s * 1e3, straggler=args.straggler)
    runs = scaling(c, args, lengths)
    table = print_table(args, runs)
    lin = {name: t[str(args.nodes[-1])]["linearity"] for name, t in table.items()}
    source = {"sync": round(SOURCE["sync"][1] / 4 / SOURCE["sync"][0], 3),
              "stalesync": round(SOURCE["stalesync"][1] / 4 / SOURCE["stalesync"][0], 3)}
    shape = bool(all(lin["colocated sync"] < v for k, v in lin.items() if "S=" in k))
    print(f"linearity 1 -> {args.nodes[-1]} nodes: " + ", ".join(f"{k} {v:.2f}" for k, v in lin.items())
          + f" (the source, 1 -> 4 supernodes: sync {source['sync']:.2f}, StaleSync {source['stalesync']:.2f}); "
          f"colocated sync below every stale row: {'yes' if shape else 'NO'}")
    dec = decomposition(c, args, lengths, runs)
    print_decomposition(dec, args.nodes)
    term = print_term(dec, args.nodes)
    print(json.dumps(dict(
        table=table, linearity=lin, source_linearity=source, shape_holds=shape,
        check=dict(pass_=ok, tolerance=args.tolerance, rows=[{k: (round(v, 4) if isinstance(v, float) else v)
                                                              for k, v in r.items()} for r in rows]),
        decomposition={name: {str(N): {k: (None if v is None else round(float(v), 4)) for k, v in parts.items()}
                              for N, parts in by_n.items()} for name, by_n in dec.items()},
        linearity_lost_by_term=term,
        constants={k: v if isinstance(v, int) else round(float(v), 6) for k, v in vars(c).items()},
        regime=dict(nodes=args.nodes, staleness=args.staleness, steps=args.steps, seed=args.seed,
                    lengths=args.lengths, max_len=args.max_len, groups_per_node=args.groups_per_node,
                    group_size=args.group_size, straggler=args.straggler))).replace('"pass_"', '"pass"'))


if __name__ == "__main__":
    main()
