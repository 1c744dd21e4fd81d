"""curriculum.py's informative shares and draw weights, and task.py's prompts by slot that they weight."""
import io

import numpy as np
import pytest
import torch

import task
from curriculum import Curriculum


def test_the_draw_follows_the_share_of_informative_groups_per_key():
    c = Curriculum(n_keys=3, decay=0.5, power=2.0, prior=1.0, explore=0.2)
    for _ in range(3):
        c.observe(0, [1, 1, 1, 1])       # key 0: solved, never informative
    c.observe(1, [1, 0, 1, 0])           # key 1: informative
    c.observe(1, [0, 0, 0, 0])           # and not
    c.step()
    overall = 1.5 / 6                    # (informative + 1/2) / (groups + 1), over every key
    shares = [overall / 4, (1 + overall) / 3, overall]  # one group at the overall share added; key 2 unseen
    assert c.informative().tolist() == pytest.approx(shares)
    mean = (3.5 + 0.5) / 6               # the mean rewards summed, over every key
    assert c.pass_rate().tolist() == pytest.approx([(3 + mean) / 4, (0.5 + mean) / 3, mean])
    base = np.array([0.5, 0.3, 0.2])     # the task's own draw
    sharp = base * np.array(shares) ** 2
    assert c.draw(base).tolist() == pytest.approx((0.8 * sharp / sharp.sum() + 0.2 / 3).tolist())
    for _ in range(100):                 # very sure it is solved: drawn only through the exploring share
        c.observe(0, [1, 1, 1, 1])
    c.step()
    assert c.draw(base)[0] == pytest.approx(0.2 / 3, rel=0.05)  # an even share of it, whatever base says


def test_a_key_whose_prompts_are_half_solved_half_never_is_not_informative():
    """Pass rate 1/2, as a key, yet no group disagrees: the share of informative groups sees it."""
    c = Curriculum(n_keys=1, prior=1.0)
    for i in range(20):
        c.observe(0, [i % 2] * 8)
    c.step()
    assert c.pass_rate()[0] == pytest.approx(0.5) and c.informative()[0] < 0.03


def test_old_counts_decay_and_replicas_are_summed():
    c = Curriculum(n_keys=2, decay=0.5)
    c.observe(1, [0, 0])
    c.step()
    c.observe(1, [1, 0])
    other = np.array([[0.0, 2.0], [0.0, 1.0], [0.0, 1.5]])  # the other replica's groups this step: key 1
    c.step(reduce=lambda new: new + other)
    assert c.counts.tolist() == [[0.0, 0.5 * 1 + 1 + 2], [0.0, 0.5 * 0 + 1 + 1], [0.0, 0.5 * 0 + 0.5 + 1.5]]
    assert not c.new.any()


def test_state_dict_round_trip_is_exact_and_plain_data():
    c = Curriculum(n_keys=4)
    for k in range(4):
        c.observe(k, [1, 0, 0, 1, 1, 1, 0, 1][:k + 2])
    c.step()
    c.observe(2, [1, 1])  # scored but not yet summed
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    buf.seek(0)
    back = Curriculum(n_keys=4)
    back.load_state_dict(torch.load(buf, weights_only=True))
    assert np.array_equal(back.counts, c.counts) and np.array_equal(back.new, c.new)
    assert np.array_equal(back.draw(np.ones(4)), c.draw(np.ones(4)))


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="explore=1.5 in \\[0, 1\\]"):
        Curriculum(n_keys=3, explore=1.5)


def test_the_length_distribution_is_the_one_make_prompts_draws():
    rng = np.random.default_rng(0)
    ks = [len(p) - 2 for p in task.make_prompts(rng, 50_000, max_digits=12)]
    seen = np.bincount(ks, minlength=13)[1:] / len(ks)
    assert np.abs(seen - task.length_distribution(12)).max() < 0.01 and task.length_distribution(12).sum() == 1


def test_a_slot_prompt_is_a_function_of_slot_attempt_and_the_draw():
    _, exclude = task.held_out(3, 64)
    prompts = task.SlotPrompts(seed=7, max_digits=3, exclude=exclude)
    assert torch.equal(prompts(5, 0), prompts(5, 0)) and not torch.equal(prompts(5, 0), prompts(5, 1))
    draws = [prompts(slot, 0) for slot in range(400)]
    assert all(tuple(p.tolist()) not in exclude for p in draws)  # never a held-out prompt
    assert {task.difficulty(p) for p in draws} >= {1, 2}         # keys: digit count - 1 (1 digit is rare)
    only_three = lambda base: np.array([0.0, 0.0, 1.0])  # noqa: E731  a draw with all its mass on 3 digits
    weighted = task.SlotPrompts(seed=7, max_digits=3, exclude=exclude, draw=only_three)
    assert all(len(weighted(slot, 0)) == 5 for slot in range(50))
