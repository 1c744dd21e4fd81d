"""--reward-model 1: a learned outcome reward model scores the responses instead of the task's rule.

    torchrun --standalone --nproc_per_node=2 train_grpo.py --reward-model 1

Fit once, after the warm-up, on rows that are each one rule label (--rm-samples of them, 2048, give
at most 6,144): the warmed-up policy's own answers to --rm-samples prompts (never held-out ones;
half drawn as the task draws, half with lengths uniform up to --max-digits, where the curriculum
may go), labelled by the rule; the right answer beside each wrong one (long strings, which the
policy rarely gets right); a near miss of each right answer (one digit changed, two swapped, one
dropped or repeated or added, not reversed: the wrong answers RL pushes toward). Then the fit is
checked by length bucket on fresh prompts (rm/check_*), frozen, and kept in host memory except
while it scores (fusion.HostOffloaded); the run's scorer (run.score) is its verdict, P(correct)
>= 0.5. Every rank fits the same one on the same rows, rank 0's weights broadcast. The rule is
still logged beside it (reward/rule_mean). At each evaluation the gap is watched (watch:
rm/watch_*): the model against the rule on the policy's fresh samples of held-out prompts, and a
warning below --rm-watch-below, the sign of a policy that games the model. The hybrid deployment
keeps the model on the auxiliary ranks, on their device, which score with it (and its gap is not
watched there). The model and its fit: options/reward_model.py.

    python -m pytest tests/test_train_grpo.py -k reward_model
"""
import functools

import numpy as np
import torch
import torch.distributed as dist

import fusion
import task
from options import reward_model
from options.push import wait_for


def attach(run):
    """Build and fit the reward model, which then scores (resumed: the checkpoint's weights)."""
    cfg = run.cfg
    with torch.random.fork_rng(devices=[]):  # its initial weights a function of the seed alone
        torch.manual_seed(cfg.seed)
        rm = reward_model.RewardModel(rm_config(cfg)).to(run.device)
    if run.resume_from is None:
        if run.rank in run.roles.generators:  # the ranks that sample (hybrid: not the auxiliary)
            with run.spans("reward_model_fit"):
                run.step0.update(fit(run, rm))  # rm/*: in step 0's record
        fitted(run)  # the others wait on rank 0's heartbeat, not in the collective below
        for t in rm.state_dict().values():  # rank 0's fit on every rank (kernels need not be
            dist.broadcast(t, src=0)         # deterministic on a device)
    rm.eval().requires_grad_(False)
    if run.roles.hybrid:  # the auxiliary ranks keep it on their device and score with it
        held = run.rank in run.roles.auxiliaries
        run.reward_model = fusion.HostOffloaded(rm, offload=False) if held else None
    else:
        run.reward_model = fusion.HostOffloaded(rm, offload=True)
        run.watch = functools.partial(watch, run)  # hybrid: the model is not on the sampling ranks
    if run.reward_model is not None:  # the hybrid's actor asks its auxiliary ranks instead
        groups = 4 * cfg.prompts_per_step  # more than a batch and the groups completed ahead of it
        run.score = Remembered(functools.partial(model_rewards, run), cfg.group_size, groups)


def model_rewards(run, prompts, responses):
    """2. The reward model's verdict, P(correct) >= 0.5 as 1.0, else 0.0. (B,) The rows come group
    by group, and each group is scored as a batch of its own: the same tensors, so the same
    verdicts, whether the filter scores it as it completes or the batch scores it for training."""
    with run.spans("reward_model"), run.reward_model.on_device() as rm:
        probs = reward_model.score(rm, prompts, responses, batch_size=run.cfg.group_size)
    return (probs >= 0.5).float()


class Remembered:
    """A scorer that remembers each group's verdicts, so that the model runs once a group. A
    group is scored as it completes (the filter and the curriculum: train_grpo.observe_group), then
    again in its batch for training (score_and_enqueue). The second read finds it here. A verdict is
    the same either way, since model_rewards scores each group as a batch of its own. The rows come
    in whole groups of `group_size`. A group's entry goes once read, and the oldest go past `size`
    groups (those filtered out, never read again)."""

    def __init__(self, score, group_size, size):
        self.score, self.group_size, self.size = score, group_size, size
        self.kept = {}  # a group's rows, as token tuples -> its verdicts (G,)

    def __call__(self, prompts, responses):
        G = self.group_size
        keys = [tuple((tuple(p.tolist()), tuple(r.tolist()))
                      for p, r in zip(prompts[i:i + G], responses[i:i + G]))
                for i in range(0, len(prompts), G)]
        found = {k: self.kept.pop(k) for k in keys if k in self.kept}  # read, so they go
        new = [j for j, k in enumerate(keys) if k not in found]
        if new:  # the groups not seen yet, whole and in order: each still a batch of its own
            rows = [i for j in new for i in range(j * G, (j + 1) * G)]
            verdicts = self.score([prompts[i] for i in rows], [responses[i] for i in rows])
            fresh = dict(zip([keys[j] for j in new], verdicts.split(G)))
            self.kept.update(fresh)  # for the next call that asks for them
            found.update(fresh)
        while len(self.kept) > self.size:
            self.kept.pop(next(iter(self.kept)))
        return torch.cat([found[k] for k in keys])  # (B,)


WATCH_PROMPTS = 256  # the held-out slice the model is checked on at each evaluation


def watch(run):
    """At each evaluation, the gap: the reward model against the rule on the current policy's
    sampled answers (temperature 1, as RL samples) to a held-out slice, fresh seeds each version.
    rm/watch_*: agreement; right_rate and wrong_rate, the shares of the rule's right and wrong
    answers the model calls so (a gamed model calls wrong answers right); balanced, their mean.
    Below --rm-watch-below, rank 0 warns. Collective (every sampling rank samples its slice)."""
    cfg, prompts = run.cfg, run.eval_prompts[:WATCH_PROMPTS]
    first = len(prompts) * run.sched.version  # fresh seeds each version
    responses = sample_responses(run, prompts, first_seed=first, stream=3)
    verdict, rule = model_rewards(run, prompts, responses), task.rewards(prompts, responses)  # (B,)
    figures = gap(verdict, rule)
    figures["rm/watch_warning"] = float(figures["rm/watch_agreement"] < cfg.rm_watch_below)
    if figures["rm/watch_warning"]:
        wrong = figures["rm/watch_wrong_rate"]
        called = "no wrong answer" if wrong is None else f"{1 - wrong:.3f} of the wrong answers"
        run.log.say(f"warning: the reward model agrees with the rule on "
                    f"{figures['rm/watch_agreement']:.3f} of {len(prompts)} sampled answers to "
                    f"held-out prompts (below --rm-watch-below {cfg.rm_watch_below}); it calls "
                    f"{called} right, and the rule finds {figures['rm/watch_rule_accuracy']:.3f} "
                    "right: the policy may be gaming it")
    return figures


def gap(verdict, rule):
    """The model's verdicts (B,) against the rule's (B,), both 0/1. A share over no answers (no
    wrong answer in the slice, say) is None, and so is the balanced mean then."""
    def share(mask):
        return float((verdict[mask] == rule[mask]).float().mean()) if mask.any() else None
    right, wrong = share(rule == 1), share(rule == 0)
    balanced = None if right is None or wrong is None else (right + wrong) / 2
    return {"rm/watch_agreement": float((verdict == rule).float().mean()),
            "rm/watch_right_rate": right, "rm/watch_wrong_rate": wrong,
            "rm/watch_balanced": balanced, "rm/watch_rule_accuracy": float(rule.float().mean())}


def rm_config(cfg):
    longest = max(cfg.max_new_tokens, cfg.max_digits + 2)  # a near miss can add a digit
    return reward_model.RMConfig(vocab_size=task.VOCAB, pad=task.PAD, steps=cfg.rm_steps,
                                 max_len=cfg.max_digits + 2 + longest, seed=cfg.seed)


def fit_keys(run):
    return f"w:{run.key}/rm_fit_step", f"w:{run.key}/rm_fit_done"


def fitted(run):
    """After the fit: rank 0 says it is done; a rank that does not sample (the hybrid's
    auxiliary) waits for that on the store, where rank 0 posts each phase of the fit and each of
    its steps, so that a fit longer than --pg-timeout-s times out only where one of them does."""
    heartbeat, done = fit_keys(run)
    if run.rank == 0:
        run.store.set(done, "1")
    elif run.rank not in run.roles.generators:
        wait_for(run, [done], "end of the reward model's fit on rank 0", moving=heartbeat,
                 poll_s=0.05)


def fit(run, rm):
    """The reward model trained on rm_samples of the policy's responses labelled by the rule, with
    the right answer and a near miss of it beside each; then checked by length bucket. rm/*."""
    cfg, (heartbeat, _) = run.cfg, fit_keys(run)
    beat = (lambda what: run.store.set(heartbeat, str(what))) if run.rank == 0 else None
    held_out = {tuple(p.tolist()) for p in run.eval_prompts}
    rng = np.random.default_rng([cfg.seed, 1])  # the fit's prompts and near misses: every rank's
    prompts = fit_prompts(rng, cfg, held_out)
    if beat:
        beat("sampling")
    responses = sample_responses(run, prompts, first_seed=0)
    prompts, responses, labels = labelled_rows(rng, prompts, responses)
    figures = reward_model.train_reward_model(rm, rm_config(cfg), prompts, responses, labels,
                                              run.device, on_step=beat)
    if beat:
        beat("check")
    return {**figures, "rm/labels": len(labels), **check(run, rm)}


def fit_prompts(rng, cfg, held_out):
    """rm_samples prompts, never held-out ones: half drawn as the task draws them (the short strings
    that RL sees most), half with a digit count uniform over [1, max_digits] (the long ones that
    the curriculum moves to)."""
    n_uniform = cfg.rm_samples // 2
    drawn = task.PromptStream(cfg.seed + 1, cfg.max_digits, exclude=held_out)
    out = drawn.next(cfg.rm_samples - n_uniform)
    for tries in range(1000 * n_uniform + 10**5):  # a brake: short strings can all be held out
        if len(out) == cfg.rm_samples:
            break
        prompt = task.prompt_of_length(rng, int(rng.integers(1, cfg.max_digits + 1)))
        if tuple(prompt.tolist()) not in held_out:
            out.append(prompt)
    if len(out) < cfg.rm_samples:
        raise RuntimeError(f"{tries + 1} draws gave only {len(out)} of {cfg.rm_samples} prompts "
                           "outside the held-out set")
    return out


NEAR_MISSES = ("one digit changed", "two neighbours swapped", "one digit dropped",
               "one digit repeated", "not reversed", "one digit added")


def near_miss(rng, right, kind):
    """An edit of a right answer (digits, EOS), so a wrong one: NEAR_MISSES[kind]. Where the edit
    would leave the string as it was (k = 1, equal neighbours, a palindrome), a digit is changed."""
    digits = right[:-1].tolist()
    k = len(digits)
    i = int(rng.integers(k))
    unequal = [j for j in range(k - 1) if digits[j] != digits[j + 1]]
    if kind == 1 and unequal:
        j = unequal[int(rng.integers(len(unequal)))]
        digits[j], digits[j + 1] = digits[j + 1], digits[j]
    elif kind == 2 and k > 1:
        del digits[i]
    elif kind == 3:
        digits.insert(i, digits[i])
    elif kind == 4 and digits != digits[::-1]:
        digits = digits[::-1]
    elif kind == 5:
        digits.append(task.DIGIT0 + int(rng.integers(10)))
    else:  # kind 0, or an edit that would change nothing
        digits[i] = task.DIGIT0 + (digits[i] - task.DIGIT0 + int(rng.integers(1, 10))) % 10
    return torch.tensor([*digits, task.EOS])


def labelled_rows(rng, prompts, responses):
    """Up to three rows a prompt, each a rule label: the policy's answer, labelled by the rule; the
    right answer where the policy's is wrong (the long strings, which a warmed-up policy rarely gets
    right, and RL may reach); a near miss of the right answer (the kinds in turn: the wrong answers
    of a policy that has learnt most of the task, which its own samples hold few of)."""
    rule = task.rewards(prompts, responses)                                       # (n,)
    wrong = [j for j in range(len(prompts)) if rule[j] == 0]
    right = [task.answer(p) for p in prompts]
    misses = [near_miss(rng, r, j % len(NEAR_MISSES)) for j, r in enumerate(right)]
    labels = torch.cat([rule, torch.ones(len(wrong)), torch.zeros(len(misses))])  # (n + w + n,)
    return (prompts + [prompts[j] for j in wrong] + prompts,
            responses + [right[j] for j in wrong] + misses, labels)


def length_buckets(max_digits, n=4):
    """n ranges of digit counts [lo, hi] that split [1, max_digits] evenly (fewer if short)."""
    edges = sorted({round(max_digits * b / n) for b in range(n + 1)} | {0})
    return [(lo + 1, hi) for lo, hi in zip(edges, edges[1:])]


def check(run, rm):
    """The fit checked by length bucket (a quarter of [1, max_digits] each) on --rm-check fresh
    prompts a bucket, in the fit's rows: the policy's answer, the right one where it is wrong, a
    near miss. rm/check_<lo>-<hi>_balanced: the mean of the shares of right and of wrong answers it
    calls so; _n its rows; _policy_accuracy, the rule's on the policy's answers;
    rm/check_min_balanced. Collective (every sampling rank samples its slice)."""
    cfg, rng = run.cfg, np.random.default_rng([run.cfg.seed, 2])
    figures = {}
    for b, (lo, hi) in enumerate(length_buckets(cfg.max_digits)):
        prompts = [task.prompt_of_length(rng, int(rng.integers(lo, hi + 1)))
                   for _ in range(cfg.rm_check)]
        responses = sample_responses(run, prompts, first_seed=b * cfg.rm_check, stream=2)
        rows = labelled_rows(rng, prompts, responses)
        said = reward_model.agreement(reward_model.score(rm, rows[0], rows[1]), rows[2])
        name = f"rm/check_{lo}-{hi}"
        figures[f"{name}_balanced"] = (said["true_positive_rate"] + said["true_negative_rate"]) / 2
        figures[f"{name}_n"] = said["n"]
        figures[f"{name}_policy_accuracy"] = float(task.rewards(prompts, responses).mean())
    figures["rm/check_min_balanced"] = min(v for k, v in figures.items() if k[-9:] == "_balanced")
    return figures


def fit_seed(seed, i, stream):
    """The sampling seed of the reward model's i-th sample in a stream (1 the fit, 2 its check, 3
    the watch): streams of their own (a 3-number key; the RL samples' have 4: task.sample_seed)."""
    return int(np.random.SeedSequence([seed, i, stream]).generate_state(1)[0])


def sample_responses(run, prompts, first_seed, stream=1):
    """The current policy's sampled response to each prompt (seed first_seed + i), every rank
    getting all of them: each rollout replica generates its slice, the writers' slices gathered in
    order. Collective."""
    i, n = run.roles.replica(run.rank), run.roles.replicas
    lo, hi = i * len(prompts) // n, (i + 1) * len(prompts) // n
    seeds = torch.tensor([fit_seed(run.cfg.seed, first_seed + j, stream)
                          for j in range(lo, hi)])
    with fusion.rollout(run.actor):
        mine = run.sampler.fresh()(prompts[lo:hi], seeds).tokens
    everyone = [None] * dist.get_world_size(run.rollout_group)
    mine = [r.cpu() for r in mine] if run.rank in run.roles.writers() else None
    dist.all_gather_object(everyone, mine, group=run.rollout_group)
    return [r for part in everyone if part is not None for r in part]
