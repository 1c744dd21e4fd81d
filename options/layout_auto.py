"""--layout auto: the planner (options/planner.py) run for the world the job started with.

    torchrun --standalone --nproc_per_node=4 train_grpo.py --layout auto

Every rank measures at once, so that ranks sharing a host's cores share them as they will in the
run (torchrun --nproc_per_node=W -m options.layout_auto prints what it measured, as JSON):
  op_s, flops       the policy's forward over 1 token (nothing to compute) and over 4096;
  step_s, row_s     a decode step of the run's sampler over 1 row; its decode of 64 of the task's
                    prompts, rows ending at the end token (a finished row leaves the batch);
  batch_s, update_s the run's own GRPO update (grpo.grpo_update) in 1 and in 8 micro-batches;
  latency           a small all-reduce inside a loop of forwards, less the loop without it (the
                    ranks arrive a forward's jitter apart, as in a decode step);
  bandwidth         a 4 MiB all-reduce; host_bandwidth (and memory_bandwidth: on a CPU the host
                    is the device) a 16 MiB copy; sample_s the task's rule;
  cores             the CPU's cores the ranks share (0 on an accelerator);
  queue_s, _row_s   the queue's step (distqueue.py, the run's columns): every rank puts rows, the
                    ids are gathered, every rank reads its share; with 2 rows a rank and with 32.
Each constant is the ranks' median (an all-gather), so every rank plans from the same numbers and
chooses the same layout. Rank 0 prints the table, and names any other deployment predicted faster
(said, not taken); the run goes on with the choice. `--layout auto` chooses the parallel layout only
(--infer-tp, --train-ep, --infer-ep, --train-pp, --micro-batches): the deployment, S and the
gradient compression stay as given, since they change what is trained. The planner prices the
--deploy given (colocated, separated or hybrid with its --aux-ranks: workload_of), and its
candidates pass the run's own checks (runnable).

--device-memory-gib G, with any layout: the planner's memory model checks the layout against G
GiB a rank before any process group, and a layout that overflows is refused, naming what does.
"""
import dataclasses
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import distqueue
import grpo
import task
from model import Policy, Sampler
from options import planner
from options.selective_queue import SelectiveQueue
from plumbing.config import grpo_config, layout_errors, model_config, validate
from plumbing.distributed import host_group

FIELDS = ("infer_tp", "train_ep", "infer_ep", "train_pp", "micro_batches")


def errors(cfg, world):
    """--layout and --device-memory-gib, checked before any process group."""
    if cfg.device_memory_gib is not None and not cfg.device_memory_gib > 0:
        return [f"--device-memory-gib {cfg.device_memory_gib} must be > 0"]
    if cfg.device_memory_gib is None or cfg.layout == "auto":
        return []
    mem = dataclasses.replace(_nominal(world), memory_bytes=cfg.device_memory_gib * 2**30)
    try:
        over = planner.overflow(model_of(cfg), mem, workload_of(cfg), layout_of(cfg))
    except ValueError:  # a world or --aux-ranks the deployment refuses: its own check names it
        return []
    return [f"--device-memory-gib {cfg.device_memory_gib}: {over}"] if over else []


def model_of(cfg):
    m = model_config(cfg)
    return planner.Model(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_experts, m.top_k,
                         m.d_expert)


def workload_of(cfg):
    """The step's shapes: the task's prompts and answers, digits 1 .. max_digits (an answer is its
    digits and the end token)."""
    mean = (cfg.max_digits + 1) / 2
    answers = tuple(min(d + 1, cfg.max_new_tokens) for d in range(1, cfg.max_digits + 1))
    return planner.Workload(cfg.prompts_per_step, cfg.group_size, prompt_tokens=mean + 2,
                            response_tokens=mean + 1, max_new_tokens=cfg.max_new_tokens,
                            lengths=answers,
                            max_prompt_tokens=cfg.max_digits + 2,
                            staleness=cfg.staleness, reference=cfg.kl_coef > 0,
                            updates_per_batch=cfg.updates_per_batch, chunk_steps=cfg.chunk_steps,
                            threshold=cfg.threshold,
                            bucket_bytes=cfg.bucket_kb * 1024, deploy=cfg.deploy,
                            aux_ranks=1 if cfg.aux_ranks is None else cfg.aux_ranks)


def layout_of(cfg):
    return planner.Layout(cfg.infer_tp, cfg.train_ep or 0, cfg.infer_ep or 0, cfg.train_pp,
                          cfg.micro_batches, cfg.nodes)


def _nominal(world):
    """A machine of `world` devices for the memory check alone (its speeds are not read)."""
    link = planner.Link(0.0, 1.0)
    speeds = dict.fromkeys(("memory_bytes", "flops", "host_bandwidth", "memory_bandwidth", "step_s",
                            "row_s", "op_s", "batch_s", "update_s", "sample_s", "queue_s",
                            "queue_row_s"), 1.0)
    return planner.Machine(world, world, intra=link, inter=link, **speeds)


def runnable(cfg, world):
    """layout -> whether the run takes it: the run's own checks of the Config it makes."""
    manual = dataclasses.replace(cfg, layout="manual", device_memory_gib=None)  # the plan's own

    def check(lay):
        return not layout_errors(dataclasses.replace(manual, **_flags(lay)), world)
    return check


def _flags(lay):
    return {f: getattr(lay, f) for f in FIELDS}


# ----------------------------------------------------------------------------- the measurement
def _timed(fn, repeat=7):
    """The median seconds of fn() over `repeat` calls, after one untimed."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _decode_step_s(model, cfg, rows):
    """Seconds per decode step over `rows` rows that never stop early (no end token)."""
    steps = min(16, cfg.max_new_tokens)  # a mean prompt and these fit the model's length
    sampler = Sampler(model, steps, eos_id=-1, pad_id=task.PAD, keep=False)
    contexts = [torch.ones(cfg.max_digits // 2 + 2, dtype=torch.long)] * rows
    return _timed(lambda: sampler(contexts, list(range(rows)))) / steps


def _decode_row_s(model, cfg, pm, flops, op_s, one):
    """Seconds per row-step of a decode as the run meets it: the run's sampler on 64 of the task's
    prompts, rows ending at the end token, a finished row leaving the batch (its cache rows copied
    out), contexts growing to the budget. Its forwards F (the longest response) and row-steps R
    (every response's tokens) are counted, its prefill priced as the planner prices it, and `one`,
    a decode step of one row, taken for each forward: the rest is R - F row-steps."""
    contexts = task.make_prompts(np.random.default_rng(cfg.seed), 64, cfg.max_digits)
    sampler = Sampler(model, cfg.max_new_tokens, task.EOS, task.PAD, cfg.temperature, keep=False)
    lengths = [len(t) for t in sampler(contexts, list(range(64))).tokens]
    forwards, row_steps = max(lengths), sum(lengths)
    tokens = sum(len(c) for c in contexts)
    prefill = pm.n_layers * op_s + tokens * pm.flops_per_token(tokens / 64) / flops
    spent = _timed(lambda: sampler(contexts, list(range(64)))) - prefill - forwards * one
    return max(spent / max(row_steps - forwards, 1), 1e-9)


def _samples(cfg, rows, response):
    """A batch shaped as the run's: rows of a mean prompt and `response` tokens, random."""
    g = torch.Generator().manual_seed(cfg.seed)
    response = min(response, cfg.max_new_tokens)
    prompt = cfg.max_digits // 2 + 2
    draw = [torch.randint(1, task.VOCAB, (prompt + response,), generator=g) for _ in range(rows)]
    old = [torch.zeros(response) for _ in range(rows)]
    return grpo.Samples([d[:prompt] for d in draw], [d[prompt:] for d in draw], old,
                        torch.randn(rows, generator=g))


def _update_s(model, cfg, samples, micro_batches, device):
    """Seconds of the run's own GRPO update (grpo.grpo_update) on this rank alone."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9, foreach=True)
    algo = dataclasses.replace(grpo_config(cfg), micro_batches=micro_batches, updates_per_batch=1)
    ref = [torch.zeros(len(r)) for r in samples.responses]
    return _timed(lambda: grpo.grpo_update(model, opt, samples, algo, device, None, ref))


def _forward_s(model, tokens, device, width):
    """Seconds of a forward (no gradient) over `tokens` tokens in rows of up to `width`."""
    shape = (max(tokens // width, 1), min(tokens, width))
    batch = torch.randint(1, task.VOCAB, shape, device=device)
    with torch.no_grad():
        return _timed(lambda: model(batch))


def _queue_step_s(cfg, device, group, world):
    """(queue_s, queue_row_s): one step's queue traffic as the run makes it, every rank writing
    `rows` rows of the run's columns (a mean prompt and response), the ids gathered, every rank
    reading its share of them all (a DP group of the world), timed at 2 and 32 rows a rank."""
    columns = {"prompt": "int64", "response": "int64", "old_logprobs": "float32",
               "reward": "float32", "rule_reward": "float32", "advantage": "float32",
               "stale": "int64"}
    spec = distqueue.QueueSpec(columns=columns, scalars=("reward", "rule_reward", "advantage"),
                               stages={"train": tuple(columns)}, timeout_s=cfg.pg_timeout_s,
                               name="calibrate")
    pg = host_group(device, cfg.pg_timeout_s) if world > 1 else None  # gloo: the queue's host rows
    queue = SelectiveQueue(spec, pg=pg)  # get(only=)
    dp_group = (group or dist.group.WORLD) if world > 1 else None
    prompt, response = cfg.max_digits // 2 + 2, min(cfg.max_new_tokens, cfg.max_digits // 2 + 2)

    def rows_of(n):
        ints, floats = torch.ones(prompt, dtype=torch.long), torch.zeros(response)
        return {"prompt": [ints] * n, "response": [ints[:1].repeat(response)] * n,
                "old_logprobs": [floats] * n, "reward": [0.0] * n, "rule_reward": [0.0] * n,
                "advantage": [0.0] * n, "stale": [torch.zeros(4, dtype=torch.long)] * n}

    def step(columns):
        mine = queue.put(columns)
        ids = [mine]
        if world > 1:
            ids = [None] * world
            dist.all_gather_object(ids, mine, group=group)
        every = {r for part in ids for r in part}
        queue.get("train", len(every), dp_group=dp_group, only=every)
    small, large = rows_of(2), rows_of(32)
    few, many = _timed(lambda: step(small)), _timed(lambda: step(large))
    row_s = max((many - few) / 30, 1e-9)
    return max(few - 2 * row_s, 1e-7), row_s


def _in_loop_latency_s(model, device, group, n):
    """One ring step of a small all-reduce as a decode loop meets it: the ranks arrive a forward's
    jitter apart, so it costs more than back-to-back calls (the loop with it less the loop
    without, per step of the ring)."""
    x, row = torch.zeros(8 * 64, device=device), torch.ones(8, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        bare = _timed(lambda: [model(row) for _ in range(16)])
        both = _timed(lambda: [(model(row), dist.all_reduce(x, group=group)) for _ in range(16)])
    return max(both - bare, 1e-7) / 16 / (2 * (n - 1))


def _bandwidth(device, group, n, latency):
    big = 4 << 20
    x = torch.zeros(big // 4, device=device)
    rest = max(_timed(lambda: dist.all_reduce(x, group=group)) - 2 * (n - 1) * latency, 1e-9)
    return 2 * (n - 1) / n * big / rest


def calibrate(cfg, device, group=None):
    """The planner's Machine for this world, measured on every rank at once; every rank returns
    the same one (each constant the ranks' median). Fixed costs are timed on inputs too small to
    compute on, the throughput on a large one. step_s and batch_s are what a decode step and a
    micro-batch cost beyond their forwards: differences of close timings, floored at 1e-7 where
    the noise makes them negative."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    torch.manual_seed(cfg.seed)
    model = Policy(model_config(cfg)).to(device)
    pm, L = model_of(cfg), model_config(cfg).n_layers
    width = min(32, model_config(cfg).max_seq_len)
    tiny, big = _forward_s(model, 1, device, width), _forward_s(model, 4096, device, width)
    flops = 4096 * pm.flops_per_token(width / 2) / max(big - tiny, 1e-9)
    op_s = tiny / L                                       # a block's forward, nothing to compute
    with torch.no_grad():
        one = _decode_step_s(model, cfg, 1)
        row_s = _decode_row_s(model, cfg, pm, flops, op_s, one)  # per row, as the run decodes
    step_s = max(one - tiny - row_s, 1e-7)                # a step beyond its forward and rows
    two = _samples(cfg, 8, 4)                               # 8 rows of a few tokens
    one_mb, eight_mb = (_update_s(model, cfg, two, m, device) for m in (1, 8))
    batch_s = max((eight_mb - one_mb) / 7 - 3 * L * op_s, 1e-7)
    update_s = max(one_mb - batch_s - 3 * L * op_s, 1e-7)
    latency, bandwidth = 1e-7, 1e12
    if world > 1:
        latency = _in_loop_latency_s(model, device, group, world)
        bandwidth = _bandwidth(device, group, world, latency)
    host = torch.empty(16 << 20, dtype=torch.uint8)
    src = torch.empty_like(host, device=device)
    host_bw = host.nbytes / _timed(lambda: host.copy_(src))
    pairs = _samples(cfg, 64, cfg.max_digits // 2 + 1)
    sample_s = _timed(lambda: task.rewards(pairs.prompts, pairs.responses)) / 64
    queue_s, queue_row_s = _queue_step_s(cfg, device, group, world)
    raw = [1 / flops, op_s, max(step_s, 1e-7), batch_s, update_s, latency, 1 / bandwidth,
           1 / host_bw, sample_s, row_s, queue_s, queue_row_s]
    if world > 1:  # the median rank's constants, on every rank
        t = torch.tensor(raw, dtype=torch.float64, device=device)
        every = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(every, t, group=group)
        raw = torch.stack(every).median(dim=0).values.tolist()
    link = planner.Link(raw[5], 1 / raw[6])
    copy = 1 / raw[7]  # on a CPU the host is the device: one bandwidth for both
    return planner.Machine(world, world, _memory_bytes(device, world), flops=1 / raw[0],
                           host_bandwidth=copy, memory_bandwidth=copy, step_s=raw[2], op_s=raw[1],
                           batch_s=raw[3], update_s=raw[4], sample_s=raw[8], row_s=raw[9],
                           queue_s=raw[10], queue_row_s=raw[11], intra=link, inter=link,
                           cores=_cores(device), name=f"this machine ({device.type})")


def _cores(device):
    """The cores a CPU's ranks share (0 for an accelerator: each computes alone)."""
    return 0 if device.type != "cpu" else len(os.sched_getaffinity(0))


def _memory_bytes(device, world):
    """A rank's memory: the accelerator's, or the host's RAM shared by its ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world


# ----------------------------------------------------------------------------- the choice
def choose(cfg, device, rank, group=None):
    """The Config with the planner's layout for this world (rank 0 prints the table)."""
    machine = calibrate(cfg, device, group)
    if cfg.device_memory_gib is not None:
        machine = dataclasses.replace(machine, memory_bytes=cfg.device_memory_gib * 2**30)
    rows = planner.plan(model_of(cfg), machine, workload_of(cfg), runnable(cfg, machine.devices))
    if rank == 0:
        print(f"--layout auto: {len(rows)} candidates on {machine.name}, {machine.devices} "
              f"rank(s), --deploy {cfg.deploy}, predicted seconds per RL step\n"
              f"{planner.table(rows)}", flush=True)
        for deploy, step in faster_deployments(cfg, machine, rows[0][1]["step"]):
            print(f"--layout auto keeps --deploy {cfg.deploy}; --deploy {deploy} is predicted "
                  f"faster here: {step:.4f} s a step", flush=True)
    return dataclasses.replace(cfg, layout="manual", **_flags(rows[0][0]))


def faster_deployments(cfg, machine, step):
    """The other deployments this world runs that the planner predicts faster than `step`, each
    with its best step: said, never taken (the deployment is the user's choice)."""
    out = []
    plain = dict(infer_tp=1, train_ep=0, infer_ep=0, train_pp=1, nodes=1)  # the plan tries each
    for deploy in ("colocated", "separated", "hybrid"):
        aux = 1 if deploy == "hybrid" else None
        other = dataclasses.replace(cfg, deploy=deploy, aux_ranks=aux, layout="manual", **plain)
        if deploy == cfg.deploy:
            continue
        try:
            validate(other, machine.devices)  # the world, the flags: this deployment runs here
            rows = planner.plan(model_of(other), machine, workload_of(other),
                                runnable(other, machine.devices))
        except ValueError:  # it does not run here, or no layout of it fits
            continue
        if rows[0][1]["step"] < step:
            out.append((deploy, rows[0][1]["step"]))
    return out


def main():
    """torchrun --nproc_per_node=W -m options.layout_auto [train_grpo flags]: the Machine measured
    for a world of W, as JSON (a file for `python -m options.planner --machine`)."""
    from plumbing.config import parse_args
    from plumbing.distributed import setup_distributed
    _, cfg = parse_args()
    rank, _, device = setup_distributed(cfg)
    machine = calibrate(cfg, device)
    if rank == 0:
        print(json.dumps(dataclasses.asdict(machine)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
