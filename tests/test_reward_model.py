"""reward_model.py: an outcome reward model learns the task's rule from labelled samples and agrees with it on
held-out ones; its training is deterministic; it is frozen after; bad settings and rows are refused by name."""
import numpy as np
import pytest
import torch

import task
from reward_model import RMConfig, RewardModel, agreement, class_weights, pack, score, train_reward_model


def _samples(n, seed):
    """n (prompt, response, label) of 1 to 6 digits: half the exact answer, half corrupted (two digits swapped,
    a digit dropped, or the EOS missing), labelled by task.score."""
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    for i in range(n):
        p = task.prompt_of_length(rng, int(rng.integers(2, 7)))
        r = task.answer(p)
        kind = i % 6
        if kind == 3:
            r = torch.cat([r[1:2], r[0:1], r[2:]])  # two digits swapped (may equal the answer: the label says)
        elif kind == 4:
            r = torch.cat([r[:1], r[2:]])           # a digit dropped
        elif kind == 5:
            r = r[:-1]                              # no EOS
        prompts.append(p)
        responses.append(r)
    labels = torch.tensor([task.score(p, r) for p, r in zip(prompts, responses)])
    return prompts, responses, labels


CFG = dict(vocab_size=task.VOCAB, max_len=20, d_model=32, n_layers=2, n_heads=4, steps=400, batch=64, lr=3e-3)


def _fit(seed=0):
    torch.manual_seed(0)
    cfg = RMConfig(**CFG, seed=seed)
    model = RewardModel(cfg)
    figures = train_reward_model(model, cfg, *_samples(1024, seed=1), device="cpu")
    return model, figures


def test_it_learns_the_rule_and_agrees_on_held_out_samples():
    torch.set_num_threads(1)
    model, figures = _fit()
    prompts, responses, labels = _samples(512, seed=2)
    held = agreement(score(model, prompts, responses), labels)
    assert held["accuracy"] >= 0.95, (held, figures)
    assert held["true_positive_rate"] >= 0.9 and held["true_negative_rate"] >= 0.9, held
    assert held["n"] == 512 and 0 < held["positive_share"] < 1
    assert figures["rm/train_agreement"] >= 0.95 and figures["rm/seconds"] > 0
    assert not any(p.requires_grad for p in model.parameters()) and not model.training  # frozen
    probs = score(model, prompts[:7], responses[:7])
    assert probs.shape == (7,) and ((0 <= probs) & (probs <= 1)).all()
    model_again, _ = _fit()  # the same inputs and seed: bit-identical weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model_again.state_dict().values()))


def test_pack_and_class_weights():
    tokens, lengths, starts = pack([torch.tensor([2, 4, 3]), torch.tensor([2, 5, 6, 3, 7])],
                                   [torch.tensor([4, 1]), torch.tensor([6])], pad=0)
    assert tokens.tolist() == [[2, 4, 3, 4, 1, 0], [2, 5, 6, 3, 7, 6]] and lengths.tolist() == [5, 6]
    assert starts.tolist() == [3, 5]  # where each response begins
    w = class_weights(torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert w[:3].sum() == pytest.approx(w[3])  # each class weighs half
    with pytest.raises(ValueError, match="every label is 1"):
        class_weights(torch.ones(4))


@pytest.mark.parametrize("bad, match", [(dict(d_model=30), "d_model=30 must be divisible by n_heads=4"),
                                        (dict(steps=0), "steps=0"), (dict(lr=float("nan")), "lr=nan"),
                                        (dict(pad=99), "pad=99")])
def test_bad_settings_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        RMConfig(**dict(CFG, **bad))


def test_a_row_longer_than_the_model_reads_is_refused():
    model = RewardModel(RMConfig(**CFG))
    with pytest.raises(ValueError, match="longer than max_len=20"):
        score(model, [torch.full((15,), 4)], [torch.full((6,), 5)])
