"""The queue's share of the RL steps' time, in each deployment: its spans over the steps', over a whole run.

    python bench/queue_share.py                 # the four deployments, 40 RL steps each (about 5 min on 2 cores)
    python bench/queue_share.py --steps 20 --deploy colocated hybrid

Each run: world 2 under torchrun, the default task and model with `--kl-coef 0.05` (so that colocated-all and the hybrid
have a reference to place) and a constant `--lr 5e-4`, a fixed number of RL steps (--steps, --rl-seconds 0). The figure
is trainer 0's `perf/queue_frac` (its `queue` spans in a step over the step's time), weighted by the steps' times, the
first step and the last (its evaluation) left out. What the spans hold differs by deployment:
  colocated       the read of this rank's share of the batch at the cut (round trips, the rows that move)
  colocated-all   the same
  separated       the trainer's wait for the generator's rows as well: the queue is where it waits
  hybrid          the actor's read at the cut, and its reads of each micro-batch's auxiliary columns, waits included
                  (bench/hybrid.py takes out the waits for the auxiliary rank's work: the queue's own time)
Runs go to bench/out/queue_share/; the last line printed is one JSON object.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--kl-coef", "0.05", "--lr", "5e-4", "--lr-decay", "1", "--train-ep", "0",  # like for like: EP off
         "--warmup-steps", "300", "--eval-every", "1000", "--eval-prompts", "64", "--rl-seconds", "0"]


def run(out, deploy, steps):
    """One torchrun run of train_grpo.py at world 2; returns trainer 0's metrics lines of the RL steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train_grpo.py"), "--deploy", deploy, "--steps", str(steps), "--out", out, *FLAGS]
    print(" ".join(cmd[2:]), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        sys.exit(f"the run failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deploy", nargs="+", default=["colocated", "colocated-all", "separated", "hybrid"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "queue_share"))
    args = p.parse_args()
    result = {}
    for deploy in args.deploy:
        steps = run(os.path.join(args.out, deploy), deploy, args.steps)[1:-1]
        step_s = sum(line["time/step_s"] for line in steps)
        queue_s = sum(line["perf/queue_frac"] * line["time/step_s"] for line in steps)
        result[deploy] = {"queue_share": queue_s / step_s, "step_s": step_s / len(steps), "steps": len(steps)}
        print(f"  {deploy:13s}: the queue's spans {queue_s:6.2f} s of {step_s:6.2f} s of RL steps: "
              f"{queue_s / step_s:.3f} (a step {1e3 * step_s / len(steps):.0f} ms)", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
