"""The GRPO family side by side: each advantage estimator with dynamic sampling (the default), the
default estimator without it, on several seeds, at equal wall time; and supervised training alone for
the same wall time.

    python bench/ablation.py                               # the full table: about 50 minutes on 2 CPU cores
    python bench/ablation.py --seeds 0 --estimators grpo --unfiltered --budget-s 60   # one quick row
    python bench/ablation.py --resume                      # an interrupted table: only the missing runs

Each RL run is the README's default command with `--seed S --adv-estimator E --filter-groups F
--rl-seconds B` (and any --extra flags): after the same warm-up, every configuration trains for the
same B seconds of RL steps (evaluations excluded), whatever its cost per step (dynamic sampling
generates more groups per step), and its held-out accuracy is evaluated right after.

The supervised row continues the warm-up instead of RL for the same wall time: its warm-up runs
warmup_steps + budget_s / (seconds per warm-up step, measured in the same seed's RL run) steps, and its
held-out accuracy after them is the figure. On this task the answer is known, so supervision is the
strong baseline: the row says what RL adds here, and what it does not.

Writes --csv (one row per run) and prints, per configuration, the mean and the spread (min to max)
over the seeds of the accuracy at the budget and of its gain over the warm-up; the last line printed
is one JSON object.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(flags, out, log, resume=False):
    """One torchrun of train_grpo.py with these flags into `out`; its metrics, summary and spans.
    With `resume`, a run whose summary.json is already in `out` is read instead of run again."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train_grpo.py"), *flags, "--out", out]
    done = os.path.exists(os.path.join(out, "summary.json"))
    print(("(kept) " if resume and done else "") + " ".join(cmd[3:]), flush=True)
    if not (resume and done):
        with open(log, "w") as f:
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(out, "summary.json")))
    spans = [json.loads(line) for line in open(os.path.join(out, "spans_rank0.jsonl"))]
    return metrics, summary, spans


def rl_row(args, estimator, filtered, seed):
    name = f"{estimator}_filter{filtered}_seed{seed}"
    flags = ["--seed", str(seed), "--adv-estimator", estimator, "--filter-groups", str(filtered),
             "--rl-seconds", str(args.budget_s), "--steps", "100000", "--eval-every", "100000", *args.extra]
    out = os.path.join(args.out, name)
    metrics, summary, spans = run(flags, out, out + ".log", args.resume)
    wall = sum(rec.get("time/step_s", 0.0) for rec in metrics)
    warm = [s for s in spans if s["name"] == "warmup"]
    warm_s = sum(s["end"] - s["start"] for s in warm)
    return dict(config=f"{estimator}, filter {filtered}", estimator=estimator, filter_groups=filtered, seed=seed,
                before=summary["eval_accuracy_before"], at_budget=summary["eval_accuracy_after"],
                rl_wall_s=round(wall, 1), rl_steps=metrics[-1]["step"],
                warmup_s_per_step=warm_s / max(summary["config"]["warmup_steps"], 1),
                warmup_steps=summary["config"]["warmup_steps"])


def supervised_row(args, seed, like):
    """Supervised steps for the warm-up's time plus the RL budget, at the warm-up's measured pace."""
    steps = like["warmup_steps"] + int(args.budget_s / like["warmup_s_per_step"])
    name = f"supervised_seed{seed}"
    flags = ["--seed", str(seed), "--warmup-steps", str(steps), "--steps", "1", *args.extra]
    out = os.path.join(args.out, name)
    _, summary, _ = run(flags, out, out + ".log", args.resume)
    return dict(config="supervised only", estimator="", filter_groups="", seed=seed, before=like["before"],
                at_budget=summary["eval_accuracy_before"], rl_wall_s=0.0, rl_steps=0,
                warmup_s_per_step=like["warmup_s_per_step"], warmup_steps=steps)


def report(rows):
    """Per configuration: mean and spread of the accuracy at the budget and of the gain."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        acc = [r["at_budget"] for r in mine]
        gain = [r["at_budget"] - r["before"] for r in mine]
        out[config] = dict(mean=round(statistics.mean(acc), 3), min=min(acc), max=max(acc),
                           gain_mean=round(statistics.mean(gain), 3), seeds=len(mine),
                           rl_steps=[r["rl_steps"] for r in mine])
        print(f"{config:24s} held-out accuracy {out[config]['mean']:.3f} ({min(acc):.3f} to {max(acc):.3f}) | "
              f"gain {out[config]['gain_mean']:+.3f} | {len(mine)} seeds", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of every configuration")
    p.add_argument("--estimators", nargs="+", default=["grpo", "dr-grpo", "rloo", "reinforce++"])
    p.add_argument("--unfiltered", nargs="*", default=["grpo"], help="estimators also run without dynamic sampling")
    p.add_argument("--budget-s", type=float, default=100.0, help="seconds of RL steps each run trains for")
    p.add_argument("--no-supervised", dest="supervised", action="store_false", help="skip the supervised row")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "ablation"), help="folder for the runs")
    p.add_argument("--resume", action="store_true", help="keep the runs already complete in --out (same flags)")
    p.add_argument("--csv", default=os.path.join(ROOT, "bench", "ablation.csv"), help="one row per run")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_grpo.py flags, for every run")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    configs = [(e, 1) for e in args.estimators] + [(e, 0) for e in args.unfiltered]
    rows = [rl_row(args, e, f, s) for e, f in configs for s in args.seeds]
    if args.supervised:
        rows += [supervised_row(args, s, next(r for r in rows if r["seed"] == s)) for s in args.seeds]
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.csv}")
    print(json.dumps(dict(budget_s=args.budget_s, seeds=args.seeds, table=report(rows))))


if __name__ == "__main__":
    main()
