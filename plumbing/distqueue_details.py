# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""DistQueue's details: what a learner of distqueue.py can take on trust, as plain functions.

distqueue.py teaches the queue: the packing, the claim protocol on the store, a read's four steps
(claim, share, fetch, agree), put and serve. This file holds the rest, which that code calls:
- the store logs' formats: ready-log entries, claim tokens, claim logs (`ready_entries`,
  `parse_entries`, `cells_of`, `new_token`, `holders`);
- the checks of the caller's input, each with a long error that says what to do (`check_*`,
  `rank_and_world`, `from_python`);
- recovery from failures: why a wait still waits (`lacking`, `silent`, `refused`), the owner's
  send-or-cancel handshake (`may_send`), claims given back (`release`), pulls cancelled
  (`cancel`): a DP group's all-or-nothing vote itself is DistQueue._agree;
- metrics: the bytes sent, and what padding would have sent (`count_sent`, `traffic`);
- what only the options use: drain's wait (`drain_wait`), the hierarchical read, get(group=)
  (`read_in_group`);
- checkpoint state: the bodies of DistQueue.state_dict and load_state_dict (`queue_state`,
  `load_queue_state`);
- unpack_cells, unpad and unpack: the inverses of distqueue's pack_cells, pad and pack.

A function that needs the queue's store or state takes the queue itself, `q`, first (a DistQueue,
used as its methods use self); the others take only the values they need. A name with a leading
underscore is used only in this file. This file imports only torch and the standard library,
never distqueue.py: what it needs of that file (dtypes, pack_cells, Rows) is passed in. It is
copied together with distqueue.py, as plumbing/distqueue_details.py beside it (keep the folder,
or change distqueue.py's one import line).
"""
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


def new_token(q):
    """A name for one read's claims, unique among this queue's readers."""
    q.claims_made += 1
    return f"{q.claimer}.{q.claims_made}"


def holders(log):
    """A claim log, "token:ids;" claims and "-token:ids;" releases -> {row: its holder}."""
    held = {}
    for entry in log.decode().split(";")[:-1]:
        who, ids = entry.split(":")
        for r in map(int, ids.split(",")):
            if not who.startswith("-"):
                held.setdefault(r, who)
            elif held.get(r) == who[1:]:
                del held[r]
    return held


# ----------------------------------- checks of a spec, the environment, a store and a process group


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


def check_master_env():
    """default_store's client reaches the store at MASTER_ADDR:MASTER_PORT; without them, the error
    says what to pass instead."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("DistQueue needs a store that every rank reaches, and MASTER_ADDR/"
                         "MASTER_PORT are not set (the process group was not started from "
                         "torchrun's environment). After init_method='tcp://HOST:PORT', pass "
                         "store=dist.TCPStore(HOST, PORT, is_master=False) on every rank: a client "
                         "of the store that the rendezvous already serves on PORT (a second "
                         "is_master=True store there fails: the port is taken). Else a TCPStore on "
                         "a free port, is_master=True on one rank only")


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


def check_get(q, stage, n, min_rows, dp_group, group):
    """get's arguments: a known stage, 0 <= min_rows <= n, n >= the DP size, this rank in the
    groups it passed, and a gloo group to broadcast in."""
    if stage not in q.spec.stages:
        raise KeyError(f"unknown stage '{stage}'; valid: {list(q.spec.stages)}")
    dp = dist.get_world_size(dp_group) if dp_group else 1
    if not 0 <= min_rows <= n or n < max(dp, 1):
        raise ValueError(f"n={n}, min_rows={min_rows}, dp size {dp}: need 0 <= min_rows <= n "
                         f"and n >= dp")
    for g, what in ((dp_group, "dp_group"), (group, "group")):
        if g is not None and dist.get_rank(g) < 0:
            raise ValueError(f"rank {q.rank} is not in the {what} it passed (ranks "
                             f"{dist.get_process_group_ranks(g)})")
    if group is not None and dist.get_backend(group) != "gloo":
        raise ValueError(f"group backend is {dist.get_backend(group)}; the broadcast needs a "
                         f"gloo group")


def check_same_n(stage, n, n0, dp_rank):
    """Every rank of a DP group passes the global batch as n: dp rank 0 planned for n0."""
    if int(n0) != n:
        raise ValueError(f"get('{stage}', n={n}) on dp rank {dp_rank}, but dp rank 0 asked "
                         f"for n={n0}: every rank of a dp_group passes the same n (the global "
                         f"batch)")


def check_sent(o, answer, reader):
    """A pull's answer to rank `reader`: "sent", or the owner o lacked some of the cells."""
    if answer != "sent":
        raise RuntimeError(f"rank {o}, asked by rank {reader} for cells it does not hold, "
                           f"answered {answer}")


def check_header(o, header, expect):
    """A transfer's header (K,) against the lengths the ready log published."""
    if header.tolist() != expect:
        raise RuntimeError(f"header {header.tolist()} from rank {o} != published lengths "
                           f"{expect}")


# ------------------ recovery: why a wait still waits, claims given back, pulls cancelled, the vote


def refused(q):
    """A peer's refusal of its own queue (rank_and_world), for this rank's timeout message."""
    key = f"{q.spec.name}/refused"
    if not q.store.check([key]):
        return ""
    return f"; a peer's queue was refused: {q.store.get(key).decode()}"


def lacking(q, stage, n, min_rows, claimed, only):
    """Why a claim still waits: rows that miss columns, fewer complete rows than asked, none."""
    cols, seen = q.spec.stages[stage], q.unclaimed[stage]
    rows = [r for r in seen if only is None or r in only]
    partial = sorted(r for r in rows if len(seen[r]) < len(cols))
    why = (f"in stage '{stage}' waiting for {n - claimed} more rows with columns {list(cols)} "
           f"(claimed {claimed}): {len(rows) - len(partial)} unclaimed rows"
           f"{' (of only)' if only is not None else ''} have every column, and this get asked "
           f"for {n} (at least {min_rows})")
    if partial:
        lack = sorted({c for r in partial for c in cols if c not in seen[r]})
        return why + f"; rows {partial[:32]} are missing columns {lack}"
    if not rows:
        return why + "; no unclaimed row has been put: is a producer still putting rows?"
    return why + (": put more rows before this get, ask for fewer (n), or take what there "
                  "is (min_rows)")


def silent(q, stage, o, keys):
    """Why a pull still waits: its owner has not answered."""
    waiting = q.store.queue_len(q._k("req", o))
    return (f"in stage '{stage}' waiting for rows {sorted({r for r, _ in keys})[:32]} from "
            f"rank {o}, which has not answered ({waiting} requests wait in its queue): rank "
            f"{o} is alive but not calling the queue (busy elsewhere: in a collective, in "
            f"compute), or it is gone. A rank whose cells are still wanted must keep calling "
            f"the queue, or drain(), before blocking elsewhere")


def may_send(q, tag, keys):
    """DistQueue._answer's handshake: write "sent" in state/<tag> (or the missing cells) unless
    the reader cancelled first; True if the transfer goes. A cancelled tag's key is deleted (the
    reader never reads it)."""
    missing = [k for k in keys if k not in q.cells]
    state = q._k("state", tag)
    answer = q.store.compare_set(state, "", f"missing {missing[:8]}" if missing else "sent")
    if answer == b"cancelled":
        q.store.delete_key(state)
    return answer == b"sent"


def release(q, stage, token, rows):
    """Give back rows claimed as token: "-token:ids;" in the claim logs ends the claims, and
    ready-log entries for this stage show the rows again to its readers."""
    for block, ids in q._blocks(rows):
        q.store.append(q._k("claims", stage, block), f"-{token}:{ids};")
    if rows:
        q._publish(ready_entries(q, cells_of(rows, q.spec.stages[stage]), stage))


def cancel(q, tags, owners, rows, received):
    """A fetch failed: cancel the requests not yet answered (an owner that answered first is
    received, to drop it), and acknowledge every transfer received as dropped."""
    for o, tag in tags.items():  # not answered: cancelled, unless the owner answers first
        if q.store.compare_set(q._k("state", tag), "", "cancelled") == b"sent":
            q._recv(o, tag, owners[o], rows)  # it sent just now: take it, to drop it
            received.append(tag)
    q._ack(received, keep=False)


# ------------------------------------------------------------------------------ metrics

_COUNTERS = ("bytes_sent", "bytes_padded_equiv", "bytes_bcast")  # count/<name> in the store


def _count(q, name, n):
    """Add n to the queue-wide counter count/<name> in the store."""
    q.store.add(q._k("count", name), int(n))


def count_sent(q, keys, cells, tmax, header, payload):
    """One transfer's bytes, and what padding each field to the step's longest cell (tmax,
    "col=length,...") would have sent."""
    longest = {c: int(n) for c, n in (x.split("=") for x in tmax.split(",") if x)}
    padded = sum(longest.get(c, t.numel()) * t.itemsize for (_, c), t in zip(keys, cells))
    _count(q, "bytes_sent", header.nbytes + payload.nbytes)
    _count(q, "bytes_padded_equiv", header.nbytes + padded)


def traffic(q):
    """DistQueue.metrics' body: the queue-wide counters, and the reads of every stage."""
    out = {f"queue/{c}": int(q.store.add(q._k("count", c), 0)) for c in _COUNTERS}
    out["queue/reads"] = sum(q.reads(s) for s in q.spec.stages)
    return out


# -------------------------- what only the options use: drain, the hierarchical read get(group=)


def drain_wait(q, timeout_s):
    """DistQueue.drain's body: serve until this rank holds no cell, and no transfer that its
    reader has not acknowledged."""
    deadline = time.monotonic() + (timeout_s or q.spec.timeout_s)
    q._wait(lambda: not q.cells and not q.inflight, deadline,
            lambda: f"in drain: rows {sorted({r for r, _ in q.cells})[:16]} not yet read "
                    f"by every stage, transfers {sorted(q.inflight)} not acknowledged")


def read_in_group(q, stage, n, min_rows, dp_group, group, step, deadline, only, dtypes, pack,
                  make_rows):
    """get(group=): only the group's first rank reads; it broadcasts the rows, or its error.
    dtypes: the stage's columns' dtypes; pack, make_rows: distqueue.py's pack_cells and Rows
    (this file cannot import it)."""
    leader = dist.get_global_rank(group, 0)
    batch, error = None, None
    if leader == q.rank:
        try:
            batch = q._read(stage, n, min_rows, dp_group, step, deadline, only)
        except Exception as e:  # told to the group first, so that its members raise too
            error = e
    return _bcast(q, batch, error, stage, group, leader, deadline + q.spec.timeout_s, dtypes,
                  pack, make_rows)


def _bcast(q, batch, error, stage, group, leader, deadline, dtypes, pack, make_rows):
    """Leader -> its model-parallel group: the size B (or the leader's failure: < 0), a header
    (B, 1+C) [ids, lengths], one payload. The deadline is the leader's plus timeout_s."""
    cols = q.spec.stages[stage]
    failures = (TimeoutError, ValueError, RuntimeError)  # a leader's failure -> -1, -2, -3

    def bcast(t, what):
        w = dist.broadcast(t, leader, group=group, async_op=True)
        q._wait(w.is_completed, deadline,
                lambda: f"in stage '{stage}' waiting for {what} from leader {leader}")
        w.wait()  # completed may mean failed (a dead leader): raise that, never read garbage
    size = len(batch.ids) if batch is not None else 0
    if error is not None:
        size = next((-1 - i for i, f in enumerate(failures) if isinstance(error, f)), -3)
    meta = torch.tensor([size])  # (1,)
    bcast(meta, "the batch size")
    if error is not None:
        raise error
    B = int(meta)
    if B < 0:
        raise failures[-B - 1](f"in stage '{stage}' the read of this group's leader, rank "
                               f"{leader}, failed (its error says why): this rank keeps no row")
    if batch is not None:
        flat = [batch.cols[c][i] for i in range(B) for c in cols]  # row-major cells, K = B * C
        lengths, payload = pack(flat)  # (K,), (bytes,)
        ids = torch.tensor(batch.ids).view(B, 1)  # (B, 1)
        header = torch.cat([ids, lengths.view(B, len(cols))], 1)  # (B, 1+C)
        _count(q, "bytes_bcast", header.nbytes + payload.nbytes)
    else:
        header = torch.empty(B, 1 + len(cols), dtype=torch.int64)  # (B, 1+C)
    if B:
        bcast(header, "the header")
    if batch is None:
        lengths = header[:, 1:].reshape(-1).tolist()  # (K,)
        nbytes = sum(n * d.itemsize for n, d in zip(lengths, dtypes * B))
        payload = torch.empty(nbytes, dtype=torch.uint8)  # (bytes,)
    if payload.numel():
        bcast(payload, "the payload")
    if batch is not None:
        return batch
    cells = unpack_cells(header[:, 1:].reshape(-1), payload, dtypes * B)  # K = B * C
    return make_rows(header[:, 0].tolist(), {c: cells[j::len(cols)] for j, c in enumerate(cols)})


# ------------------------------------------------------------------------------ checkpoint state


def queue_state(q):
    """DistQueue.state_dict's body: it first serves until every transfer this rank sent is
    acknowledged; then the cells it holds (copies) and the stages that read each, its row and
    read counters, and, on rank 0, the queue-wide counters of the store."""
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
    """DistQueue.load_state_dict's body: the rank's cells published in the ready log and claimed
    for the stages that read them already, rank 0's counters restored, then a wait until every
    rank of the queue has done so."""
    q.cells = {k: t.clone() for k, t in sd["cells"].items()}  # this queue's own copies
    q.next_local = sd["next_local"]
    q.served = {k: set(v) for k, v in sd["served"].items()}
    q.steps = dict(sd["steps"])
    q._reset_caches()
    if q.cells:  # one ready-log key, as one put writes
        q._publish(ready_entries(q, dict(sorted(q.cells.items()))))
    for s in q.spec.stages:  # read by s already: claimed in s's logs
        read = sorted({r for (r, _), stages in q.served.items() if s in stages})
        for block, ids in q._blocks(read):
            q.store.append(q._k("claims", s, block), f"restored:{ids};")
    for k, v in sd["counters"].items():
        q.store.set(q._k(*k.split("/")), str(v))
    done = q._k("restored")
    q.store.add(done, 1)
    q._wait(lambda: int(q.store.add(done, 0)) >= q.world,
            time.monotonic() + q.spec.timeout_s,
            lambda: f"waiting for the other ranks to restore their cells "
                    f"({int(q.store.add(done, 0))} of {q.world} have)")


# ------------- unpack_cells, unpad and unpack: the inverses of pack_cells, pad, pack (the last two
# for a reader's check and the tests: the queue's own read unpacks with unpack_cells)


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
