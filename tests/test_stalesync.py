"""stalesync.py: the staleness bound, admission capacity, nothing lost, S = 0 equals the synchronous path,
partial rollouts continued under new weights, bad input (checkpoints: tests/test_stale_state.py).

The bound and accounting tests drive the scheduler with a scripted sampler (response lengths drawn per
seed) in a discrete-time simulation of a generator and a trainer of random speeds; the equivalence and
partial-rollout tests use the real tiny model.Policy, grpo.py's math and task.py's task."""
import copy

import numpy as np
import pytest
import torch

from grpo import grpo_loss, group_advantages, pad_responses, sequence_logprobs, token_logprobs
from model import ModelConfig, Policy, Sampler, counter_uniform, generate, sample_tokens
from options import lockstep, streaming
from stalesync import StaleConfig, StaleSync, sync_rollout
from task import EOS, PAD, VOCAB, make_prompts, score


class ScriptedSampler:
    """step_fn whose response length is a function of the seed: tokens and log-probs are position codes."""

    def __init__(self, length_of):
        self.length_of, self.seen, self.tokens = length_of, set(), 0

    def __call__(self, contexts, seeds, n_done, max_steps):
        toks, lps, done = [], [], []
        for s, n0 in zip(seeds.tolist(), n_done.tolist()):
            self.seen.add(s)
            left = self.length_of(s) - n0
            n = left if max_steps is None else min(left, max_steps)
            toks.append(torch.arange(n0, n0 + n) % 10 + 4)
            self.tokens += n
            lps.append(-0.01 * torch.arange(n0, n0 + n, dtype=torch.float32))
            done.append(n == left)
        return toks, lps, done


def _lengths(rng):
    """A random length law: a long tail of random shape, 1..200 tokens, fixed per seed."""
    mu, sigma = rng.uniform(0.5, 3.0), rng.uniform(0.2, 1.5)
    salt = int(rng.integers(1 << 30))
    return lambda seed: int(np.clip(np.random.default_rng([salt, seed]).lognormal(mu, sigma), 1, 200))


def _check_batch(b, S, cfg, length_of=None):
    assert len(b.ids) == cfg.groups_per_step * cfg.group_size and len(set(b.ids)) == len(b.ids)
    if length_of is not None:  # every response complete
        assert [len(r) for r in b.responses] == [length_of(s) for s in b.seeds]
    for sv, v in zip(b.start_versions, b.token_versions):
        assert 0 <= b.version - sv <= S, f"age {b.version - sv} > S={S}"
        assert len(v) and int(v[0]) == sv and bool((v[1:] >= v[:-1]).all()) and int(v[-1]) <= b.version
    assert b.metrics["stale/age_max"] <= S


def _simulate(S, seed, separated, steps=12, cfg=None, keep_group=None):
    """Generator and trainer at random speeds. Returns the scheduler, the sampler and the trained ids."""
    rng = np.random.default_rng(seed)
    cfg = cfg or StaleConfig(staleness=S, groups_per_step=int(rng.integers(1, 4)), group_size=int(rng.integers(1, 5)),
                             threshold=float(rng.choice([1.0, 0.5, 0.3])), chunk_steps=int(rng.integers(1, 9)))
    sampler, first = ScriptedSampler(_lengths(rng)), {}  # first: seed -> version at its first token

    def step_fn(contexts, seeds, n_done, max_steps):  # records ages outside the scheduler's own books
        for s, n in zip(seeds.tolist(), n_done.tolist()):
            if n == 0:
                first[s] = sched.version
        return sampler(contexts, seeds, n_done, max_steps)

    sched = StaleSync(cfg, step_fn, prompt_fn=lambda slot, attempt: torch.tensor([2, 5, 3]),
                      keep_group=keep_group)
    trained = []

    def check(b):
        _check_batch(b, S, cfg, sampler.length_of)
        assert all(b.version - first[s] <= S for s in b.seeds), "a sample older than S was trained"
    if not separated:  # colocated: rollout, train, update
        for _ in range(steps):
            b = sched.rollout()
            assert b.version == sched.version
            check(b)
            trained += b.ids
            sched.update()
        return sched, sampler, trained, cfg
    train_ticks, delay = int(rng.integers(1, 6)), int(rng.integers(0, 4))  # trainer speed, weight latency
    gen_speed = float(rng.uniform(0.2, 1.0))  # the generator decodes a chunk on this share of the ticks
    queue, busy_until, trainer_v, arrivals, t = [], None, 0, [], 0
    while trainer_v < steps:
        t += 1
        for when, v in [a for a in arrivals if a[0] <= t]:  # weights reach the generator
            sched.update(max(sched.version, v))
        arrivals = [a for a in arrivals if a[0] > t]
        sched.admit()
        assert sched.slots_opened <= (S + sched.version + 1) * cfg.groups_per_step
        if rng.random() < gen_speed:
            sched.decode()
        while sched.ready():
            queue.append(sched.take())
        if busy_until is not None and t >= busy_until:  # an optimizer step ends
            trainer_v, busy_until = trainer_v + 1, None
            arrivals.append((t + delay, trainer_v))
        if busy_until is None and queue:
            b = queue.pop(0)
            assert b.version == trainer_v, "batches are trained in order, one optimizer step each"
            check(b)
            trained += b.ids
            busy_until = t + train_ticks
        assert t < 100_000, "no progress"
    return sched, sampler, trained + [i for b in queue for i in b.ids], cfg  # queued: handed to training


@pytest.mark.parametrize("S", [0, 1, 2, 4])
def test_bound_and_nothing_lost(S):
    for trial in range(12):
        sched, sampler, trained, cfg = _simulate(S, seed=100 * S + trial, separated=trial % 2 == 1)
        assert sched.max_admitted_over <= 0, "admission exceeded (S + v + 1) * groups_per_step"
        acc = sched.accounting()
        assert set(trained) == acc["trained"] and len(trained) == len(set(trained))
        assert not (acc["trained"] & acc["regenerated"] or acc["trained"] & acc["in_flight"]
                    or acc["regenerated"] & acc["in_flight"])
        everything = acc["trained"] | acc["regenerated"] | acc["in_flight"]
        assert everything == set(range(sched.next_id)), "a sample id was lost"
        assert sampler.seen <= everything  # seeds are the sample ids
        if S == 0:
            assert not acc["regenerated"] and not acc["in_flight"]
        if S <= 1:  # the cut rule makes regeneration impossible: at most groups_per_step groups fall due
            assert not acc["regenerated"], "a group aged out although the cut waits for due groups"


@pytest.mark.parametrize("S", [2, 4])
def test_bound_and_nothing_lost_while_groups_age_out(S):
    """A pool at capacity and one group per step: groups pile up due at once and some are regenerated."""
    regenerated = 0
    for trial in range(8):
        cfg = StaleConfig(staleness=S, groups_per_step=1, group_size=2, threshold=1 / (S + 1), chunk_steps=2)
        sched, _, trained, _ = _simulate(S, seed=7 + 100 * S + trial, separated=trial % 2 == 1, steps=20, cfg=cfg)
        acc = sched.accounting()
        assert set(trained) == acc["trained"] and len(trained) == len(set(trained))
        assert acc["trained"] | acc["regenerated"] | acc["in_flight"] == set(range(sched.next_id))
        assert len(acc["regenerated"]) == cfg.group_size * sched.regenerated
        regenerated += sched.regenerated
    assert regenerated > 0, "no group aged out: the test does not exercise regeneration"


@pytest.mark.parametrize("S, chunk_s0", [(0, False), (0, True), (1, False), (2, False)])
def test_on_group_shows_every_kept_group_once_before_it_is_trained(S, chunk_s0):
    """on_group (options/streaming.py) streams each group as it completes and is kept, with the samples, tokens and
    log-probs that take() later emits: every trained group was shown before its batch, once; a filtered group
    never; at S = 2 a group shown and then aged out is shown again with fresh samples (and only the second attempt
    trains). chunk_s0: S = 0 in chunks of chunk_steps, the groups then complete over several calls (and the batches
    are the same)."""
    same = lambda prompt, responses: len({len(r) for r in responses}) > 1
    batches = {}
    for chunked in sorted({False, chunk_s0}):
        cfg = StaleConfig(staleness=S, groups_per_step=2, group_size=2, threshold=0.5, chunk_steps=3)
        shown, calls = {}, []
        sampler = ScriptedSampler(_lengths(np.random.default_rng(7 + S)))
        Streaming = streaming.scheduler_class(StaleSync, lambda b: calls.append(b) or shown.update(
            {i: (r, lp) for i, r, lp in zip(b.ids, b.responses, b.logprobs)}), chunk_s0=chunked)
        sched = Streaming(cfg, sampler, prompt_fn=lambda slot, attempt: torch.tensor([2, 5, 3, slot % 7]),
                          keep_group=same)
        trained = []
        for _ in range(12):
            b = sched.rollout()
            for i, r, lp in zip(b.ids, b.responses, b.logprobs):
                assert torch.equal(shown[i][0], r) and torch.equal(shown[i][1], lp), f"sample {i} shown otherwise"
            trained += b.ids
            sched.update()
        acc = sched.accounting()
        assert len(shown) == sum(len(c.ids) for c in calls)  # each sample shown once
        assert not set(shown) & acc["filtered"] and set(trained) <= set(shown)
        assert set(shown) - set(trained) <= acc["regenerated"] | acc["in_flight"]
        assert all(len(set(c.slots)) == 1 and c.version is None for c in calls)  # one group per call
        batches[chunked] = sorted((c.slots[0], [r.tolist() for r in c.responses]) for c in calls if c.ids[0] in trained)
        if chunked:
            assert len({len(c.ids) for c in calls}) == 1 and sampler.tokens > 0
    assert batches[False] == batches[chunk_s0]  # chunked S = 0: the same groups (in completion order), the same slots


@pytest.mark.parametrize("S", [0, 1, 2])
def test_dynamic_sampling_trains_only_kept_groups_and_loses_nothing(S):
    """keep_group refuses some complete groups (here: those whose responses all have the same length, a
    stand-in for equal rewards): they are dropped and counted, replaced by new groups, every batch still
    holds groups_per_step kept groups within the bound, and every sample id is accounted for."""
    same = lambda prompt, responses: len({len(r) for r in responses}) > 1
    dropped = 0
    for trial in range(8):
        cfg = StaleConfig(staleness=S, groups_per_step=2, group_size=2, threshold=0.5, chunk_steps=3)
        sched, sampler, trained, _ = _simulate(S, seed=31 + 100 * S + trial, separated=trial % 2 == 1, cfg=cfg,
                                               keep_group=same)
        assert sched.max_admitted_over <= 0
        acc = sched.accounting()
        assert set(trained) == acc["trained"] and len(trained) == len(set(trained))
        assert acc["trained"] | acc["regenerated"] | acc["filtered"] | acc["in_flight"] == set(range(sched.next_id))
        assert len(acc["filtered"]) == cfg.group_size * sched.filtered
        for g in range(0, len(trained), cfg.group_size):  # every trained group passes the filter
            assert same(None, [torch.zeros(sampler.length_of(i)) for i in trained[g:g + cfg.group_size]])
        dropped += sched.filtered
    assert dropped > 0, "no group was filtered: the test does not exercise dynamic sampling"


def test_admission_inequality_is_strict_before_a_start():
    """slots_opened < (S + v + 1) * gps to open one more, so slots_opened <= capacity after it."""
    cfg = StaleConfig(staleness=1, groups_per_step=2, group_size=1, threshold=0.25, chunk_steps=1)
    sched = StaleSync(cfg, ScriptedSampler(lambda s: 50), prompt_fn=lambda slot, attempt: torch.tensor([2]))
    assert sched.admit() == 4 and sched.slots_opened == 4 == sched.capacity()
    assert sched.admit() == 0
    while not sched.ready():
        sched.decode()
    sched.take()  # batch 0, then the optimizer step that makes version 1
    sched.update()
    assert sched.admit() == 2 and sched.slots_opened == 6


def test_too_old_groups_are_regenerated_not_trained():
    """S=2, one group per step: two long groups fall due at the same batch; one is trained, the other
    would be 3 versions old at the next batch, so it is restarted (new ids) and counted."""
    long_seeds = {0, 1}  # groups 0 and 1 (group size 1): 30 tokens; everything else: 1 token
    cfg = StaleConfig(staleness=2, groups_per_step=1, group_size=1, threshold=1 / 3, chunk_steps=4)
    sched = StaleSync(cfg, ScriptedSampler(lambda s: 30 if s in long_seeds else 1),
                      lambda slot, attempt: torch.tensor([2]))
    batches = []
    for _ in range(4):
        batches.append(sched.rollout())
        _check_batch(batches[-1], 2, cfg, sched.step_fn.length_of)
        sched.update()
    assert [b.ids for b in batches[:3]] == [[2], [3], [0]]
    assert sched.regenerated == 1 and sched.accounting()["regenerated"] == {1}
    assert batches[3].metrics["stale/regenerated"] == 1


def _tiny_policy(seed=0):
    torch.manual_seed(seed)
    return Policy(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, n_experts=2, top_k=1,
                              d_expert=32, max_seq_len=40))


def _sampler(model, max_new, eos=EOS):
    return lambda c, s, n, m: generate(model, c, s, max_new, eos, PAD, 1.0, 1.0, n_done=n, max_steps=m)


def _train_step(model, opt, prompts, responses, logprobs, G):
    rewards = torch.tensor([score(p, r) + 0.1 * len(r) for p, r in zip(prompts, responses)])  # some signal
    adv = group_advantages(rewards, G)
    tokens, mask, (old,) = pad_responses(prompts, responses, logprobs)
    loss, _ = grpo_loss(sequence_logprobs(model, tokens, 1.0), old, None, adv, mask)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_s0_equals_the_synchronous_path():
    G, gps, max_new, steps = 4, 2, 12, 3
    rng = np.random.default_rng(0)
    prompts_all = make_prompts(rng, gps * steps, max_digits=8)

    sync = _tiny_policy()
    opt = torch.optim.AdamW(sync.parameters(), lr=1e-2)
    for k in range(steps):  # the synchronous loop, as train_grpo.py runs it
        prompts = prompts_all[k * gps:(k + 1) * gps]
        ctx = [p for p in prompts for _ in range(G)]
        gen = generate(sync, ctx, torch.arange(k * gps * G, (k + 1) * gps * G), max_new, EOS, PAD, 1.0, 1.0)
        _train_step(sync, opt, ctx, gen.tokens, gen.logprobs, G)

    stale = _tiny_policy()
    opt = torch.optim.AdamW(stale.parameters(), lr=1e-2)
    stream = iter(prompts_all)
    sched = StaleSync(StaleConfig(staleness=0, groups_per_step=gps, group_size=G, threshold=0.5, chunk_steps=2),
                      _sampler(stale, max_new), prompt_fn=lambda slot, attempt: next(stream))
    for k in range(steps):
        b = sched.rollout()
        assert b.metrics["stale/age_max"] == 0 and b.metrics["stale/partial_continued"] == 0
        _train_step(stale, opt, b.prompts, b.responses, b.logprobs, G)
        sched.update()
    for (name, a), (_, b) in zip(sync.state_dict().items(), stale.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs from the synchronous path"
    # the naive helper is that same single call
    toks, _, done = sync_rollout(_sampler(stale, max_new), prompts_all[:1], G, torch.arange(G))
    assert all(done) and len(toks) == G


@pytest.mark.parametrize("cached", [False, True])
def test_partial_rollout_continues_under_new_weights(cached):
    """cached: model.Sampler keeps the KV cache between chunks, and update() must drop it."""
    G, max_new = 2, 12
    model = _tiny_policy(1)
    snapshots = {0: copy.deepcopy(model.state_dict())}
    rng = np.random.default_rng(1)
    cfg = StaleConfig(staleness=1, groups_per_step=2, group_size=G, threshold=0.5, chunk_steps=3)
    sampler = Sampler(model, max_new, EOS, PAD) if cached else _sampler(model, max_new)
    sched = StaleSync(cfg, sampler, prompt_fn=lambda slot, attempt: make_prompts(rng, 1, max_digits=6)[0])
    g = torch.Generator().manual_seed(0)
    continued = []
    for v in range(4):
        b = sched.rollout()
        _check_batch(b, 1, cfg)
        continued += [(b, i) for i, tv in enumerate(b.token_versions) if len(set(tv.tolist())) > 1]
        assert b.metrics["stale/partial_continued"] == sum(c[0] is b for c in continued)
        with torch.no_grad():  # "an optimizer step": move every weight
            for p in model.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        sched.update()
        snapshots[v + 1] = copy.deepcopy(model.state_dict())
    assert continued, "no sequence was cut and continued across versions"
    ref = _tiny_policy()
    for b, i in continued:
        prompt, resp, lp, tv = b.prompts[i], b.responses[i], b.logprobs[i], b.token_versions[i]
        seed = b.seeds[i]
        # complete and valid: EOS only last, or the whole budget
        assert len(resp) == max_new or int(resp[-1]) == EOS
        assert int((resp[:-1] == EOS).sum()) == 0 and bool(((resp >= 0) & (resp < VOCAB)).all())
        full = torch.cat([prompt, resp])[None]                                          # (1, P + n)
        pos = len(prompt) - 1 + torch.arange(len(resp))                                 # predicting positions
        u = counter_uniform(torch.full((len(resp),), seed), len(prompt) + torch.arange(len(resp)))
        stale_only = None
        for v in sorted(set(tv.tolist())):
            ref.load_state_dict(snapshots[v])
            with torch.no_grad():
                logits = ref(full)[0, pos]                                              # (n, V)
            at = tv == v
            recomputed = token_logprobs(logits[None], resp[None])[0]                    # (n,)
            torch.testing.assert_close(lp[at], recomputed[at], atol=1e-5, rtol=0)
            tok, _ = sample_tokens(logits, u)                                           # counter-based draw
            assert torch.equal(tok[at], resp[at]), "token not the draw of the version that produced it"
            if v == int(tv[0]):
                stale_only = recomputed
        assert (lp[tv != tv[0]] - stale_only[tv != tv[0]]).abs().max() > 1e-3, "later tokens used old weights"


@pytest.mark.parametrize("kwargs, match", [(dict(staleness=-1), r"staleness=-1 .*>= 0"),
                                           (dict(threshold=0.0), r"threshold=0.0 .*\(0, 1\]"),
                                           (dict(threshold=1.5), r"threshold=1.5 .*\(0, 1\]"),
                                           (dict(groups_per_step=0), r"groups_per_step=0"),
                                           (dict(groups_per_step=1.5), r"groups_per_step=1.5 .*integer"),
                                           (dict(chunk_steps=2.5), r"chunk_steps=2.5 .*integer")])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StaleConfig(**kwargs)


class Counting:
    """A sampler object with a cache: counts its resets; its state is a dict."""

    def __init__(self):
        self.resets, self.inner = 0, ScriptedSampler(lambda s: 3)

    def step(self, *args):
        return self.inner(*args)

    def reset(self):
        self.resets += 1

    def state_dict(self):
        return {"resets": self.resets}

    def load_state_dict(self, sd):
        self.resets = sd["resets"]


def test_the_sampler_contract_bound_methods_lists_and_stalls():
    cfg = StaleConfig(staleness=1, groups_per_step=1, group_size=2, threshold=0.5, chunk_steps=2)
    sampler = Counting()
    sched = StaleSync(cfg, sampler.step, prompt_fn=lambda slot, attempt: torch.tensor([2, 3]))  # a bound method
    for _ in range(3):
        sched.rollout()
        sched.update()
    # found on its owner; reset at each round's end (rollout memory) and each update (new weights)
    assert sampler.resets == 6 and sched.state_dict()["sampler"] == {"resets": 6}
    model_sampler = torch.nn.Linear(2, 2)  # an nn.Module as step_fn: its weights stay out of the checkpoint
    model_sampler.forward = ScriptedSampler(lambda s: 3)
    sched = StaleSync(cfg, model_sampler, prompt_fn=lambda slot, attempt: torch.tensor([2, 3]))
    sched.rollout()
    assert sched.state_dict()["sampler"] is None
    as_lists = lambda c, seeds, n, m: ([[5] * 2 for _ in c], [[-0.5] * 2 for _ in c], [True] * len(c))
    batch = StaleSync(cfg, as_lists, prompt_fn=lambda slot, attempt: torch.tensor([2, 3])).rollout()  # lists are fine
    assert [r.tolist() for r in batch.responses] == [[5, 5]] * 2 and batch.logprobs[0].dtype == torch.float32
    stalled = lambda c, seeds, n, m: ([[] for _ in c], [[] for _ in c], [False] * len(c))
    with pytest.raises(RuntimeError, match="the sampler made no token and ended no row of the 4 in flight"):
        StaleSync(cfg, stalled, prompt_fn=lambda slot, attempt: torch.tensor([2, 3])).rollout()
    short = lambda c, seeds, n, m: ([[5]], [[-0.5]], [True])
    with pytest.raises(ValueError, match="1 token rows, 1 log-prob rows and 1 done flags for 4 rows"):
        StaleSync(cfg, short, prompt_fn=lambda slot, attempt: torch.tensor([2, 3])).rollout()
    batch = StaleSync(cfg, as_lists, prompt_fn=lambda slot, attempt: [2, 3]).rollout()  # a prompt as a list of ints
    assert batch.prompts[0].tolist() == [2, 3] and batch.prompts[0].dtype == torch.long
    for bad in (torch.tensor([[2, 3]]), torch.tensor([2.0, 3.0]), torch.tensor([], dtype=torch.long), "23"):
        with pytest.raises(ValueError, match="prompt_fn\\(\\) returned .* a 1-D integer tensor of token ids"):
            StaleSync(cfg, as_lists, prompt_fn=lambda slot, attempt: bad).rollout()
    prompt = lambda slot, attempt: [2, 3]
    for good in (lambda s, a, m: np.int64(7 + m), lambda s, a, m: torch.tensor(7 + m)):  # integers of numpy, torch
        batch = StaleSync(cfg, as_lists, prompt_fn=prompt, seed_fn=good).rollout()
        assert batch.seeds == [7, 8] and all(type(s) is int for s in batch.seeds)
    for bad in (lambda s, a, m: 7 + m / 4, lambda s, a, m: torch.tensor(7.5), lambda s, a, m: True):
        with pytest.raises(TypeError, match="seed_fn\\(\\) returned .* it must return an integer seed"):
            StaleSync(cfg, as_lists, prompt_fn=prompt, seed_fn=bad).rollout()  # floats: members would share one


def test_update_refuses_a_version_it_cannot_have():
    sched = StaleSync(StaleConfig(staleness=1, groups_per_step=1, group_size=1), ScriptedSampler(lambda s: 3),
                      prompt_fn=lambda slot, attempt: torch.tensor([2, 3]))
    sched.update(sched.rollout().version + 1)  # weights trained on batch 0: version 1
    for bad in (0, 2, "1", 1.0):  # older than the sampler's; trained on a batch not emitted yet; not an int
        with pytest.raises(ValueError, match=f"update\\(version={bad!r}\\)"):
            sched.update(bad)
    sched.update(1)  # the same weights again: allowed, the cache is dropped
    assert sched.version == 1


@pytest.mark.parametrize("S", [0, 1, 2])
def test_ready_rank_keeps_decoding_until_all_ranks_are_ready(S):
    """rollout(cut=...): a rank whose batch is ready while a peer's is not keeps decoding its long
    tail (colocated, gradients all-reduced); the batches stay valid and S = 0 is unchanged."""
    length_of = lambda seed: 20 if seed % 7 == 0 else 2 + seed % 3  # a long tail in every few groups
    cfg = StaleConfig(staleness=S, groups_per_step=2, group_size=3, threshold=0.5, chunk_steps=3)
    plain_sampler, waiting_sampler = ScriptedSampler(length_of), ScriptedSampler(length_of)
    plain = StaleSync(cfg, plain_sampler, prompt_fn=lambda slot, attempt: torch.tensor([2, 5]))
    waiting = StaleSync(cfg, waiting_sampler, prompt_fn=lambda slot, attempt: torch.tensor([2, 5]))
    calls = []
    while_ready = [0, 0]  # tokens decoded while this rank was ready and waited; sampler count at the last turn

    def all_ready(sched):  # the cut AllReady makes, with a peer that becomes ready 4 loop turns after this rank
        mine = sched.ready()
        if calls and calls[-1]:
            while_ready[0] += waiting_sampler.tokens - while_ready[1]
        while_ready[1] = waiting_sampler.tokens
        calls.append(mine)
        return (cfg.groups_per_step, None) if mine and sum(calls[-5:]) == 5 and len(calls) >= 5 else None

    for _ in range(6):
        a, b = plain.rollout(), waiting.rollout(cut=all_ready)
        calls.clear()
        _check_batch(b, S, cfg, length_of)
        if S == 0:
            assert a.ids == b.ids and all(torch.equal(x, y) for x, y in zip(a.responses, b.responses))
        plain.update(), waiting.update()
    acc = waiting.accounting()
    assert acc["trained"] | acc["regenerated"] | acc["in_flight"] == set(range(waiting.next_id))
    if S > 0:  # the waiting turns decoded the in-flight long tail
        assert while_ready[0] > 0
    else:      # nothing is ever in flight once the batch is complete
        assert while_ready[0] == 0


def _cut_world(rank, world_size, S, steps=6):
    """A rank per replica, 2 groups each per step; replica 0's groups are dropped twice in three attempts (equal
    lengths, a stand-in for equal rewards), replica 1's never. The same run under AllReady and under SharedCut."""
    import torch.distributed as dist
    from stalesync import AllReady, SharedCut
    gps, G = 2, 3
    to_global = lambda slot: slot // gps * gps * world_size + rank * gps + slot % gps
    seed = lambda g, attempt, j: 1000 * g + 10 * attempt + j
    unlucky = lambda s: (s // 1000) % (gps * world_size) < gps and (s // 10) % 10 % 3 != 2
    length_of = lambda s: 3 if unlucky(s) else 2 + s % 3 + (s // 1000) % 4
    keep = lambda prompt, responses: len({len(r) for r in responses}) > 1
    out = {}
    for name, cut in (("all", AllReady()), ("shared", SharedCut())):
        cfg = StaleConfig(staleness=S, groups_per_step=gps, group_size=G, threshold=0.5, chunk_steps=2)
        sched = StaleSync(cfg, ScriptedSampler(length_of), lambda slot, a: torch.tensor([2, 4 + to_global(slot) % 9]),
                          lambda slot, a, j: seed(to_global(slot), a, j), keep_group=keep)
        turns, batches = [], []
        counted = lambda sched: (turns.__setitem__(-1, turns[-1] + 1), cut(sched))[1]
        for _ in range(steps):
            turns.append(0)
            b = sched.rollout(cut=counted)
            for sv in b.start_versions:
                assert 0 <= b.version - sv <= S
            batches.append([(to_global(slot), s, r.tolist()) for slot, s, r in zip(b.slots, b.seeds, b.responses)])
            sched.update()
        acc = sched.accounting()
        assert acc["trained"] | acc["regenerated"] | acc["filtered"] | acc["in_flight"] == set(range(sched.next_id))
        assert sched.max_admitted_over <= 0
        everyone = [None] * world_size
        dist.all_gather_object(everyone, batches)
        out[name] = dict(turns=turns, regenerated=sched.regenerated, batches=[sum(parts, []) for parts in zip(*everyone)],
                         shares=[[len(b) // G for b in parts] for parts in zip(*everyone)])
    return out


@pytest.mark.parametrize("S", [0, 1])
def test_a_shared_cut_lets_a_replica_fill_in_for_one_held_back_by_dropped_groups(S):
    """SharedCut, two replicas: one cut over both pools. Every batch holds 2 x groups_per_step groups, each its slot's
    draw, no slot trained twice, every sample accounted for and no age above S. At S = 1, the replica whose groups are
    dropped again and again no longer holds the step: its peer's complete groups of later slots fill the batch, and
    its slowest round takes fewer loop turns than under AllReady, and no group ages out. At S = 0 both cuts make the
    same batches."""
    from tests.distributed import run_distributed
    out, _ = run_distributed(_cut_world, world_size=2, args=(S,))
    for name in ("all", "shared"):
        slots = [g for batch in out[name]["batches"] for g, _, _ in batch[::3]]
        assert len(slots) == len(set(slots)), f"{name}: a slot trained twice"
        for batch in out[name]["batches"]:
            assert len(batch) == 4 * 3
            for g, s, _ in batch:
                assert s // 1000 == g  # its slot's draw
    if S == 0:
        assert out["shared"]["batches"] == out["all"]["batches"] and out["shared"]["shares"] == out["all"]["shares"]
    else:
        assert all(shares == [2, 2] for shares in out["all"]["shares"])
        assert any(shares[1] > 2 for shares in out["shared"]["shares"]), out["shared"]["shares"]
        assert out["shared"]["regenerated"] == 0  # at S = 1 every due group is needed: none ages out
        assert max(out["shared"]["turns"]) < max(out["all"]["turns"]), (out["shared"], out["all"])


def test_update_twice_is_refused_at_once():
    cfg = StaleConfig(staleness=1, groups_per_step=1, group_size=2, threshold=0.5, chunk_steps=2)
    sched = StaleSync(cfg, ScriptedSampler(lambda s: 3), prompt_fn=lambda slot, attempt: torch.tensor([2, 3]))
    sched.rollout()
    sched.update()
    with pytest.raises(RuntimeError, match="update\\(\\) at version 1 with 1 batches out"):
        sched.update()  # a second step's update without a second batch


def test_the_brakes_a_sampler_that_never_ends_and_a_filter_that_refuses_everything():
    """Neither rule spins: a row past the response budget, or more groups dropped than the limit, raises."""
    cfg = StaleConfig(staleness=1, groups_per_step=2, group_size=2, threshold=0.5, chunk_steps=4, max_len=10)
    never_done = lambda c, seeds, n, m: ([[5] * m for _ in c], [[-0.5] * m for _ in c], [False] * len(c))
    with pytest.raises(RuntimeError, match="the sampler .*<lambda> returned samples .* with 10 or more tokens and not "
                                           "done: .* by max_len 10"):
        StaleSync(cfg, never_done, prompt_fn=lambda slot, attempt: torch.tensor([2, 3])).rollout()
    limited = StaleConfig(staleness=0, groups_per_step=2, group_size=2, max_filtered=5)
    sched = StaleSync(limited, ScriptedSampler(lambda s: 3), prompt_fn=lambda slot, attempt: torch.tensor([2, 3]),
                      keep_group=lambda prompt, responses: False)  # every group's rewards equal
    with pytest.raises(RuntimeError, match="dynamic sampling dropped 6 groups while making batch 0, past the limit "
                                           "of 5"):
        sched.rollout()
    for bad in (dict(max_len=0), dict(max_filtered=-1), dict(max_len=2.5), dict(max_len=None)):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            StaleConfig(**bad)


def test_the_brakes_are_on_by_default():
    """A copied stalesync.py with the defaults: neither a sampler that never ends a row nor a filter
    that refuses every group runs forever."""
    cfg = StaleConfig(staleness=1, groups_per_step=1, group_size=1, chunk_steps=1 << 14)  # 8 calls to the brake
    assert (cfg.max_len, cfg.max_filtered) == (1 << 17, 128)
    never_done = lambda c, seeds, n, m: ([[5] * m for _ in c], [[-0.5] * m for _ in c], [False] * len(c))
    with pytest.raises(RuntimeError, match="with 131072 or more tokens and not done: .* by max_len 131072"):
        StaleSync(cfg, never_done, prompt_fn=lambda slot, attempt: [2, 3]).rollout()
    sched = StaleSync(StaleConfig(staleness=0, groups_per_step=1, group_size=2), ScriptedSampler(lambda s: 3),
                      prompt_fn=lambda slot, attempt: [2, 3], keep_group=lambda prompt, responses: False)
    with pytest.raises(RuntimeError, match="dynamic sampling dropped 129 groups while making batch 0, past the limit "
                                           "of 128"):
        sched.rollout()


def test_padded_or_float_tokens_are_refused():
    cfg = StaleConfig(staleness=0, groups_per_step=1, group_size=2)
    padded = lambda c, seeds, n, m: (torch.tensor([[5, 1, 0], [5, 5, 1]]), [[-0.5] * 3] * 2, [True, True])
    with pytest.raises(ValueError, match="tokens as one \\(2, 3\\) tensor: return one 1-D sequence per row"):
        StaleSync(cfg, padded, prompt_fn=lambda slot, attempt: [2, 3]).rollout()
    floats = lambda c, seeds, n, m: ([[5.7, 1.0]] * 2, [[-0.5] * 2] * 2, [True, True])
    with pytest.raises(ValueError, match="row 0: the sampler returned tokens of dtype torch.float32"):
        StaleSync(cfg, floats, prompt_fn=lambda slot, attempt: [2, 3]).rollout()


@pytest.mark.parametrize("S", [0, 1])
def test_a_slot_gets_the_same_prompt_and_samples_however_the_batch_is_split(S):
    """Dynamic sampling on: one scheduler making global batches of 4 groups, against two replicas making 2
    each, with prompts and seeds drawn by global (slot, attempt). At S = 0 every step trains the same
    groups, slot for slot (which groups are kept, and what replaces a dropped one, follows the slot, not
    the replica); at S > 0 every trained group is still its slot's draw."""
    length_of = lambda seed: 2 + (seed // 10 % 3 == 0) * (seed % 2)  # some attempts have mixed lengths
    keep = lambda prompt, responses: len({len(r) for r in responses}) > 1   # a stand-in for equal rewards
    draw = lambda g, attempt: torch.tensor([2, 4 + (7 * g + 3 * attempt) % 10, 3])
    seed = lambda g, attempt, j: 1000 * g + 10 * attempt + j

    def replica(r, n_replicas, gps=4):
        n = gps // n_replicas
        to_global = lambda slot: slot // n * gps + r * n + slot % n        # local slot -> global batch slot
        cfg = StaleConfig(staleness=S, groups_per_step=n, group_size=3, threshold=0.5, chunk_steps=2)
        return StaleSync(cfg, ScriptedSampler(length_of), lambda slot, a: draw(to_global(slot), a),
                         lambda slot, a, j: seed(to_global(slot), a, j), keep_group=keep), to_global

    one, halves = [replica(0, 1)], [replica(r, 2) for r in range(2)]
    for step in range(5):
        by_slot = []
        for scheds in (one, halves):
            got = {}
            for sched, to_global in scheds:
                b = sched.rollout()
                sched.update()
                for i, slot in enumerate(b.slots):
                    row = (b.prompts[i].tolist(), b.seeds[i], b.responses[i].tolist())
                    got.setdefault(to_global(slot), []).append(row)
            by_slot.append(got)
        if S == 0:
            assert by_slot[0] == by_slot[1] and sorted(by_slot[0]) == list(range(4 * step, 4 * step + 4))
        for got in by_slot:  # every trained group: its slot's draw at some attempt, its seeds that attempt's
            for g, rows in got.items():
                attempt = (rows[0][1] - 1000 * g) // 10
                assert rows[0][0] == draw(g, attempt).tolist()
                assert [r[1] for r in rows] == [seed(g, attempt, j) for j in range(3)]
    assert sum(s.filtered for s, _ in one) > 0, "no group was dropped: the test does not exercise the refill"


class IdleCounting(ScriptedSampler):
    """ScriptedSampler that counts its calls and its idle() calls."""

    def __init__(self, length_of):
        super().__init__(length_of)
        self.calls = self.idles = 0

    def __call__(self, contexts, seeds, n_done, max_steps):
        self.calls += 1
        return super().__call__(contexts, seeds, n_done, max_steps)

    def idle(self):
        self.idles += 1


def test_decode_calls_idle_exactly_when_no_row_is_in_flight():
    """options/lockstep.py's scheduler: decode() with no row in flight calls idle() in place of step_fn (a lock-step
    engine's rank joins its peers' forwards there): the step_fn's own, or its owner's for a bound method. The core
    StaleSync calls no idle()."""
    cfg = StaleConfig(staleness=1, groups_per_step=1, group_size=2, threshold=0.5, chunk_steps=2)
    prompt = lambda slot, attempt: torch.tensor([2, 3])  # noqa: E731
    LockStepSync = lockstep.scheduler_class(StaleSync)
    for bound in (False, True):
        sampler = IdleCounting(lambda s: 3)
        sched = LockStepSync(cfg, sampler.__call__ if bound else sampler, prompt)
        assert sched.decode() == 0 and (sampler.idles, sampler.calls) == (1, 0)  # nothing admitted yet
        sched.admit()
        while sched.in_flight():
            assert sched.decode() > 0 and sampler.idles == 1  # rows in flight: the sampler, never idle()
        assert sampler.calls == 2 and sched.decode() == 0 and (sampler.idles, sampler.calls) == (2, 2)
    assert StaleSync(cfg, sampler, prompt).decode() == 0 and sampler.idles == 2  # the core: no idle() called
    assert StaleSync(cfg, ScriptedSampler(lambda s: 3), prompt).decode() == 0  # no idle anywhere: nothing to call
