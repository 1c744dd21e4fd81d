# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""DistQueue's details: what a learner of distqueue.py can take on trust, as plain functions.

distqueue.py teaches the queue: the packing, put and serve, a read's four steps on the store
(claim, share, fetch, agree), and what a read that fails gives back. This file holds the rest:
- the store logs' formats: the ready log's entries (`ready_entries`, `parse_entries`; distqueue.py
  writes and reads the log; `retire_keys` deletes what every reader read), pull requests
  (`request`, `parse_request`), acknowledgements (`ack`);
  a row's cells (`cells_of`), a cell's last reader (`read_last`);
- the default store (`default_store`) and the checks of the caller's input, each with a long
  error that says what to do (`check_*`, `rank_and_world`, `from_python`, `put_cells`);
- the messages of a failure: why a wait still waits (`lacking`, `silent`, `refused`), a DP
  peer's failure (`peer_failed`);
- metrics: the bytes sent, and what padding would have sent (`count`, `count_sent`, `traffic`);
- checkpoint state: the bodies of DistQueue.state_dict and load_state_dict (`queue_state`,
  `load_queue_state`);
- pack (one field packed, the tests' and the bench's), and unpack_cells, unpad and unpack: the
  inverses of distqueue's pack_cells and pad, and of pack.

A function that needs the queue's store or state takes the queue itself, `q`, first (a DistQueue,
used as its methods use self); the others take only the values they need. A name with a leading
underscore is used only in this file. This file imports only torch and the standard library,
never distqueue.py (its example aside): what it needs of that file (its DTYPES) is passed in. It is
copied together with distqueue.py, as plumbing/distqueue_details.py beside it (keep the folder,
or change distqueue.py's one import line).

Using distqueue.py elsewhere: this example runs on 2 gloo processes in a folder holding only the
two files (tests/test_copy_alone.py runs it there):

    import datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from distqueue import DistQueue, QueueSpec

    def rank_main(rank, world, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        spec = QueueSpec(columns={"tokens": "int64", "reward": "float32"}, scalars=("reward",),
                         stages={"train": ("tokens", "reward")}, timeout_s=60)
        q = DistQueue(spec)  # rank and world size: the process group's; the store: env://'s
        q.put({"tokens": [torch.arange(n) for n in (2, 30)], "reward": [1.0, 0.0]})  # ragged
        rows = q.get("train", 4, dp_group=dist.group.WORLD)  # 4 rows in all, split by length
        print(f"rank {rank}: rows {rows.ids}, {sum(map(len, rows.cols['tokens']))} tokens")
        dist.barrier()  # every rank done before any tears down
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port), nprocs=2)
"""
import datetime
import os
import time

import torch
import torch.distributed as dist

# ------------------------------------------------------------------------------ the logs' formats


def ready_entries(q, cells, stage=""):
    """{(row, col): tensor or (owner, length)} -> "row,column,owner,length;" per cell, the
    column by its number in the spec. A stage ends each entry: only its readers see the cell."""
    out = []
    for (r, c), v in cells.items():
        owner, length = (q.rank, v.numel()) if torch.is_tensor(v) else v
        tail = f",{stage}" if stage else ""
        out.append(f"{r},{q.col_index[c]},{owner},{length}{tail};")
    return "".join(out)


def parse_entries(spec, entries, stage, rows):
    """Entries of this stage's columns -> rows {row: {col: (owner, length)}}; returns rows."""
    names = list(spec.columns)
    for e in entries.split(";")[:-1]:
        r, c, owner, length, *released = e.split(",")  # released: in that stage only
        if names[int(c)] in spec.stages[stage] and released in ([], [stage]):
            rows.setdefault(int(r), {})[names[int(c)]] = (int(owner), int(length))
    return rows


def cells_of(rows, cols):
    """{row: {col: (owner, length)}} -> {(row, col): (owner, length)}, rows ascending."""
    return {(r, c): rows[r][c] for r in sorted(rows) for c in cols}


def read_last(q, key):
    """Whether the stage reading this cell now is the last that needs it (then it takes the
    queue's own tensor, not a copy)."""
    return len(q.served.get(key, ())) + 1 >= q.needers[key[1]]


def request(reader, tag, stage, tmax, keys):
    """A pull request: "reader|tag|stage|longest cells|row:col,...", tmax {col: longest cell}."""
    longest = ",".join(f"{c}={length}" for c, length in tmax.items())
    wanted = ",".join(f"{r}:{c}" for r, c in keys)
    return f"{reader}|{tag}|{stage}|{longest}|{wanted}"


def parse_request(text):
    """request's inverse: reader, tag, stage, the longest cells (as text), keys [(row, col)]."""
    reader, tag, stage, tmax, wanted = text.split("|")
    keys = [(int(r), c) for r, c in (x.split(":") for x in wanted.split(","))]
    return int(reader), int(tag), stage, tmax, keys


def retire_keys(q, keys, readers):
    """DistQueue._retire's body: delete the ready-log keys that all their `readers` have read, so
    that the store does not grow with the run. Each reader counts the keys it read in
    ready/<i>/reads, and the count that completes deletes the key and its count."""
    for key in keys:
        if int(q.store.add(f"{key}/reads", 1)) == readers:
            q.store.delete_key(key)
            q.store.delete_key(f"{key}/reads")


def ack(q, tags, keep):
    """The reader's word on each transfer it received: ack/<tag> "kept" or "dropped"."""
    for tag in tags:
        q.store.set(q._k("ack", tag), "kept" if keep else "dropped")


# ------------------------------ the default store; checks of a spec, a store and a process group


def check_spec(spec, dtypes):
    """QueueSpec's fields: known dtypes (the names in `dtypes`, distqueue.DTYPES), stages that read
    known columns, every column read by a stage, positive times, and names that fit in control
    messages and store keys."""
    bad = {c: d for c, d in spec.columns.items() if d not in dtypes}
    if bad:
        raise ValueError(f"unknown dtypes {bad}; valid: {sorted(dtypes)}")
    for s, cols in spec.stages.items():
        unknown = [c for c in cols if c not in spec.columns]
        if unknown or not cols:
            raise ValueError(f"stage '{s}' reads {list(cols)}; unknown {unknown}; "
                             f"valid {list(spec.columns)}")
    unread = [c for c in spec.columns if not any(c in cols for cols in spec.stages.values())]
    if unread or any(s not in spec.columns for s in spec.scalars):
        raise ValueError(f"columns {unread} read by no stage, or scalars {list(spec.scalars)} "
                         f"not in columns {list(spec.columns)}")
    if spec.timeout_s <= 0 or spec.poll_s <= 0:
        raise ValueError(f"timeout_s={spec.timeout_s} and poll_s={spec.poll_s} must be > 0")
    bad = [x for x in [*spec.columns, *spec.stages] if not x or set(x) & set("|:,;=/ \t\n")]
    if bad:  # they go into '|:,;='-separated control messages and '/'-joined store keys
        raise ValueError(f"column or stage names {bad} are empty or contain one of "
                         f"| : , ; = / or whitespace")


def default_store(timeout_s=300.0):
    """The rendezvous' store: a TCPStore client of MASTER_ADDR:MASTER_PORT (set by torchrun or any
    env:// start), or an in-process HashStore in a world of one. Without MASTER_ADDR/MASTER_PORT,
    the error says what to pass instead."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dist.HashStore()
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("DistQueue needs a store that every rank reaches, and MASTER_ADDR/"
                         "MASTER_PORT are not set (the process group was not started from "
                         "torchrun's environment). After init_method='tcp://HOST:PORT', pass "
                         "store=dist.TCPStore(HOST, PORT, is_master=False) on every rank: a client "
                         "of the store that the rendezvous already serves on PORT (a second "
                         "is_master=True store there fails: the port is taken). Else a TCPStore on "
                         "a free port, is_master=True on one rank only")
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def check_store(store):
    """Refuses, before any collective, a store without queue operations, atomic add, append,
    compare_set and multi_get: TCPStore and HashStore have them, FileStore has no queue."""
    try:
        store.queue_len("dq/probe")
        store.add("dq/probe_add", 0)
        store.append("dq/probe_append", "")
        store.compare_set("dq/probe_compare_set", "", "")
        store.multi_get(["dq/probe_add"])
    except (NotImplementedError, RuntimeError, AttributeError) as e:
        raise ValueError(f"{type(store).__name__} cannot serve a DistQueue ({e}): it needs queue "
                         "operations (queue_push, queue_pop, queue_len), add, append, compare_set "
                         "and multi_get; pass a TCPStore or a HashStore (a process group started "
                         "with file:// has a FileStore)") from None


def rank_and_world(rank, world_size, store, name):
    """This process's rank and the ranks that put rows, by default the default process group's (0
    and 1 without one). A rank that is not this process's would give two ranks the same row ids:
    refused, and said in the store, so that its peers' waits name it when they time out."""
    up = dist.is_initialized()
    rank = (dist.get_rank() if up else 0) if rank is None else rank
    world_size = (dist.get_world_size() if up else 1) if world_size is None else world_size
    error = None
    if up and rank != dist.get_rank():
        error = (f"DistQueue(rank={rank}) in the process of rank {dist.get_rank()}: pass this "
                 "process's rank, or leave rank and world_size out (the process group's)")
    elif not 0 <= rank < world_size:
        error = (f"DistQueue(rank={rank}, world_size={world_size}): rank must be in "
                 "[0, world_size)")
    if error is not None:
        store.set(f"{name}/refused", error)
        raise ValueError(error)
    return rank, world_size


def check_pg(pg):
    """The queue's data moves host tensors, point to point: pg must be a gloo group."""
    if dist.is_initialized() and dist.get_backend(pg) != "gloo":
        raise ValueError(f"pg backend is {dist.get_backend(pg)}; "
                         f"pass pg=dist.new_group(backend='gloo')")


# ------------------------------------------------------------------- checks of the caller's input


def from_python(v, want, r, c):
    """A cell given as Python values, in the column's dtype; floats for an integer column are
    refused rather than truncated."""
    if want.is_floating_point:
        return torch.tensor(v, dtype=want)
    t = torch.tensor(v)
    if t.is_floating_point() and t.numel():
        given = torch.tensor(v, dtype=torch.float64).flatten().tolist()[:4]  # as written
        raise TypeError(f"column '{c}' row {r}: float values {given} for a {want} column "
                        "would be truncated: pass integers, or declare the column float32")
    return t.to(want)


def check_columns(spec, columns, n):
    """put's columns: each known, each with n rows."""
    for c, vals in columns.items():
        if c not in spec.columns:
            raise KeyError(f"unknown column '{c}'; valid: {list(spec.columns)}")
        if len(vals) != n:
            raise ValueError(f"column '{c}' has {len(vals)} rows, others {n}")


def check_cell(q, r, c, t, want):
    """One cell of put: its dtype, its shape, and not written before."""
    scalar = c in q.spec.scalars
    if t.dtype != want:
        raise TypeError(f"column '{c}' row {r}: dtype {t.dtype}, expected {want}")
    if scalar and t.numel() != 1 or not scalar and t.dim() != 1:
        raise ValueError(f"column '{c}' row {r}: shape {tuple(t.shape)}; scalar fields "
                         f"take one value, others a 1-D tensor")
    if (r, c) in q.cells or any(c in s.get(r, ()) for s in q.unclaimed.values()):
        raise ValueError(f"cell (row {r}, column '{c}') written twice")


def put_cells(q, columns, ids, dtypes):
    """put's cells of rows `ids`, {(row, col): 1-D tensor}: each a tensor or Python values, in
    its column's dtype (dtypes: distqueue.DTYPES), checked, and copied to host: the queue's own."""
    cells = {}
    for c, vals in columns.items():
        want = dtypes[q.spec.columns[c]]
        for r, v in zip(ids, vals):
            t = v if torch.is_tensor(v) else from_python(v, want, r, c)
            check_cell(q, r, c, t, want)  # dtype, shape, written once
            cells[(r, c)] = t.detach().reshape(-1).to("cpu", copy=True)  # the queue's own copy
    return cells


def check_get(q, stage, n, dp_group):
    """get's arguments: a known stage, n >= the DP size (and >= 1), this rank in the dp_group."""
    if stage not in q.spec.stages:
        raise KeyError(f"unknown stage '{stage}'; valid: {list(q.spec.stages)}")
    dp = dist.get_world_size(dp_group) if dp_group else 1
    if n < max(dp, 1):
        raise ValueError(f"n={n}, dp size {dp}: need n >= dp and n >= 1")
    if dp_group is not None and dist.get_rank(dp_group) < 0:
        raise ValueError(f"rank {q.rank} is not in the dp_group it passed (ranks "
                         f"{dist.get_process_group_ranks(dp_group)})")


def check_reader(q, stage):
    """One queue reads a stage. Its first read names it in reader/<stage> (compare_set: the first
    writer stays). A read by any other queue is refused, since both would take the same rows."""
    if stage in q.reading:
        return
    me = f"queue {q.me} on rank {q.rank}"
    first = q.store.compare_set(q._k("reader", stage), "", me).decode()
    if first != me:
        raise ValueError(f"stage '{stage}' is read by {first}; {me} may not read it too, or "
                         f"both would take the same rows. Read a stage from one DP group (its "
                         f"dp rank 0 claims for all), or let several readers share it with "
                         f"SelectiveQueue (options/selective_queue.py)")
    q.reading.add(stage)


def check_same_n(stage, n, n0, dp_rank):
    """Every rank of a DP group passes the global batch as n: dp rank 0 planned for n0."""
    if int(n0) != n:
        raise ValueError(f"get('{stage}', n={n}) on dp rank {dp_rank}, but dp rank 0 asked "
                         f"for n={n0}: every rank of a dp_group passes the same n (the global "
                         f"batch)")


def check_sent(q, o, tag):
    """Owner o's answer to a pull, read from state/<tag> (then deleted): "sent", or it lacked
    some of the cells."""
    state = q._k("state", tag)
    answer = q.store.get(state).decode()
    q.store.delete_key(state)
    if answer != "sent":
        raise RuntimeError(f"rank {o}, asked by rank {q.rank} for cells it does not hold, "
                           f"answered {answer}")


def check_header(o, header, expect):
    """A transfer's header (K,) against the lengths the ready log published."""
    if header.tolist() != expect:
        raise RuntimeError(f"header {header.tolist()} from rank {o} != published lengths "
                           f"{expect}")


# ------------------------------------------------- a failure's messages: why a wait still waits


def refused(q):
    """A peer's refusal of its own queue (rank_and_world), for this rank's timeout message."""
    key = f"{q.spec.name}/refused"
    if not q.store.check([key]):
        return ""
    return f"; a peer's queue was refused: {q.store.get(key).decode()}"


def lacking(q, stage, n, least, claimed, rows):
    """Why a claim still waits: rows that miss columns, fewer complete rows than asked, none. The
    rows counted: those this read may claim (ids in q.unclaimed[stage])."""
    cols, seen = q.spec.stages[stage], q.unclaimed[stage]
    partial = sorted(r for r in rows if len(seen[r]) < len(cols))
    why = (f"in stage '{stage}' waiting for {n - claimed} more rows with columns {list(cols)} "
           f"(claimed {claimed}): {len(rows) - len(partial)} unclaimed rows"
           f"{' (of those it may take)' if len(rows) < len(seen) else ''} have every column, "
           f"and this get asked for {n} (at least {least})")
    if partial:
        lack = sorted({c for r in partial for c in cols if c not in seen[r]})
        return why + f"; rows {partial[:32]} are missing columns {lack}"
    if not rows:
        return why + "; no unclaimed row has been put: is a producer still putting rows?"
    return why + (": put more rows before this get, ask for fewer (n), or take what there "
                  "is (SelectiveQueue's min_rows)")


def silent(q, stage, o, keys):
    """Why a pull still waits: its owner has not answered."""
    waiting = q.store.queue_len(q._k("req", o))
    return (f"in stage '{stage}' waiting for rows {sorted({r for r, _ in keys})[:32]} from "
            f"rank {o}, which has not answered ({waiting} requests wait in its queue): rank "
            f"{o} is alive but not calling the queue (busy elsewhere: in a collective, in "
            f"compute), or it is gone. A rank whose cells are still wanted must keep calling "
            f"the queue (any get or put, or serve()) before blocking elsewhere")


def peer_failed(first, kind, why):
    """The error of a DP rank whose group failed elsewhere (DistQueue._agree): one of the first
    failure's kind, naming that rank (first) and why."""
    kinds = {"TimeoutError": TimeoutError, "ValueError": ValueError}
    return kinds.get(kind, RuntimeError)(f"dp rank {first} of this get's dp_group failed, so "
                                         f"this rank keeps no row: {why}")


# ------------------------------------------------------------------------------ metrics

_COUNTERS = ("bytes_sent", "bytes_padded_equiv", "bytes_bcast")  # count/<name> in the store


def count(q, name, n):
    """Add n to the queue-wide counter count/<name> in the store."""
    q.store.add(q._k("count", name), int(n))


def count_sent(q, keys, cells, tmax, header, payload):
    """One transfer's bytes, and what padding each field to the step's longest cell (tmax,
    "col=length,...") would have sent."""
    longest = {c: int(n) for c, n in (x.split("=") for x in tmax.split(",") if x)}
    padded = sum(longest.get(c, t.numel()) * t.itemsize for (_, c), t in zip(keys, cells))
    count(q, "bytes_sent", header.nbytes + payload.nbytes)
    count(q, "bytes_padded_equiv", header.nbytes + padded)


def traffic(q):
    """DistQueue.metrics' body: the whole queue's traffic, counted in the store by the ranks that
    sent it: packed bytes sent (headers included), what padding each field to the step's longest
    cell would have sent, bytes broadcast inside model-parallel groups (an option's read), and
    stage reads."""
    out = {f"queue/{c}": int(q.store.add(q._k("count", c), 0)) for c in _COUNTERS}
    out["queue/reads"] = sum(q.reads(s) for s in q.spec.stages)
    return out


# ------------------------------------------------------------------------------ checkpoint state


def queue_state(q):
    """DistQueue.state_dict's body: this rank's part of the queue, saved by every rank where no get
    runs (a consistent cut, such as the end of a training step). It first serves until every
    transfer this rank sent is acknowledged; then the cells it holds (copies) and the stages that
    read each, its row and read counters, and, on rank 0, the queue-wide counters of the store.
    Nothing of the store is saved: load_state_dict publishes the held cells again, so the file
    does not grow with the rows ever put."""
    q._wait(lambda: not q.inflight, time.monotonic() + q.spec.timeout_s,
            lambda: f"in state_dict: transfers {sorted(q.inflight)} not acknowledged")
    keys = [f"count/{c}" for c in _COUNTERS] + [f"reads/{s}" for s in q.spec.stages]
    keys.append("tag")
    counters = {}
    if q.rank == 0:
        counters = {k: int(q.store.add(q._k(*k.split("/")), 0)) for k in keys}
    cells = {k: t.clone() for k, t in q.cells.items()}  # the last stage takes the originals
    return {"cells": cells, "served": {k: sorted(v) for k, v in q.served.items()},
            "next_local": q.next_local, "steps": dict(q.steps), "counters": counters}


def load_queue_state(q, sd):
    """DistQueue.load_state_dict's body. Every rank loads its own dict into a queue whose store
    holds none of this queue's keys (a new store, or a new spec.name). It publishes its cells in
    the ready log again, each for the stages that have not read it yet (a stage-tailed entry), and
    restores rank 0's counters. Collective over the queue's ranks: it returns once every rank has
    published."""
    q.cells = {k: t.clone() for k, t in sd["cells"].items()}  # this queue's own copies
    q.next_local = sd["next_local"]
    q.served = {k: set(v) for k, v in sd["served"].items()}
    q.steps = dict(sd["steps"])
    q._reset_caches()
    entries = ""
    for s, cols in q.spec.stages.items():  # one ready-log key, as one put writes
        unread = {k: t for k, t in sorted(q.cells.items())
                  if k[1] in cols and s not in q.served.get(k, ())}
        entries += ready_entries(q, unread, s) if unread else ""
    if entries:
        q._publish(entries)
    for k, v in sd["counters"].items():
        q.store.set(q._k(*k.split("/")), str(v))
    done = q._k("restored")
    q.store.add(done, 1)
    q._wait(lambda: int(q.store.add(done, 0)) >= q.world,
            time.monotonic() + q.spec.timeout_s,
            lambda: f"waiting for the other ranks to restore their cells "
                    f"({int(q.store.add(done, 0))} of {q.world} have)")


# ------------- pack, one field packed; the inverses of pad, pack, pack_cells: unpad and unpack (for
# a reader's check and the tests), unpack_cells (the queue's own read)


def pack(seqs):
    """Packed, one field: concatenate along the sequence dim, no padding. Returns flat (N,) and
    lengths (B,). (The queue packs many fields at once: pack_cells.)"""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)  # (B,)
    flat = torch.cat([s.reshape(-1) for s in seqs]) if seqs else torch.empty(0)  # (N,)
    return flat, lengths


def unpad(padded, lengths):
    return [padded[i, : int(n)].clone() for i, n in enumerate(lengths)]


def unpack(flat, lengths):
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    if lengths.dim() != 1 or (lengths < 0).any() or int(lengths.sum()) != flat.numel():
        raise ValueError(f"lengths {lengths.tolist()} (sum {int(lengths.sum())}) do not split a "
                         f"payload of {flat.numel()} elements; they must be >= 0 and sum to it")
    return [t.clone() for t in torch.split(flat, lengths.tolist())]


def unpack_cells(header, payload, dtypes):
    """Inverse of pack_cells; dtypes (K,) come from the spec, not the wire. Each cell views its own
    slice of the payload, or a copy of it where the slice is not aligned to its dtype's size."""
    nbytes = [n * d.itemsize for n, d in zip(header.tolist(), dtypes)]
    if header.numel() != len(dtypes) or sum(nbytes) != payload.numel():
        raise ValueError(f"header lengths {header.tolist()} x dtypes give {sum(nbytes)} bytes, "
                         f"payload has {payload.numel()}")
    cells, offset = [], 0
    for piece, d, n in zip(torch.split(payload, nbytes), dtypes, nbytes):
        aligned = (payload.storage_offset() + offset) % d.itemsize == 0
        cells.append(piece.view(d) if aligned else piece.clone().view(d))
        offset += n
    return cells
