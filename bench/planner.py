"""Check the layout planner (options/planner.py) against what this machine measures.

    python bench/planner.py               # about 15 minutes on 2 cores: 6 calibrations, 19 layouts x 3, memory
    python bench/planner.py --repeats 1 --steps 6                        # a quicker look
    python bench/planner.py --staleness 1 --worlds 2 --memory 0 --repeats 3     # S = 1, world 2 (about 4 minutes)

One fixed workload (no warm-up, so the untrained policy ends a response at its end token with probability about
1/14 a token; --rl-seconds 0, --steps, no dynamic sampling, no curriculum, S = 0 or --staleness), run by train_grpo.py
at world 2 and 4 in every layout listed below (colocated; and --deploy separated at both worlds, hybrid with 2
auxiliary ranks at world 4, each priced as its deployment) and in the one the planner chooses for each world (where
that is a listed layout, the flags resolved alike, it is that one, measured once). First the machine is
measured at each world (torchrun -m options.layout_auto: the constants --layout auto plans with). Then the layouts
run --repeats times, interleaved (layout after layout, then again), each a torchrun, the machine measured again
before each repeat after the first. A layout's step time is the median over its steps from the third on; its
measured time is the median of its repeats, its predicted time the median of its repeats' predictions. Reported:
each layout's predicted and measured seconds per RL step and their relative error; the Spearman rank correlation of
predicted against measured over every layout; chosen_over_best, the planner's choice's measured time over the
fastest colocated layout measured at that world (the larger of the two worlds; --layout auto keeps the deployment);
median_rel_err. The table also holds each stage's measured seconds (time/<stage>_s, the queue's from perf/queue_frac).

Memory: the same layouts' bytes per rank on a model of about 13M parameters (d_model 256, 4 blocks, 8 experts of width
512), each run for two steps (the second switch's, with the Adam state): the run's mem/* figures (training shards, Adam
state, the engine's weights, the rollout's shards with the inference experts, the switch's bucket) and its switch byte
counts against the planner's, the largest relative difference. (The gradients are freed before each switch, so
mem/train_grads_bytes is 0 there: the planner's gradients are the shards' size, as FSDP2's are. Activations and the KV
cache have no allocator figure on a CPU: predicted, unchecked.) The last line printed is one JSON object.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from options import layout_auto, planner  # noqa: E402
from plumbing.planner_details import ep_bytes, switch_bytes  # noqa: E402
from plumbing.config import parse_args, resolve  # noqa: E402

WORKLOAD = ["--warmup-steps", "0", "--rl-seconds", "0", "--filter-groups", "0", "--curriculum", "0",
            "--staleness", "0", "--eval-prompts", "16", "--eval-every", "1000", "--log-every", "1000"]
LAYOUTS = {2: ["--train-ep 0", "--train-ep 2 --infer-ep 1", "--train-ep 2 --infer-ep 1 --micro-batches 1",
               "--train-ep 2 --infer-ep 1 --micro-batches 8", "--train-ep 2 --infer-ep 2", "--infer-tp 2",
               "--train-pp 2", "--train-ep 0 --micro-batches 8", "--deploy separated"],
           4: ["--train-ep 0 --micro-batches 2", "--train-ep 2 --infer-ep 1", "--train-ep 4 --infer-ep 4",
               "--train-ep 2 --infer-ep 4", "--infer-tp 2", "--infer-tp 4", "--train-pp 2", "--deploy separated",
               "--deploy hybrid --aux-ranks 2"]}
MEASURED = ("rollout", "switch", "score", "reference", "train")  # time/<stage>_s; the queue from perf/queue_frac
BIG = ["--d-model", "256", "--n-layers", "4", "--n-experts", "8", "--d-expert", "512", "--bucket-kb", "4096"]


ABORTS = []  # runs that finished (summary.json written) and then aborted in gloo's teardown


def torchrun(world, script, args, out=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd += ["-m", script] if not script.endswith(".py") else [script]
    cmd += args + (["--out", out] if out else [])
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    finished = out is not None and os.path.exists(os.path.join(out, "summary.json"))
    if done.returncode and finished and "terminate called without an active exception" in done.stderr:
        ABORTS.append(" ".join(args))
    elif done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def calibrate(world):
    """The Machine that --layout auto would plan with at this world."""
    return planner.Machine.load(json.loads(torchrun(world, "options.layout_auto", []).splitlines()[-1]))


def config(world, flags, extra=()):
    _, cfg = parse_args(WORKLOAD + list(extra) + flags.split())
    return resolve(cfg, world)


def workload(cfg):
    """The planner's workload for this run: the task's prompts, the untrained policy's responses (an end token
    with probability about 1 / vocabulary a token, capped by the budget: the planner's default, a geometric length of
    this mean)."""
    p_end = 1 / 14
    mean = (1 - (1 - p_end) ** cfg.max_new_tokens) / p_end
    work = layout_auto.workload_of(cfg)
    return planner.Workload(**{**work.__dict__, "response_tokens": mean, "lengths": None})


def measure(world, flags, steps, extra=(), folder=None):
    with tempfile.TemporaryDirectory() as out:
        torchrun(world, "train_grpo.py", WORKLOAD + ["--steps", str(steps)] + list(extra) + flags.split(), out)
        recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    return [r for r in recs if r.get("step", 0) >= 1]


def spearman(xs, ys):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def _layout(world, flags):
    """What a run of these flags runs: its layout and deployment, the defaults resolved."""
    cfg = config(world, flags)
    return layout_auto.layout_of(cfg), cfg.deploy, cfg.aux_ranks


def ranking(machines, repeats, steps):
    """Every layout's predicted and measured step time (each stage the median of its repeats' predictions), the
    planner's choice at each world (from the first calibration, as --layout auto chooses at the start, here for the
    bench's workload), and the machines each repeat was predicted with. Each repeat measures the machine again before
    its layouts run, and predicts them from those constants: a prediction and its measurement a few minutes apart, so
    that the host's drift over the whole run (a shared machine) is not counted as the model's error."""
    layouts, chosen = dict(), dict()
    for world, machine in machines.items():
        cfg = config(world, "")
        rows = planner.plan(layout_auto.model_of(cfg), machine, workload(cfg), layout_auto.runnable(cfg, world))
        choice = " ".join(f"--{k.replace('_', '-')} {getattr(rows[0][0], k)}" for k in layout_auto.FIELDS)
        same = [f for f in LAYOUTS[world] if _layout(world, f) == _layout(world, choice)]
        chosen[world] = same[0] if same else choice  # a listed layout the planner chose is measured once
        for flags in LAYOUTS[world] + ([] if same else [choice]):
            layouts[(world, flags)] = dict(measured=[], predicted=[], stages=[], measured_stages=[])
    calibrations = []
    for repeat in range(repeats):
        now = machines if repeat == 0 else {w: calibrate(w) for w in machines}
        calibrations.append(now)
        for (world, flags), runs in layouts.items():
            recs = measure(world, flags, steps)
            recs = [r for r in recs if r["step"] >= 3]
            runs["measured"].append(statistics.median(r["time/step_s"] for r in recs))
            seen = {k: statistics.median(r[f"time/{k}_s"] for r in recs) for k in MEASURED}
            seen["queue"] = statistics.median(r["perf/queue_frac"] * r["time/step_s"] for r in recs)
            runs["measured_stages"].append(seen)
            cfg = config(world, flags)
            stage = planner.stages(layout_auto.model_of(cfg), now[world], workload(cfg), layout_auto.layout_of(cfg))
            runs["predicted"].append(stage["step"])
            runs["stages"].append(stage)
            print(f"  world {world} {flags}: {runs['measured'][-1]:.3f} s a step, "
                  f"predicted {runs['predicted'][-1]:.3f}", flush=True)
    table = []
    for (world, flags), runs in layouts.items():
        stages = {k: round(statistics.median(s[k] for s in runs["stages"]), 4) for k in runs["stages"][0]}
        seen = {k: round(statistics.median(s[k] for s in runs["measured_stages"]), 4) for k in MEASURED + ("queue",)}
        table.append(dict(world=world, layout=flags, predicted_s=statistics.median(runs["predicted"]),
                          measured_s=statistics.median(runs["measured"]), chosen=flags == chosen[world],
                          stages=stages, measured_stages=seen))
    return table, chosen, calibrations


def memory(machines):
    """The run's mem/* and switch bytes against the planner's, on a 13M-parameter model, for every layout."""
    rows = []
    for world in machines:
        for flags in LAYOUTS[world]:
            if "pp" in flags and world == 4 or "deploy" in flags:
                continue  # a 4-block model at PP 2 and world 4 is the same check as at world 2; the deployments'
                # memory is the colocated formulas' over their ranks (tests/test_planner.py)
            rec = measure(world, flags, 2, extra=BIG)[-1]  # step 2: the Adam state exists
            cfg = config(world, flags, BIG)
            model, lay = layout_auto.model_of(cfg), layout_auto.layout_of(cfg)
            machine = machines[world]
            mem = planner.memory(model, machine, workload(cfg), lay)
            pairs = {"mem/train_params_bytes": mem["params"], "mem/train_optim_bytes": mem["optim"],
                     "mem/rollout_params_bytes": mem["rollout_params"], "mem/rollout_infer_bytes": mem["infer"],
                     "switch/peak_extra_bytes": mem["bucket"],
                     "switch/received_min_bytes": switch_bytes(model, machine, lay)}
            if lay.train_ep:
                pairs["ep/to_rollout_bytes_moved"] = ep_bytes(model, machine, lay)
            for key, predicted in pairs.items():
                err = abs(predicted - rec[key]) / max(rec[key], 1)
                rows.append(dict(world=world, layout=flags, figure=key, predicted=predicted, reported=rec[key],
                                 rel_err=err))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--staleness", type=int, default=0, help="S of the workload")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    p.add_argument("--memory", type=int, default=1, help="0: skip the memory check")
    a = p.parse_args()
    WORKLOAD[WORKLOAD.index("--staleness") + 1] = str(a.staleness)
    machines = {w: calibrate(w) for w in a.worlds}
    for w, m in machines.items():
        print(f"world {w}: {json.dumps(m.__dict__, default=lambda o: o.__dict__)}", flush=True)
    table, chosen, calibrations = ranking(machines, a.repeats, a.steps)
    print(f"{'world':>5} {'layout':<52} {'predicted':>9} {'measured':>8} {'rel_err':>7}")
    for r in sorted(table, key=lambda r: r["measured_s"]):
        err = (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
        r["rel_err"] = err
        mark = " (chosen)" if r["chosen"] else ""
        print(f"{r['world']:>5} {r['layout'] + mark:<52} {r['predicted_s']:9.3f} {r['measured_s']:8.3f} {err:+7.1%}")
    # the planner chooses among the colocated layouts (--layout auto keeps the deployment): the best of those
    best = {w: min(r["measured_s"] for r in table if r["world"] == w and "deploy" not in r["layout"])
            for w in machines}
    over = max(r["measured_s"] / best[r["world"]] for r in table if r["chosen"])
    mem = memory(machines) if a.memory else [dict(rel_err=0.0, figure="none", world=0, layout="not checked")]
    worst = max(mem, key=lambda r: r["rel_err"])
    print(f"memory: {len(mem)} figures over {len({(r['world'], r['layout']) for r in mem})} layouts; largest relative "
          f"difference {worst['rel_err']:.2%} ({worst['figure']}, world {worst['world']} {worst['layout']})")
    rho = spearman([r["predicted_s"] for r in table], [r["measured_s"] for r in table])
    print(json.dumps(dict(staleness=a.staleness, spearman=rho,
                          chosen_over_best=over,
                          median_rel_err=statistics.median(abs(r["rel_err"]) for r in table),
                          candidates=len(table), chosen=chosen, table=table,
                          memory_max_rel_err=worst["rel_err"], memory=mem, teardown_aborts=ABORTS,
                          machines=[{w: json.loads(json.dumps(m, default=lambda o: o.__dict__)) for w, m in now.items()}
                                    for now in calibrations])))


if __name__ == "__main__":
    main()
