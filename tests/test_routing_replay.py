"""options/routing_replay.py: the engine records each response token's experts, a prefix read again keeps
them, and training replays them (or measures how often its own routing differs)."""
import io

import numpy as np
import pytest
import torch

import grpo
import task
from grpo import GRPOConfig, Samples, chunk_logprobs
from model import ModelConfig, Policy, Sampler
from options.routing_replay import (Around, RecordRoutes, means, moe_layers, routing, sampler_class,
                                    scheduler_class)
from stalesync import StaleConfig, StaleSync
from tests.test_model import EOS, _contexts, _model
from tests.test_stalesync import ScriptedSampler, _lengths

Recording = sampler_class(Sampler)
PerTokenSync = scheduler_class(StaleSync)  # StaleSync keeping the sampler's per-token fields with the samples


def _free_routes(model, seq):
    """The experts each token of seq (T,) picks per MoE layer in a forward that routes freely: (T, L, K), as sets."""
    hooks = [RecordRoutes() for _ in moe_layers(model)]
    with torch.no_grad(), routing(model, hooks):
        model(seq[None, :])
    return torch.stack([h.chosen for h in hooks], 1).sort(-1).values


def test_a_prefix_read_again_under_new_weights_keeps_its_recorded_routes():
    """The recording sampler keeps each row's recorded experts per seed through reset(): under new weights, the
    prefill that reads a cut row's context again routes its response tokens with them (prompt tokens freely), so the
    continued tokens' log-probs are those of a training forward that replays the record, not of free routing. The
    record survives a state_dict round trip (a resumed sampler continues the same) and leaves with a finished row."""
    model, ctxs, seeds = _model(), _contexts([3, 9, 5]), torch.tensor([4, 5, 6])
    sampler = Recording(model, 14, eos_id=None)  # no EOS: every row is cut, then runs to its budget
    first = sampler(ctxs, seeds, max_steps=4)
    assert not any(first.done) and all((r >= 0).all() for r in first.per_token["routes"])  # keep=True: all read
    sampler.reset()  # new weights are coming: the cache goes, the record stays
    buf = io.BytesIO()
    torch.save(sampler.state_dict(), buf)
    resumed = Recording(model, 14, eos_id=None)
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert resumed.recorded.keys() == {4, 5, 6} and all(
        torch.equal(resumed.recorded[s][1], r) for s, r in zip([4, 5, 6], first.per_token["routes"]))
    with torch.no_grad():  # new weights: every router's preferences reversed
        for block in model.blocks:
            block.moe.router.weight.mul_(-1.0)
    ctxs2 = [torch.cat([c, t]) for c, t in zip(ctxs, first.tokens)]
    free = [_free_routes(model, c)[len(c) - 4:] for c in ctxs2]  # what a free prefill would pick for the response
    assert any(not torch.equal(f, r.sort(-1).values) for f, r in zip(free, first.per_token["routes"]))
    rest, again = sampler(ctxs2, seeds, n_done=[4, 4, 4]), resumed(ctxs2, seeds, n_done=[4, 4, 4])
    assert all(rest.done) and sampler.recorded == {}  # done: the record is dropped
    assert all(torch.equal(a, b) for a, b in zip(rest.tokens + rest.logprobs, again.tokens + again.logprobs))
    routes = [torch.cat([a, b]) for a, b in zip(first.per_token["routes"], rest.per_token["routes"])]
    samples = Samples(ctxs, [torch.cat([a, b]) for a, b in zip(first.tokens, rest.tokens)], None, None,
                      per_token={"routes": routes})
    cfg = GRPOConfig(micro_batches=1)
    replayed = chunk_logprobs(model, samples, cfg, "cpu", around=Around())  # the record at every response token
    freely = chunk_logprobs(model, samples, cfg, "cpu")
    for lp, rep in zip(rest.logprobs, replayed):
        torch.testing.assert_close(lp, rep[4:], atol=1e-5, rtol=0)
    assert any((lp - fr[4:]).abs().max() > 1e-4 for lp, fr in zip(rest.logprobs, freely))  # replay mattered


def test_a_token_no_forward_read_is_recorded_by_the_prefill_that_first_reads_it():
    """keep=False with max_steps: the call ends before any forward reads a cut row's last token (-1 in its routes);
    the next call's prefill reads it first, records its choice, and replays the recorded ones."""
    model, ctxs, seeds = _model(), _contexts([3, 9]), torch.tensor([4, 5])
    sampler = Recording(model, 14, eos_id=None, keep=False)
    first = sampler(ctxs, seeds, max_steps=3)
    assert all((r[-1] == -1).all() and (r[:-1] >= 0).all() for r in first.per_token["routes"])
    ctxs2 = [torch.cat([c, t]) for c, t in zip(ctxs, first.tokens)]
    second = sampler(ctxs2, seeds, n_done=[3, 3], max_steps=3)
    for c, s, r, t in zip(ctxs2, [4, 5], first.per_token["routes"], second.tokens):
        tokens, recorded = sampler.recorded[s]
        assert torch.equal(tokens[:3], c[-3:]) and torch.equal(tokens[3:], t) and len(recorded) == 6
        assert torch.equal(recorded[:2], r[:2])  # kept
        assert torch.equal(recorded[2].sort(-1).values, _free_routes(model, c)[-1])  # the prefill's own choice
    with pytest.raises(RuntimeError, match="seed 4's recorded routes are for a response of 6 tokens"):
        sampler([torch.cat([ctxs[0], (first.tokens[0] + 1) % 14])], seeds[:1], n_done=[3])  # another response


def _rollout_with_routes(seed=0):
    """A small MoE policy's own samples, with the experts its engine chose for each response token."""
    torch.manual_seed(seed)
    model = Policy(ModelConfig(vocab_size=14, d_model=32, d_expert=32, max_seq_len=40)).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 14, (int(n),), generator=g) for n in torch.randint(2, 9, (8,), generator=g)]
    out = Recording(model, 12, task.EOS, temperature=1.0)(prompts, torch.arange(8))
    samples = grpo.Samples(prompts, out.tokens, out.logprobs, torch.randn(8, generator=g),
                           per_token={"routes": out.per_token["routes"]})
    return model, samples


def test_the_engine_records_each_response_tokens_experts_and_training_replays_them():
    """The recording sampler records, per response token and layer, the experts the decode forward that read it
    chose (the last token, read by no forward, -1). The training forward finds the same choice (mismatch 0, the
    two phases' kernels agreeing here); routes that differ everywhere are measured as such, and under routing
    replay the forward uses them (the mismatch of what it used is 0 by construction, the log-probs change)."""
    import copy
    model, s = _rollout_with_routes()
    L, K, E = model.cfg.n_layers, model.cfg.top_k, model.cfg.n_experts
    for r, t in zip(s.per_token["routes"], s.responses):
        assert r.shape == (len(t), L, K) and (r[-1] == -1).all() and (r[:-1] >= 0).all() and (r < E).all()
    def run(samples, replay):  # on a copy, its own optimizer: every run starts from the same weights
        copied = copy.deepcopy(model)
        samples.around = Around(replay)
        sums = grpo.grpo_update(copied, torch.optim.SGD(copied.parameters(), lr=0.0), samples,
                                grpo.GRPOConfig(micro_batches=2), "cpu")
        return grpo.batch_means(sums) | means(sums)
    same = run(s, replay=False)
    assert same["moe/routing_mismatch"] == 0.0 and same["moe/router_mismatch_free"] == 0.0
    shifted = grpo.Samples(s.prompts, s.responses, s.old_logprobs, s.advantages,  # another set, always
                           per_token={"routes": [torch.where(r >= 0, (r + 1) % E, r) for r in s.per_token["routes"]]})
    free, replayed = run(shifted, replay=False), run(shifted, replay=True)
    assert free["moe/routing_mismatch"] == 1.0 and free["moe/router_mismatch_free"] == 1.0
    assert replayed["moe/routing_mismatch"] == 0.0 and replayed["moe/router_mismatch_free"] == 1.0
    assert free["rollout/logprob_gap_mean"] == same["rollout/logprob_gap_mean"]  # free routing ignores the record
    assert replayed["rollout/logprob_gap_mean"] > 10 * same["rollout/logprob_gap_mean"] + 1e-4
    lp_own = grpo.chunk_logprobs(model, s, grpo.GRPOConfig(), "cpu", around=Around())  # replaying its own choice
    lp_free = grpo.chunk_logprobs(model, s, grpo.GRPOConfig(), "cpu")
    assert all(torch.equal(a, b) for a, b in zip(lp_own, lp_free))


# ------------------------------------------------- the routes ride with their samples (scheduler_class's fields)
class TaggingSampler(ScriptedSampler):
    """ScriptedSampler that also gives, per new token, a (2,) field: its seed and its position."""

    def __call__(self, contexts, seeds, n_done, max_steps):
        toks, lps, done = super().__call__(contexts, seeds, n_done, max_steps)
        tags = [torch.stack([torch.full((len(t),), s), torch.arange(n0, n0 + len(t))], 1)
                for t, s, n0 in zip(toks, seeds.tolist(), n_done.tolist())]
        return type("Out", (), dict(tokens=toks, logprobs=lps, done=done, per_token={"tag": tags}))()


def test_per_token_fields_follow_their_samples_across_chunks_and_a_resume():
    """A sampler's per-token fields (the engine's experts per token, say) are joined over the chunks of a partial
    rollout, saved with the samples in flight, and handed on with each trained sample: one entry per token."""
    lengths = _lengths(np.random.default_rng(7))
    cfg = StaleConfig(staleness=1, groups_per_step=2, group_size=3, threshold=0.5, chunk_steps=4)

    def make():
        return PerTokenSync(cfg, TaggingSampler(lengths), lambda slot, attempt: torch.tensor([2, slot % 10 + 4, 3]))

    a = make()
    a.rollout(), a.update()
    a.admit(), a.decode()  # mid-round: partial samples hold a piece of their field
    b = make()
    b.load_state_dict(torch.load(io.BytesIO(_saved(a.state_dict())), weights_only=True))
    for _ in range(3):
        x, y = a.rollout(), b.rollout()
        a.update(), b.update()
        for seed, r, tag, tag_b in zip(x.seeds, x.responses, x.per_token["tag"], y.per_token["tag"]):
            assert torch.equal(tag, torch.stack([torch.full((len(r),), seed), torch.arange(len(r))], 1))
            assert torch.equal(tag, tag_b)
    one_row = type("Out", (), dict(tokens=[[5]], logprobs=[[-0.1]], done=[True], per_token={"tag": [[1, 2]]}))()
    bad = PerTokenSync(StaleConfig(groups_per_step=1, group_size=1), lambda *a: one_row, lambda s, a: [2, 3])
    with pytest.raises(ValueError, match=r"per_token\['tag'\]: rows \[0\] do not hold one entry per new token"):
        bad.admit(), bad.decode()


def _saved(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def test_a_per_token_field_that_does_not_cover_its_tokens_is_refused_naming_the_sample():
    """A field the sampler returns on some calls only, and a checkpoint whose sample lacks a field its peers hold, are
    refused (take(), state_dict(), load_state_dict()), naming the sample and the field; none: Batch.per_token {}."""
    cfg = StaleConfig(staleness=1, groups_per_step=1, group_size=2, threshold=1.0, chunk_steps=2)
    prompt = lambda slot, attempt: torch.tensor([2, 3])  # noqa: E731

    class Sometimes(TaggingSampler):  # the field from the second call on
        def __call__(self, contexts, seeds, n_done, max_steps):
            out = super().__call__(contexts, seeds, n_done, max_steps)
            out.per_token = out.per_token if int(n_done.max()) > 0 else {}
            return out

    sched = PerTokenSync(cfg, Sometimes(lambda s: 5), prompt)
    sched.admit(), sched.decode(), sched.decode()  # 2 tokens without the field, then 2 with it
    with pytest.raises(ValueError, match=r"sample 0: per_token\['tag'\] holds 2 entries for its 4 tokens"):
        sched.state_dict()
    with pytest.raises(ValueError, match=r"sample 0: per_token\['tag'\] holds 3 entries for its 5 tokens"):
        sched.rollout()
    good = PerTokenSync(cfg, TaggingSampler(lambda s: 5), prompt)
    good.admit(), good.decode()
    sd = good.state_dict()
    del sd["pool"][0]["samples"][1]["per_token"]  # as a checkpoint saved before the field existed, for one sample
    with pytest.raises(ValueError, match=r"sample 1: per_token\['tag'\] holds 0 entries for its 2 tokens"):
        PerTokenSync(cfg, TaggingSampler(lambda s: 5), prompt).load_state_dict(sd)
    assert StaleSync(cfg, ScriptedSampler(lambda s: 2), prompt).rollout().per_token == {}
