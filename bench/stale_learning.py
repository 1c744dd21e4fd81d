"""Learning under staleness: held-out accuracy against wall time for S = 0, 1 and 4 on the default task.

    python bench/stale_learning.py                 # three default runs, one after the other (~12 min)
    python bench/stale_learning.py --staleness 0 1 --extra --steps 100

Each run is `torchrun --standalone --nproc_per_node=2 train_grpo.py --staleness S` with the default
config otherwise (same seed, same warm-up). The curve comes from each run's metrics.jsonl: wall time is
the run's own clock at each evaluation (summed step times after the warm-up). Writes
bench/stale_learning.csv (staleness, step, wall_s, eval_accuracy; the runs go to bench/out/) and
bench/stale_learning.svg (the runs' curves on one chart, timeline.write_curves_svg), and prints, as
its last line, one JSON object with each run's before/after accuracy, wall time and tokens per second.
"""
import argparse
import csv
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 4], help="S values to run")
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out"), help="folder for the runs")
    p.add_argument("--csv", default=os.path.join(ROOT, "bench", "stale_learning.csv"), help="the curve")
    p.add_argument("--svg", default=os.path.join(ROOT, "bench", "stale_learning.svg"), help="the curves, drawn")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_grpo.py flags")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows, result = [], {}
    for s in args.staleness:
        run_dir = os.path.join(args.out, f"stale_S{s}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(ROOT, "train_grpo.py"), "--staleness", str(s), "--eval-every", str(args.eval_every),
               "--out", run_dir, *args.extra]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        wall = 0.0
        for rec in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))):
            wall += rec.get("time/step_s", 0.0)
            if "eval/accuracy" in rec:
                rows.append({"staleness": s, "step": rec["step"], "wall_s": round(wall, 2),
                             "eval_accuracy": rec["eval/accuracy"]})
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
        result[f"S{s}"] = {"before": summary["eval_accuracy_before"], "after": summary["eval_accuracy_after"],
                           "rl_wall_s": round(wall, 1), "tokens_per_s": round(summary["tokens_per_s"], 1)}
        print(f"S={s}: accuracy {summary['eval_accuracy_before']:.3f} -> {summary['eval_accuracy_after']:.3f} "
              f"| RL {wall:.0f}s | {summary['tokens_per_s']:.0f} tok/s", flush=True)
    path = args.csv
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["staleness", "step", "wall_s", "eval_accuracy"])
        w.writeheader()
        w.writerows(rows)
    sys.path.insert(0, ROOT)
    from plumbing import timeline
    runs = [os.path.join(args.out, f"stale_S{s}") for s in args.staleness]
    timeline.write_curves_svg(runs, args.svg, labels=[f"S = {s}" for s in args.staleness])
    print(f"wrote {path} and {args.svg}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
