# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""Informative prompts: draw where a group of G responses is likely to disagree.

GRPO learns only from a group whose rewards differ: all right or all wrong, its advantages are
zero, and dynamic sampling throws it away. Near the end of a run most prompts are solved, so a run
that draws its prompts blindly generates many groups to keep one. A prompt of pass rate p makes an
informative group with probability 1 - p^G - (1 - p)^G (not all G right, not all G wrong): high in
the middle, near zero at both ends. If prompts come with a difficulty key (here: how many digits to
reverse), that chance can be learned per key from the groups the run scores anyway, and the draw
can go where it is high.

`Curriculum` counts, per key, the groups scored, how many of them were informative, and the
rewards. It estimates each key's informative share directly, not through the formula above. The
prompts of one key differ: half of them solved and half never is a pass rate of 1/2 and no
informative group at all. And a few groups of a key say little about a pass rate near 0 or 1,
where the formula is steepest. A key with few groups leans towards the share over every key
(`prior` groups of it).

`draw(base)` turns the task's own distribution over keys into the one to draw from: base times
each key's share to the `power`, mixed with `explore` spread evenly over the keys. The power
sharpens the draw: late in a run most keys are nearly solved, and only a few, at the frontier of
what the policy can do, still disagree often. The even share keeps every key measured, however
rarely the task draws it: a key that the policy forgets is noticed, and so is a rare one that it
begins to solve. Old counts decay by `decay` at each step, so that the draw follows the policy as
it learns.

Every replica scores other groups, so the counts are summed over the replicas at step boundaries
(`step(reduce)`). Every rank then holds the same counts and draws with the same weights, and a
checkpoint of any rank resumes them exactly.

    python -m pytest tests/test_curriculum.py

Peers: DAPO (dynamic sampling, a cap on generation batches), GRESO (skip prompts whose history
predicts zero variance), curriculum samplers that draw where pass rates are neither 0 nor 1.

Using this file elsewhere: numpy only. Keys are integers in [0, n_keys), and rewards are numbers.
Example (tests/test_copy_alone.py runs it in a folder that holds only this file):

    import numpy as np
    from curriculum import Curriculum

    c = Curriculum(n_keys=3)
    for _ in range(20):  # one step's groups: key 0 always solved, key 1 half the time, key 2 never
        c.observe(0, [1] * 8)
        c.observe(1, [1, 0] * 4)
        c.observe(2, [0] * 8)
    c.step()  # a step boundary (with replicas: c.step(reduce=their all-reduce))
    draw = c.draw(base=np.array([0.6, 0.3, 0.1]))  # the task's own draw over the keys
    print("draw over the keys:", draw.round(3))     # key 1, the informative one, takes most of it
    assert draw.argmax() == 1

Shapes: K difficulty keys, G group size.
"""
import numpy as np

GROUPS, INFORMATIVE, MEAN_REWARD = 0, 1, 2  # the rows of the counts


class Curriculum:
    """Per difficulty key: groups scored, informative ones, mean rewards; decayed once per step."""

    def __init__(self, n_keys, decay=0.9, power=4.0, prior=4.0, explore=0.1):
        if not (n_keys >= 1 and 0 <= decay <= 1 and power > 0 and prior > 0 and 0 <= explore <= 1):
            raise ValueError(f"n_keys={n_keys} must be >= 1, decay={decay} in [0, 1], "
                             f"power={power} > 0, prior={prior} > 0 and explore={explore} "
                             "in [0, 1]")
        self.decay, self.power, self.prior, self.explore = decay, power, prior, explore
        # (3, K): groups, informative groups, and the sum of the groups' mean rewards
        self.counts = np.zeros((3, n_keys))
        self.new = np.zeros((3, n_keys))     # (3, K): this step's, on this replica, not yet summed

    def observe(self, key, rewards):
        """One scored group of prompt difficulty `key`: its G rewards."""
        self.new[GROUPS, key] += 1
        self.new[INFORMATIVE, key] += len(set(rewards)) > 1
        self.new[MEAN_REWARD, key] += float(np.mean(rewards))

    def step(self, reduce=None):
        """A step boundary: this step's counts, summed over the replicas by
        reduce((3, K) array) -> (3, K) array (None: one replica), join the decayed old ones."""
        new = self.new if reduce is None else reduce(self.new)
        self.counts = self.decay * self.counts + new
        self.new = np.zeros_like(self.new)

    def informative(self):
        """(K,) each key's share of informative groups, with `prior` groups at the share over every
        key added: a key seen rarely (or long ago) is taken to be as informative as the others are,
        not more."""
        return self._shrunk(INFORMATIVE)

    def pass_rate(self):
        """(K,) each key's mean reward, estimated the same way."""
        return self._shrunk(MEAN_REWARD)

    def _shrunk(self, row):
        # The share over every key (1/2 before any group).
        overall = (self.counts[row].sum() + 0.5) / (self.counts[GROUPS].sum() + 1)
        return (self.counts[row] + self.prior * overall) / (self.counts[GROUPS] + self.prior)

    def draw(self, base):
        """(K,) the draw over keys, from the task's own draw `base` (K,): base times each key's
        informative share to the power, normalised, mixed with `explore` spread evenly over the keys
        (every key keeps being drawn and measured, however rarely the task draws it)."""
        sharp = base * self.informative() ** self.power
        return (1 - self.explore) * sharp / sharp.sum() + self.explore / len(base)

    def state_dict(self):
        return {"counts": self.counts.tolist(), "new": self.new.tolist()}

    def load_state_dict(self, state):
        self.counts, self.new = np.array(state["counts"]), np.array(state["new"])
