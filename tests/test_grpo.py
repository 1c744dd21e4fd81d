"""grpo.py's math against slow loop references, and task.py's task and reward."""
import numpy as np
import pytest
import torch

import grpo
import task


# --- slow, loop-based references -----------------------------------------------------------

def slow_group_advantages(rewards, group_size, eps, scale_by_std):
    out = []
    for g in range(0, len(rewards), group_size):
        grp = [float(r) for r in rewards[g:g + group_size]]
        mean = sum(grp) / len(grp)
        std = (sum((r - mean) ** 2 for r in grp) / (len(grp) - 1)) ** 0.5
        out += [(r - mean) / (std + eps) if scale_by_std else r - mean for r in grp]
    return torch.tensor(out)


def slow_grpo_loss(lp, old, ref, adv, mask, clip_eps, kl_coef, loss_agg):
    import math
    seq_losses, total, n = [], 0.0, 0
    for b in range(lp.shape[0]):
        s, k = 0.0, 0
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            ratio = math.exp(max(-20.0, min(20.0, float(lp[b, t] - old[b, t]))))
            clipped = max(1 - clip_eps, min(1 + clip_eps, ratio))
            term = -min(ratio * float(adv[b]), clipped * float(adv[b]))
            d = max(-20.0, min(20.0, float(ref[b, t] - lp[b, t])))
            term += kl_coef * (math.exp(d) - d - 1)
            s, k, total, n = s + term, k + 1, total + term, n + 1
        seq_losses.append(s / max(k, 1))
    return total / n if loss_agg == "token-mean" else sum(seq_losses) / len(seq_losses)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_group_advantages_match_loop_reference(scale_by_std):
    rewards = torch.tensor([1., 0., 0., 1., 1., 1., 1., 1., 0.5, 0., 2., 1.])
    got = grpo.group_advantages(rewards, 4, eps=1e-6, scale_by_std=scale_by_std)
    torch.testing.assert_close(got, slow_group_advantages(rewards, 4, 1e-6, scale_by_std))
    assert got[4:8].abs().max() == 0                     # a group of equal rewards has no signal


def test_group_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        grpo.group_advantages(torch.zeros(6), 4)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_grpo_loss_matches_loop_reference(loss_agg, kl_coef):
    g = torch.Generator().manual_seed(0)
    B, L = 5, 7
    lp, old, ref = (-torch.rand(B, L, generator=g) * 3 for _ in range(3))
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[0] = False                                       # an empty row must not divide by zero
    loss, m = grpo.grpo_loss(lp, old, ref, adv, mask, 0.2, kl_coef, loss_agg)
    expect = slow_grpo_loss(lp, old, ref, adv, mask, 0.2, kl_coef, "token-mean" if loss_agg == "token-mean" else "seq")
    assert abs(float(loss) - expect) < 1e-5
    ratio = torch.exp(lp - old)[mask]
    a = adv[:, None].expand(B, L)[mask]
    assert m["ratio_mean"] == pytest.approx(float(ratio.mean()), abs=1e-6)
    clipped = (ratio * a > ratio.clamp(0.8, 1.2) * a).float().mean()
    assert m["clip_frac"] == pytest.approx(float(clipped), abs=1e-6) and 0 < m["clip_frac"] < 1
    d = (ref - lp)[mask]
    assert m["k3_mean"] == pytest.approx(float((d.exp() - d - 1).mean()), abs=1e-6)


def test_grpo_loss_gradient_is_the_policy_gradient_on_policy():
    # At ratio 1 with no KL, d loss / d logprob = -A / n_tokens for every unmasked token.
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss, _ = grpo.grpo_loss(lp, lp.detach(), None, torch.tensor([2.0, -1.0]), mask)
    loss.backward()
    expect = torch.tensor([[-2 / 3, -2 / 3, 0], [1 / 3, 0, 0]])
    torch.testing.assert_close(lp.grad, expect)


def test_off_policy_logprobs():
    beh, prox = torch.log(torch.tensor([[0.5, 0.2]])), torch.log(torch.tensor([[0.25, 0.4]]))
    old, w = grpo.off_policy_logprobs(beh, prox)
    assert old is beh and w is None
    old, w = grpo.off_policy_logprobs(beh, prox, decoupled=True, max_weight=1.5)
    assert old is prox and torch.allclose(w, torch.tensor([[0.5, 1.5]]))
    with pytest.raises(ValueError, match="proximal"):
        grpo.off_policy_logprobs(beh, decoupled=True)


def test_score_and_answer():
    prompt = torch.tensor([task.BOS, task.DIGIT0 + 1, task.DIGIT0 + 2, task.DIGIT0 + 3, task.SEP])
    right = torch.tensor([task.DIGIT0 + 3, task.DIGIT0 + 2, task.DIGIT0 + 1, task.EOS])
    assert task.score(prompt, right) == 1.0
    assert task.score(prompt, right[:-1]) == 0.0             # no EOS: wrong
    assert task.score(prompt, torch.cat([right[:2], right[3:]])) == 0.0


def test_task_has_a_long_tail():
    lengths = np.array([len(task.answer(p)) for p in task.make_prompts(np.random.default_rng(0), 4000, 32)])
    assert np.median(lengths) <= 9 and np.percentile(lengths, 99) >= 3 * np.median(lengths)


def test_training_prompts_are_never_held_out_ones():
    seed, max_digits, n_eval = 0, 32, 512
    eval_prompts, warm, rl = task.prompt_streams(seed, max_digits, n_eval)
    held = {tuple(p.tolist()) for p in eval_prompts}
    drawn = warm.next(3000) + rl.next(3000)
    assert not any(tuple(p.tolist()) in held for p in drawn)
    plain = task.PromptStream(np.random.SeedSequence(seed).spawn(2)[1], max_digits).next(3000)
    assert sum(tuple(p.tolist()) in held for p in plain) > 10  # without the exclusion they overlap (~1%)
    again = task.prompt_streams(seed, max_digits, n_eval)[2]  # the same stream on every rank and every run
    assert all(torch.equal(a, b) for a, b in zip(again.next(3000), drawn[3000:]))
