"""What a run shows and leaves behind: a tqdm bar with a line every --log-every steps and at each
evaluation; metrics.jsonl (one object per step), summary.json, spans_rank<N>.jsonl (every timed
phase of every rank), and from them (timeline.py) trace.json, timeline.svg and curves.svg.

A step's figures are sums over each trainer's rows (share_figures, from the "stale" facts each row
carries: stale_facts), added over the trainers in one collective and then divided: the logged means
are over the whole batch, whatever the split.
"""
import dataclasses
import gc
import json
import os
import re
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import grpo
from plumbing import checkpoint, timeline
from plumbing.stalesync_details import FilterLimitError

# time/<key>_s in metrics.jsonl: the seconds a step spent in spans of these names
PHASES = {"rollout": "rollout", "train": "train", "reference": "reference", "score": "score",
          "switch": ("switch_to_rollout", "switch_to_train", "push", "recv")}
SAVED = ("before", "accuracy", "by_digits", "tokens", "seconds", "regenerated", "extra_groups",
         "skipped", "elapsed")


def all_sum(values, device, group=None, op=dist.ReduceOp.SUM):
    """A dict of floats reduced over the group in one collective (float64)."""
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return dict(zip(values, t.tolist()))


def _step(line):
    """The step of a metrics.jsonl line, or None for a line that is empty or cut short."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return None


AT_CUT = ("regenerated", "filtered", "filled_in")  # a batch's facts of its cut (stale/*_at_cut)
STALE_FACTS = ("sample_id", "start_version", "versions", *AT_CUT)  # AT_CUT: on its first row


def stale_facts(batch, at_cut):
    """Each row's STALE_FACTS, put into the queue with it: its sample id, the version its first
    token was made at, how many versions its tokens span (> 1: a partial rollout), and on the first
    row the batch's AT_CUT (its cut's groups regenerated, dropped, given for a held-back peer)."""
    none = [0] * len(AT_CUT)
    rows = zip(batch.ids, batch.start_versions, batch.token_versions)
    return [torch.tensor([i, start, len(set(v.tolist())), *(at_cut if j == 0 else none)])
            for j, (i, start, v) in enumerate(rows)]


def cut_facts(batch):
    """A batch's AT_CUT, from StaleSync's figures of its cut."""
    return [batch.metrics[f"stale/{name}_at_cut"] for name in AT_CUT]


def share_figures(step, rows):
    """The step's sums over this trainer's rows (a distqueue Rows), for RunLog.figures."""
    width = len(STALE_FACTS)  # a row that older code put (a resumed queue) lacks the last facts
    facts = [torch.nn.functional.pad(f, (0, width - len(f))) for f in rows.cols["stale"]]
    table = torch.stack(facts) if facts else torch.zeros(0, width, dtype=torch.long)  # (B, F)
    stale = dict(zip(STALE_FACTS, table.unbind(1)))                 # name -> (B,)
    ages = (step - 1) - stale["start_version"]                      # (B,)
    reward, rule = rows.stack("reward"), rows.stack("rule_reward")  # (B,)
    return {"reward": float(reward.sum()), "rule_reward": float(rule.sum()),
            "rule_agree": float((reward == rule).sum()), "rows": len(rows.ids),
            "prompt_digits": float(sum(len(p) - 2 for p in rows.cols["prompt"])),
            "response_tokens": float(sum(len(r) for r in rows.cols["response"])),
            "age_sum": float(ages.sum()), "age_max": float(ages.max()) if len(ages) else 0.0,
            "partial_continued": float((stale["versions"] > 1).sum()),
            **{name: float(stale[name].sum()) for name in AT_CUT}}


def lockstep_counts(run):
    """The engine's lock-step counts so far, this rank's (rank 0's in metrics.jsonl): forwards of
    zero rows run for its peers, and agreements (one all-reduce each); 0 without a lock-step engine
    (--infer-ep 1, a trainer rank)."""
    lockstep = getattr(run.sampler, "lockstep", None)  # options/lockstep.py's sampler has one
    return {"lockstep/dummy_forwards": lockstep.dummy_forwards if lockstep is not None else 0,
            "lockstep/agreements": lockstep.agreements if lockstep is not None else 0}


class RunLog:
    """Rank 0 writes metrics.jsonl (one object per step) and summary.json, and shows a tqdm bar with
    a line every log_every steps and at each evaluation. At the end every rank's spans go to rank 0,
    which writes spans_rank<N>.jsonl, trace.json, timeline.svg and curves.svg (timeline.py).
    Collective: every rank builds one (the ranks agree on when the run started) and closes it."""

    def __init__(self, run, start=1, gather=checkpoint.dense_state_dict):
        self.run, self.t_start = run, run.spans.t0
        self.start = start  # the first RL step of this run
        self.gather = gather  # the trained model whole on every rank (collective): summary's hash
        self.means = [grpo.batch_means]  # trainers' sums -> a step's figures (options add theirs)
        t0 = [time.time() - (time.perf_counter() - self.t_start)]  # the start in wall-clock time
        dist.broadcast_object_list(t0, src=0)  # rank 0's: every rank's spans on one time axis
        self.offset = time.time() - time.perf_counter() - t0[0]  # perf_counter -> since the start
        fresh_writer = run.rank == 0 and start == 1
        self.file = self.open_metrics() if fresh_writer else None  # resuming: reopen_metrics
        self.before = self.accuracy = self.by_digits = None
        self.last_step = start - 1
        self.tokens = self.seconds = self.regenerated = self.extra_groups = self.skipped = 0.0
        self.elapsed = 0.0  # seconds of earlier runs up to the checkpoint this one resumed from

    def open_metrics(self):
        """metrics.jsonl, new; or, resuming at step `start`, kept up to the checkpoint's step and
        appended to (the lines a run wrote after its last checkpoint go, and a line cut short by a
        crash: those steps are run again)."""
        path = os.path.join(self.run.out_dir, "metrics.jsonl")
        if self.start == 1 or not os.path.exists(path):
            return open(path, "w")
        with open(path) as f:
            kept = [line for line in f if _step(line) is not None and _step(line) < self.start]
        with open(path, "w") as f:
            f.writelines(kept)
        return open(path, "a")

    def state_dict(self):
        """The figures so far, for a checkpoint (JSON: numbers and None)."""
        elapsed = self.elapsed + time.perf_counter() - self.t_start
        return {k: getattr(self, k) for k in SAVED} | {"elapsed": elapsed}

    def load_state_dict(self, state):
        """The checkpoint's figures. metrics.jsonl is reopened apart, once all has loaded
        (reopen_metrics)."""
        for k in SAVED:
            setattr(self, k, state[k])
        self.offset += self.elapsed  # this run's spans after the checkpoint's time, on one axis

    def reopen_metrics(self):
        """Resuming: rank 0's metrics.jsonl, cut back to the checkpoint's step, appended to."""
        if self.run.rank == 0:
            self.file = self.open_metrics()

    def rl_seconds(self, mark):
        """Seconds of RL steps so far, evaluations excluded, this one (begun at `mark`) included:
        the clock of --rl-seconds."""
        return self.seconds + time.perf_counter() - mark[1]

    def share(self, step, seconds):
        """The share of the run behind after `step` and `seconds` of RL: the larger of step /
        --steps and seconds over --rl-seconds (the limit that binds first; the bar's, and the
        learning rate's)."""
        cfg = self.run.cfg
        return max(step / cfg.steps, seconds / cfg.rl_seconds if cfg.rl_seconds else 0.0)

    def done(self, step, mark):
        """The share of the run behind after `step` (begun at `mark`), on rank 0's clock, so that
        every trainer agrees (one MAX all-reduce over the trainers, while the steps alone leave the
        run unfinished)."""
        run = self.run
        if not run.cfg.rl_seconds or step >= run.cfg.steps:
            return self.share(step, 0.0)
        seconds = self.rl_seconds(mark) if run.rank == 0 else 0.0
        rank0 = all_sum({"s": seconds}, run.device, run.train_group, dist.ReduceOp.MAX)["s"]
        return self.share(step, rank0)

    def progress(self):
        """The RL steps, start .. --steps, with a bar on rank 0 that follows the limit that binds:
        its share is the larger of the RL seconds over --rl-seconds and the steps over --steps, so
        its time left is the sooner end, and it ends at 100% when the clock stops the run."""
        cfg = self.run.cfg
        bar = tqdm(total=100, disable=self.run.rank != 0, desc="GRPO", dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {postfix} [{elapsed}<{remaining}]")

        def advance(step):
            share = self.share(step, self.seconds)
            of_time = f", {self.seconds:.0f}/{cfg.rl_seconds:.0f} s of RL" if cfg.rl_seconds else ""
            bar.set_postfix_str(f"step {step}/{cfg.steps}{of_time}", refresh=False)
            bar.update(min(100.0, 100 * share) - bar.n)
        advance(self.start - 1)
        try:
            for step in range(self.start, cfg.steps + 1):
                yield step
                advance(step)
        finally:
            if cfg.rl_seconds and self.seconds >= cfg.rl_seconds:  # the clock ended the last step
                advance(self.last_step)
            bar.close()

    def mark(self, **args):
        """A step begins: its spans carry `args` (step, version). Returns where its spans and
        time start."""
        self.run.spans.args = args
        return len(self.run.spans.spans), time.perf_counter()

    def figures(self, step, mark, sums, extra):
        """The step's record: sums over every trainer's rows (one collective over the trainers; the
        maxima, keys ending in _max, another), the time spent in each phase since `mark`, and
        `extra` (the switch's)."""
        run, (first, t0) = self.run, mark
        maxima = {k: v for k, v in sums.items() if k.endswith("_max")}
        s = all_sum({k: v for k, v in sums.items() if k not in maxima}, run.device, run.train_group)
        s.update(all_sum(maxima, run.device, run.train_group, dist.ReduceOp.MAX))
        step_s, spans, rows = time.perf_counter() - t0, run.spans, max(s["rows"], 1)
        self.tokens, self.seconds = self.tokens + s["response_tokens"], self.seconds + step_s
        self.regenerated += s["regenerated"]
        self.extra_groups += s["regenerated"] + s["filtered"]
        kept = run.cfg.prompts_per_step
        self.last_step = step
        self.skipped += s["skipped_max"]
        phases = {f"time/{k}_s": spans.total(names, first) for k, names in PHASES.items()}
        return {"step": step, "reward/mean": s["reward"] / rows,
                "reward/rule_mean": s["rule_reward"] / rows,
                # rows whose reward is the rule's (a learned one's)
                "reward/rule_agreement": s["rule_agree"] / rows,
                **{k: v for means in self.means for k, v in means(s).items()},
                "rollout/response_tokens": s["response_tokens"],
                "perf/tokens_per_s": s["response_tokens"] / step_s,
                "time/step_s": step_s, **phases,
                # waiting: for samples (queue), or, ready first, for the peers' rollouts (idle)
                "perf/idle_frac": spans.total(("queue", "idle"), first) / step_s,
                # the queue's reads and their waits
                "perf/queue_frac": spans.total(("queue",), first) / step_s,
                "stale/age_max": s["age_max"], "stale/age_mean": s["age_sum"] / rows,
                "stale/partial_continued": s["partial_continued"],
                "stale/regenerated": self.regenerated,
                # groups a replica gave for a held-back peer (the shared cut)
                "stale/filled_in": s["filled_in"],
                # dynamic sampling: groups dropped this step; groups generated and never trained, so
                # far; the step's yield, groups trained over groups generated (dropped, or
                # regenerated when too old)
                "rollout/filtered_groups": s["filtered"], "rollout/extra_groups": self.extra_groups,
                "rollout/yield": kept / (kept + s["filtered"] + s["regenerated"]),
                "rollout/prompt_digits_mean": s["prompt_digits"] / rows,
                "train/lr": run.optimizer.param_groups[0]["lr"],  # --lr-decay anneals it
                # optimizer steps skipped for a non-finite gradient, so far
                "train/skipped_steps": self.skipped,
                # hybrid: put for later; put, then regenerated, and let go
                **({"queue/rows_ahead": s["rows_ahead"]} if "rows_ahead" in s else {}),
                **({"queue/rows_dropped": s["rows_dropped"]} if "rows_dropped" in s else {}),
                # rank 0 writes it
                **lockstep_counts(run), **(run.queue.metrics() if self.file else {}), **extra}

    def warmed_up(self, evaluation):
        """Step 0: the held-out accuracy after the warm-up, the "before" figure."""
        self.before = evaluation["eval/accuracy"]
        warmup_s = self.run.spans.total("warmup")
        self.say(f"warm-up: {self.run.cfg.warmup_steps} steps in {warmup_s:.1f}s | "
                 f"held-out accuracy {self.before or 0.0:.3f}")
        if "rm/check_min_balanced" in evaluation:  # --reward-model: fit after the warm-up
            e, name = evaluation, re.compile(r"rm/check_(\d+-\d+)_balanced")
            buckets = ", ".join(f"{m[1]} digits {v:.3f}"
                                for k, v in e.items() if (m := name.match(k)))
            self.say(f"reward model: {e['rm/labels']} rule labels ({self.run.cfg.rm_samples} "
                     f"samples, the right answer beside each wrong one, a near miss of each), "
                     f"{e['rm/seconds']:.1f}s | balanced accuracy on fresh prompts: {buckets}")
        self.write({"step": 0, **evaluation}, show=False)

    def write(self, rec, show=None):
        """One line of metrics.jsonl; on the terminal every log_every steps and each evaluation."""
        if rec.get("eval/accuracy") is not None:
            self.accuracy, self.by_digits = rec["eval/accuracy"], rec["eval/accuracy_by_digits"]
        if not self.file:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if show is None:
            show = rec["step"] % self.run.cfg.log_every == 0 or "eval/accuracy" in rec
        if show:
            held_out = ""
            if "eval/accuracy" in rec:
                held_out = f" | held-out accuracy {rec['eval/accuracy']:.3f}"
            self.say(f"step {rec['step']} | reward {rec['reward/mean']:.2f} | "
                     f"loss {rec['loss']:+.4f} | {rec['perf/tokens_per_s']:.0f} tok/s | "
                     f"rollout {rec['time/rollout_s']:.2f}s train {rec['time/train_s']:.2f}s | "
                     f"age {rec['stale/age_max']:.0f} | "
                     f"filtered {rec['rollout/filtered_groups']:.0f}{held_out}")

    def say(self, line):
        if self.file:
            tqdm.write(line)

    def close(self):
        """summary.json, the spans and the pictures. params_sha256: a hash of the trained weights
        (gathered: collective over the trainers), to compare runs by; wall_s: this run's seconds,
        plus, after a resume, those up to the checkpoint."""
        run = self.run
        full = self.gather(run.model) if run.model is not None else None
        params_sha256 = checkpoint.params_sha256(full) if full is not None else None
        q = run.queue.metrics()
        kept = self.last_step * run.cfg.prompts_per_step  # the groups trained, in every step so far
        summary = {"eval_accuracy_before": self.before, "eval_accuracy_after": self.accuracy,
                   "eval_accuracy_by_digits": self.by_digits,
                   "yield": kept / max(kept + self.extra_groups, 1),
                   "wall_s": self.elapsed + time.perf_counter() - self.t_start,
                   "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
                   "queue_bytes_sent": q["queue/bytes_sent"],
                   "queue_bytes_padded_equiv": q["queue/bytes_padded_equiv"],
                   "world_size": run.roles.world,
                   "resumed_at_step": self.start - 1 if self.start > 1 else None,
                   "checkpoint_s": run.spans.total("checkpoint"), "params_sha256": params_sha256,
                   "config": dataclasses.asdict(run.cfg)}
        self.write_spans()
        if self.file:
            self.file.close()
            with open(os.path.join(run.out_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            timeline.write_all(run.out_dir)
            self.say(f"held-out accuracy {self.before:.3f} -> {self.accuracy:.3f} | "
                     f"{summary['wall_s']:.0f}s | {summary['tokens_per_s']:.0f} tok/s | "
                     f"{run.out_dir}")
        return summary

    def write_spans(self):
        """Every rank's spans, gathered to rank 0 (the ranks may not share a disk), a file each."""
        run = self.run
        run.spans.settle()
        mine = [{"rank": run.rank, "name": name, "start": s0 + self.offset, "end": s1 + self.offset,
                 **args} for name, s0, s1, args in run.spans.spans]
        everyone = [None] * run.roles.world if run.rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        if everyone is None:
            return
        earlier = []
        if self.start > 1:
            earlier = [n for n in os.listdir(run.out_dir) if n.startswith("spans_rank")]
        ranks = [os.path.join(run.out_dir, f"spans_rank{rank}.jsonl")
                 for rank in range(len(everyone))]
        # an earlier run's ranks, all of them
        paths = sorted({os.path.join(run.out_dir, n) for n in earlier} | set(ranks))
        kept = {p: self.kept_spans(p) for p in paths}
        # the new spans come after every kept one
        shift = max([0.0] + [s["end"] - self.elapsed for k in kept.values() for s in k])
        new = dict(zip(ranks, everyone))
        for path in paths:
            with open(path, "w") as f:
                f.writelines(json.dumps(s) + "\n" for s in kept[path])
                shifted = (dict(s, start=s["start"] + shift, end=s["end"] + shift)
                           for s in new.get(path, []))
                f.writelines(json.dumps(s) + "\n" for s in shifted)

    def kept_spans(self, path):
        """Resuming: the spans an earlier run wrote that began before the checkpoint this one
        resumed from (those after it, like their metrics lines, belong to steps run again). A new
        run keeps none."""
        if self.start == 1 or not os.path.exists(path):
            return []
        with open(path) as f:
            spans = [json.loads(line) for line in f if line.strip()]
        return [s for s in spans if s["start"] < self.elapsed]


def run_guarded(run, loop):
    """loop(run), then the log closed: (summary, the trained model). An error names the phase this
    rank was in (a dead peer surfaces as a failed collective), and a brake's error the flags that
    set it. What setup made lives as long as the loop: frozen, a full garbage collection skips it
    and pauses a rank (its peers waiting) far less."""
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        loop(run)
    except Exception as e:
        where, args = run.spans.failed_in or ("the loop", run.spans.args)
        raise RuntimeError(f"rank {run.rank} stopped in {where} ({args}): {type(e).__name__}: "
                           f"{e}{hint(run.cfg, e)}") from e
    finally:
        if freeze:
            gc.unfreeze()
    return run.log.close(), run.model


def hint(cfg, e):
    """What a brake's error means in train_grpo.py's flags."""
    if isinstance(e, FilterLimitError):
        return (f" (--filter-groups 1: dynamic sampling; --filter-limit {cfg.filter_limit} groups "
                "dropped per prompt trained stops the run; --filter-groups 0 turns it off)")
    return ""
