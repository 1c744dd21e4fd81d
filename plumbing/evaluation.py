"""The held-out accuracy: greedy answers to prompts never trained on, counted by digit count.

Each rollout replica decodes its slice of the held-out set; one rank per replica (its writer)
counts, so that a sum over the ranks counts each prompt once.
"""
import torch

import task


def held_out_correct(run):
    """Greedy decoding of this replica's slice of the held-out set: {digits: how many of those
    prompts it answers exactly} (0 on a rank that is not its replica's writer)."""
    i, n = run.roles.replica(run.rank), run.roles.replicas  # replica i of n
    mine = run.eval_prompts[i * len(run.eval_prompts) // n:(i + 1) * len(run.eval_prompts) // n]
    greedy = run.sampler.fresh(temperature=0)  # the run's kind of sampler (its peers too), greedy
    gen = greedy(mine, torch.zeros(len(mine), dtype=torch.long))
    writer = run.rank in run.roles.writers()
    correct = dict.fromkeys(range(1, run.cfg.max_digits + 1), 0.0)
    for p, r in zip(mine, gen.tokens):
        correct[len(p) - 2] += task.score(p, r) if writer else 0.0
    return correct


def eval_figures(run, correct):
    """The held-out accuracy, overall and by digit count, from every replica's {digits: correct}."""
    asked = dict.fromkeys(correct, 0)
    for p in run.eval_prompts:
        asked[len(p) - 2] += 1
    return {"eval/accuracy": sum(correct.values()) / len(run.eval_prompts),
            "eval/accuracy_by_digits": {str(k): correct[k] / asked[k] for k in correct if asked[k]}}


def curriculum_figures(learned):
    """What the curriculum has learned: each digit count's informative share and pass rate."""
    def by_digits(values):  # key k: k + 1 digits
        return {str(k + 1): round(float(v), 3) for k, v in enumerate(values)}
    return {"curriculum/informative_by_digits": by_digits(learned.informative()),
            "curriculum/pass_rate_by_digits": by_digits(learned.pass_rate())}


def is_eval_step(cfg, step):
    """The first step, every --eval-every steps, and the last of --steps (a run the clock ends
    evaluates its last step too)."""
    return step <= 1 or step % cfg.eval_every == 0 or step == cfg.steps
