"""grpo.py's math against slow loop references, and task.py's task and reward."""
import dataclasses
import warnings

import numpy as np
import pytest
import torch

import grpo
import task


# --- slow, loop-based references -----------------------------------------------------------

def slow_advantages(rewards, group_size, estimator, eps=1e-6):
    """Each estimator as its paper writes it, one sample at a time."""
    r = [float(x) for x in rewards]
    if estimator == "reinforce++":  # the batch's own mean and (unbiased) std
        mean = sum(r) / len(r)
        std = (sum((x - mean) ** 2 for x in r) / max(len(r) - 1, 1)) ** 0.5
        return torch.tensor([(x - mean) / (std + eps) for x in r])
    out = []
    for g in range(0, len(r), group_size):
        grp = r[g:g + group_size]
        mean = sum(grp) / len(grp)
        std = (sum((x - mean) ** 2 for x in grp) / (len(grp) - 1)) ** 0.5
        for i, x in enumerate(grp):
            if estimator == "grpo":
                out.append((x - mean) / (std + eps))
            elif estimator == "dr-grpo":
                out.append(x - mean)
            else:  # rloo: the mean of the others as the baseline
                out.append(x - sum(grp[:i] + grp[i + 1:]) / (len(grp) - 1))
    return torch.tensor(out)


def slow_grpo_loss(lp, old, ref, adv, mask, clip_eps, kl_coef, loss_agg, clip_high=None, weights=None, norm_len=None):
    import math
    high = clip_eps if clip_high is None else clip_high
    seq_losses, total, n = [], 0.0, 0
    for b in range(lp.shape[0]):
        s, k = 0.0, 0
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            ratio = math.exp(max(-20.0, min(20.0, float(lp[b, t] - old[b, t]))))
            clipped = max(1 - clip_eps, min(1 + high, ratio))
            term = -min(ratio * float(adv[b]), clipped * float(adv[b]))
            if weights is not None:
                term *= float(weights[b, t])
            if ref is not None:
                d = max(-20.0, min(20.0, float(ref[b, t] - lp[b, t])))
                term += kl_coef * (math.exp(d) - d - 1)
            s, k, total, n = s + term, k + 1, total + term, n + 1
        if k:  # a response with no loss token counts in no mean
            seq_losses.append(s / k if loss_agg == "seq-mean-token-mean" else s / (norm_len or 1))
    if loss_agg == "token-mean":
        return total / max(n, 1)
    return sum(seq_losses) / max(len(seq_losses), 1)


REWARDS = torch.tensor([1., 0., 0., 1.,   1., 1., 1., 1.,   0.5, 0., 2., 1.,   0., 0., 0., 0.])  # 4 groups of 4


@pytest.mark.parametrize("estimator", grpo.ESTIMATORS)
def test_advantages_match_loop_reference(estimator):
    got = grpo.group_advantages(REWARDS, 4, estimator)
    if estimator == "reinforce++":  # the group part is the reward itself; the batch part normalises
        assert torch.equal(got, REWARDS)
        got = grpo.batch_normalize(got)
    torch.testing.assert_close(got, slow_advantages(REWARDS, 4, estimator).to(got.dtype))
    if estimator != "reinforce++":
        assert got[4:8].abs().max() == 0 and got[12:].abs().max() == 0  # equal rewards: no signal
    g = torch.Generator().manual_seed(1)
    random = torch.rand(24, generator=g)                                   # random rewards, groups of 3
    want = slow_advantages(random, 3, estimator)
    got = grpo.group_advantages(random, 3, estimator)
    torch.testing.assert_close(grpo.batch_normalize(got) if estimator == "reinforce++" else got, want)


def test_advantages_refuse_ragged_groups_and_a_group_of_one():
    with pytest.raises(ValueError, match="groups of 4"):
        grpo.group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size 1: a group of one has no baseline"):
        grpo.group_advantages(torch.zeros(6), 1)  # an unbiased std of one value is NaN
    assert torch.equal(grpo.group_advantages(torch.arange(3.0), 1, "reinforce++"), torch.arange(3.0))


@pytest.mark.parametrize("estimator", grpo.ESTIMATORS)
def test_an_empty_share_has_no_advantages_and_no_warning(estimator):
    """A replica whose shared-cut share is empty scores no rows: no std of nothing (torch warned of
    degrees of freedom <= 0 in normal runs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grpo.group_advantages(torch.zeros(0), 4, estimator).shape == (0,)
    with pytest.raises(ValueError, match="estimator='ppo'"):
        grpo.group_advantages(torch.zeros(4), 2, "ppo")


def _loss_inputs(seed=0, B=6, L=7):
    g = torch.Generator().manual_seed(seed)
    lp, old, ref = (-torch.rand(B, L, generator=g) * 3 for _ in range(3))
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[0] = False                                       # an empty row: no division by zero, no count
    mask[1] = False
    mask[1, 2] = True                                     # a single-token response
    return lp, old, ref, adv, mask


@pytest.mark.parametrize("loss_agg", grpo.LOSS_AGGS)
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("clip_high", [None, 0.28])
def test_grpo_loss_matches_loop_reference(loss_agg, kl_coef, clip_high):
    lp, old, ref, adv, mask = _loss_inputs()
    norm_len = 9 if loss_agg == "seq-mean-token-sum-norm" else None
    loss, m = grpo.grpo_loss(lp, old, ref, adv, mask, 0.2, kl_coef, loss_agg, clip_eps_high=clip_high,
                             norm_len=norm_len)
    expect = slow_grpo_loss(lp, old, ref, adv, mask, 0.2, kl_coef, loss_agg, clip_high, norm_len=norm_len)
    assert abs(float(loss) - expect) < 1e-5
    ratio = torch.exp(lp - old)[mask]
    a = adv[:, None].expand_as(lp)[mask]
    assert m["ratio_mean"] == pytest.approx(float(ratio.mean()), abs=1e-6)
    clipped = (ratio * a > ratio.clamp(0.8, 1 + (clip_high or 0.2)) * a).float().mean()
    assert m["clip_frac"] == pytest.approx(float(clipped), abs=1e-6) and 0 < m["clip_frac"] < 1
    d = (ref - lp)[mask]
    assert m["k3_mean"] == pytest.approx(float((d.exp() - d - 1).mean()), abs=1e-6)


def test_clip_higher_and_token_weights():
    lp, old, ref, adv, mask = _loss_inputs(seed=3)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(4)) * 2
    loss, _ = grpo.grpo_loss(lp, old, None, adv, mask, 0.2, 0.0, "token-mean", w, clip_eps_high=0.3)
    assert abs(float(loss) - slow_grpo_loss(lp, old, None, adv, mask, 0.2, 0.0, "token-mean", 0.3, w)) < 1e-5
    # a ratio of 1.25 with a positive advantage: clipped at 1.2 symmetric, not at 1.3 with clip-higher
    one = torch.ones(1, 1, dtype=torch.bool)
    up = torch.log(torch.tensor([[1.25]]))
    sym, _ = grpo.grpo_loss(up, torch.zeros(1, 1), None, torch.ones(1), one, 0.2)
    high, _ = grpo.grpo_loss(up, torch.zeros(1, 1), None, torch.ones(1), one, 0.2, clip_eps_high=0.3)
    assert float(sym) == pytest.approx(-1.2) and float(high) == pytest.approx(-1.25)


def test_seq_mean_counts_only_responses_with_a_loss_token():
    """A response with no loss token (a truncated one, masked) is in no per-sequence mean (as verl's
    agg_loss): two rows, one empty, give the other row's mean, not half of it."""
    per = torch.tensor([[2.0, 4.0], [5.0, 5.0]])
    mask = torch.tensor([[True, True], [False, False]])
    assert float(grpo.aggregate(per, mask, "seq-mean-token-mean")) == 3.0
    assert float(grpo.aggregate(per, mask, "seq-mean-token-sum-norm", norm_len=4)) == 1.5
    assert float(grpo.aggregate(per, mask, "token-mean")) == 3.0
    with pytest.raises(ValueError, match="norm_len >= 1"):
        grpo.aggregate(per, mask, "seq-mean-token-sum-norm")


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
    drawn = warm.next(3000) + [rl(slot, attempt) for slot in range(1500) for attempt in range(2)]
    assert not any(tuple(p.tolist()) in held for p in drawn)
    plain = task.PromptStream(np.random.SeedSequence(seed).spawn(2)[1], max_digits).next(3000)
    assert sum(tuple(p.tolist()) in held for p in plain) > 10  # without the exclusion they overlap (~1%)
    again = task.prompt_streams(seed, max_digits, n_eval)[2]  # the same prompts on every rank and every run
    assert all(torch.equal(again(slot, attempt), rl(slot, attempt)) for slot in range(100) for attempt in range(2))


# --- the update ------------------------------------------------------------------------------

class TinyLM(torch.nn.Module):
    """A bigram model: enough for grpo_update's forward and backward."""

    def __init__(self, vocab=8):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab)

    def forward(self, tokens):
        return self.out(self.embed(tokens))


def _samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 8, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g) for _ in range(n)]
    responses = [torch.randint(2, 8, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g) for _ in range(n)]
    old = [-torch.rand(len(r), generator=g) for r in responses]
    return grpo.Samples(prompts, responses, old, torch.randn(n, generator=g))


def _update(samples, **cfg):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sums = grpo.grpo_update(model, opt, samples, grpo.GRPOConfig(**cfg), "cpu")
    return torch.cat([p.detach().flatten() for p in model.parameters()]), grpo.batch_means(sums)


def test_inputs_that_arrive_per_micro_batch_train_as_complete_ones():
    """arrive(rows) is called once per micro-batch, in the order of Samples.order, before its forward; filling the
    advantages and reference log-probs there trains to the parameters of complete inputs."""
    full = _samples(n=8)
    ref = [lp - 0.1 for lp in full.old_logprobs]
    order = [5, 1, 7, 0, 3, 6, 2, 4]  # e.g. when each row's inputs were put

    expected = _update_with(dataclasses.replace(full, order=order), list(ref), None)
    samples = dataclasses.replace(full, advantages=torch.full((8,), float("nan")), order=order)
    filled, calls = [None] * 8, []

    def arrive(rows):
        calls.append(list(rows))
        for i in rows:
            filled[i], samples.advantages[i] = ref[i], full.advantages[i]
    got = _update_with(samples, filled, arrive)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert calls == [[3, 1], [6, 4], [7, 0], [5, 2]]  # rows sorted by order, 4 micro-batches


def _update_with(samples, ref_logprobs, arrive):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grpo.grpo_update(model, opt, samples, grpo.GRPOConfig(kl_coef=0.1), "cpu", ref_logprobs=ref_logprobs,
                     arrive=arrive)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_mask_truncated_equals_leaving_the_rows_out(loss_agg):
    s = _samples()
    s.truncated = [False, True, False, False, True, False]
    kept = [i for i, t in enumerate(s.truncated) if not t]
    without = grpo.Samples([s.prompts[i] for i in kept], [s.responses[i] for i in kept],
                           [s.old_logprobs[i] for i in kept], s.advantages[kept])
    masked, m1 = _update(s, mask_truncated=True, loss_agg=loss_agg, micro_batches=1)
    left_out, m2 = _update(without, loss_agg=loss_agg, micro_batches=1)
    torch.testing.assert_close(masked, left_out)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    plain, _ = _update(s, loss_agg=loss_agg, micro_batches=1)
    assert not torch.allclose(plain, left_out)  # without the mask the truncated rows do count


def test_update_logs_entropy_and_the_rollout_gap():
    s = _samples()
    _, m = _update(s)
    assert 0 < m["entropy"] < torch.log(torch.tensor(8.0))  # per token, at most log V
    gap = [(lp - b).abs() for lp, b in zip(grpo.chunk_logprobs(TinyLM(), s, grpo.GRPOConfig(), "cpu"), s.old_logprobs)]
    assert m["rollout/logprob_gap_max"] == pytest.approx(float(torch.cat(gap).max()), rel=1e-5)
    assert m["rollout/logprob_gap_mean"] == pytest.approx(float(torch.cat(gap).mean()), rel=1e-5)


def test_tis_cap_weights_tokens_by_the_capped_ratio_to_the_behaviour():
    """tis_cap: old log-probs are the current weights' (recomputed), each token weighted by
    min(pi_train / pi_rollout, C). With C huge it is the decoupled objective; with behaviour equal to
    the current policy every weight is 1 and the update is the plain one."""
    s = _samples()
    on_policy = grpo.Samples(s.prompts, s.responses, grpo.chunk_logprobs(TinyLM(), s, grpo.GRPOConfig(), "cpu"),
                             s.advantages)
    plain, _ = _update(on_policy)
    capped, _ = _update(on_policy, tis_cap=2.0)
    torch.testing.assert_close(plain, capped)
    uncapped, _ = _update(s, decoupled=True)
    huge, _ = _update(s, tis_cap=1e9)
    assert torch.equal(uncapped, huge)
    small, _ = _update(s, tis_cap=0.5)
    assert not torch.allclose(small, huge)


def _batch_normalize(rank, world, values):
    return grpo.batch_normalize(values.chunk(world)[rank], "cpu", None)


def test_batch_normalize_over_ranks_is_the_whole_batch_normalised():
    from tests.distributed import run_distributed
    v = torch.rand(10, generator=torch.Generator().manual_seed(2))
    parts = run_distributed(_batch_normalize, world_size=2, args=(v,))
    torch.testing.assert_close(torch.cat(parts), grpo.batch_normalize(v))
    torch.testing.assert_close(grpo.batch_normalize(v), (v - v.mean()) / (v.std() + 1e-6))


def test_a_non_finite_gradient_skips_the_step_and_leaves_the_weights():
    s = _samples()
    model = TinyLM()
    start = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    s.advantages[2] = float("nan")
    sums = grpo.grpo_update(model, opt, s, grpo.GRPOConfig(micro_batches=1), "cpu")
    assert sums["skipped_max"] == 1 and grpo.batch_means(sums)["train/skipped_updates"] == 1
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), start)
    assert not opt.state  # the optimizer never stepped: no moments built from the bad gradient
    s.advantages[2] = 0.5
    sums = grpo.grpo_update(model, opt, s, grpo.GRPOConfig(micro_batches=1), "cpu")
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert sums["skipped_max"] == 0 and not torch.equal(after, start)


def _nan_on_rank_1(rank, world):
    s = _samples(seed=rank)
    if rank == 1:
        s.advantages[0] = float("inf")
    model = TinyLM()
    start = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    sums = grpo.grpo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-2), s,
                            grpo.GRPOConfig(micro_batches=1), "cpu")
    return sums["skipped_max"], torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), start)


def test_every_rank_skips_when_one_rank_sees_a_non_finite_gradient():
    """A plain model (no FSDP): only rank 1's gradient is bad, and still both ranks skip the same step."""
    from tests.distributed import run_distributed
    assert run_distributed(_nan_on_rank_1, world_size=2) == [(1, True), (1, True)]
