"""The hybrid placement against colocated-all, side by side in one run of this script, on the same work.

    python bench/hybrid.py                      # S = 0, 1 and 2, two rounds of the six runs (about 15 min on 2 cores)
    python bench/hybrid.py --staleness 0 --rounds 1 --steps 40

Both at world 2 (no more processes than the machine's 2 cores), with the KL term on and the learned reward model
scoring (no filter, no curriculum: with them, --rules 1, the hybrid's actor asks for each group's rewards as it
completes and waits for them), a fixed number of RL steps (--steps, --rl-seconds 0):
  colocated-all   2 ranks, each generates half the batch, then computes the reference's log-probs and the reward
                  model's scores of its share (both kept on host between uses), then trains (FSDP2 over the 2)
  hybrid          rank 0 is the actor (generates the whole batch, trains); rank 1 holds the reference and the reward
                  model and works on each group as soon as rank 0 puts it (rank 0 answers its pulls between decode
                  forwards), while rank 0 decodes the rest; rank 0's update starts on the groups rank 1 has finished
                  and reads each later micro-batch's columns as it reaches it
The regime: the default task and model, where the reference and the reward model take about a fifth of a
colocated-all rank's step (measured: the `reference` and `reward_model` spans over `time/step_s`, printed below).

Figures, over the RL steps of each run (rank 0's metrics.jsonl and every rank's spans):
  tokens/s        response tokens over the steps' time
  actor idle      the actor's share of the steps' time spent waiting: its `queue` and `idle` spans (colocated-all:
                  rank 0's; hybrid: rank 0, the only actor rank)
  queue's own     rank 0's `queue` spans, less the time the auxiliary rank was working while rank 0's update waited for
                  a micro-batch's columns (a wait for its work, not for the queue): the queue's round trips, transfers
                  and polling (target in the hybrid: < 5%)
  hybrid_over_colocated_all   the hybrid's tokens/s over colocated-all's, in the same round
  aux idle        the auxiliary rank's waits for work, per RL step (summary.json): its reads of the queue and the
                  CPU seconds it burns (it blocks on its inbox in the store between notices)
The bound: what this machine allows the hybrid. Per RL step k, the actor must do its own work a_k (its step time less
its waits) and the auxiliary rank its own, x_k (its `reference` and `reward_model` spans inside step k's window, from
the actor's first span of step k to its last); at best they overlap completely, so step k takes at least
max(a_k, x_k). The hybrid's bound in tokens/s is its tokens over sum_k max(a_k, x_k); `bound` is that over
colocated-all's tokens/s, and `share_of_bound` the hybrid's measured tokens/s over its bound (the target: >= 0.9).
The auxiliary work can fill only the actor's waits: where x_k < a_k, the auxiliary rank idles for the rest. The bound
is loose: the groups that complete in a round's last decode chunk can only be worked on after it (`tail`: the
auxiliary work after the actor's rollout ended, over the steps' time), and the update's first micro-batch needs the
columns of the groups that completed first; a_k is the hybrid's own actor work (its chunked decode, its puts and
serving included).
The source's claim for its hybrid placement (a larger cluster, a 718B MoE): higher throughput than either pure form;
the ratio here is this machine's, with one actor rank against two.
Runs go to bench/out/hybrid/; the last line printed is one JSON object.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import timeline  # noqa: E402

FLAGS = ["--kl-coef", "0.05", "--lr", "5e-4", "--lr-decay", "1", "--train-ep", "0",  # like for like: EP off
         "--reward-model", "1", "--rm-samples", "512", "--rm-steps", "100", "--filter-groups", "0", "--curriculum", "0",
         "--warmup-steps", "300", "--eval-every", "1000", "--eval-prompts", "64", "--rl-seconds", "0"]
WAITS = ("queue", "idle")
AUX_WORK = ("reference", "reward_model")


def train(out, deploy, staleness, steps):
    """One torchrun run of train_grpo.py at world 2; returns (metrics lines of the RL steps, spans)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train_grpo.py"), "--deploy", deploy, "--staleness", str(staleness), "--steps",
           str(steps), "--out", out, *FLAGS]
    print(" ".join(cmd[2:]), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        sys.exit(f"the run failed ({r.returncode}):\n{r.stderr[-4000:]}")
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]
    summary = json.load(open(os.path.join(out, "summary.json")))
    idle = {k: summary[f"aux_idle_{k}"] / len(lines) for k in ("gets", "cpu_s") if f"aux_idle_{k}" in summary}
    return lines, timeline.load_spans(out), idle


def inside(spans, rank, names, lo, hi):
    """Seconds of rank's spans named in `names` that fall inside [lo, hi]."""
    return sum(max(0.0, min(s["end"], hi) - max(s["start"], lo)) for s in spans
               if s["rank"] == rank and s["name"] in names)


def queue_own(spans, helper, lo, hi):
    """Seconds of rank 0's `queue` spans inside [lo, hi], less, in those inside its update (`train`: the hybrid's
    reads of each micro-batch's auxiliary columns), the time the auxiliary rank (helper; None: none) was working: a
    wait for its work, not for the queue. What is left is the queue's own time: round trips, transfers, polling."""
    mine = [s for s in spans if s["rank"] == 0 and s["name"] == "queue" and s["end"] > lo and s["start"] < hi]
    total = sum(min(s["end"], hi) - max(s["start"], lo) for s in mine)
    updates = [s for s in spans if s["rank"] == 0 and s["name"] == "train" and s["end"] > lo and s["start"] < hi]
    waits = [s for s in mine if any(u["start"] <= s["start"] and s["end"] <= u["end"] for u in updates)]
    waited = 0.0 if helper is None else sum(inside(spans, helper, AUX_WORK, max(s["start"], lo), min(s["end"], hi))
                                            for s in waits)
    return total - waited


def figures(lines, spans, deploy):
    """tokens/s, the actor's idle share, the auxiliary work's share of the actor's step time, the queue's own share,
    and (hybrid) the bound's tokens/s and the tail, from the RL steps (the first left out: first-time allocations; the
    last: its evaluation)."""
    rows, step_s, waits, aux, tail, own, bound_s = lines[1:-1], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    helper = 1 if deploy == "hybrid" else None
    for line in rows:
        mine = [s for s in spans if s["rank"] == 0 and s.get("step") == line["step"]]
        lo, hi = min(s["start"] for s in mine), max(s["end"] for s in mine)
        wait = inside(spans, 0, WAITS, lo, hi)
        work = inside(spans, 0 if helper is None else helper, AUX_WORK, lo, hi)
        step_s, waits, aux, own = step_s + line["time/step_s"], waits + wait, aux + work, own + queue_own(
            spans, helper, lo, hi)
        if helper is not None:  # the auxiliary work after the round
            rolled = max(s["end"] for s in mine if s["name"] == "rollout")
            tail += inside(spans, helper, AUX_WORK, rolled, hi)
        bound_s += max(line["time/step_s"] - wait, work)
    tokens = sum(line["rollout/response_tokens"] for line in rows)
    return {"tokens_per_s": tokens / step_s, "actor_idle": waits / step_s, "aux_share": aux / step_s,
            "tail": tail / step_s, "queue_own": own / step_s, "bound_tokens_per_s": tokens / bound_s,
            "steps": len(rows)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the runs, back to back (the ratio's spread)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "hybrid"))
    p.add_argument("--rules", type=int, default=0, help="1: dynamic sampling and the curriculum on, judged by the "
                   "reward model's rewards (the hybrid's auxiliary rank scores each group as it completes)")
    p.add_argument("--rm-steps", type=int, default=100, help="the reward model's fit (train_grpo's default: 500; "
                   "with --rules 1 a fit short of converging leaves the two deployments' filters different models)")
    args = p.parse_args()
    FLAGS[FLAGS.index("--rm-steps") + 1] = str(args.rm_steps)
    if args.rules:
        FLAGS[FLAGS.index("--filter-groups") + 1] = FLAGS[FLAGS.index("--curriculum") + 1] = "1"
    result = {}
    for S in args.staleness:
        ratios, bounds, shares, tails, own = [], [], [], [], {"colocated-all": [], "hybrid": []}
        idles = []
        for i in range(args.rounds):
            f = {}
            for deploy in ("colocated-all", "hybrid") if i % 2 == 0 else ("hybrid", "colocated-all"):
                lines, spans, idle = train(os.path.join(args.out, f"{deploy}_s{S}_{i}"), deploy, S, args.steps)
                f[deploy] = figures(lines, spans, deploy)
                if idle:
                    idles.append(idle)
                    print(f"  S = {S} hybrid: the auxiliary rank's idle reads {idle['gets']:.1f} and CPU "
                          f"{idle['cpu_s'] * 1e3:.1f} ms per step", flush=True)
                print(f"  S = {S} {deploy:13s}: {f[deploy]['tokens_per_s']:6.0f} tok/s | actor idle "
                      f"{f[deploy]['actor_idle']:.3f} | reference and reward model {f[deploy]['aux_share']:.3f} of the "
                      f"actor's step time ({'on it' if deploy == 'colocated-all' else 'on rank 1'}; after its "
                      f"rollout {f[deploy]['tail']:.3f}) | the queue's own time {f[deploy]['queue_own']:.3f}",
                      flush=True)
            ratio = f["hybrid"]["tokens_per_s"] / f["colocated-all"]["tokens_per_s"]
            bound = f["hybrid"]["bound_tokens_per_s"] / f["colocated-all"]["tokens_per_s"]
            ratios.append(ratio), bounds.append(bound), shares.append(ratio / bound)
            tails.append(f["hybrid"]["tail"])
            for deploy in own:
                own[deploy].append(f[deploy]["queue_own"])
            print(f"  S = {S} round {i}: hybrid / colocated-all {ratio:.3f}, bound {bound:.3f}, share of the bound "
                  f"{ratio / bound:.3f}", flush=True)
        result[f"s{S}"] = {"hybrid_over_colocated_all": ratios, "bound": bounds, "share_of_bound": shares,
                           "median_share_of_bound": statistics.median(shares), "tail": tails, "queue_own": own,
                           "aux_idle_gets_per_step": [i["gets"] for i in idles],
                           "aux_idle_cpu_s_per_step": [i["cpu_s"] for i in idles]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
