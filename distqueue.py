# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""DistQueue: the data queue between RL stages, packed and read hierarchically.

Rows (samples) by columns (fields) flow rollout -> scoring -> reference log-probs -> training. Each cell
stays on the rank that wrote it until a stage wants it ("split, cache and read dynamically"); a stage
claims ready rows and pulls them from their owners as ONE packed payload per owner (zero-padding
transfer, article figure 7); with `group=` only the group's leader talks to the queue and broadcasts the
packed batch inside its model-parallel group (hierarchical transfer, article figure 6).

Public API (everything else is private):
    spec = QueueSpec(columns={"prompt": "int64", "response": "int64", "old_logprobs": "float32",
                              "reward": "float32"}, scalars=("reward",),
                     stages={"train": ("prompt", "response", "old_logprobs", "reward")}, timeout_s=60)
    q = DistQueue(spec, store=None, rank=r, world_size=w, pg=None)  # store: default_store(); pg: gloo
    ids = q.put({"prompt": [t...], "response": [t...], "reward": [0.5, ...]})  # new rows -> row ids
    q.row_id(j, rank)                               # the id of a rank's j-th row, known in advance
    q.put({"old_logprobs": [t...]}, ids=ids)        # write more columns of existing rows
    b = q.get("train", n, dp_group=None, group=None, min_rows=None, only=None)  # -> Rows
    b.ids, b.cols["response"] (list of 1-D), b.stack("reward") (B,), b.packed("response") (flat, lens)
    q.drain(); q.metrics()  # the whole queue's traffic, whichever rank asks
    q.reads("train"); q.state_dict(); q.load_state_dict(sd)
    pad/unpad (naive), pack/unpack, pack_cells/unpack_cells, balance_split: pure primitives.

Design:
- Control plane: torch.distributed Store (TCPStore under torchrun): one ready log ("row,column,owner,len;"
  per cell, a counter and one key per put: a poll fetches only the new entries, in a round trip or three), claim logs
  (per stage and block of row ids, one atomic `append` per claim: a row belongs to the first claim naming
  it that was not released since), request queues per owner, a state key per transfer (sent, cancelled
  or missing: one writer wins) and an ack per transfer (kept or dropped).
- Data plane: p2p isend/irecv of packed tensors on `pg`: a header of per-cell lengths (K,) int64 first,
  then one uint8 payload. The header is per cell (row x field), so fields of different lengths and
  dtypes share ONE header and ONE payload; dtypes come from the spec, never over the wire.
- Balance: `get(..., dp_group=g)` reads a global batch of n rows; dp rank 0 claims them and splits by
  tokens (sum of the variable-length fields) with greedy longest-first (LPT): max - min <= longest row.
  A row written by a rank of g stays with it while that rank holds no more than a fair share: where the
  writers are the readers (colocated), only the rows that even out their loads move. The plan a rank
  reads carries n: a rank that passed another n raises ValueError naming both (the whole group does).
- A reader's own cells need no transfer: it gets copies (it may write into them), except in the last stage
  that reads a cell, which takes the queue's own tensor, freed from the queue as the read keeps it.
- A claim poll scans only the rows its reader has not seen claimed (the rows a claim log shows held
  leave its tables; a rank that reads a DP plan gets the cells' places with it): its cost follows the
  rows not yet claimed, not the rows ever put.
- Every wait polls with a deadline and serves other ranks' requests while it waits (so SPMD ranks that
  are producers and consumers at once never deadlock); a producer that does not answer -> TimeoutError
  naming the stage, the rows and its rank. A dp_group read returns only once every rank of the group has
  its rows, so SPMD code may enter a collective right after it; otherwise a rank whose cells are still
  wanted must keep calling the queue, or `drain()`, before blocking elsewhere.
- A get that raises (TimeoutError, or a pull's error) loses nothing and strands nothing. It keeps no
  row, its reader's own cells included, and releases its claims: the rows stay claimable, and a retried
  get (or any reader of the stage) reads each of them exactly once. Each owner it asked either never
  sends (the request is cancelled first) or has its transfer acknowledged as dropped, so the owner's
  drain() and state_dict() do not wait for it; an owner frees a cell only once a reader of every stage
  acknowledged keeping it. With dp_group the read succeeds on every rank of the group or on none (each
  raises the first failure's error type; dp rank 0 releases the group's rows; the others wait up to 2 x
  timeout_s for its plan, so that a claim that times out is the failure they raise); with group, the members
  raise the leader's failure (they wait up to 2 x timeout_s for its answer).

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
1. Data lives in host memory and moves on a gloo group (pass `pg`); the source's queue is an RDMA store.
2. No separate queue servers: the owner rank serves its own cells, inside any queue call or `drain()`.
3. Padded equivalent pads each field to the longest cell of the step's global batch (a [B, T] tensor).
4. Ids are deterministic (local_count * world + rank), so a resumed run sees the same rows in order.

Run: python -m pytest tests/test_distqueue.py ; python bench/distqueue.py --lengths lognormal:5,1.2

Using this file elsewhere: torch (tested with 2.13; CPU tensors; the data moves over a gloo group, also next to nccl),
and a store with queue operations, atomic add, append, compare_set and multi_get: TCPStore (torchrun's, found from
MASTER_ADDR and MASTER_PORT) or HashStore (one process); a FileStore is refused at construction. Rows are
lists of 1-D tensors per column (scalar columns: one value), of the spec's dtypes. Example
(tests/test_copy_alone.py runs it in a folder that holds only this file):

    import datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from distqueue import DistQueue, QueueSpec

    def rank_main(rank, world, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        spec = QueueSpec(columns={"tokens": "int64", "reward": "float32"}, scalars=("reward",),
                         stages={"train": ("tokens", "reward")}, timeout_s=60)
        q = DistQueue(spec, rank=rank, world_size=world)  # the store: torchrun's (here env://'s)
        q.put({"tokens": [torch.arange(n) for n in (2, 30)], "reward": [1.0, 0.0]})  # ragged rows
        rows = q.get("train", 4, dp_group=dist.group.WORLD)  # 4 rows in all, split by tokens, packed
        print(f"rank {rank}: rows {rows.ids}, {sum(map(len, rows.cols['tokens']))} tokens")
        dist.barrier()  # every rank done before any tears down
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port), nprocs=2)

Shapes: B rows, C fields of a stage, K cells (row x field) in one transfer, N elements, T longest length.
"""
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "bool": torch.bool}
CLAIM_BLOCK = 1024  # row ids per claim log: a claim reads its blocks' logs whole, so they stay short

# ----------------------------------------------------------------------------- packing primitives


def pad(seqs, pad_value=0):
    """Naive: pad every sample to the longest one. Returns padded (B, T) and lengths (B,)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)  # (B,)
    T = int(lengths.max()) if len(seqs) else 0
    out = torch.full((len(seqs), T), pad_value, dtype=seqs[0].dtype if seqs else torch.int64)  # (B, T)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out, lengths


def unpad(padded, lengths):
    return [padded[i, : int(n)].clone() for i, n in enumerate(lengths)]


def pack(seqs):
    """Packed: concatenate along the sequence dim. Returns flat (N,) and lengths (B,); no padding."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)  # (B,)
    flat = torch.cat([s.reshape(-1) for s in seqs]) if seqs else torch.empty(0)  # (N,) N = sum(lengths)
    return flat, lengths


def unpack(flat, lengths):
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    if lengths.dim() != 1 or (lengths < 0).any() or int(lengths.sum()) != flat.numel():
        raise ValueError(f"lengths {lengths.tolist()} (sum {int(lengths.sum())}) do not split a payload "
                         f"of {flat.numel()} elements; they must be >= 0 and sum to it")
    return [t.clone() for t in torch.split(flat, lengths.tolist())]


def pack_cells(cells):
    """Many fields, many dtypes -> header (K,) int64 of lengths and ONE payload (bytes,) uint8."""
    header = torch.tensor([c.numel() for c in cells], dtype=torch.int64)  # (K,)
    payload = torch.cat([c.contiguous().reshape(-1).view(torch.uint8) for c in cells]) if cells \
        else torch.empty(0, dtype=torch.uint8)  # (sum_k len_k * itemsize_k,)
    return header, payload


def unpack_cells(header, payload, dtypes):
    """Inverse of pack_cells; dtypes (K,) come from the spec, not the wire. Each cell views its slice of the payload
    (cells never overlap), or a copy of it where the slice does not start at a multiple of its dtype's size."""
    nbytes = [n * d.itemsize for n, d in zip(header.tolist(), dtypes)]
    if header.numel() != len(dtypes) or sum(nbytes) != payload.numel():
        raise ValueError(f"header lengths {header.tolist()} x dtypes give {sum(nbytes)} bytes, "
                         f"payload has {payload.numel()}")
    cells, offset = [], 0
    for piece, d, n in zip(torch.split(payload, nbytes), dtypes, nbytes):
        aligned = (payload.storage_offset() + offset) % d.itemsize == 0
        cells.append(piece.view(d) if aligned else piece.clone().view(d))  # a copy realigns it
        offset += n
    return cells


def balance_split(tokens, parts, homes=None):
    """Rows into `parts` lists of near-equal tokens (>= 0): greedy longest-first (LPT), the next-longest row
    to the lightest part. max - min <= max(tokens).
    homes (optional): the part each row already lives in, or None. Longest first, a row stays home if its
    home, with it, holds at most a fair share (total / parts); the rest go by LPT. A home sends away less
    than its excess over the fair share plus one row, and the bound still holds: the heaviest part, if it
    got an LPT row, was the lightest just before its last one; if it got none, it holds at most the mean,
    so every part holds the mean. A part still empty then (all stayed home) takes the shortest row of the
    part with the most rows: every load was within [0, max(tokens)], and stays there."""
    homes = [None] * len(tokens) if homes is None else homes
    fair, load, out, rest = sum(tokens) / parts, [0] * parts, [[] for _ in range(parts)], []
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        h = homes[i]
        if h is not None and load[h] + tokens[i] <= fair:
            out[h].append(i)
            load[h] += tokens[i]
        else:
            rest.append(i)
    for i in rest:  # longest first still
        p = min(range(parts), key=lambda p: (load[p], len(out[p]), p))  # ties (0 tokens): fewest rows
        out[p].append(i)
        load[p] += tokens[i]
    for q in [q for q in range(parts) if not out[q]]:  # every reader gets a row while there are enough
        donor = max(range(parts), key=lambda p: (len(out[p]), -p))
        if len(out[donor]) < 2:
            break
        i = min(out[donor], key=lambda i: (tokens[i], i))
        out[donor].remove(i)
        out[q].append(i)
    return [sorted(o) for o in out]


# ----------------------------------------------------------------------------- config and batch


@dataclass
class QueueSpec:
    columns: dict           # field name -> dtype name ("int64", "float32", ...)
    stages: dict            # stage name -> tuple of the fields it reads
    scalars: tuple = ()     # fields with one value per row (stored as (1,) tensors)
    timeout_s: float = 60.0  # every wait raises after this long
    poll_s: float = 0.002   # sleep between control-plane polls
    name: str = "dq"        # key prefix: several queues can share one store

    def __post_init__(self):
        bad = {c: d for c, d in self.columns.items() if d not in DTYPES}
        if bad:
            raise ValueError(f"unknown dtypes {bad}; valid: {sorted(DTYPES)}")
        for s, cols in self.stages.items():
            unknown = [c for c in cols if c not in self.columns]
            if unknown or not cols:
                raise ValueError(f"stage '{s}' reads {list(cols)}; unknown {unknown}; valid {list(self.columns)}")
        unread = [c for c in self.columns if not any(c in cols for cols in self.stages.values())]
        if unread or any(s not in self.columns for s in self.scalars):
            raise ValueError(f"columns {unread} read by no stage, or scalars {list(self.scalars)} not in "
                             f"columns {list(self.columns)}")
        if self.timeout_s <= 0 or self.poll_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} and poll_s={self.poll_s} must be > 0")
        bad = [x for x in [*self.columns, *self.stages] if not x or set(x) & set("|:,;=/ \t\n")]
        if bad:  # they are written into '|:,;='-separated control messages and '/'-joined store keys
            raise ValueError(f"column or stage names {bad} are empty or contain one of | : , ; = / or whitespace")


@dataclass
class Rows:
    """What a stage read: row ids and, per field, one 1-D tensor per row."""
    ids: list               # (B,) row ids, ascending
    cols: dict              # field -> list of B 1-D tensors
    tmax: dict = field(default_factory=dict)  # field -> longest cell of the step's global batch

    def stack(self, col):
        return torch.cat(self.cols[col])  # (B,) for a scalar field

    def packed(self, col):
        return pack(self.cols[col])  # flat (N,), lengths (B,)


def default_store(timeout_s=300.0):
    """The store of the run's rendezvous, from public API: a TCPStore client of MASTER_ADDR:MASTER_PORT
    (torchrun, or any env:// start, sets both); an in-process HashStore in a world of one. After a tcp://
    start, its error says which store to pass; after a file:// start, pass a TCPStore of your own."""
    import datetime
    import os
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dist.HashStore()
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("DistQueue needs a store that every rank reaches, and MASTER_ADDR/MASTER_PORT are not set "
                         "(the process group was not started from torchrun's environment). After "
                         "init_method='tcp://HOST:PORT', pass store=dist.TCPStore(HOST, PORT, is_master=False) on "
                         "every rank: a client of the store that the rendezvous already serves on PORT (a second "
                         "is_master=True store there fails: the port is taken). Else a TCPStore on a free port, "
                         "is_master=True on one rank only")
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def check_store(store):
    """The queue's control plane needs a store with queue operations, atomic add, append, compare_set and multi_get:
    TCPStore and HashStore have them, FileStore has no queue operations. Raises before any collective."""
    try:
        store.queue_len("dq/probe")
        store.add("dq/probe_add", 0)
        store.append("dq/probe_append", "")
        store.compare_set("dq/probe_compare_set", "", "")
        store.multi_get(["dq/probe_add"])
    except (NotImplementedError, RuntimeError, AttributeError) as e:
        raise ValueError(f"{type(store).__name__} cannot serve a DistQueue ({e}): it needs queue operations "
                         "(queue_push, queue_pop, queue_len), add, append, compare_set and multi_get; pass a TCPStore "
                         "or a HashStore (a process group started with file:// has a FileStore)") from None


# ----------------------------------------------------------------------------- the queue


class DistQueue:
    """One rank's handle on the queue (see the module docstring). store: a TCPStore or HashStore every
    rank reaches (default: default_store()); rank, world_size: this rank in the ranks that share the
    queue; pg: a gloo process group over them for the data (default: the default group, if gloo)."""

    def __init__(self, spec: QueueSpec, store=None, rank=0, world_size=1, pg=None):
        store = default_store(spec.timeout_s) if store is None else store
        check_store(store)
        self.spec, self.store, self.rank, self.world, self.pg = spec, store, rank, world_size, pg
        self.p = spec.name
        self.needers = {c: sum(c in cols for cols in spec.stages.values()) for c in spec.columns}  # stages reading c
        self.col_index = {c: i for i, c in enumerate(spec.columns)}  # a column's number in the ready log
        self.cells = {}          # (row, col) -> 1-D tensor this rank owns and has not fully delivered
        self.served = {}         # (row, col) -> stages whose reader acknowledged keeping it
        self.next_local = 0      # rows this rank created (ids = next_local * world + rank)
        self.steps = {s: 0 for s in spec.stages}  # balanced reads per stage (plan keys)
        self.inflight = {}       # tag -> (works, tensors, cells, stage): sent, kept alive until the reader acks
        self.claimer = int(store.add(self._k("claimers"), 1))  # unique per queue object on this store
        self.claims_made = 0     # reads this object claimed for (their tokens: claimer.count)
        self._reset_caches()
        if dist.is_initialized() and dist.get_backend(pg) != "gloo":  # host tensors, async p2p: gloo only
            raise ValueError(f"pg backend is {dist.get_backend(pg)}; pass pg=dist.new_group(backend='gloo')")

    def row_id(self, j, rank=None):
        """The id of the j-th row a rank (default: this one) creates: ids are deterministic, so a reader
        can name the rows it wants (get(only=...)) without asking."""
        return j * self.world + (self.rank if rank is None else rank)

    def _reset_caches(self):
        self.unclaimed = {s: {} for s in self.spec.stages}  # stage -> {row: {col: (owner, length)}} not seen claimed
        self.ready_off = dict.fromkeys(self.spec.stages, 0)  # stage -> ready-log entries it has read

    def _k(self, *parts):
        return "/".join([self.p, *map(str, parts)])

    # --- producers
    def put(self, columns, ids=None):
        """Write cells. ids=None creates new rows; else writes more columns of existing rows."""
        n = None
        for c, vals in columns.items():  # validate everything before anything is published
            if c not in self.spec.columns:
                raise KeyError(f"unknown column '{c}'; valid: {list(self.spec.columns)}")
            n = len(vals) if n is None else n
            if len(vals) != n:
                raise ValueError(f"column '{c}' has {len(vals)} rows, others {n}")
        new = ids is None
        ids = [self.row_id(self.next_local + i) for i in range(n or 0)] if new else list(ids)
        if n is not None and len(ids) != n:
            raise ValueError(f"{len(ids)} ids for {n} rows")
        cells = {}
        for c, vals in columns.items():
            want = DTYPES[self.spec.columns[c]]
            for r, v in zip(ids, vals):
                t = v if torch.is_tensor(v) else torch.tensor(v, dtype=want)
                if t.dtype != want:
                    raise TypeError(f"column '{c}' row {r}: dtype {t.dtype}, expected {want}")
                if c in self.spec.scalars and t.numel() != 1 or c not in self.spec.scalars and t.dim() != 1:
                    raise ValueError(f"column '{c}' row {r}: shape {tuple(t.shape)}; scalar fields take one "
                                     f"value, others a 1-D tensor")
                if (r, c) in self.cells or any(c in seen.get(r, ()) for seen in self.unclaimed.values()):
                    raise ValueError(f"cell (row {r}, column '{c}') written twice")
                cells[(r, c)] = t.detach().reshape(-1).to("cpu", copy=True)  # own copy, in host memory (departure 1)
        self.cells.update(cells)
        self.next_local += len(ids) if new else 0
        self._publish(self._entries(cells))
        self.serve()
        return ids

    def _entries(self, cells, stage=None):
        """Ready-log entries of cells ({(row, col): tensor, or (owner, length)}): "row,column,owner,len;", the column
        by its number in the spec (the same on every rank); with stage, "row,column,owner,len,stage;" (cells
        released in that stage)."""
        tail = "" if stage is None else f",{stage}"
        out = []
        for (r, c), v in cells.items():
            owner, length = (self.rank, v.numel()) if torch.is_tensor(v) else v
            out.append(f"{r},{self.col_index[c]},{owner},{length}{tail};")
        return "".join(out)

    def _publish(self, entries):
        """Append to the ready log: a counter, then one key per append (a put's cells, every column: two store round
        trips), so a poll reads only what is new."""
        i = int(self.store.add(self._k("ready", "n"), 1)) - 1
        self.store.set(self._k("ready", i), entries)

    # --- serving: the owner answers pull requests (called from every wait loop)
    def serve(self):
        """Answer the requests waiting for this rank, one packed transfer each; then retire the transfers
        their readers acknowledged: kept (the cells reached that stage) or dropped (a get that failed)."""
        qk = self._k("req", self.rank)
        while self.store.queue_len(qk) > 0:
            dst, tag, stage, tmax, cells = self.store.queue_pop(qk, block=False).decode().split("|")
            tag, keys = int(tag), [(int(r), c) for r, c in (x.split(":") for x in cells.split(","))]
            missing, state = [k for k in keys if k not in self.cells], self._k("state", tag)
            answer = self.store.compare_set(state, "", f"missing {missing[:8]}" if missing else "sent").decode()
            if answer != "sent":  # the reader cancelled first (it never reads this), or the cells are gone
                if answer == "cancelled":
                    self.store.delete_key(state)
                continue
            header, payload = pack_cells([self.cells[k] for k in keys])  # (K,), (bytes,)
            works = [dist.isend(header, int(dst), group=self.pg, tag=2 * tag)]
            if payload.numel():
                works.append(dist.isend(payload, int(dst), group=self.pg, tag=2 * tag + 1))
            self.inflight[tag] = (works, (header, payload), keys, stage)
            tm = dict(x.split("=") for x in tmax.split(",") if x)
            pad_bytes = sum(int(tm.get(c, self.cells[(r, c)].numel())) * self.cells[(r, c)].dtype.itemsize
                            for r, c in keys)
            self._count("bytes_sent", header.nbytes + payload.nbytes)
            self._count("bytes_padded_equiv", header.nbytes + pad_bytes)
        for tag in [t for t in self.inflight if self.store.check([self._k("ack", t)])]:
            works, _, keys, stage = self.inflight.pop(tag)
            for w in works:  # the reader received it all before acknowledging: these return at once
                w.wait()
            if self.store.get(self._k("ack", tag)) == b"kept":
                for k in keys:
                    self._delivered(k, stage)
            self.store.delete_key(self._k("ack", tag))

    def _delivered(self, key, stage):
        stages = self.served.setdefault(key, set())
        stages.add(stage)
        if len(stages) >= self.needers[key[1]]:  # every stage that reads it has it: free the cell
            del self.cells[key], self.served[key]

    def _read_last(self, key):
        """Whether the stage reading this cell now is the last that needs it (the others acknowledged it)."""
        return len(self.served.get(key, ())) + 1 >= self.needers[key[1]]

    def _wait(self, done, deadline, what):
        """Poll `done` until the deadline, serving peers all along: even a wait that succeeds at once
        serves, or a rank that only ever polls (get(min_rows=0)) would starve the ranks pulling from it."""
        while not (self.serve() or done()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distqueue '{self.p}' rank {self.rank}: timed out after "
                                   f"{self.spec.timeout_s}s {what()}")
            time.sleep(self.spec.poll_s)

    def drain(self, timeout_s=None):
        """A producer that is done serves until every cell it owns reached every stage that reads it."""
        deadline = time.monotonic() + (timeout_s or self.spec.timeout_s)
        self._wait(lambda: not self.cells and not self.inflight, deadline,
                   lambda: f"in drain: rows {sorted({r for r, _ in self.cells})[:16]} not yet read by every stage, "
                           f"transfers {sorted(self.inflight)} not acknowledged")

    # --- consumers: claim and release (control plane), fetch (data plane), then keep or drop
    def _token(self):
        """A name for one read's claims, unique among this queue's readers."""
        self.claims_made += 1
        return f"{self.claimer}.{self.claims_made}"

    def _refresh(self, stage):
        """The ready log's new entries, for this stage's columns -> self.unclaimed[stage]. Each stage keeps its own
        place in the log, so a rank tracks only the stages it claims for. Three store round trips when there is
        something new and written (one counted but not yet written: read at a later poll), one when there is not."""
        seen, names = self.unclaimed[stage], list(self.spec.columns)
        cols = {self.col_index[c] for c in self.spec.stages[stage]}
        n = int(self.store.add(self._k("ready", "n"), 0))
        keys = self._written([self._k("ready", i) for i in range(self.ready_off[stage], n)])
        for log in self.store.multi_get(keys) if keys else []:
            for e in log.decode().split(";")[:-1]:
                r, c, o, length, *released = e.split(",")
                if int(c) in cols and released in ([], [stage]):  # a release shows its cells to its stage only
                    seen.setdefault(int(r), {})[names[int(c)]] = (int(o), int(length))
        self.ready_off[stage] += len(keys)

    def _written(self, keys):
        """The longest prefix of `keys` (the log's next entries, in order) that is written. An entry counted but
        never written (its writer died between the two) hides the entries after it from every reader: their gets
        time out, as they would waiting on the dead writer's cells."""
        while keys and not self.store.check(keys):
            keys = keys[:-1] if self.store.check(keys[:1]) else []
        return keys

    def _claim(self, stage, n, min_rows, deadline, token, only=None):
        """Claim up to n complete rows (at least min_rows) as `token` -> {row: {col: (owner, length)}}.
        A claim that times out releases what it won, so its rows go to the next reader."""
        cols, seen, mine = self.spec.stages[stage], self.unclaimed[stage], {}

        def poll():
            self._refresh(stage)
            cand = sorted(r for r, cells in seen.items() if len(cells) == len(cols) and (only is None or r in only))
            if len(mine) + len(cand) < min_rows:  # not enough yet: claim nothing (a reader racing for the same
                return False                      # rows may still win some first: then the timeout releases them)
            mine.update(self._claim_rows(stage, cand[: n - len(mine)], token))
            return len(mine) >= n or (len(mine) >= min_rows and len(cand) <= n - len(mine))
        try:
            self._wait(poll, deadline, lambda: self._lacking(stage, n, min_rows, len(mine), only))
        except Exception:
            self._release(stage, token, mine)
            raise
        return mine

    def _lacking(self, stage, n, min_rows, claimed, only):
        """Why a claim still waits: rows that miss columns, fewer complete rows than asked, or none at all."""
        cols, seen = self.spec.stages[stage], self.unclaimed[stage]
        rows = [r for r in seen if only is None or r in only]
        partial = sorted(r for r in rows if len(seen[r]) < len(cols))
        why = (f"in stage '{stage}' waiting for {n - claimed} more rows with columns {list(cols)} (claimed "
               f"{claimed}): {len(rows) - len(partial)} unclaimed rows{' (of only)' if only is not None else ''} "
               f"have every column, and this get asked for {n} (at least {min_rows})")
        if partial:
            lack = sorted({c for r in partial for c in cols if c not in seen[r]})
            return why + f"; rows {partial[:32]} are missing columns {lack}"
        if not rows:
            return why + "; no unclaimed row has been put: is a producer still putting rows?"
        return why + ": put more rows before this get, ask for fewer (n), or take what there is (min_rows)"

    def _claim_rows(self, stage, rows, token):
        """Claim rows for stage as `token`; returns {row: cells} of those won, out of self.unclaimed. Per
        block of CLAIM_BLOCK row ids, one atomic append of the claim to the block's log, then one read of
        the log: a row belongs to the first claim naming it that was not released since, so racing readers
        all see the same holder. Every row the log shows held leaves self.unclaimed: a poll scans only the
        rows this reader has not seen claimed. Two store round trips per block, not one per row."""
        won = {}
        for block in sorted({r // CLAIM_BLOCK for r in rows}):
            key = self._k("claims", stage, block)
            self.store.append(key, f"{token}:{','.join(str(r) for r in rows if r // CLAIM_BLOCK == block)};")
            held = self._holders(self.store.get(key))
            for r in held:
                cells = self.unclaimed[stage].pop(r, None)
                if held[r] == token and cells is not None:  # None: won at an earlier poll of this read
                    won[r] = cells
        return won

    @staticmethod
    def _holders(log):
        """A claim log ("token:ids;" claims, "-token:ids;" releases) -> {row: the token that holds it}."""
        held = {}
        for entry in log.decode().split(";")[:-1]:
            who, ids = entry.split(":")
            for r in map(int, ids.split(",")):
                if not who.startswith("-"):
                    held.setdefault(r, who)
                elif held.get(r) == who[1:]:
                    del held[r]
        return held

    def _release(self, stage, token, rows):
        """Give back rows claimed as `token` ({row: {col: (owner, length)}}): a "-token" entry in each block's
        claim log ends the claims, and entries naming the stage, in the ready log, show the rows again to the
        stage's readers (they dropped them when they saw them claimed)."""
        ids = sorted(rows)
        for block in sorted({r // CLAIM_BLOCK for r in ids}):
            self.store.append(self._k("claims", stage, block),
                              f"-{token}:{','.join(str(r) for r in ids if r // CLAIM_BLOCK == block)};")
        if ids:
            self._publish(self._entries({(r, c): rows[r][c] for r in ids for c in self.spec.stages[stage]}, stage))

    def _fetch(self, stage, rows, tmax, deadline):
        """The cells of rows ({row: {col: (owner, length)}}): local ones at hand, one request and one packed
        transfer per remote owner. Acknowledges nothing (the caller keeps or drops): returns the cells and
        the tags received. On an error it cancels the requests not yet answered, drops what came, and raises."""
        cols, owners = self.spec.stages[stage], {}
        for r in sorted(rows):
            for c in cols:
                owners.setdefault(rows[r][c][0], []).append((r, c))
        local = owners.pop(self.rank, [])  # the consumer may write into a cell: a copy, unless freed once read
        got = {k: self.cells[k] if self._read_last(k) else self.cells[k].clone() for k in local}
        tm, tags, received = ",".join(f"{c}={n}" for c, n in tmax.items()), {}, []
        for o, keys in owners.items():
            tags[o] = int(self.store.add(self._k("tag"), 1))
            msg = f"{self.rank}|{tags[o]}|{stage}|{tm}|" + ",".join(f"{r}:{c}" for r, c in keys)
            self.store.queue_push(self._k("req", o), msg)
        try:
            for o, tag in list(tags.items()):
                self._wait(lambda: self.store.check([self._k("state", tag)]), deadline,
                           lambda: self._silent(stage, o, owners[o]))
                del tags[o]  # answered: received next, or a broken transfer (an error, never retried)
                received.append(tag)  # acknowledged, kept or dropped, whatever _recv finds
                got.update(self._recv(o, tag, owners[o], rows))
        except Exception:
            for o, tag in tags.items():  # not answered yet: cancelled, unless the owner answers first
                if self.store.compare_set(self._k("state", tag), "", "cancelled") == b"sent":
                    self._recv(o, tag, owners[o], rows)  # it sent just now: take it, to acknowledge it
                    received.append(tag)
            self._ack(received, keep=False)
            raise
        return got, received

    def _silent(self, stage, o, keys):
        """Why a pull still waits: its owner has not answered."""
        waiting = self.store.queue_len(self._k("req", o))
        return (f"in stage '{stage}' waiting for rows {sorted({r for r, _ in keys})[:32]} from rank {o}, which has "
                f"not answered ({waiting} requests wait in its queue): rank {o} is alive but not calling the queue "
                f"(busy elsewhere: in a collective, in compute), or it is gone. A rank whose cells are still wanted "
                f"must keep calling the queue, or drain(), before blocking elsewhere")

    def _recv(self, o, tag, keys, rows):
        """One transfer from owner o: its answer (state key), a header (K,) of lengths, then one payload."""
        state = self._k("state", tag)
        answer = self.store.get(state).decode()
        self.store.delete_key(state)
        if answer != "sent":
            raise RuntimeError(f"rank {o}, asked by rank {self.rank} for cells it does not hold, answered {answer}")
        header = torch.empty(len(keys), dtype=torch.int64)  # (K,) lengths header first
        dist.recv(header, o, group=self.pg, tag=2 * tag)
        dtypes = [DTYPES[self.spec.columns[c]] for _, c in keys]
        nbytes = sum(n * d.itemsize for n, d in zip(header.tolist(), dtypes))
        payload = torch.empty(nbytes, dtype=torch.uint8)  # (bytes,) then one payload, as the owner sent it
        if nbytes:
            dist.recv(payload, o, group=self.pg, tag=2 * tag + 1)
        expect = [rows[r][c][1] for r, c in keys]
        if header.tolist() != expect:  # received whole first: the owner's sends complete either way
            raise RuntimeError(f"header {header.tolist()} from rank {o} != published lengths {expect}")
        return dict(zip(keys, unpack_cells(header, payload, dtypes)))

    def _ack(self, tags, keep):
        for tag in tags:
            self.store.set(self._k("ack", tag), "kept" if keep else "dropped")

    def _read(self, stage, n, min_rows, dp_group, step, deadline, only=None):
        """Claim (dp rank 0), split and publish the plan (dp rank 0), fetch this rank's part; keep it only if
        every rank of the DP group fetched its own, else drop it, release the group's claims and raise."""
        cols = self.spec.stages[stage]
        dp_rank, dp_size = (dist.get_rank(dp_group), dist.get_world_size(dp_group)) if dp_group else (0, 1)
        root = dist.get_global_rank(dp_group, 0) if dp_group else self.rank  # names this DP group's keys
        token, claimed, got, tags, error = self._token(), {}, {}, [], None
        try:
            if dp_rank == 0:
                claimed = self._claim(stage, n, n if dp_size > 1 else min_rows, deadline, token, only)
                rows, tmax = self._plan(stage, n, claimed, dp_size, dp_group, step, root)
            else:  # the leader answers within its deadline, its own failure included: that is the one raised (the
                # fetch keeps this rank's deadline: a plan that comes late fails the group, whose outcome says why)
                rows, tmax = self._take_plan(stage, n, dp_rank, step, root, deadline + self.spec.timeout_s)
            got, tags = self._fetch(stage, rows, tmax, deadline)
        except Exception as e:
            error = e
        if dp_size > 1:  # return only when the whole DP group has its rows: SPMD code may then enter a
            error = self._agree(stage, step, root, dp_rank, dp_size, error, deadline)  # collective at once
        self._ack(tags, keep=error is None)
        if error is not None:
            if dp_rank == 0:  # its claim holds the whole group's rows; a plan may be left unread
                self._release(stage, token, claimed)
                for i in range(1, dp_size):
                    self.store.delete_key(self._k("plan", stage, step, root, i))
            raise error
        for r in rows:
            for c in cols:
                if rows[r][c][0] == self.rank:
                    self._delivered((r, c), stage)
        if rows:  # a poll that found nothing (min_rows=0) is no read
            self.store.add(self._k("reads", stage), 1)
        ids = sorted(rows)
        return Rows(ids, {c: [got[(r, c)] for r in ids] for c in cols}, dict(tmax))

    def _plan(self, stage, n, claimed, dp_size, dp_group, step, root):
        """dp rank 0: its own part of the claimed rows and the longest cell per field; with a DP group, it
        publishes every other rank's part: n, the longest cells, and per row where its cells are."""
        cols, ids = self.spec.stages[stage], sorted(claimed)
        tmax = {c: max(claimed[r][c][1] for r in ids) for c in cols} if ids else {}
        if dp_size == 1:
            return claimed, tmax
        parts = self._split(ids, claimed, cols, dp_group)
        tm = ",".join(f"{c}={v}" for c, v in tmax.items())
        for i, part in enumerate(parts[1:], 1):
            where = ";".join(f"{r}:" + ",".join(f"{o},{length}" for o, length in (claimed[r][c] for c in cols))
                             for r in (ids[j] for j in part))
            self.store.set(self._k("plan", stage, step, root, i), f"{n}|{tm}|{where}")
        return {ids[j]: claimed[ids[j]] for j in parts[0]}, tmax

    def _take_plan(self, stage, n, dp_rank, step, root, deadline):
        """dp rank > 0: this rank's part of dp rank 0's plan (unless the group failed first); checks n."""
        key, outcome = self._k("plan", stage, step, root, dp_rank), self._k("outcome", stage, step, root)
        self._wait(lambda: self.store.check([key]) or self.store.check([outcome]), deadline,
                   lambda: f"in stage '{stage}' waiting for dp rank 0's plan for step {step}")
        if not self.store.check([key]):
            raise RuntimeError(f"dp rank 0 published no plan for step {step}")  # _agree says why
        n0, tm, where = self.store.get(key).decode().split("|")
        self.store.delete_key(key)
        if int(n0) != n:
            raise ValueError(f"get('{stage}', n={n}) on dp rank {dp_rank}, but dp rank 0 asked for n={n0}: every "
                             f"rank of a dp_group passes the same n (the global batch)")
        cols, rows = self.spec.stages[stage], {}
        for e in where.split(";") if where else ():
            r, places = e.split(":")
            v = [int(x) for x in places.split(",")]
            rows[int(r)] = {c: (v[2 * j], v[2 * j + 1]) for j, c in enumerate(cols)}
        return rows, {c: int(v) for c, v in (x.split("=") for x in tm.split(",") if x)}

    def _agree(self, stage, step, root, dp_rank, dp_size, error, deadline):
        """All or nothing across a DP group: each rank votes (its part fetched, or its error); the last of
        dp_size ok votes, or the first error, sets the outcome (compare_set: the first writer wins), and every
        rank waits for it. Returns None, or the error this rank raises: the first failure's, on every rank."""
        outcome = self._k("outcome", stage, step, root)
        if error is None and int(self.store.add(self._k("done", stage, step, root), 1)) == dp_size:
            self.store.compare_set(outcome, "", "ok")
            for key in ("done", "outcome"):  # every rank voted here, so it read the last step's outcome
                self.store.delete_key(self._k(key, stage, step - 1, root))
        elif error is not None:
            self.store.compare_set(outcome, "", f"{dp_rank}|{type(error).__name__}|{error}")
        try:
            self._wait(lambda: self.store.check([outcome]), deadline,
                       lambda: f"in stage '{stage}' waiting for the other DP ranks to receive their rows")
        except TimeoutError as e:
            error = e
            self.store.compare_set(outcome, "", f"{dp_rank}|TimeoutError|{e}")
        verdict = self.store.get(outcome).decode()
        if verdict == "ok":
            return None
        first, kind, why = verdict.split("|", 2)
        if int(first) == dp_rank:
            return error
        return {"TimeoutError": TimeoutError, "ValueError": ValueError}.get(kind, RuntimeError)(
            f"dp rank {first} of this get's dp_group failed, so this rank keeps no row: {why}")

    def _split(self, ids, rows, cols, dp_group):
        """balance_split of rows over dp_group by tokens (the lengths of their variable-length cells), a row's
        home being the DP rank that holds most of its elements, if any: a rank reading what it wrote pulls nothing."""
        dp_index = {g: i for i, g in enumerate(dist.get_process_group_ranks(dp_group))}
        var, homes = [c for c in cols if c not in self.spec.scalars], []
        for r in ids:
            held = {}  # DP rank -> elements of this row it holds
            for c in cols:
                owner, length = rows[r][c]
                if owner in dp_index:
                    held[dp_index[owner]] = held.get(dp_index[owner], 0) + length
            homes.append(max(held, key=lambda i: (held[i], -i)) if held else None)
        return balance_split([sum(rows[r][c][1] for c in var) for r in ids], len(dp_index), homes)

    def get(self, stage, n, dp_group=None, group=None, min_rows=None, only=None):
        """Read up to n rows (at least min_rows, default n; 0 = poll) that `stage` has not consumed.
        dp_group: n is the global batch, split by tokens across its ranks. group: only its first rank
        reads; it broadcasts the packed batch to the rest of the group. only: a set of row ids to take
        from, for a reader that must take given rows (e.g. one batch of each producer). A get that raises
        keeps no row and leaves every row it took claimable: it may be called again."""
        if stage not in self.spec.stages:
            raise KeyError(f"unknown stage '{stage}'; valid: {list(self.spec.stages)}")
        dp, min_rows = dist.get_world_size(dp_group) if dp_group else 1, n if min_rows is None else min_rows
        if not 0 <= min_rows <= n or n < max(dp, 1):
            raise ValueError(f"n={n}, min_rows={min_rows}, dp size {dp}: need 0 <= min_rows <= n and n >= dp")
        deadline = time.monotonic() + self.spec.timeout_s
        for g, what in ((dp_group, "dp_group"), (group, "group")):
            if g is not None and dist.get_rank(g) < 0:
                raise ValueError(f"rank {self.rank} is not in the {what} it passed (ranks "
                                 f"{dist.get_process_group_ranks(g)})")
        if group is not None and dist.get_backend(group) != "gloo":
            raise ValueError(f"group backend is {dist.get_backend(group)}; the broadcast needs a gloo group")
        leader = dist.get_global_rank(group, 0) if group is not None else self.rank
        step, self.steps[stage] = self.steps[stage], self.steps[stage] + 1  # same count on every rank (SPMD)
        if group is None:
            return self._read(stage, n, min_rows, dp_group, step, deadline, only)
        batch, error = None, None
        if leader == self.rank:
            try:
                batch = self._read(stage, n, min_rows, dp_group, step, deadline, only)
            except Exception as e:  # told to the group first, so that its members raise too
                error = e
        return self._bcast(batch, error, stage, group, leader, deadline + self.spec.timeout_s)

    def _bcast(self, batch, error, stage, group, leader, deadline):
        """Leader -> its model-parallel group: size (or the leader's failure: < 0), header (B, 1+C)
        [ids, lengths], one payload. The deadline is the leader's plus timeout_s: the leader always answers."""
        cols = list(self.spec.stages[stage])
        dtypes = [DTYPES[self.spec.columns[c]] for c in cols]
        failures = (TimeoutError, ValueError, RuntimeError)  # a leader's failure -> meta -1, -2, -3

        def bcast(t, what):
            w = dist.broadcast(t, leader, group=group, async_op=True)
            self._wait(w.is_completed, deadline, lambda: f"in stage '{stage}' waiting for {what} from leader {leader}")
            w.wait()  # completed may mean failed (a dead leader): raise that, never read an unfilled buffer
        code = next((-1 - i for i, f in enumerate(failures) if isinstance(error, f)), -3) if error else 0
        meta = torch.tensor([len(batch.ids) if batch else code], dtype=torch.int64)  # (1,)
        bcast(meta, "the batch size")
        if error is not None:
            raise error
        B = int(meta)
        if B < 0:
            raise failures[-B - 1](f"in stage '{stage}' the read of this group's leader, rank {leader}, failed (its "
                                   f"error says why): this rank keeps no row")
        if batch is not None:
            flat = [batch.cols[c][i] for i in range(B) for c in cols]  # row-major cells, K = B * C
            header, payload = pack_cells(flat)
            header = torch.cat([torch.tensor(batch.ids).view(B, 1), header.view(B, len(cols))], 1)  # (B, 1+C)
            self._count("bytes_bcast", header.nbytes + payload.nbytes)
        else:
            header = torch.empty(B, 1 + len(cols), dtype=torch.int64)  # (B, 1+C)
        if B:
            bcast(header, "the header")
        if batch is None:
            nbytes = sum(n * d.itemsize for row in header[:, 1:].tolist() for n, d in zip(row, dtypes))
            payload = torch.empty(nbytes, dtype=torch.uint8)  # (bytes,)
        if payload.numel():
            bcast(payload, "the payload")
        if batch is not None:
            return batch
        cells = unpack_cells(header[:, 1:].reshape(-1), payload, dtypes * B)  # K = B * C
        return Rows(header[:, 0].tolist(), {c: cells[j::len(cols)] for j, c in enumerate(cols)})

    # --- observability and checkpointing
    COUNTERS = ("bytes_sent", "bytes_padded_equiv", "bytes_bcast")

    def _count(self, name, n):
        self.store.add(self._k("count", name), int(n))

    def metrics(self):
        """The whole queue's traffic so far, counted in the store by the ranks that sent it: packed bytes
        sent (headers included), what padding each field to the step's longest cell would have sent,
        bytes broadcast inside model-parallel groups, and stage reads."""
        out = {f"queue/{c}": int(self.store.add(self._k("count", c), 0)) for c in self.COUNTERS}
        out["queue/reads"] = sum(self.reads(s) for s in self.spec.stages)
        return out

    def reads(self, stage):
        return int(self.store.add(self._k("reads", stage), 0))

    def state_dict(self):
        """This rank's part of the queue, saved by every rank at a point where no get is running (a cut that
        the caller makes consistent, such as the end of a training step): the cells it holds and the stages
        each already reached, its row and read counters; rank 0 adds the queue-wide counters. It first
        serves and waits until every transfer it sent is acknowledged. Nothing of the store is saved:
        load_state_dict publishes the held cells again, so the file does not grow with the rows ever put."""
        self._wait(lambda: not self.inflight, time.monotonic() + self.spec.timeout_s,
                   lambda: f"in state_dict: transfers {sorted(self.inflight)} not acknowledged")
        keys = [f"count/{c}" for c in self.COUNTERS] + [f"reads/{s}" for s in self.spec.stages] + ["tag"]
        counters = {k: int(self.store.add(self._k(*k.split("/")), 0)) for k in keys} if self.rank == 0 else {}
        cells = {k: t.clone() for k, t in self.cells.items()}  # a snapshot: the last stage's reader takes the originals
        return {"cells": cells, "served": {k: sorted(v) for k, v in self.served.items()},
                "next_local": self.next_local, "steps": dict(self.steps), "counters": counters}

    def load_state_dict(self, sd):
        """Every rank loads its own dict into a queue whose store holds none of this queue's keys (a new
        store, or a new spec.name): it publishes its held cells in the ready log, with the claims of the
        stages that read them already; rank 0 restores the counters (tags included). Collective over the
        queue's ranks: it returns once every rank has published."""
        self.cells, self.next_local = {k: t.clone() for k, t in sd["cells"].items()}, sd["next_local"]  # ours alone
        self.served = {k: set(v) for k, v in sd["served"].items()}
        self.steps = dict(sd["steps"])
        self._reset_caches()
        if self.cells:  # one ready-log append, as one put would write
            self._publish(self._entries(dict(sorted(self.cells.items()))))
        for s in self.spec.stages:  # read by s already: claimed in s's logs, so no reader of s takes them
            read = sorted({r for (r, _), stages in self.served.items() if s in stages})
            for block in sorted({r // CLAIM_BLOCK for r in read}):
                self.store.append(self._k("claims", s, block),
                                  f"restored:{','.join(str(r) for r in read if r // CLAIM_BLOCK == block)};")
        for k, v in sd["counters"].items():
            self.store.set(self._k(*k.split("/")), str(v))
        done = self._k("restored")
        self.store.add(done, 1)
        self._wait(lambda: int(self.store.add(done, 0)) >= self.world, time.monotonic() + self.spec.timeout_s,
                   lambda: f"waiting for the other ranks to restore their cells ({int(self.store.add(done, 0))} "
                           f"of {self.world} have)")
