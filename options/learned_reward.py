"""--reward-model 1: a learned outcome reward model scores the responses instead of the task's rule.

    torchrun --standalone --nproc_per_node=2 train_grpo.py --reward-model 1

Fit once, after the warm-up, on --rm-samples of the warmed-up policy's own responses to the task's
prompts (never held-out ones), labelled by the rule (options/reward_model.py: the model and its
fit); every rank fits the same one on the same samples, rank 0's weights broadcast. Then it is
frozen and kept in host memory except while it scores (fusion.HostOffloaded), and the run's scorer
(run.score) is its verdict, P(correct) >= 0.5. The rule is still logged beside it
(reward/rule_mean), and its agreement with the rule on the held-out prompts' samples goes into
step 0's record (rm/*). At each evaluation the gap is watched (watch: rm/watch_*): the model against
the rule on the policy's fresh samples of held-out prompts, and a warning below --rm-watch-below,
the sign of a policy that games the model. The hybrid deployment keeps the model on the auxiliary
ranks, on their device, which score with it (and its gap is not watched there).

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
        said = [None]  # rank 0's refusal of the fit, said on every rank (hybrid: the auxiliary too)
        if run.rank in run.roles.generators:  # the ranks that sample (hybrid: not the auxiliary)
            with run.spans("reward_model_fit"):
                try:
                    run.step0.update(fit(run, rm))  # rm/*: in step 0's record
                except OneLabel as err:
                    said = [str(err)]
        fitted(run)  # the others wait on rank 0's heartbeat, not in the collective below
        dist.broadcast_object_list(said, src=0)
        if said[0] is not None:
            raise ValueError(said[0])
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
        run.score = functools.partial(model_rewards, run)


def model_rewards(run, prompts, responses):
    """2. The reward model's verdict, P(correct) >= 0.5 as 1.0, else 0.0. (B,) The rows come group
    by group, and each group is scored as a batch of its own: the same tensors, so the same
    verdicts, whether the filter scores it as it completes or the batch scores it for training."""
    with run.spans("reward_model"), run.reward_model.on_device() as rm:
        probs = reward_model.score(rm, prompts, responses, batch_size=run.cfg.group_size)
    return (probs >= 0.5).float()


WATCH_PROMPTS = 256  # the held-out slice the model is checked on at each evaluation


def watch(run):
    """At each evaluation, the gap: the reward model against the rule on the current policy's
    sampled answers (temperature 1, as RL samples) to a held-out slice, fresh seeds each version.
    rm/watch_*: agreement; right_rate and wrong_rate, the shares of the rule's right and wrong
    answers the model calls so (a gamed model calls wrong answers right); balanced, their mean.
    Below --rm-watch-below, rank 0 warns. Collective (every sampling rank samples its slice)."""
    cfg, prompts = run.cfg, run.eval_prompts[:WATCH_PROMPTS]
    first = cfg.rm_samples + len(run.eval_prompts) * (1 + run.sched.version)  # past fit()'s seeds
    responses = sample_responses(run, prompts, first_seed=first)
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
    return reward_model.RMConfig(vocab_size=task.VOCAB, pad=task.PAD, steps=cfg.rm_steps,
                                 max_len=cfg.max_digits + 2 + cfg.max_new_tokens, seed=cfg.seed)


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
    """The reward model trained on rm_samples of the policy's responses, labelled by the rule; its
    agreement with the rule on the policy's responses to the held-out prompts. rm/*."""
    cfg, (heartbeat, _) = run.cfg, fit_keys(run)
    beat = (lambda what: run.store.set(heartbeat, str(what))) if run.rank == 0 else None
    held_out = {tuple(p.tolist()) for p in run.eval_prompts}
    prompts = task.PromptStream(cfg.seed + 1, cfg.max_digits, exclude=held_out).next(cfg.rm_samples)
    if beat:
        beat("sampling")
    responses = sample_responses(run, prompts, first_seed=0)
    labels = task.rewards(prompts, responses)
    if len(set(labels.tolist())) < 2:
        right = "right" if labels[0] else "wrong"
        raise OneLabel(f"--reward-model 1: the rule finds all {len(labels)} of the warmed-up "
                       f"policy's samples {right} (--rm-samples {cfg.rm_samples}, after "
                       f"--warmup-steps {cfg.warmup_steps}); the fit needs right and wrong "
                       "answers: draw more samples, or warm up longer (all wrong) or less "
                       "(all right)")
    figures = reward_model.train_reward_model(rm, rm_config(cfg), prompts, responses, labels,
                                              run.device, on_step=beat)
    if beat:
        beat("held-out")
    held = sample_responses(run, run.eval_prompts, first_seed=len(prompts))
    probs = reward_model.score(rm, run.eval_prompts, held)
    agree = reward_model.agreement(probs, task.rewards(run.eval_prompts, held))
    return {**figures, **{f"rm/held_out_{k}": float(v) for k, v in agree.items()}}


class OneLabel(ValueError):
    """The samples of the fit carry one label only."""


def fit_seed(seed, i):
    """The sampling seed of the reward model's i-th sample: a stream of its own (a 3-number key; the
    RL samples' have 4: task.sample_seed)."""
    return int(np.random.SeedSequence([seed, i, 1]).generate_state(1)[0])


def sample_responses(run, prompts, first_seed):
    """The current policy's sampled response to each prompt (seed first_seed + i), every rank
    getting all of them: each rollout replica generates its slice, the writers' slices gathered in
    order. Collective."""
    i, n = run.roles.replica(run.rank), run.roles.replicas
    lo, hi = i * len(prompts) // n, (i + 1) * len(prompts) // n
    seeds = torch.tensor([fit_seed(run.cfg.seed, first_seed + j) for j in range(lo, hi)])
    with fusion.rollout(run.actor):
        mine = run.sampler.fresh()(prompts[lo:hi], seeds).tokens
    everyone = [None] * dist.get_world_size(run.rollout_group)
    mine = [r.cpu() for r in mine] if run.rank in run.roles.writers() else None
    dist.all_gather_object(everyone, mine, group=run.rollout_group)
    return [r for part in everyone if part is not None for r in part]
