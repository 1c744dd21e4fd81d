# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""The task: reverse a string of digits. Prompts, answers, the reward, the held-out set, prompt streams.

    BOS 3 1 4 =   ->   4 1 3 EOS

The string length k is round(lognormal(2.0, 0.6)) clipped to [1, max_digits], so answers run from 2
to max_digits + 1 tokens with a long tail (median about 8): the tail that the staleness and packing
mechanisms are measured on. The reward is a rule, exact match: 1 or 0. Swapping the task for another
one with a verifiable reward means swapping this file: train_grpo.py uses `VOCAB`, `PAD`, `EOS`,
`score`, `answer` (for the supervised warm-up), `prompt_streams` and `ReplicaPrompts`.

The held-out set is a fixed draw of prompts (its own seed, whatever --seed says), scored greedily; the
training streams redraw any prompt that is in it, so that the held-out accuracy measures prompts the
policy never trained on.

    python -c "import task; print(task.prompt_streams(seed=0, max_digits=32, n_eval=4)[0])"

Shapes: P_i prompt length (k + 2), n_i response length.
"""
import numpy as np
import torch

# Tokens: padding, end of answer, start of prompt, "=" (end of prompt), then the digits 0-9.
PAD, EOS, BOS, SEP, DIGIT0 = 0, 1, 2, 3, 4
VOCAB = DIGIT0 + 10

EVAL_SEED = 20261129  # the held-out prompts' own stream: fixed, whatever --seed says


def make_prompts(rng, n, max_digits, mu=2.0, sigma=0.6):
    """n prompts [BOS, d_1..d_k, "="], k = round(lognormal(mu, sigma)) clipped to [1, max_digits]."""
    ks = np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, max_digits).astype(int)
    return [torch.tensor([BOS, *(DIGIT0 + rng.integers(0, 10, size=k)), SEP]) for k in ks]  # n x (P_i,)


def answer(prompt):
    """The reference response (n_i,): the digits reversed, then EOS."""
    return torch.cat([prompt[1:-1].flip(0), torch.tensor([EOS])])


def score(prompt, response):
    """The reward: 1.0 if the response is exactly the reversed digits followed by EOS, else 0.0."""
    return float(torch.equal(response, answer(prompt)))


class PromptStream:
    """An endless, seeded stream of prompts: every rank that draws from the same seed gets the same
    global batches. exclude: prompts (tuples of tokens) that are redrawn whenever drawn."""

    def __init__(self, seed, max_digits, exclude=frozenset()):
        self.rng = np.random.default_rng(seed)
        self.max_digits = max_digits
        self.exclude = exclude
        self.drawn = 0  # prompts given so far: how far along the stream is (a resume at another world size)

    def next(self, n):
        self.drawn += n
        out, tries = [], 0
        while len(out) < n:
            tries += n - len(out)
            if tries > 1000 * n + 10**5:
                raise RuntimeError(f"{tries} draws gave only {len(out)} of {n} prompts outside the held-out set")
            out += [p for p in make_prompts(self.rng, n - len(out), self.max_digits)
                    if tuple(p.tolist()) not in self.exclude]
        return out

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state, "drawn": self.drawn}

    def load_state_dict(self, state):
        self.rng.bit_generator.state, self.drawn = state["rng"], state["drawn"]


class ReplicaPrompts:
    """StaleSync's prompt_fn: this replica's slice of each global batch of prompts, one at a time."""

    def __init__(self, stream, per_step, replica, replicas):
        self.stream, self.per_step = stream, per_step
        self.first, self.n = replica * per_step // replicas, per_step // replicas
        self.buffer = []

    def __call__(self):
        if not self.buffer:
            self.buffer = self.stream.next(self.per_step)[self.first:self.first + self.n]
        return self.buffer.pop(0)

    def state_dict(self):
        """The prompts drawn and not yet given out (the stream itself is saved on its own)."""
        return {"buffer": [p.clone() for p in self.buffer]}

    def load_state_dict(self, state):
        self.buffer = list(state["buffer"])


def held_out(max_digits, n_eval):
    """The held-out prompts: a fixed draw of n_eval, and the set of distinct ones (as tuples)."""
    prompts = PromptStream(EVAL_SEED, max_digits).next(n_eval)
    return prompts, {tuple(p.tolist()) for p in prompts}


def n_possible_prompts(max_digits):
    """How many distinct prompts exist: strings of 1 to max_digits digits."""
    return sum(10 ** k for k in range(1, max_digits + 1))


def prompt_streams(seed, max_digits, n_eval):
    """(held-out prompts, warm-up stream, RL stream): the training streams never give a held-out prompt."""
    eval_prompts, exclude = held_out(max_digits, n_eval)
    warm, rl = np.random.SeedSequence(seed).spawn(2)
    return eval_prompts, PromptStream(warm, max_digits, exclude), PromptStream(rl, max_digits, exclude)
