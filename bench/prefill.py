"""Benchmark the sampler's costs: what one more prefill forward costs, in tokens of work, and what
model._prefill's length buckets gain on the pools a stale rollout holds; and what one decode step costs
by live rows and KV width (the costs bench/simulate.py is calibrated on).

    python bench/prefill.py            # 1 thread, the default policy; about 40 s

model.FORWARD_COST_TOKENS is the price the bucketing DP charges per extra forward. This bench measures
the two things it stands for, in one run:
  forward_cost_tokens   the fixed cost of a forward, in tokens of work: t(1 row x n tokens) fitted as
                        a + b n over a few n, reported as a / b;
  pools                 for each pool (held long-tail rows next to fresh short prompts, the case the
                        buckets are for; only short rows; only fresh prompts): the time of one padded
                        forward against the bucketed prefill, with the number of buckets the DP chose.
A split pays when it saves more padded tokens than the forward costs: the constant should sit near the
measured forward cost, and the bucketed prefill should not be slower than one padded forward beyond
the noise of a timing.
  decode_ms             one decode step (a forward of one token per row with the KV cache, and
                        sampling) for rows in {1, 64, 256} and KV widths {32, 256}.
  generate_s            a whole generate() of 64 and 256 rows, the KV cache compacted by KVCache.compact
                        (the few rows past the live batch move into finished slots) against the naive copy
                        of every live row whenever a row finishes: the same tokens, and the time.
  moe_ms                one MoE layer on N tokens, every expert on every token against each expert on its
                        own tokens, for a few layer shapes, and which of the two the layer runs
                        (model.DENSE_MOE_WORK), marked where it is the slower.
The last line printed is one JSON object.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
import model as M  # noqa: E402


def timed(fn, reps):
    """Median seconds of fn() over reps calls, after one warm call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill(policy, lens, cost):
    """The bucketed prefill of rows of these lengths, with `cost` as the DP's price of a forward:
    (a call that runs it, the number of buckets)."""
    contexts = [torch.randint(4, 14, (n,)) for n in lens]

    @torch.no_grad()
    def call():
        M._prefill(policy, contexts, 0, 1, forward_cost=cost)
    return call, len(M._length_buckets(lens, cost))


def decode_table(policy, reps, rounds=5):
    """ms per decode step, {(rows, KV width): ms}, the cache filled to the width with random keys: the
    median of `rounds` rounds that visit every cell in turn (so that the host's drift hits all alike)."""
    steps = {}
    for rows in (1, 64, 256):
        for width in (32, 256):
            cache = M.KVCache(policy.cfg, rows, width + 1, "cpu", torch.float32)
            tok, pos = torch.zeros(rows, 1, dtype=torch.long), torch.full((rows, 1), width)
            mask = torch.ones(rows, 1, 1, width + 1, dtype=torch.bool)

            @torch.no_grad()
            def step(cache=cache, tok=tok, pos=pos, mask=mask, rows=rows, width=width):
                cache.length = width
                logits = policy(tok, pos, mask, cache)[:, -1]                       # (rows, V)
                M.sample_tokens(logits, torch.rand(rows, dtype=torch.float64))
            steps[(rows, width)] = step
    times = {cell: [] for cell in steps}
    for _ in range(rounds):
        for cell, fn in steps.items():
            times[cell].append(timed(fn, reps))
    return {cell: statistics.median(t) * 1e3 for cell, t in times.items()}


def naive_compact(cache, finished):
    """KVCache.compact the naive way: a copy of every live row, in order."""
    live = (~finished).nonzero().squeeze(-1)
    cache.k, cache.v = cache.k[:, live], cache.v[:, live]
    return live


def compaction_table(policy, reps, rounds=3):
    """A whole generate() of N rows (random contexts of 10 to 30 tokens, up to 33 new tokens, rows ending at EOS
    as the untrained policy samples it), with the cache compacted by KVCache.compact against the naive copy:
    {N: (naive s, compact s, same tokens and log-probs)}, the median of `rounds` interleaved rounds."""
    moved = M.KVCache.compact
    calls, times, same = {}, {}, {}
    for rows in (64, 256):
        contexts = [torch.randint(4, 14, (int(n),)) for n in torch.randint(10, 31, (rows,))]
        seeds = torch.arange(rows)

        @torch.no_grad()
        def call(way, contexts=contexts, seeds=seeds):
            M.KVCache.compact = way
            try:
                return M.generate(policy, contexts, seeds, 33, eos_id=1)
            finally:
                M.KVCache.compact = moved
        calls[rows], times[rows] = call, ([], [])
        a, b = call(naive_compact), call(moved)
        same[rows] = all(map(torch.equal, a.tokens + a.logprobs, b.tokens + b.logprobs))
    for _ in range(rounds):
        for rows, call in calls.items():
            for way, t in zip((naive_compact, moved), times[rows]):
                t.append(timed(lambda: call(way), max(reps // 5, 1)))
    return {rows: (statistics.median(t[0]), statistics.median(t[1]), same[rows]) for rows, t in times.items()}


def moe_table(reps, rounds=3):
    """ms per MoE layer on N tokens, every expert on every token (dense) against each expert on its own
    tokens (sparse), for a few layer shapes: {(D, F, E, N): (dense ms, sparse ms, the layer's choice)}. Both
    compute the same function (equal up to float rounding); model.DENSE_MOE_WORK sets where a layer switches."""
    cells = {}
    for D, Fx, E in ((64, 128, 4), (64, 128, 8), (64, 128, 16), (128, 256, 4), (256, 512, 4)):
        torch.manual_seed(0)
        layer = M.MoE(M.ModelConfig(d_model=D, d_expert=Fx, n_experts=E, top_k=2))
        for N in (16, 32, 64, 128, 256, 512):
            cells[(D, Fx, E, N)] = (layer, torch.randn(N, D))
    times = {cell: ([], []) for cell in cells}
    for _ in range(rounds):  # rounds that visit every cell in turn: the host's drift hits all alike
        for cell, (layer, x) in cells.items():
            choice = layer.dense_below
            for way, below in enumerate((float("inf"), 0)):  # dense, then sparse
                layer.dense_below = below
                with torch.no_grad():
                    times[cell][way].append(timed(lambda: layer(x), reps))
            layer.dense_below = choice
    return {cell: (statistics.median(d) * 1e3, statistics.median(s) * 1e3,
                   "dense" if cell[3] <= cells[cell][0].dense_below else "sparse")
            for cell, (d, s) in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15, help="timed calls per figure (median)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = M.Policy(M.ModelConfig(max_seq_len=320)).eval()
    sizes = [8, 64, 128, 256]
    with torch.no_grad():
        t = [timed(lambda n=n: policy(torch.randint(4, 14, (1, n))), args.reps) for n in sizes]
    b, a = np.polyfit(sizes, t, 1)                                   # t(n) = a + b n, seconds
    rng = np.random.default_rng(0)
    pools = {"24 held long-tail rows + 16 fresh prompts": [int(x) for x in rng.integers(150, 260, 24)] + [18] * 16,
             "128 short held rows": [int(x) for x in rng.integers(18, 60, 128)],
             "64 fresh prompts": [int(x) for x in rng.integers(10, 30, 64)]}
    out = {"forward_cost_tokens": round(a / b, 1), "constant": M.FORWARD_COST_TOKENS, "pools": {}}
    print(f"a forward of 1 row x n tokens: {a * 1e3:.2f} ms + {b * 1e6:.1f} us x n -> fixed cost "
          f"{a / b:.0f} tokens of work (model.FORWARD_COST_TOKENS = {M.FORWARD_COST_TOKENS})")
    for name, lens in pools.items():
        one, _ = prefill(policy, lens, 10 ** 9)                     # a price no split pays: one forward
        split, n_buckets = prefill(policy, lens, M.FORWARD_COST_TOKENS)
        t_one, t_split = timed(one, args.reps), timed(split, args.reps)
        out["pools"][name] = {"one_forward_ms": round(t_one * 1e3, 2), "bucketed_ms": round(t_split * 1e3, 2),
                              "buckets": n_buckets, "speedup": round(t_one / t_split, 2)}
        print(f"{name:42s} one forward {t_one * 1e3:6.1f} ms | {n_buckets} buckets {t_split * 1e3:6.1f} ms "
              f"| x{t_one / t_split:.2f}")
    decode = decode_table(policy, args.reps)
    out["decode_ms"] = {f"{r} rows, width {w}": round(ms, 3) for (r, w), ms in decode.items()}
    print("decode step, ms: " + " | ".join(f"{r} rows x {w}: {ms:.2f}" for (r, w), ms in decode.items()))
    comp = compaction_table(policy, args.reps)
    out["generate_s"] = {f"{n} rows": {"naive_compaction": round(naive, 4), "compact": round(moved, 4),
                                       "speedup": round(naive / moved, 2), "same_tokens_and_logprobs": same}
                         for n, (naive, moved, same) in comp.items()}
    for n, (naive, moved, same) in comp.items():
        print(f"generate, {n:3d} rows: the naive compaction {naive * 1e3:6.1f} ms | KVCache.compact {moved * 1e3:6.1f} "
              f"ms | x{naive / moved:.2f} | the same tokens and log-probs: {same}")
    moe = moe_table(args.reps)
    out["moe_ms"] = {f"D {d} F {f} E {e}, {n} tokens": {"dense": round(dn, 3), "sparse": round(sp, 3), "chosen": c}
                     for (d, f, e, n), (dn, sp, c) in moe.items()}
    for d, f, e, n in moe:
        dn, sp, c = moe[(d, f, e, n)]
        print(f"MoE layer D {d} F {f} E {e} (top-2), {n:3d} tokens: every expert {dn:6.2f} ms | routed "
              f"{sp:6.2f} ms | the layer runs {c}" + ("" if (dn <= sp) == (c == "dense") else " (the slower)"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
