# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""The task: reverse a string of digits. Prompts, answers, reward, held-out set, prompt streams.

    BOS 3 1 4 =   ->   4 1 3 EOS

The string length k is round(lognormal(2.0, 0.6)) clipped to [1, max_digits], so answers run from
2 to max_digits + 1 tokens with a long tail (median about 8): the tail that the staleness and
packing mechanisms are measured on. The reward is a rule, exact match: 1 or 0. Another task with a
verifiable reward replaces this file, keeping what the run (train_grpo.py and plumbing/) uses:
`VOCAB`, `PAD`, `EOS`, the reward (`score`, `rewards`), `answer` (for the supervised warm-up), the
prompts (`prompt_streams`, `held_out`, `n_possible_prompts`), and for the RL prompts `SlotPrompts`,
`sample_seed` and `difficulty`. Five places outside it assume digit strings too: --max-digits sizes
the prompts, the response budget's floor and the curriculum's keys (plumbing/config.py,
plumbing/run.py), a checkpoint checks it (plumbing/checkpoint.py's SHAPE_FIELDS), the held-out
figures count by digits (plumbing/evaluation.py), and so does the log's prompt_digits
(plumbing/runlog.py).

A prompt's difficulty key is its digit count k, less one (keys start at 0). The RL prompts are
drawn by global batch slot and attempt (`SlotPrompts`, a pure function of the seed, the slot, the
attempt and the draw over lengths in force), so that every deployment draws the same prompt for the
same slot. The draw picks k from the task's length distribution, or the caller's draw made from it
(curriculum.py), then the digits.

The held-out set is a fixed draw of prompts (its own seed, whatever --seed says), scored greedily.
The training streams redraw any prompt that is in it, so that the held-out accuracy measures
prompts the policy never trained on.

    python -c "import task; print(task.prompt_streams(seed=0, max_digits=32, n_eval=4)[0])"

Shapes: P_i prompt length (k + 2), n_i response length.
"""
import math

import numpy as np
import torch

# Tokens: padding, end of answer, start of prompt, "=" (end of prompt), then the digits 0-9.
PAD, EOS, BOS, SEP, DIGIT0 = 0, 1, 2, 3, 4
VOCAB = DIGIT0 + 10

EVAL_SEED = 20261129  # the held-out prompts' own stream: fixed, whatever --seed says
# A prompt's digit count: round(lognormal(MU, SIGMA)), clipped to [1, max_digits].
MU, SIGMA = 2.0, 0.6


def make_prompts(rng, n, max_digits, mu=MU, sigma=SIGMA):
    """n prompts [BOS, d_1..d_k, "="], k = round(lognormal(mu, sigma)) clipped to
    [1, max_digits]."""
    ks = np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, max_digits).astype(int)
    return [prompt_of_length(rng, k) for k in ks]  # n x (P_i,)


def prompt_of_length(rng, k):
    return torch.tensor([BOS, *(DIGIT0 + rng.integers(0, 10, size=k)), SEP])  # (k + 2,)


def difficulty(prompt):
    """The prompt's difficulty key: its digit count minus one, in [0, max_digits)."""
    return len(prompt) - 3


def length_distribution(max_digits, mu=MU, sigma=SIGMA):
    """(max_digits,) the chance of each digit count 1..max_digits under make_prompts:
    round(lognormal(mu, sigma)) clipped, i.e. the lognormal's mass over [k - 1/2, k + 1/2), the ends
    taking the tails."""
    def cdf(x):
        return 0.0 if x <= 0 else 0.5 * (1 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2))))
    edges = [cdf(k + 0.5) for k in range(1, max_digits)]  # P(X < k + 1/2), k < max_digits
    return np.diff([0.0, *edges, 1.0])


def answer(prompt):
    """The reference response (n_i,): the digits reversed, then EOS."""
    return torch.cat([prompt[1:-1].flip(0), torch.tensor([EOS])])


def score(prompt, response):
    """The reward: 1.0 if the response is exactly the reversed digits followed by EOS, else 0.0."""
    return float(torch.equal(response, answer(prompt)))


def rewards(prompts, responses):
    """score for each (prompt, response): (B,)."""
    return torch.tensor([score(p, r) for p, r in zip(prompts, responses)])


class PromptStream:
    """An endless, seeded stream of prompts: every rank that draws from the same seed gets the same
    global batches. exclude: prompts (tuples of tokens) that are redrawn whenever drawn."""

    def __init__(self, seed, max_digits, exclude=frozenset()):
        self.rng = np.random.default_rng(seed)
        self.max_digits = max_digits
        self.exclude = exclude

    def next(self, n):
        out, tries = [], 0
        while len(out) < n:
            tries += n - len(out)
            if tries > 1000 * n + 10**5:
                raise RuntimeError(f"{tries} draws gave only {len(out)} of {n} prompts outside the "
                                   "held-out set")
            out += [p for p in make_prompts(self.rng, n - len(out), self.max_digits)
                    if tuple(p.tolist()) not in self.exclude]
        return out

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["rng"]


class SlotPrompts:
    """The RL prompt of a global batch slot and attempt (StaleSync's prompt_fn, once the caller
    maps its local slots to global ones). It is drawn from a generator seeded by (seed, slot,
    attempt), and redrawn while it is a held-out prompt. The digit count k comes from
    draw(length_distribution), the caller's (max_digits,) distribution made from the task's own
    (None: the task's own). The same slot gives the same prompt on every rank, in every deployment,
    as long as draw() agrees. It holds no state of its own."""

    def __init__(self, seed, max_digits, exclude=frozenset(), draw=None):
        self.seed, self.exclude, self.draw = seed, exclude, draw
        self.lengths = length_distribution(max_digits)                            # (max_digits,)

    def __call__(self, slot, attempt):
        rng = np.random.default_rng([self.seed, slot, attempt])
        p = self.lengths if self.draw is None else self.draw(self.lengths)
        for _ in range(1000):
            prompt = prompt_of_length(rng, 1 + int(rng.choice(len(p), p=p / p.sum())))
            if tuple(prompt.tolist()) not in self.exclude:
                return prompt
        raise RuntimeError(f"slot {slot}, attempt {attempt}: 1000 draws gave only held-out prompts")


def sample_seed(seed, slot, attempt, member):
    """The sampling seed of member j of the group in global batch slot `slot`, attempt `attempt`:
    the same in every deployment and world size, so every layout samples the same responses."""
    return int(np.random.SeedSequence([seed, slot, attempt, member]).generate_state(1)[0])


def held_out(max_digits, n_eval):
    """The held-out prompts: a fixed draw of n_eval, and the set of distinct ones (as tuples)."""
    prompts = PromptStream(EVAL_SEED, max_digits).next(n_eval)
    return prompts, {tuple(p.tolist()) for p in prompts}


def n_possible_prompts(max_digits):
    """How many distinct prompts exist: strings of 1 to max_digits digits."""
    return sum(10 ** k for k in range(1, max_digits + 1))


def prompt_streams(seed, max_digits, n_eval, draw=None):
    """(held-out prompts, warm-up stream, RL prompts by slot): the training prompts are never
    held-out ones."""
    eval_prompts, exclude = held_out(max_digits, n_eval)
    warm, rl = np.random.SeedSequence(seed).spawn(2)
    rl_seed = int(rl.generate_state(1)[0])
    warm_stream = PromptStream(warm, max_digits, exclude)
    rl_prompts = SlotPrompts(rl_seed, max_digits, exclude, draw)
    return eval_prompts, warm_stream, rl_prompts
