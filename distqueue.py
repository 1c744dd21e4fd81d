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
    b = q.get("train", n, dp_group=None, group=None, min_rows=None)  # -> Rows
    b.ids, b.cols["response"] (list of 1-D), b.stack("reward") (B,), b.packed("response") (flat, lens)
    q.drain(); q.metrics()  # the whole queue's traffic, whichever rank asks
    q.reads("train"); q.state_dict(); q.load_state_dict(sd)
    pad/unpad (naive), pack/unpack, pack_cells/unpack_cells, balance_split: pure primitives.

Design:
- Control plane: torch.distributed Store (TCPStore under torchrun): per-column ready logs
  ("row,owner,len;", a counter and one key per put: a poll fetches only the new entries), claim logs
  (per stage and block of row ids, one atomic `append` per claim: the first entry naming a row wins
  it), request queues per owner, sent/ack flags.
- Data plane: p2p isend/irecv of packed tensors on `pg`: a header of per-cell lengths (K,) int64 first,
  then one uint8 payload. The header is per cell (row x field), so fields of different lengths and
  dtypes share ONE header and ONE payload; dtypes come from the spec, never over the wire.
- Balance: `get(..., dp_group=g)` reads a global batch of n rows; dp rank 0 claims them and splits by
  tokens (sum of the variable-length fields) with greedy longest-first (LPT): max - min <= longest row.
  A row written by a rank of g stays with it while that rank holds no more than a fair share: where the
  writers are the readers (colocated), only the rows that even out their loads move.
- Every wait polls with a deadline and serves other ranks' requests while it waits (so SPMD ranks that
  are producers and consumers at once never deadlock); a dead producer -> TimeoutError naming the stage
  and the rows. A dp_group read returns only once every rank of the group has its rows, so SPMD code
  may enter a collective right after it; otherwise a rank whose cells are still wanted must keep
  calling the queue, or `drain()`, before blocking elsewhere.

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
1. Data lives in host memory and moves on a gloo group (pass `pg`); the source's queue is an RDMA store.
2. No separate queue servers: the owner rank serves its own cells, inside any queue call or `drain()`.
3. Padded equivalent pads each field to the longest cell of the step's global batch (a [B, T] tensor).
4. Ids are deterministic (local_count * world + rank), so a resumed run sees the same rows in order.

Run: python -m pytest tests/test_distqueue.py ; python bench/distqueue.py --lengths lognormal:5,1.2

Using this file elsewhere: torch (tested with 2.13; CPU tensors; the data moves over a gloo group, also next to nccl),
and a store with queue operations, atomic add and append: TCPStore (torchrun's, found from MASTER_ADDR and
MASTER_PORT) or HashStore (one process); a FileStore is refused at construction. Rows are lists of 1-D
tensors per column (scalar columns: one value), of the spec's dtypes. Example (tests/test_copy_alone.py
runs it in a folder that holds only this file):

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
    """Inverse of pack_cells; dtypes (K,) come from the spec, not the wire."""
    nbytes = [int(n) * torch.empty(0, dtype=d).element_size() for n, d in zip(header.tolist(), dtypes)]
    if header.numel() != len(dtypes) or sum(nbytes) != payload.numel():
        raise ValueError(f"header lengths {header.tolist()} x dtypes give {sum(nbytes)} bytes, "
                         f"payload has {payload.numel()}")
    # .clone() realigns each slice so that .view(dtype) is legal
    return [p.clone().view(d) for p, d in zip(torch.split(payload, nbytes), dtypes)]


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
    (torchrun, or any env:// start, sets both); an in-process HashStore in a world of one. Elsewhere
    (tcp:// or file:// starts), build the store yourself and pass it."""
    import datetime
    import os
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dist.HashStore()
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("DistQueue needs a store that every rank reaches: MASTER_ADDR/MASTER_PORT are not set "
                         "(the process group was not started from torchrun's environment); pass "
                         "store=dist.TCPStore(host, port, world_size, is_master=rank == 0)")
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def check_store(store):
    """The queue's control plane needs a store with queue operations, atomic add and append: TCPStore and
    HashStore have them, FileStore has no queue operations. Raises before any collective."""
    try:
        store.queue_len("dq/probe")
        store.add("dq/probe_add", 0)
        store.append("dq/probe_append", "")
    except (NotImplementedError, RuntimeError, AttributeError) as e:
        raise ValueError(f"{type(store).__name__} cannot serve a DistQueue ({e}): it needs queue operations "
                         "(queue_push, queue_pop, queue_len), add and append; pass a TCPStore or a HashStore "
                         "(a process group started with file:// has a FileStore)") from None


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
        self.cells = {}          # (row, col) -> 1-D tensor this rank owns and has not fully delivered
        self.served = {}         # (row, col) -> stages it was delivered to so far
        self.next_local = 0      # rows this rank created (ids = next_local * world + rank)
        self.steps = {s: 0 for s in spec.stages}  # balanced reads per stage (plan keys)
        self.inflight = {}       # tag -> (works, tensors) kept alive until the receiver acks
        self.claimer = int(store.add(self._k("claimers"), 1))  # unique per queue object on this store
        self.claims_made = 0     # claim entries this object wrote (their tokens: claimer.count)
        self._reset_caches()
        if dist.is_initialized() and dist.get_backend(pg) != "gloo":  # host tensors, async p2p: gloo only
            raise ValueError(f"pg backend is {dist.get_backend(pg)}; pass pg=dist.new_group(backend='gloo')")

    def row_id(self, j, rank=None):
        """The id of the j-th row a rank (default: this one) creates: ids are deterministic, so a reader
        can name the rows it wants (get(only=...)) without asking."""
        return j * self.world + (self.rank if rank is None else rank)

    def _reset_caches(self):
        self.ready = {c: {} for c in self.spec.columns}  # col -> {row: (owner, length)}
        self.ready_off = {c: 0 for c in self.spec.columns}  # col -> entries of its ready log read so far
        self.taken = {s: set() for s in self.spec.stages}  # rows known to be claimed, per stage

    def _k(self, *parts):
        return "/".join([self.p, *map(str, parts)])

    def _needers(self, col):
        return sum(col in cols for cols in self.spec.stages.values())

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
                if (r, c) in self.cells or r in self.ready[c]:
                    raise ValueError(f"cell (row {r}, column '{c}') written twice")
                cells[(r, c)] = t.detach().reshape(-1).to("cpu", copy=True)  # own copy, in host memory (departure 1)
        self.cells.update(cells)
        self.next_local += len(ids) if new else 0
        for c in columns:  # the ready log: a counter, then one key per entry, so a poll reads only what is new
            i = int(self.store.add(self._k("ready", c, "n"), 1)) - 1
            self.store.set(self._k("ready", c, i), "".join(f"{r},{self.rank},{cells[(r, c)].numel()};" for r in ids))
        self.serve()
        return ids

    # --- serving: the owner answers pull requests (called from every wait loop)
    def serve(self):
        qk = self._k("req", self.rank)
        while self.store.queue_len(qk) > 0:
            dst, tag, stage, tmax, cells = self.store.queue_pop(qk, block=False).decode().split("|")
            tag, keys = int(tag), [(int(r), c) for r, c in (x.split(":") for x in cells.split(","))]
            missing = [k for k in keys if k not in self.cells]
            if missing:
                raise RuntimeError(f"rank {self.rank} asked by rank {dst} for cells {missing[:8]} it does not hold")
            header, payload = pack_cells([self.cells[k] for k in keys])  # (K,), (bytes,)
            works = [dist.isend(header, int(dst), group=self.pg, tag=2 * tag)]
            if payload.numel():
                works.append(dist.isend(payload, int(dst), group=self.pg, tag=2 * tag + 1))
            self.inflight[tag] = (works, (header, payload))
            self.store.set(self._k("sent", tag), "1")
            tm = dict(x.split("=") for x in tmax.split(",") if x)
            pad_bytes = sum(int(tm.get(c, self.cells[(r, c)].numel())) * self.cells[(r, c)].element_size()
                            for r, c in keys)
            self._count("bytes_sent", header.nbytes + payload.nbytes)
            self._count("bytes_padded_equiv", header.nbytes + pad_bytes)
            for k in keys:
                self._delivered(k, stage)
        for tag in [t for t in self.inflight if self.store.check([self._k("ack", t)])]:
            for w in self.inflight.pop(tag)[0]:
                w.wait()
            self.store.delete_key(self._k("ack", tag))

    def _delivered(self, key, stage):
        self.served.setdefault(key, set()).add(stage)
        if len(self.served[key]) >= self._needers(key[1]):
            del self.cells[key], self.served[key]

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

    # --- consumers: claim (control plane), pull (data plane)
    def _refresh(self, cols):
        for c in cols:  # entries in order; one counted but not yet written is read at a later poll
            n = int(self.store.add(self._k("ready", c, "n"), 0))
            while self.ready_off[c] < n and self.store.check([k := self._k("ready", c, self.ready_off[c])]):
                for e in self.store.get(k).decode().split(";")[:-1]:
                    r, o, length = map(int, e.split(","))
                    self.ready[c][r] = (o, length)
                self.ready_off[c] += 1

    def _claim(self, stage, n, min_rows, deadline, only=None):
        cols, mine = self.spec.stages[stage], []

        def poll():
            self._refresh(cols)
            cand = sorted(r for r in self.ready[cols[0]] if r not in self.taken[stage]
                          and all(r in self.ready[c] for c in cols) and (only is None or r in only))
            if len(mine) + len(cand) < min_rows:  # not enough yet: claim nothing, so that a get that times out
                return False                      # leaves its rows to the next reader (a reader racing for the
                                                  # same rows may still win some of them first, then time out)
            mine.extend(self._claim_rows(stage, cand[: n - len(mine)]))
            return len(mine) >= n or (len(mine) >= min_rows and len(cand) <= n - len(mine))

        def what():
            partial = sorted({r for c in cols for r in self.ready[c]} - self.taken[stage])
            lack = sorted({c for r in partial for c in cols if r not in self.ready[c]})
            head = f"in stage '{stage}' waiting for {n - len(mine)} more rows with columns {list(cols)} " \
                   f"(claimed {len(mine)}): "
            return head + (f"rows {partial[:32]} are missing columns {lack}" if partial
                           else "no row has been produced: is the producer alive?")
        self._wait(poll, deadline, what)
        return sorted(mine)

    def _claim_rows(self, stage, rows):
        """Claim rows for stage; returns those won. Per block of CLAIM_BLOCK row ids, one atomic
        append of this call's entry to the block's claim log, then one read of the log: a row belongs to
        the first entry that names it, so racing readers all see the same winner. Two store round trips
        per block, where a claim per row would cost one per row."""
        token, won = f"{self.claimer}.{self.claims_made}", []  # unique among this queue's readers
        self.claims_made += 1
        for block in sorted({r // CLAIM_BLOCK for r in rows}):
            asked = [r for r in rows if r // CLAIM_BLOCK == block]
            key = self._k("claims", stage, block)
            self.store.append(key, f"{token}:{','.join(map(str, asked))};")
            first = {}
            for entry in self.store.get(key).decode().split(";")[:-1]:
                who, ids = entry.split(":")
                for r in ids.split(","):
                    first.setdefault(int(r), who)
            self.taken[stage].update(first)  # every row in the log is claimed, by this call or another
            won += [r for r in asked if first[r] == token]
        return won

    def _pull(self, stage, rows, tmax, deadline):
        cols, got, owners = self.spec.stages[stage], {}, {}
        for r in rows:
            for c in cols:
                owners.setdefault(self.ready[c][r][0], []).append((r, c))
        tm = ",".join(f"{c}={n}" for c, n in tmax.items())
        tags = {}
        for o, keys in owners.items():
            if o == self.rank:  # local cells: no transfer
                for k in keys:
                    got[k] = self.cells[k].clone()  # the consumer may write into it; other stages read it too
                    self._delivered(k, stage)
                continue
            tags[o] = int(self.store.add(self._k("tag"), 1))
            msg = f"{self.rank}|{tags[o]}|{stage}|{tm}|" + ",".join(f"{r}:{c}" for r, c in keys)
            self.store.queue_push(self._k("req", o), msg)
        for o, tag in tags.items():
            self._wait(lambda: self.store.check([self._k("sent", tag)]), deadline,
                       lambda: f"in stage '{stage}' waiting for rows {sorted({r for r, _ in owners[o]})} "
                               f"from rank {o}: is the producer alive?")
            keys = owners[o]
            header = torch.empty(len(keys), dtype=torch.int64)  # (K,) lengths header first
            dist.recv(header, o, group=self.pg, tag=2 * tag)
            expect = [self.ready[c][r][1] for r, c in keys]
            if header.tolist() != expect:
                raise RuntimeError(f"header {header.tolist()} from rank {o} != published lengths {expect}")
            dtypes = [DTYPES[self.spec.columns[c]] for _, c in keys]
            nbytes = sum(int(n) * torch.empty(0, dtype=d).element_size() for n, d in zip(expect, dtypes))
            payload = torch.empty(nbytes, dtype=torch.uint8)  # (bytes,) then one payload
            if nbytes:
                dist.recv(payload, o, group=self.pg, tag=2 * tag + 1)
            got.update(zip(keys, unpack_cells(header, payload, dtypes)))
            self.store.set(self._k("ack", tag), "1")
            self.store.delete_key(self._k("sent", tag))
        return Rows(list(rows), {c: [got[(r, c)] for r in rows] for c in cols}, dict(tmax))

    def _read(self, stage, n, min_rows, dp_group, step, deadline, only=None):
        cols = self.spec.stages[stage]
        dp_rank, dp_size = (dist.get_rank(dp_group), dist.get_world_size(dp_group)) if dp_group else (0, 1)
        root = dist.get_global_rank(dp_group, 0) if dp_group else self.rank  # names this DP group's plan
        var = [c for c in cols if c not in self.spec.scalars]
        if dp_rank == 0:
            rows = self._claim(stage, n, n if dp_size > 1 else min_rows, deadline, only)
            tmax = {c: max(self.ready[c][r][1] for r in rows) for c in cols} if rows else {}
            if dp_size > 1:  # token-balanced split of the global batch, published on the control plane
                parts = self._split(rows, cols, var, dp_group)
                for i, part in enumerate(parts[1:], 1):
                    self.store.set(self._k("plan", stage, step, root, i), " ".join(
                        [",".join(str(rows[j]) for j in part), ",".join(f"{c}={v}" for c, v in tmax.items())]))
                rows = [rows[j] for j in parts[0]]
        else:
            key = self._k("plan", stage, step, root, dp_rank)
            self._wait(lambda: self.store.check([key]), deadline,
                       lambda: f"in stage '{stage}' waiting for dp rank 0's plan for step {step}")
            ids, tm = self.store.get(key).decode().split(" ")
            self.store.delete_key(key)
            rows = [int(x) for x in ids.split(",") if x]
            tmax = {c: int(v) for c, v in (x.split("=") for x in tm.split(","))}
            self._refresh(cols)
        self.store.add(self._k("reads", stage), 1)
        batch = self._pull(stage, rows, tmax, deadline)
        if dp_size > 1:  # return only when the whole DP group has its rows: SPMD code may then enter a
            done = self._k("done", stage, step, root)  # collective without starving a peer's pull
            self.store.add(done, 1)
            self._wait(lambda: int(self.store.add(done, 0)) >= dp_size, deadline,
                       lambda: f"in stage '{stage}' waiting for the other DP ranks to receive their rows")
        return batch

    def _split(self, rows, cols, var, dp_group):
        """balance_split of rows over dp_group by tokens (the lengths of their cells in `var`), a row's home
        being the DP rank that holds most of its elements, if any: a rank that reads what it wrote pulls nothing."""
        dp_index = {g: i for i, g in enumerate(dist.get_process_group_ranks(dp_group))}
        homes = []
        for r in rows:
            held = {}  # DP rank -> elements of this row it holds
            for c in cols:
                owner, length = self.ready[c][r]
                if owner in dp_index:
                    held[dp_index[owner]] = held.get(dp_index[owner], 0) + length
            homes.append(max(held, key=lambda i: (held[i], -i)) if held else None)
        return balance_split([sum(self.ready[c][r][1] for c in var) for r in rows], len(dp_index), homes)

    def get(self, stage, n, dp_group=None, group=None, min_rows=None, only=None):
        """Read up to n rows (at least min_rows, default n; 0 = poll) that `stage` has not consumed.
        dp_group: n is the global batch, split by tokens across its ranks. group: only its first rank
        reads; it broadcasts the packed batch to the rest of the group. only: a set of row ids to take
        from, for a reader that must take given rows (e.g. one batch of each producer)."""
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
        batch = self._read(stage, n, min_rows, dp_group, step, deadline, only) if leader == self.rank else None
        return batch if group is None else self._bcast(batch, stage, group, leader, deadline)

    def _bcast(self, batch, stage, group, leader, deadline):
        """Leader -> its model-parallel group: size, header (B, 1+C) [ids, lengths], one payload."""
        cols = list(self.spec.stages[stage])
        dtypes = [DTYPES[self.spec.columns[c]] for c in cols]

        def bcast(t, what):
            w = dist.broadcast(t, leader, group=group, async_op=True)
            self._wait(w.is_completed, deadline, lambda: f"in stage '{stage}' waiting for {what} from leader {leader}")
            w.wait()  # completed may mean failed (a dead leader): raise that, never read an unfilled buffer
        meta = torch.tensor([len(batch.ids) if batch else 0], dtype=torch.int64)  # (1,)
        bcast(meta, "the batch size")
        B = int(meta)
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
            nbytes = sum(int(n) * torch.empty(0, dtype=d).element_size()
                         for row in header[:, 1:].tolist() for n, d in zip(row, dtypes))
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
        return {"cells": dict(self.cells), "served": {k: sorted(v) for k, v in self.served.items()},
                "next_local": self.next_local, "steps": dict(self.steps), "counters": counters}

    def load_state_dict(self, sd):
        """Every rank loads its own dict into a queue whose store holds none of this queue's keys (a new
        store, or a new spec.name): it publishes its held cells in the ready logs, with the claims of the
        stages that read them already; rank 0 restores the counters (tags included). Collective over the
        queue's ranks: it returns once every rank has published."""
        self.cells, self.next_local = dict(sd["cells"]), sd["next_local"]
        self.served = {k: set(v) for k, v in sd["served"].items()}
        self.steps = dict(sd["steps"])
        self._reset_caches()
        for c in self.spec.columns:  # one ready-log entry per column, as one put would write
            rows = sorted(r for r, col in self.cells if col == c)
            if rows:
                i = int(self.store.add(self._k("ready", c, "n"), 1)) - 1
                self.store.set(self._k("ready", c, i), "".join(f"{r},{self.rank},{self.cells[(r, c)].numel()};"
                                                               for r in rows))
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
