import torch

import pytest

from grpo import token_logprobs
from model import KVCache, ModelConfig, Policy, Sampler, _length_buckets, counter_uniform, generate, sample_tokens

EOS = 1


def _model(seed=0):
    torch.manual_seed(seed)
    return Policy(ModelConfig(vocab_size=14, max_seq_len=64)).eval()


def _contexts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 14, (n,), generator=g) for n in lengths]


def test_cached_decode_matches_full_forward():
    model = _model()
    seq = _contexts([20])[0][None, :]                                   # (1, 20)
    full = model(seq)                                                   # (1, 20, V)
    cache = KVCache(model.cfg, 1, 20, seq.device, torch.float32)
    pos = torch.arange(20)[None, :]
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    step_logits = [model(seq[:, :8], pos[:, :8], mask, cache)]          # prefill 8 tokens
    for t in range(8, 20):                                              # then one token at a time
        m = torch.ones(1, 1, 1, t + 1, dtype=torch.bool)
        step_logits.append(model(seq[:, t:t + 1], pos[:, t:t + 1], m, cache))
    cached = torch.cat(step_logits, dim=1)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)


def test_compacting_the_cache_moves_only_the_rows_it_must():
    cfg = ModelConfig(vocab_size=14, max_seq_len=64)
    cache = KVCache(cfg, 6, 10, "cpu", torch.float32)
    cache.k.normal_(), cache.v.normal_()
    cache.length = 7
    k, v, storage = cache.k.clone(), cache.v.clone(), cache.k.untyped_storage().data_ptr()
    assert cache.compact(torch.zeros(6, dtype=torch.bool)).tolist() == list(range(6))  # none finished: no change
    order = cache.compact(torch.tensor([True, False, False, True, False, False]))
    assert order.tolist() == [4, 1, 2, 5]  # rows 4 and 5, live past the first 4, fill the finished slots 0 and 3
    assert torch.equal(cache.k[..., :7, :], k[:, order, :, :7]) and torch.equal(cache.v[..., :7, :], v[:, order, :, :7])
    assert cache.k.shape[1] == 4 and cache.k.untyped_storage().data_ptr() == storage  # a view: nothing copied whole
    order = cache.compact(torch.tensor([False, False, True, True]))  # the finished rows are the last: none moves
    assert order.tolist() == [0, 1] and torch.equal(cache.k[..., :7, :], k[:, [4, 1], :, :7])
    assert cache.compact(torch.ones(2, dtype=torch.bool)).tolist() == [] and cache.k.shape[1] == 0


def test_compacting_by_moving_rows_samples_what_copying_every_live_row_samples(monkeypatch):
    model, ctxs = _model(), _contexts([2, 11, 6, 6, 1, 15, 9, 3])
    moved = generate(model, ctxs, torch.arange(8), max_new_tokens=20, eos_id=EOS)

    def copy_live(cache, finished):  # the naive compaction: every live row copied, in order
        live = (~finished).nonzero().squeeze(-1)
        cache.k, cache.v = cache.k[:, live], cache.v[:, live]
        return live
    monkeypatch.setattr(KVCache, "compact", copy_live)
    copied = generate(model, ctxs, torch.arange(8), max_new_tokens=20, eos_id=EOS)
    assert len({len(t) for t in copied.tokens}) > 2  # rows finish at different steps: the batch is compacted
    assert all(map(torch.equal, moved.tokens, copied.tokens))
    for a, b in zip(moved.logprobs, copied.logprobs):  # a row's place in a small batch can move a kernel's rounding
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_generate_logprobs_equal_training_forward():
    model = _model()
    ctxs = _contexts([3, 9, 5, 12])
    for temperature in (1.0, 0.7):
        gen = generate(model, ctxs, seeds=torch.arange(4), max_new_tokens=15, eos_id=EOS,
                       temperature=temperature)
        for c, toks, lps in zip(ctxs, gen.tokens, gen.logprobs):
            assert len(toks) > 0
            seq = torch.cat([c, toks])[None, :]
            logits = model(seq)[:, len(c) - 1:-1]                       # predicts each response token
            ref = token_logprobs(logits, toks[None, :], temperature)[0]
            torch.testing.assert_close(lps, ref, atol=1e-5, rtol=0)


def test_batch_of_mixed_lengths_equals_each_alone():
    model = _model()
    ctxs = _contexts([2, 11, 6, 6, 1, 15])
    seeds = torch.tensor([5, 6, 7, 8, 9, 10])
    batch = generate(model, ctxs, seeds, max_new_tokens=20, eos_id=EOS)
    for i, c in enumerate(ctxs):
        alone = generate(model, [c], seeds[i:i + 1], max_new_tokens=20, eos_id=EOS)
        assert torch.equal(batch.tokens[i], alone.tokens[0])
        torch.testing.assert_close(batch.logprobs[i], alone.logprobs[0], atol=1e-5, rtol=0)
        assert batch.done[i] and alone.done[0]


def test_length_buckets_are_an_optimal_partition():
    """The prefill's buckets cover every row once and minimise padded tokens + a forward's fixed cost,
    checked against every split of the rows sorted by length."""
    import itertools
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        B = int(torch.randint(1, 8, (1,), generator=g))
        lens = torch.randint(1, 300, (B,), generator=g).tolist() if trial % 4 else [16] * B
        cost = int(torch.randint(0, 300, (1,), generator=g))
        buckets = _length_buckets(lens, cost)
        assert sorted(i for b in buckets for i in b) == list(range(B))
        assert all(b == sorted(b) for b in buckets)
        got = sum(len(b) * max(lens[i] for i in b) + cost for b in buckets)
        srt = sorted(lens, reverse=True)
        best = min(sum((e - s) * srt[s] + cost for s, e in zip((0,) + cuts, cuts + (B,)))
                   for n in range(B) for cuts in itertools.combinations(range(1, B), n))
        assert got == best
        if len(set(lens)) == 1:
            assert len(buckets) == 1  # equal lengths: one forward, as before


def test_prefill_in_length_buckets_equals_each_alone():
    """Long held rows and short new prompts are prefilled in separate forwards (no short row padded to the
    longest); every row still samples what it samples alone, in one call or merged into a held cache."""
    model = _model()
    ctxs = _contexts([40, 2, 3, 44, 1, 4, 2, 3, 5, 1, 2])
    assert len(_length_buckets([len(c) for c in ctxs])) > 1
    seeds = torch.arange(21, 32)
    batch = generate(model, ctxs, seeds, max_new_tokens=15, eos_id=EOS)
    # The same rows through a caching Sampler: two held rows, then the rest merged in (their prefill split).
    sampler = Sampler(model, 15, EOS)
    first = sampler(ctxs[:2], seeds[:2], max_steps=2)
    assert not any(first.done) and len(_length_buckets([len(c) for c in ctxs[2:]])) > 1
    rest = sampler([torch.cat([c, t]) for c, t in zip(ctxs[:2], first.tokens)] + ctxs[2:], seeds,
                   n_done=[len(t) for t in first.tokens] + [0] * (len(ctxs) - 2))
    for i, c in enumerate(ctxs):
        alone = generate(model, [c], seeds[i:i + 1], max_new_tokens=15, eos_id=EOS)
        assert len(alone.tokens[0]) > 1
        assert torch.equal(batch.tokens[i], alone.tokens[0])
        torch.testing.assert_close(batch.logprobs[i], alone.logprobs[0], atol=1e-5, rtol=0)
        toks = torch.cat([first.tokens[i], rest.tokens[i]]) if i < 2 else rest.tokens[i]
        lps = torch.cat([first.logprobs[i], rest.logprobs[i]]) if i < 2 else rest.logprobs[i]
        assert torch.equal(toks, alone.tokens[0])
        torch.testing.assert_close(lps, alone.logprobs[0], atol=1e-5, rtol=0)


def test_stops_at_eos_or_budget():
    model = _model()
    gen = generate(model, _contexts([4] * 16), torch.arange(16), max_new_tokens=6, eos_id=EOS)
    for toks in gen.tokens:
        assert 1 <= len(toks) <= 6
        assert (toks[:-1] != EOS).all()                  # EOS only ever as the last token
        assert len(toks) == 6 or toks[-1] == EOS


def test_cut_and_continue_equals_one_round():
    model = _model()
    ctxs, seeds = _contexts([3, 7, 5]), torch.tensor([1, 2, 3])
    whole = generate(model, ctxs, seeds, max_new_tokens=25, eos_id=EOS, temperature=1.3)
    part = generate(model, ctxs, seeds, max_new_tokens=25, eos_id=EOS, temperature=1.3, max_steps=4)
    cut = [i for i in range(3) if not part.done[i]]
    assert cut, "the test needs at least one row cut part-way"
    rest = generate(model, [torch.cat([ctxs[i], part.tokens[i]]) for i in cut], seeds[cut],
                    max_new_tokens=25, eos_id=EOS, temperature=1.3,
                    n_done=[len(part.tokens[i]) for i in cut])
    for i in range(3):
        toks, lps = part.tokens[i], part.logprobs[i]
        if i in cut:
            j = cut.index(i)
            toks, lps = torch.cat([toks, rest.tokens[j]]), torch.cat([lps, rest.logprobs[j]])
        assert torch.equal(toks, whole.tokens[i])
        torch.testing.assert_close(lps, whole.logprobs[i], atol=1e-5, rtol=0)


def test_sampler_keeps_its_cache_across_chunks():
    """Rows decoded in chunks by a Sampler that keeps its cache, with new rows merged in midway, give the
    tokens of one uncut call; a chunk of held rows only reads no prefix again (no multi-token forward)."""
    model = _model()
    ctxs, seeds = _contexts([3, 9, 5, 12, 1, 7]), [11, 12, 13, 14, 15, 16]
    whole = generate(model, ctxs, torch.tensor(seeds), max_new_tokens=30, eos_id=EOS, temperature=1.2)
    sampler, got, prefills = Sampler(model, 30, EOS, temperature=1.2), {s: [[], []] for s in seeds}, []
    hook = model.register_forward_pre_hook(lambda m, a: prefills.append(a[0].shape[1] > 1))
    live, waiting, merged = seeds[:3], seeds[3:], False
    while live or waiting:
        add, waiting = waiting[:2], waiting[2:]
        merged |= bool(add) and bool(live)
        live = live + add
        n_done = [len(got[s][0]) for s in live]
        contexts = [torch.cat([ctxs[seeds.index(s)], torch.tensor(got[s][0], dtype=torch.long)]) for s in live]
        out = sampler(contexts, torch.tensor(live), n_done, max_steps=3)
        assert any(prefills) == bool(add)  # a prefix is read once: only new rows are prefilled
        if sampler.state is not None:  # no column that is padding in every row survives a merge
            assert sampler.state["k"].shape[3] <= max(map(len, contexts)) + 3
        prefills.clear()
        for s, t, lp in zip(live, out.tokens, out.logprobs):
            got[s][0] += t.tolist()
            got[s][1] += lp.tolist()
        live = [s for s, d in zip(live, out.done) if not d]
    hook.remove()
    assert merged, "the test needs new rows merged into a held cache"
    for i, s in enumerate(seeds):
        assert got[s][0] == whole.tokens[i].tolist()
        torch.testing.assert_close(torch.tensor(got[s][1]), whole.logprobs[i], atol=1e-5, rtol=0)
    assert sampler.state is None  # every row finished: nothing held


def test_length_limit_is_checked_per_row():
    """A long held row near the end of its budget decodes next to a fresh prompt with a large budget: each
    row fits max_seq_len (64) though the longest context plus the chunk does not (58 + 8)."""
    model = _model()
    ctxs, seeds = _contexts([58, 5]), torch.tensor([1, 2])
    out = generate(model, ctxs, seeds, max_new_tokens=34, eos_id=None, n_done=[30, 0], max_steps=8)
    assert [len(t) for t in out.tokens] == [4, 8] and out.done == [True, False]
    for i in range(2):  # as each row alone
        alone = generate(model, ctxs[i:i + 1], seeds[i:i + 1], 34, None, n_done=[[30, 0][i]], max_steps=8)
        assert torch.equal(alone.tokens[0], out.tokens[i])
    with pytest.raises(ValueError, match="row 0: context 60 \\+ 8 new tokens exceeds max_seq_len=64"):
        generate(model, _contexts([60, 5]), seeds, max_new_tokens=34, eos_id=None, n_done=[20, 0], max_steps=8)


def test_sampler_refuses_a_changed_context_and_reset_drops_the_cache():
    model = _model()
    ctxs = _contexts([4, 6])
    sampler = Sampler(model, 20, eos_id=None)  # no EOS: every row runs to its budget
    out = sampler(ctxs, torch.tensor([1, 2]), max_steps=2)
    assert not any(out.done) and sampler.state is not None
    with pytest.raises(RuntimeError, match="not the one it was cut with"):  # the tokens made not appended
        sampler(ctxs, torch.tensor([1, 2]), n_done=[2, 2], max_steps=2)
    other = [torch.cat([c, (t + 1) % 14]) for c, t in zip(ctxs, out.tokens)]  # the right length, other tokens
    with pytest.raises(RuntimeError, match="not the one it was cut with"):
        sampler(other, torch.tensor([1, 2]), n_done=[2, 2], max_steps=2)
    with pytest.raises(ValueError, match="distinct seeds"):  # rows are keyed by seed
        sampler(ctxs, torch.tensor([3, 3]), max_steps=2)
    with torch.no_grad():  # new weights: a held cache is now stale
        model.head.weight.mul_(-1.0)
    ctxs2 = [torch.cat([c, t]) for c, t in zip(ctxs, out.tokens)]
    fresh = generate(model, ctxs2, torch.tensor([1, 2]), 20, None, n_done=[2, 2])
    stale = Sampler(model, 20, eos_id=None)
    stale.state = sampler.state  # the cache kept under the old weights
    stale = stale(ctxs2, torch.tensor([1, 2]), n_done=[2, 2])
    assert not all(torch.allclose(a, b) for a, b in zip(stale.logprobs, fresh.logprobs))
    sampler.reset()
    again = sampler(ctxs2, torch.tensor([1, 2]), n_done=[2, 2])
    assert all(again.done) and [len(t) for t in again.tokens] == [18, 18]
    assert all(torch.equal(a, b) for a, b in zip(again.tokens, fresh.tokens))
    assert all(torch.equal(a, b) for a, b in zip(again.logprobs, fresh.logprobs))  # a fresh call, exactly


@pytest.mark.parametrize("kw, match", [(dict(temperature=-1.0), "temperature=-1.0"),
                                       (dict(temperature=float("nan")), "temperature=nan"),
                                       (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5")])
def test_bad_sampling_arguments_and_an_empty_context_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampler(_model(), 4, EOS, **kw)
    with pytest.raises(ValueError, match="row 1: an empty context"):
        generate(_model(), [torch.tensor([3]), torch.tensor([], dtype=torch.long)], torch.tensor([1, 2]), 4, EOS)


def test_sampler_follows_the_distribution_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(20000, 4)
    u = counter_uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    tok, _ = sample_tokens(logits, u)
    freq = torch.bincount(tok, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    tok, _ = sample_tokens(logits, u, top_p=0.7)                  # nucleus {0, 1}
    freq = torch.bincount(tok, minlength=4).float() / 20000
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.625) < 0.015


def test_greedy_is_argmax():
    model = _model()
    ctxs = _contexts([5, 8])
    gen = generate(model, ctxs, torch.arange(2), max_new_tokens=10, eos_id=EOS, temperature=0)
    for c, toks in zip(ctxs, gen.tokens):
        seq = torch.cat([c, toks])[None, :]
        assert torch.equal(model(seq)[0, len(c) - 1:-1].argmax(-1), toks)


def _lockstep_rank(rank, world_size):
    """Rank 0 decodes rows of very different lengths in chunks of 3 steps: its first call prefills two length buckets
    (a long continued row among short prompts) where rank 1's prefills one; its second call merges new rows into
    held ones; one row has no budget left (0 tokens) and one finishes at its first token (budget 1). Rank 1 decodes
    one short row, finishes first and then only idles. Their engine holds half the experts each (EP 2), so every
    forward sends tokens across. Returns each rank's tokens next to a dense world-of-one engine's on the same rows,
    its dummy forwards, the buckets of its first prefill, whether a call mixed held and new rows, and greedy
    decoding's tokens against the dense engine's."""
    import torch.distributed as dist
    from moe_switch import EPLayout, EPMoE
    from plumbing.moe_switch_details import new_groups
    from options.lockstep import LockStep, sampler_class
    model = _model()
    ctxs, seeds = _contexts([3, 58, 6, 5, 2, 4, 3, 2, 5, 20, 4, 4]), list(range(11, 23))
    n_done = [0, 27, 30, 29] + [0] * 8  # row 1: a long prefix with 3 tokens left; row 2: none left; row 3: one
    mine, (live, later) = ([*range(11)], ([*range(9)], [9, 10])) if rank == 0 else ([11], ([11], []))
    whole = generate(model, ctxs, torch.tensor(seeds), max_new_tokens=30, eos_id=EOS, temperature=1.2, n_done=n_done)
    layout = EPLayout(2, world_size, model.cfg.n_experts)
    group = new_groups(layout)[0]
    for block in model.blocks:
        block.moe = EPMoE.from_dense(block.moe, layout, group)
    lockstep = LockStep(group, "cpu", every=2)
    sampler, got, mixed = sampler_class(Sampler, lockstep)(model, 30, EOS, temperature=1.2), {i: [] for i in mine}, False
    buckets = len(_length_buckets([len(ctxs[i]) for i in live]))
    while True:  # one call per turn on every rank, until every rank is done (the cut's role in a run)
        held = set(sampler.state["seeds"]) if sampler.state is not None else set()
        mixed |= bool(held & {seeds[i] for i in live}) and bool({seeds[i] for i in live} - held)
        contexts = [torch.cat([ctxs[i], torch.tensor(got[i], dtype=torch.long)]) for i in live]
        out = sampler(contexts, torch.tensor([seeds[i] for i in live]), [n_done[i] + len(got[i]) for i in live],
                      max_steps=3)
        for i, t in zip(live, out.tokens):
            got[i] += t.tolist()
        live, later = [i for i, d in zip(live, out.done) if not d] + later, []  # new rows join the held ones
        busy = torch.tensor([len(live)])
        dist.all_reduce(busy)
        if not busy.item():
            break
    rows = mine if rank == 0 else []  # rank 1: no rows at all
    greedy = sampler.fresh(temperature=0)([ctxs[i] for i in rows], torch.zeros(len(rows)),
                                          n_done=[n_done[i] for i in rows])
    want_greedy = generate(_model(), [ctxs[i] for i in rows], torch.zeros(len(rows)), 30, EOS, temperature=0,
                           n_done=[n_done[i] for i in rows]) if rows else greedy
    return ([got[i] for i in mine], [whole.tokens[i].tolist() for i in mine], lockstep.dummy_forwards, buckets,
            mixed, [t.tolist() for t in greedy.tokens], [t.tolist() for t in want_greedy.tokens])


def test_expert_parallel_engine_decodes_in_lock_step_as_one_process_does():
    """EP 2 over 2 ranks with unequal work: a rank with fewer prefill buckets, no rows left (or none at all) runs
    dummy forwards of zero rows, so its experts still serve its peer's tokens; the tokens are those of a dense
    engine in one process, rows with no budget and rows finishing at their first token included."""
    from tests.distributed import run_distributed
    out = run_distributed(_lockstep_rank, world_size=2, timeout_s=120)
    for rank, (got, want, dummies, buckets, mixed, greedy, want_greedy) in enumerate(out):
        assert got == want, rank
        assert greedy == want_greedy, rank
    (got, _, _, buckets0, mixed0, _, _), (_, _, dummies1, buckets1, _, _, _) = out
    assert buckets0 >= 2 and buckets1 == 1  # the ranks' first prefills run different numbers of forwards
    assert mixed0, "the test needs a call that merges new rows into held ones"
    assert got[2] == [] and len(got[3]) == 1  # budget 0: no token; budget 1: done at step 0
    assert dummies1 > 0  # rank 1 finished first and idled through rank 0's forwards
