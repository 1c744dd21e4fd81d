"""DistQueue: packing, exactly-once delivery, token balance, failure, checkpoint; SelectiveQueue's reads (only,
min_rows, hierarchical), puts of more columns, drain.

python -m pytest tests/test_distqueue.py
"""
import datetime
import os
import random
import re
import time

import pytest
import torch
import torch.distributed as dist

import distqueue as dq
import options.selective_queue as sq
from options.selective_queue import SelectiveQueue  # get(only=, min_rows=, group=), put(ids=), drain()
from options.selective_queue import new_token
from plumbing.distqueue_details import pack, unpack, unpack_cells, unpad
from tests.distributed import run_distributed

COLS = {"prompt": "int64", "response": "int64", "logp": "float32", "reward": "float32"}


def _row(r):
    """Deterministic content of row r, so any rank can check what it received."""
    n = (r * 7919) % 23  # lengths 0..22, including 0 and 1
    return {"prompt": torch.arange(r % 5 + 1) + 100 * r, "response": torch.arange(n) + r,
            "logp": torch.linspace(-1, 0, n) - r, "reward": float(r)}


def _check(batch, cols):
    """Number of cells whose content differs from _row(id)."""
    bad = 0
    for i, r in enumerate(batch.ids):
        for c in cols:
            want = _row(r)[c]
            want = torch.tensor([want]) if c == "reward" else want
            bad += not torch.equal(batch.cols[c][i], want)
    return bad


# ---------------------------------------------------------------- single process


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16])
def test_pack_unpack_round_trip_matches_padded_reference(dtype):
    g = torch.Generator().manual_seed(0)
    lengths = [0, 1, 0, 5, 1] + torch.randint(0, 40, (20,), generator=g).tolist()
    seqs = [(torch.randn(n, generator=g) * 100).to(dtype) for n in lengths]
    flat, lens = pack(seqs)
    assert flat.numel() == sum(lengths) and lens.tolist() == lengths
    padded, plens = dq.pad(seqs)
    for a, b, c in zip(unpack(flat, lens), unpad(padded, plens), seqs):
        assert a.dtype == dtype and torch.equal(a, c) and torch.equal(b, c)
    assert flat.numel() < padded.numel()  # packing sends less than padding on uneven lengths
    mixed = seqs + [torch.arange(n) for n in lengths]  # one header, one payload, two dtypes
    header, payload = dq.pack_cells(mixed)
    payload = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])[3:]  # a slice of a larger buffer, offset 3
    out = unpack_cells(header, payload, [dtype] * len(seqs) + [torch.int64] * len(lengths))
    assert all(o.dtype == m.dtype and torch.equal(o, m) for o, m in zip(out, mixed))
    for o in out[::2]:  # cells view the payload or copy it, and never overlap: a consumer writes into one only
        o.fill_(7)
    assert all(torch.equal(o, m) for o, m in zip(out[1::2], mixed[1::2]))


def test_malformed_input_rejected_before_anything_is_published():
    with pytest.raises(ValueError, match=r"lengths \[2, 2\] \(sum 4\).*5 elements"):
        unpack(torch.arange(5), [2, 2])
    with pytest.raises(ValueError, match="unknown dtypes.*'int7'"):
        dq.QueueSpec(columns={"x": "int7"}, stages={"s": ("x",)})
    with pytest.raises(ValueError, match=r"stage 's'.*unknown \['y'\]"):
        dq.QueueSpec(columns={"x": "int64"}, stages={"s": ("x", "y")})
    spec = dq.QueueSpec(columns=COLS, scalars=("reward",), stages={"t": tuple(COLS)}, timeout_s=0.2)
    store = dq.default_store()
    q = dq.DistQueue(spec, store)
    with pytest.raises(KeyError, match="unknown column 'respone'.*'response'"):
        q.put({"prompt": [torch.arange(3)], "respone": [torch.arange(3)]})
    with pytest.raises(TypeError, match="column 'response' row 0: dtype torch.float32, expected torch.int64"):
        q.put({"prompt": [torch.arange(3)], "response": [torch.ones(3)]})
    with pytest.raises(ValueError, match="column 'reward' row 0: shape"):
        q.put({"reward": [torch.ones(2)]})
    with pytest.raises(KeyError, match="unknown stage 'trian'"):
        q.get("trian", 1)
    assert not q.cells and not store.check(["dq/ready/n"])  # nothing was published
    assert q.put({"prompt": [torch.arange(3)]}) == [0]  # and the first valid row still gets id 0


def test_balance_split_long_tail_within_longest_sample():
    g = torch.Generator().manual_seed(1)
    tokens = torch.distributions.LogNormal(5.0, 1.5).sample((256,)).ceil().long().tolist()
    for parts in (2, 3, 4, 8):
        split = dq.balance_split(tokens, parts)
        assert sorted(i for p in split for i in p) == list(range(256))
        loads = [sum(tokens[i] for i in p) for p in split]
        assert max(loads) - min(loads) <= max(tokens)
    naive = [sum(tokens[i::4]) for i in range(4)]  # row-count balance is not token balance here
    assert max(naive) - min(naive) > max(loads) - min(loads)


def test_balance_split_keeps_rows_home_where_balance_allows():
    """Colocated, the readers wrote the rows: a row leaves its writer only to even out the loads."""
    g = torch.Generator().manual_seed(2)
    for sigma, parts in [(1.5, 2), (1.5, 4), (0.5, 2), (0.5, 4)]:
        tokens = (4.0 + sigma * torch.randn(512, generator=g)).exp().ceil().long().tolist()  # log-normal
        homes = [i % parts for i in range(512)]  # row ids are local_count * world + writer
        split = dq.balance_split(tokens, parts, homes)
        assert sorted(i for p in split for i in p) == list(range(512))
        loads = [sum(tokens[i] for i in p) for p in split]
        assert max(loads) - min(loads) <= max(tokens)
        fair = sum(tokens) / parts
        for p in range(parts):  # what leaves a home is less than its excess over a fair share plus one row
            mine = [i for i in range(512) if homes[i] == p]
            moved = sum(tokens[i] for i in mine if i not in split[p])
            assert moved < max(0.0, sum(tokens[i] for i in mine) - fair) + max(tokens)
        away = sum(homes[i] != p for p, rows in enumerate(split) for i in rows)
        lpt_away = sum(homes[i] != p for p, rows in enumerate(dq.balance_split(tokens, parts)) for i in rows)
        assert lpt_away > 512 // 3 and (away < 512 // 20 if sigma < 1 else away < lpt_away)  # LPT sends most away
    assert dq.balance_split([5, 3, 3, 5], 2, [0, 0, 1, 1]) == [[0, 1], [2, 3]]  # balanced homes: nothing moves
    for tokens, parts, homes in (([4, 1, 1], 3, [0, 0, 0]), ([0, 0, 0, 0], 2, [0] * 4), ([7, 0, 0], 3, [1] * 3)):
        split = dq.balance_split(tokens, parts, homes)  # all would stay home: every part still gets a row
        assert all(split) and sorted(sum(split, [])) == list(range(len(tokens)))
    assert dq.balance_split([5, 3, 3, 5], 2, [None] * 4) == dq.balance_split([5, 3, 3, 5], 2)  # no home: LPT


def test_state_dict_resume_is_bit_exact():
    spec = dq.QueueSpec(columns=COLS, scalars=("reward",), stages={"a": ("prompt",), "b": tuple(COLS)})

    def fill(q):
        q.put({c: [_row(r)[c] for r in range(12)] for c in COLS})
        return q.get("a", 5), q.get("b", 3)

    q1 = dq.DistQueue(spec, dq.default_store())
    fill(q1)
    sd = q1.state_dict()
    saved = {k: t.clone() for k, t in sd["cells"].items()}
    q2 = dq.DistQueue(spec, dq.default_store())  # a fresh store, as after a restart
    q2.load_state_dict(sd)
    for q in (q1, q2):
        q.put({c: [_row(r)[c] for r in range(12, 14)] for c in COLS})
    for stage, n in (("a", 9), ("b", 11)):
        b1 = q1.get(stage, n)
        assert _check(b1, spec.stages[stage]) == 0
        for cells in b1.cols.values():  # q1's consumer writes into its batch (b takes the queue's own cells)
            for t in cells:
                t.fill_(-1)
        b2 = q2.get(stage, n)  # neither the state dict nor the queue loaded from it sees that
        assert b1.ids == b2.ids and _check(b2, spec.stages[stage]) == 0
    assert all(torch.equal(sd["cells"][k], t) for k, t in saved.items())
    assert not q1.cells and not q2.cells  # every cell reached both stages, then was freed


def test_only_takes_the_named_rows():
    """A reader that must take one given batch (the separated trainer when generators run ahead)."""
    spec = dq.QueueSpec(columns=COLS, scalars=("reward",), stages={"b": tuple(COLS)}, timeout_s=0.2)
    q = SelectiveQueue(spec, dq.default_store())
    q.put({c: [_row(r)[c] for r in range(8)] for c in COLS})
    assert q.get("b", 3, only={5, 2, 7}).ids == [2, 5, 7]
    assert q.get("b", 2).ids == [0, 1]                      # the rest, oldest first
    with pytest.raises(TimeoutError, match="waiting for 1 more rows"):
        q.get("b", 1, only={5})                             # taken already: never again


def test_a_get_that_times_out_strands_no_row_and_only_the_last_stage_takes_the_queues_own_cells():
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"a": ("x",), "b": ("x",)}, timeout_s=0.2)
    q = dq.DistQueue(spec, dq.default_store())
    buf = torch.arange(4)
    q.put({"x": [buf, buf + 10, buf + 20]})
    buf.zero_()  # the producer reuses its buffer: the queue kept its own copy
    with pytest.raises(TimeoutError, match="waiting for 4 more rows"):
        q.get("a", 4)  # 3 rows only: it claims none of them
    q.put({"x": [torch.arange(2)]})
    got = q.get("a", 4)
    assert got.ids == [0, 1, 2, 3] and torch.equal(got.cols["x"][0], torch.arange(4))
    got.cols["x"][1].fill_(7)  # a consumer writes into its batch: stage b still reads what was put
    held = [q.cells[(r, "x")] for r in range(4)]
    last = q.get("b", 4)  # b reads them last: it takes the queue's own cells, which the queue then frees
    assert [t.tolist() for t in last.cols["x"]] == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23], [0, 1]]
    assert all(t is h for t, h in zip(last.cols["x"], held)) and not q.cells
    with pytest.raises(ValueError, match=r"stage names \['a\|b', 'x y'\]"):  # they would break the control messages
        dq.QueueSpec(columns={"x": "int64"}, stages={"a|b": ("x",), "x y": ("x",)})
    with pytest.raises(ValueError, match=r"header lengths \[2, 0, 5\]"):  # one more cell than dtypes
        unpack_cells(torch.tensor([2, 0, 5]), torch.zeros(16, dtype=torch.uint8), [torch.int64] * 2)


def test_a_second_reader_of_a_stage_is_refused_naming_the_first():
    """DistQueue's claim is the reader's own bookkeeping: a second queue reading the same stage would take
    the same rows, so its first read is refused, naming the first reader and SelectiveQueue."""
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"a": ("x",), "b": ("x",)}, timeout_s=0.2)
    store = dist.HashStore()
    q, other = dq.DistQueue(spec, store), dq.DistQueue(spec, store)
    q.put({"x": [torch.arange(2)] * 4})
    assert q.get("a", 2).ids == [0, 1]
    with pytest.raises(ValueError, match="stage 'a' is read by queue 1 on rank 0; queue 2 on rank 0 may not .*"
                                         "SelectiveQueue"):
        other.get("a", 2)
    assert q.get("a", 2).ids == [2, 3] and q.get("b", 4).ids == [0, 1, 2, 3]  # the refused read took nothing


def test_the_ready_log_keeps_only_the_keys_some_stage_has_not_read():
    """A long run must not grow the store: each ready-log key goes once every stage's reader read it."""
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"a": ("x",), "b": ("x",)}, timeout_s=0.2)
    store = dist.HashStore()
    q = dq.DistQueue(spec, store)
    for _ in range(3):
        q.put({"x": [torch.arange(2)] * 2})
    keys = [f"dq/ready/{i}" for i in range(3)]
    assert q.get("a", 6).ids == list(range(6)) and all(store.check([k]) for k in keys)  # b has not read them
    assert q.get("b", 4).ids == [0, 1, 2, 3] and not any(store.check([k]) for k in keys)
    q.put({"x": [torch.arange(2)]})  # row 6: the log goes on where it was
    assert q.get("b", 3).ids == [4, 5, 6] and q.get("a", 1).ids == [6] and not store.check(["dq/ready/3"])


def test_an_idle_poll_fetches_nothing_old():
    """A reader polls the ready log at every wait: it must fetch only new entries, not the whole history
    (600 steps of train_grpo's defaults made each poll fetch 0.8 MB per column, when each column had its own log)."""
    class CountingStore:
        def __init__(self):
            self.store, self.got = dist.HashStore(), 0

        def get(self, key):
            value = self.store.get(key)
            self.got += len(value)
            return value

        def multi_get(self, keys):
            values = self.store.multi_get(keys)
            self.got += sum(len(v) for k, v in zip(keys, values) if not k.endswith("/n"))  # not the counters
            return values

        def __getattr__(self, name):
            return getattr(self.store, name)
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"a": ("x",)}, timeout_s=0.1)
    store = CountingStore()
    q = dq.DistQueue(spec, store)
    for _ in range(20):
        q.put({"x": [torch.arange(3)] * 4})
    assert len(q.get("a", 80).ids) == 80
    assert store.got > 20 * 4 * len("0,0,0,3;")  # the 20 puts' entries were read (once)
    before = store.got
    with pytest.raises(TimeoutError):
        q.get("a", 1)  # polls for 0.1 s: nothing new
    assert store.got == before


def test_a_ready_entry_counted_before_it_is_written_is_read_once_in_order():
    """A writer counts an entry, then writes it: a reader that polls in between reads the entries before it, and the
    counted one (and those after it) at a later poll, each once."""
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"a": ("x",)}, timeout_s=0.1)
    store = dist.HashStore()
    q = dq.DistQueue(spec, store)
    q.put({"x": [torch.arange(2)]})                      # entry 0: row 0
    i = int(store.add(q._k("ready", "n"), 1)) - 1       # entry 1 counted, not yet written
    assert len(q.get("a", 1).ids) == 1                   # row 0 only
    with pytest.raises(TimeoutError, match="no unclaimed row"):
        q.get("a", 1)
    store.set(q._k("ready", i), "1,0,0,2;")             # entry 1 written: row 1, column 0, owner 0
    q.cells[(1, "x")] = torch.arange(2)
    q.next_local = 2
    assert q.get("a", 1).ids == [1]                      # read after entry 0
    with pytest.raises(TimeoutError, match="no unclaimed row"):
        q.get("a", 1)                                    # and once


def test_a_read_claims_its_rows_in_a_few_store_round_trips():
    """A claim costs two store round trips per block of CLAIM_BLOCK row ids (an append, a read of the
    block's log), not one per row: 80 rows over two blocks take 4, where a claim per row took 80."""
    class CountingStore:
        def __init__(self):
            self.store, self.calls = dist.HashStore(), []

        def __getattr__(self, name):
            op = getattr(self.store, name)

            def counted(*args, **kwargs):
                self.calls.append((name, args[0] if args else None))
                return op(*args, **kwargs)
            return counted
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"a": ("x",)}, timeout_s=5)
    store = CountingStore()
    q = SelectiveQueue(spec, store)
    block, saved = 40, sq.CLAIM_BLOCK
    sq.CLAIM_BLOCK = block
    try:
        for _ in range(20):
            q.put({"x": [torch.arange(3)] * 4})
        store.calls.clear()
        assert q.get("a", 80).ids == list(range(80))
        claims = [key for op, key in store.calls if "claims" in str(key)]
        assert len(claims) == 2 * 80 // block, claims
        assert q.get("a", 1, min_rows=0).ids == []  # every row is taken: nothing is claimed twice
        # a second reader of the same store, rank and queue name (a restarted process) wins only what is left
        q.put({"x": [torch.arange(3)] * 3})  # rows 80, 81, 82
        other = SelectiveQueue(spec, store)
        other._read_ready("a")
        assert sorted(other._claim_rows("a", [78, 79, 80, 81], new_token(other))) == [80, 81]
        q._read_ready("a")
        assert sorted(q._claim_rows("a", [81, 82], new_token(q))) == [82]
    finally:
        sq.CLAIM_BLOCK = saved


def test_a_get_of_more_rows_than_exist_says_how_many_and_what_to_do():
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"a": ("x",)}, timeout_s=0.2)
    q = SelectiveQueue(spec, dq.default_store())
    q.put({"x": [torch.arange(3)] * 3})
    with pytest.raises(TimeoutError) as e:
        q.get("a", 5)
    assert "3 unclaimed rows have every column, and this get asked for 5" in str(e.value)
    assert "put more rows" in str(e.value) and "missing columns" not in str(e.value)
    assert q.get("a", 5, min_rows=3).ids == [0, 1, 2]  # the timeout claimed nothing


def _entries(x):
    """Entries of nested containers (dicts, sets, lists, tuples); tensors are not looked into."""
    if isinstance(x, dict):
        return len(x) + sum(_entries(v) for v in x.values())
    if isinstance(x, (list, set, tuple)):
        return len(x) + sum(_entries(v) for v in x)
    return 0


def test_a_poll_scans_only_the_rows_not_yet_claimed():
    """A claim poll scans what the queue holds per row: after 2,000 rows put and read in two stages, that
    follows the rows still unread, not every row ever put."""
    spec = dq.QueueSpec(columns={"x": "int64", "y": "int64"}, stages={"a": ("x", "y"), "b": ("x",)}, timeout_s=5)
    q = SelectiveQueue(spec, dist.HashStore())
    for _ in range(100):
        q.put({"x": [torch.arange(3)] * 20, "y": [torch.arange(2)] * 20})
        assert len(q.get("a", 20).ids) == 20 and len(q.get("b", 20).ids) == 20
    q.put({"x": [torch.arange(3)] * 5})  # 5 rows more: stage a waits for their y
    assert q.get("a", 1, min_rows=0).ids == [] and len(q.get("b", 2).ids) == 2
    held = _entries({k: v for k, v in vars(q).items() if k not in ("spec", "store")})
    assert held < 100, held
    assert len(q.unclaimed["a"]) == 5 and len(q.unclaimed["b"]) == 3  # what a poll of each stage scans


# ---------------------------------------------------------------- multi-rank


def _exactly_once(rank, world, rows_per_producer):
    """Ranks 2, 3 produce rows with random sleeps; ranks 0, 1 consume 'score', write 'reward' (so the
    consumers are producers too), and consume 'train', which pulls cells from two owners per row. Both
    consumers race for the same rows."""
    spec = dq.QueueSpec(columns={c: COLS[c] for c in ("prompt", "response", "reward")}, scalars=("reward",),
                        stages={"score": ("prompt", "response"), "train": ("prompt", "response", "reward")},
                        timeout_s=30, poll_s=0.005)
    sq.CLAIM_BLOCK = 5  # claims race over several claim logs, and one claim can span two of them
    store = dq.default_store()
    q = SelectiveQueue(spec, store, rank, world)
    rng, total = random.Random(rank), 2 * rows_per_producer
    out = {"produced": [], "score": [], "train": [], "bad": 0}
    if rank >= 2:
        for _ in range(rows_per_producer):
            time.sleep(rng.uniform(0, 0.03))
            r = q.next_local * world + rank
            out["produced"] += q.put({c: [_row(r)[c]] for c in ("prompt", "response")})
    else:
        while int(store.add("t/train", 0)) < total:
            b = q.get("score", 3, min_rows=0)
            if b.ids:
                out["bad"] += _check(b, ("prompt", "response"))
                q.put({"reward": [float(r) for r in b.ids]}, ids=b.ids)
                out["score"] += b.ids
            b = q.get("train", 3, min_rows=0)
            out["bad"] += _check(b, spec.stages["train"])
            out["train"] += b.ids
            store.add("t/train", len(b.ids))
            time.sleep(0 if b.ids else 0.01)  # idle poll: leave the 2 CI cores to the producers
    q.drain()
    dist.barrier()  # rank 0 hosts the store: nobody leaves while others still use it
    return out


def test_every_row_reaches_every_stage_exactly_once():
    outs = run_distributed(_exactly_once, world_size=4, args=(12,))
    produced = outs[2]["produced"] + outs[3]["produced"]
    assert len(produced) == len(set(produced)) == 24
    for stage in ("score", "train"):
        consumed = outs[0][stage] + outs[1][stage]
        assert sorted(consumed) == sorted(produced), stage  # no row lost, none twice
    assert outs[0]["bad"] == outs[1]["bad"] == 0


def _hierarchical(rank, world, steps):
    """World 4 = 2 model-parallel groups {0,1}, {2,3}; leaders 0, 2 are the DP ranks. Every rank
    produces rows (so a leader pulls from a non-leader that is itself waiting on the broadcast)."""
    mp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    everyone = dist.new_group([0, 1, 2, 3])
    spec = dq.QueueSpec(columns=COLS, scalars=("reward",), stages={"train": tuple(COLS)}, timeout_s=30)
    q = SelectiveQueue(spec, dq.default_store(), rank, world)
    g = torch.Generator().manual_seed(rank)
    out = {"batches": [], "reads": [], "bad": 0}
    for step in range(steps + 1):
        lens = torch.distributions.LogNormal(3.0, 1.2).sample((4,)).ceil().long().tolist()
        ids = q.put({"prompt": [torch.arange(4) for _ in lens], "response": [torch.randint(0, 9, (n,), generator=g)
                     for n in lens], "logp": [torch.randn(n, generator=g) for n in lens], "reward": [1.0] * 4})
        flat = step == steps  # last step: flat read, every rank talks to the queue
        b = q.get("train", 16, dp_group=everyone if flat else dp, group=None if flat else mp)
        out["batches"].append((b.ids, {c: [t.tolist() for t in v] for c, v in b.cols.items()}, ids))
        dist.barrier()
        out["reads"].append(q.reads("train"))
        dist.barrier()
    out["tokens"] = [sum(len(r) for r in b[1]["response"]) + sum(len(p) for p in b[1]["prompt"])
                     for b in out["batches"]]
    out["longest"] = [max(len(p) + len(r) for p, r in zip(b[1]["prompt"], b[1]["response"])) for b in out["batches"]]
    q.drain()
    dist.barrier()
    out["metrics"] = q.metrics()
    dist.barrier()
    return out


def test_hierarchical_read_one_read_per_group_identical_data_balanced_tokens():
    steps = 3
    outs = run_distributed(_hierarchical, world_size=4, args=(steps,))
    reads = outs[0]["reads"]
    assert [b - a for a, b in zip([0] + reads, reads)] == [2] * steps + [4]  # 2 per step; flat: 4
    for s in range(steps):
        assert outs[0]["batches"][s][:2] == outs[1]["batches"][s][:2]  # ids and every cell identical
        assert outs[2]["batches"][s][:2] == outs[3]["batches"][s][:2]
        step_rows = sorted(i for o in outs for i in o["batches"][s][2])
        assert sorted(outs[0]["batches"][s][0] + outs[2]["batches"][s][0]) == step_rows  # exactly once
        t0, t2 = outs[0]["tokens"][s], outs[2]["tokens"][s]
        assert abs(t0 - t2) <= max(outs[0]["longest"][s], outs[2]["longest"][s])
    flat = [o["batches"][steps][0] for o in outs]
    assert sorted(sum(flat, [])) == sorted(i for o in outs for i in o["batches"][steps][2])
    assert all(o["metrics"] == outs[0]["metrics"] for o in outs)  # the whole queue's counts, on any rank
    sent, padded = outs[0]["metrics"]["queue/bytes_sent"], outs[0]["metrics"]["queue/bytes_padded_equiv"]
    assert 0 < sent < padded  # packed transfer moved the data, and less than padding would have
    assert outs[0]["metrics"]["queue/bytes_bcast"] > 0 and outs[0]["metrics"]["queue/reads"] == reads[-1]


def _colocated(rank, world):
    """Every rank writes rows and reads a token-balanced share of all of them (colocated)."""
    spec = dq.QueueSpec(columns={"response": "int64"}, stages={"train": ("response",)}, timeout_s=30)
    q = dq.DistQueue(spec, dq.default_store(), rank, world)
    out = []
    for lens in ([[9, 1, 5, 5, 1, 9], [5, 5, 9, 1, 9, 1]][rank], [40 if rank == 0 else 5] * 6):  # loads equal, then 8x
        ids = q.put({"response": [torch.arange(n) for n in lens]})
        b = q.get("train", 6 * world, dp_group=dist.group.WORLD)
        out.append((ids, b.ids, sum(len(r) for r in b.cols["response"]), q.metrics()["queue/bytes_sent"]))
        dist.barrier()
    return out


def test_colocated_readers_keep_the_rows_they_wrote_where_balance_allows():
    (even0, heavy0), (even1, heavy1) = run_distributed(_colocated, world_size=2)
    assert even0[1] == even0[0] and even1[1] == even1[0] and even0[3] == 0  # own rows, nothing sent
    assert set(heavy0[1]) < set(heavy0[0]) and set(heavy1[0]) < set(heavy1[1])  # only rank 0's surplus moves
    assert sorted(heavy0[1] + heavy1[1]) == sorted(heavy0[0] + heavy1[0])
    assert abs(heavy0[2] - heavy1[2]) <= 40 and heavy0[3] > 0  # balanced within the longest row


def _dead_producer(rank, world):
    # Both gets time out whatever the timeout: rank 1 said it had put before they start, never writes
    # 'response' and never serves; a wait polls once before it reads the clock. So 0.5 s, not 2 s a get.
    spec = dq.QueueSpec(columns={"prompt": "int64", "response": "int64"},
                        stages={"gen": ("prompt",), "score": ("prompt", "response")}, timeout_s=0.5)
    q = dq.DistQueue(spec, dq.default_store(), rank, world)
    if rank == 1:
        q.put({"prompt": [torch.arange(3)] * 2})  # then "dies": never writes 'response', never serves
        dq.default_store().set("t/put", "1")
        return None
    dq.default_store().wait(["t/put"])
    errors = []
    for stage in ("score", "gen"):
        try:
            q.get(stage, 2)
        except TimeoutError as e:
            errors.append(str(e))
    return errors


def test_dead_producer_makes_consumer_raise_naming_stage_and_rows():
    errors = run_distributed(_dead_producer, world_size=2)[0]
    assert len(errors) == 2  # both waits raised instead of hanging
    assert "stage 'score'" in errors[0] and "rows [1, 3] are missing columns ['response']" in errors[0]
    assert "stage 'gen'" in errors[1] and "rows [1, 3] from rank 1" in errors[1]


def _owner_lacks_a_cell(rank, world):
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"t": ("x",)}, timeout_s=20)
    store = dq.default_store()
    q = dq.DistQueue(spec, store, rank, world)
    if rank == 1:
        q.put({"x": [torch.arange(3)]})  # row 1
        del q.cells[(1, "x")]  # lost (a bug's effect): the owner answers that it lacks the cell
        while not store.check(["t/done"]):
            q.serve()
            time.sleep(0.01)
        return None
    try:
        q.get("t", 1)
        error = None
    except RuntimeError as e:
        error = str(e)
    left = [k for k in ("dq/state/1", "dq/ack/1") if store.check([k])]
    store.set("t/done", "1")
    return error, left


def test_an_owner_that_lacks_a_cell_fails_the_read_and_leaves_no_key():
    error, left = run_distributed(_owner_lacks_a_cell, world_size=2)[0]
    assert "rank 1, asked by rank 0 for cells it does not hold, answered missing [(1, 'x')]" in error
    assert left == []  # no state/<tag> and no ack/<tag> for a transfer that was never sent


def _dead_leader(rank, world):
    """Model-parallel group {0, 1}, leader 0. Rank 1 names a group it is not in (refused at once), then
    reads through the leader, which has died: an error, never an empty batch."""
    only0, group = dist.new_group([0]), dist.new_group([0, 1])
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"t": ("x",)}, timeout_s=20)
    q = SelectiveQueue(spec, dq.default_store(), rank, world)
    if rank == 0:
        dq.default_store().wait(["t/put"])
        return None  # the leader leaves: its process group is destroyed and the process exits
    out = []
    try:
        q.get("t", 1, group=only0)
    except ValueError as e:
        out.append(str(e))
    q.put({"x": [torch.arange(3)] * 4})
    dq.default_store().set("t/put", "1")
    try:
        out.append(f"returned {q.get('t', 4, group=group).ids}")
    except Exception as e:  # gloo's error for the lost peer, or the queue's timeout
        out.append(type(e).__name__)
    return out


def test_a_dead_leader_is_an_error_and_a_foreign_group_is_refused():
    out = run_distributed(_dead_leader, world_size=2, leave_together=False)[1]
    assert out[0] == "rank 1 is not in the group it passed (ranks [0])"
    assert not out[1].startswith("returned"), out


def test_a_store_without_queue_operations_is_refused_at_construction(tmp_path):
    """A process group started with file:// has a FileStore, which has no queue operations: refused when
    the queue is built, naming what works, not at its first use."""
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"s": ("x",)})
    with pytest.raises(ValueError, match="FileStore cannot serve a DistQueue.*TCPStore or a HashStore"):
        dq.DistQueue(spec, dist.FileStore(str(tmp_path / "store"), 1))
    dq.DistQueue(spec, dist.HashStore())  # fine


class _OwnerAnswersFirst:
    """Rank 0's store, where a get that gave up cancels its request: rank 2 is let back first, and answers."""

    def __init__(self, store):
        self.store = store

    def compare_set(self, key, expected, desired):
        if desired == "cancelled":
            self.store.set("t/back", "1")
            self.store.wait([key])  # rank 2 answered: the cancel comes too late, rank 0 must take the transfer
        return self.store.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _slow_owner(rank, world, answers_late):
    """Rank 0 reads 6 rows: 2 of its own, 2 of rank 1, which serves at once, and 2 of rank 2, which is alive
    but away (it waits on the store, not calling the queue) until rank 0's first get has timed out (or, if
    answers_late, until that get cancels its request: rank 2 then answers first)."""
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"t": ("x",)}, timeout_s=3)
    store = dq.default_store()
    q = SelectiveQueue(spec, _OwnerAnswersFirst(store) if answers_late and rank == 0 else store, rank, world)
    q.put({"x": [torch.arange(3) + 10 * (rank + 3 * j) for j in range(2)]})  # rows rank, rank + 3
    store.add("t/put", 1)
    if rank > 0:
        if rank == 2:
            store.wait(["t/back"])
        q.drain(timeout_s=60)  # rank 1: the transfer rank 0 dropped does not hold it up
        return {"cells": len(q.cells), "inflight": len(q.inflight)}
    while int(store.add("t/put", 0)) < world:
        time.sleep(0.01)
    try:
        q.get("t", 6)
        error = None
    except TimeoutError as e:
        error = str(e)
    own = len(q.cells)  # its own cells: still held, not delivered by the failed get
    store.set("t/back", "1")
    b = q.get("t", 6)
    q.drain(timeout_s=60)
    return {"error": error, "own": own, "ids": b.ids, "x": [t.tolist() for t in b.cols["x"]],
            "cells": len(q.cells), "inflight": len(q.inflight)}


@pytest.mark.parametrize("answers_late", [False, True])
def test_a_get_that_fails_on_a_slow_owner_loses_nothing_and_a_retry_reads_every_row_once(answers_late):
    out = run_distributed(_slow_owner, world_size=3, args=(answers_late,))
    error = out[0]["error"]
    assert error is not None and "waiting for rows [2, 5] from rank 2" in error
    assert "alive but not calling the queue" in error and "or it is gone" in error
    assert "must keep calling the queue (any get or put, or serve()) before blocking elsewhere" in error
    assert out[0]["own"] == 2
    assert out[0]["ids"] == list(range(6))  # exactly once, in one retry
    assert out[0]["x"] == [(torch.arange(3) + 10 * r).tolist() for r in range(6)]
    assert all(o["cells"] == 0 and o["inflight"] == 0 for o in out)  # every owner drained


def _dp_slow_owner(rank, world):
    """DP ranks 0, 1 read 6 rows as one global batch; rank 2 owns 2 of them and is away at first."""
    dp = dist.new_group([0, 1])
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"t": ("x",)}, timeout_s=3)
    store = dq.default_store()
    q = SelectiveQueue(spec, store, rank, world)
    q.put({"x": [torch.arange(3) + 10 * (rank + 3 * j) for j in range(2)]})
    store.add("t/put", 1)
    if rank == 2:
        store.wait(["t/back"])
        q.drain(timeout_s=60)
        return {"cells": len(q.cells), "inflight": len(q.inflight)}
    while int(store.add("t/put", 0)) < world:
        time.sleep(0.01)
    try:
        q.get("t", 6, dp_group=dp)
        error = None
    except TimeoutError as e:
        error = str(e)
    if int(store.add("t/failed", 1)) == 2:
        store.set("t/back", "1")
    b = q.get("t", 6, dp_group=dp)
    q.drain(timeout_s=60)
    return {"error": error, "ids": b.ids, "x": [t.tolist() for t in b.cols["x"]],
            "cells": len(q.cells), "inflight": len(q.inflight)}


def test_a_dp_group_read_fails_on_every_rank_or_none_and_its_retry_reads_every_row_once():
    out = run_distributed(_dp_slow_owner, world_size=3)
    assert out[0]["error"] is not None and out[1]["error"] is not None  # both raised TimeoutError
    assert sorted(out[0]["ids"] + out[1]["ids"]) == list(range(6))
    assert all(x == (torch.arange(3) + 10 * r).tolist() for o in out[:2] for r, x in zip(o["ids"], o["x"]))
    assert all(o["cells"] == 0 and o["inflight"] == 0 for o in out)


def _dp_different_n(rank, world):
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"t": ("x",)}, timeout_s=10)
    store = dq.default_store()
    q = dq.DistQueue(spec, store, rank, world)
    q.put({"x": [torch.arange(3)] * 2})
    store.add("t/put", 1)
    while int(store.add("t/put", 0)) < world:
        time.sleep(0.01)
    try:
        q.get("t", 4 if rank == 0 else 2, dp_group=dist.group.WORLD)
        error = None
    except ValueError as e:
        error = str(e)
    return error, q.get("t", 4, dp_group=dist.group.WORLD).ids


def test_dp_ranks_that_pass_different_n_all_raise_naming_both():
    (e0, ids0), (e1, ids1) = run_distributed(_dp_different_n, world_size=2)
    for e in (e0, e1):
        assert e is not None and "get('t', n=2) on dp rank 1, but dp rank 0 asked for n=4" in e
    assert sorted(ids0 + ids1) == [0, 1, 2, 3]  # the failed read kept nothing: the next one reads them all


def _leader_fails(rank, world):
    """Model-parallel group {0, 1}, leader 0: the first read times out (no row), the second finds rows."""
    group = dist.new_group([0, 1])
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"t": ("x",)}, timeout_s=2)
    q = SelectiveQueue(spec, dq.default_store(), rank, world)
    try:
        q.get("t", 2, group=group)
        error = None
    except TimeoutError as e:
        error = str(e)
    if rank == 1:
        q.put({"x": [torch.arange(3), torch.arange(4)]})
    b = q.get("t", 2, group=group)
    return error, b.ids, [t.tolist() for t in b.cols["x"]]


def test_a_leaders_failed_read_is_raised_in_its_whole_group_and_a_retry_works():
    (e0, ids0, x0), (e1, ids1, x1) = run_distributed(_leader_fails, world_size=2)
    assert "waiting for 2 more rows" in e0 and "the read of this group's leader, rank 0, failed" in e1
    assert ids0 == ids1 == [1, 3] and x0 == x1 == [[0, 1, 2], [0, 1, 2, 3]]


def _defaults_and_misuse(rank, world):
    """DistQueue(spec) in a world of 2 takes its rank and world size from the process group; a rank
    that is not this process's, and floats for an integer column, are refused."""
    refused = dq.QueueSpec(columns={"x": "int64"}, stages={"t": ("x",)}, timeout_s=2, name="refused")
    if rank == 1:  # both ranks would put ids 0, 2, ...
        with pytest.raises(ValueError, match="DistQueue\\(rank=0\\) in the process of rank 1"):
            dq.DistQueue(refused, rank=0, world_size=world)
    else:  # the peer's read names the refusal when it times out
        with pytest.raises(TimeoutError, match="a peer's queue was refused: DistQueue\\(rank=0\\) in the process"):
            dq.DistQueue(refused).get("t", 2)
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"t": ("x",)}, timeout_s=20)
    q = dq.DistQueue(spec)
    with pytest.raises(TypeError, match="column 'x' row .*: float values \\[1.7, 2.2\\] for a torch.int64"):
        q.put({"x": [[1.7, 2.2]]})
    q.put({"x": [[rank, 5], [7]]})  # lists of Python ints are fine
    rows = q.get("t", 4, dp_group=dist.group.WORLD)
    dist.barrier()
    return (q.rank, q.world), rows.ids


def test_a_queue_takes_its_rank_from_the_process_group_and_refuses_misuse():
    (r0, ids0), (r1, ids1) = run_distributed(_defaults_and_misuse, world_size=2)
    assert r0 == (0, 2) and r1 == (1, 2) and sorted(ids0 + ids1) == [0, 1, 2, 3]  # no row lost


def _tcp_start(rank, world, port):
    """A world started from tcp://: the queue's error names the store to pass; build exactly that."""
    dist.destroy_process_group()
    del os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    spec = dq.QueueSpec(columns={"x": "int64"}, stages={"t": ("x",)}, timeout_s=20)
    with pytest.raises(ValueError) as e:
        dq.DistQueue(spec, rank=rank, world_size=world)
    advice = re.search(r"store=(dist\.TCPStore\([^)]*\))", str(e.value)).group(1)
    names = {"dist": dist, "HOST": "127.0.0.1", "PORT": port, "host": "127.0.0.1", "port": port,
             "world_size": world, "rank": rank}
    q = dq.DistQueue(spec, eval(advice, names), rank, world)  # the advice, word for word
    q.put({"x": [torch.arange(3)] * 2})
    ids = q.get("t", 4, dp_group=dist.group.WORLD).ids
    dist.barrier()
    return advice, ids


def test_the_advice_for_a_tcp_start_works_as_written():
    from tests.distributed import free_port
    (advice, ids0), (_, ids1) = run_distributed(_tcp_start, world_size=2, args=(free_port(),))
    assert "is_master=False" in advice and sorted(ids0 + ids1) == [0, 1, 2, 3]
