"""stalesync.py: StaleSync's checkpoint state (state_dict, load_state_dict). A scheduler saved mid-round, its
partial rollouts in flight, resumes bit for bit (with a scripted sampler, and with model.Sampler's KV cache); an
empty share's dropped groups survive the round trip; another config is refused."""
import io

import numpy as np
import pytest
import torch

from model import ModelConfig, Policy, Sampler
from stalesync import StaleConfig, StaleSync
from task import EOS, PAD, VOCAB, make_prompts
from tests.test_stalesync import ScriptedSampler, _lengths


def test_state_dict_resumes_bit_exactly():
    lengths = _lengths(np.random.default_rng(5))
    cfg = StaleConfig(staleness=2, groups_per_step=2, group_size=3, threshold=0.5, chunk_steps=5)

    def make():  # a prompt that is a function of its slot and attempt: nothing of it to save
        return StaleSync(cfg, ScriptedSampler(lengths), lambda slot, attempt: torch.tensor([2, slot % 10 + 4, 3]))

    a = make()
    for _ in range(3):
        a.rollout(), a.update()
    a.admit(), a.decode()  # mid-round: samples in flight, some partial
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = make()
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b.accounting() == a.accounting() and any(s["tokens"] for g in b.pool for s in g["samples"])
    assert b.max_admitted_over == a.max_admitted_over > -10**9  # the admission record survives a resume
    for _ in range(4):
        x, y = a.rollout(), b.rollout()
        a.update(), b.update()
        assert x.ids == y.ids and x.metrics == y.metrics and x.start_versions == y.start_versions
        assert all(torch.equal(p, q) for p, q in zip(x.responses + x.logprobs, y.responses + y.logprobs))
    with pytest.raises(ValueError, match="config"):
        StaleSync(StaleConfig(staleness=1), None, None).load_state_dict(a.state_dict())
    older = a.state_dict()
    older["cfg"]["chunk_s0"] = False  # a checkpoint of the code before options/streaming.py: it resumes
    make().load_state_dict(older)


def test_state_dict_with_a_cached_sampler_resumes_bit_exactly():
    """model.Sampler holds the KV cache of the rows cut mid-round: it travels in the checkpoint, so the
    resumed run continues from it, as the original does, with the very same log-prob bits."""
    torch.manual_seed(1)  # the default policy: re-reading a prefix then changes some log-prob bits
    model = Policy(ModelConfig(vocab_size=VOCAB, max_seq_len=60))
    cfg = StaleConfig(staleness=1, groups_per_step=2, group_size=3, threshold=0.5, chunk_steps=3)

    def make():
        rng = np.random.default_rng(3)
        prompt_fn = lambda slot, attempt: make_prompts(rng, 1, max_digits=8)[0]
        return StaleSync(cfg, Sampler(model, 30, EOS, PAD), prompt_fn), rng

    (a, ra), (b, rb) = make(), make()
    for _ in range(2):
        a.rollout(), a.update()
    a.admit(), a.decode()  # mid-round: the sampler holds the cut rows' cache
    assert a.step_fn.state is not None
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    rb.bit_generator.state = ra.bit_generator.state
    assert b.step_fn.state["seeds"] == a.step_fn.state["seeds"]
    for _ in range(3):
        x, y = a.rollout(), b.rollout()
        a.update(), b.update()
        assert x.ids == y.ids
        assert all(torch.equal(p, q) for p, q in zip(x.responses + x.logprobs, y.responses + y.logprobs))


def test_an_empty_share_reports_its_dropped_groups_in_the_next_batch_and_resumes():
    """take(0): a shared cut's empty share, a batch of no group. The groups dropped before it are reported by the next
    batch that holds groups, not lost, across a state_dict round trip; the brake counts from the last take."""
    cfg = StaleConfig(staleness=1, groups_per_step=2, group_size=2, threshold=0.5, chunk_steps=8, max_filtered=3)
    make = lambda: StaleSync(cfg, ScriptedSampler(lambda seed: 2 + seed % 2),
                             prompt_fn=lambda slot, attempt: torch.tensor([2, slot + attempt, 3]),
                             keep_group=lambda prompt, responses: int(prompt[1]) % 2 == 0)  # odd: dropped
    sched = make()
    sched.admit()
    sched.decode()  # every row ends within a chunk: slots 1 and 3 dropped, reopened
    assert sched.filtered == 2
    empty = sched.take(0, 0)  # batch 0 has no due group at S = 1
    assert empty.ids == [] and empty.metrics["stale/filtered_at_cut"] == 0 and empty.metrics["stale/age_max"] == 0
    resumed = make()
    resumed.load_state_dict(sched.state_dict())
    resumed.update()
    batch = resumed.rollout()
    assert len(batch.ids) == 4 and batch.metrics["stale/filtered_at_cut"] == resumed.filtered >= 2
    assert resumed.filtered_at_take == resumed.filtered  # the brake's count starts again at each take
