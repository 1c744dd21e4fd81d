# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""DistQueue: the data queue between RL stages, packed and read hierarchically.

Rows (samples) by columns (fields) flow from rollout to training; a cell stays on the rank that
wrote it until a stage reads it. Three ideas move it:
- Zero-padding transfer (article figure 7): padding each field to the longest cell (`pad`, the
  naive version) sends mostly zeros on long-tailed lengths. A reader pulls each owner's cells as a
  header of lengths (K,) int64 and ONE uint8 payload (`pack_cells`); dtypes come from the spec.
- Balance: with `dp_group=`, n is the global batch, claimed by dp rank 0 and split by length (a
  row weighs its variable-length cells' elements; `balance_split`: max - min <= the longest row).
  A row stays with the rank that wrote it while that rank holds no more than a fair share, so
  colocated readers move few rows.
- Hierarchical transfer (figure 6, an option): with `group=`, only the group's first rank reads
  the queue, then broadcasts the packed batch to the rest of its model-parallel group.

Reads are made safe by a protocol on a torch.distributed Store, under keys "<name>/...":
  ready/n, ready/<i>  the ready log, one key per put: "row,column,owner,length;" per cell
  claims/<stage>/<b>  claim logs: a reader appends "token:rows;"; a row belongs to the first
                      claim naming it that no "-token:rows;" has released, so it is read once
  req/<owner>         pull requests; the owner answers each with one packed transfer
  state/<tag>         the owner's "sent" or the reader's "cancelled": the first writer wins
  ack/<tag>           the reader "kept" or "dropped" the cells; an owner frees a cell once
                      every stage that reads it kept it
  plan/<stage>/<step>/<root>  the rows that dp rank 0 claimed for its DP group
  done/..., outcome/...       the DP group's vote: every rank keeps its rows, or none does
A get that raises keeps no row and releases its claims: a retry reads each row exactly once.
Every wait serves other ranks' requests and raises TimeoutError naming the stage, the rows and the
rank: a rank whose cells are still wanted keeps calling the queue, or drain(), before it blocks.

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
1. Data lives in host memory and moves on a gloo group (`pg`); the source's queue is an RDMA store.
2. No separate queue servers: an owner serves its own cells inside any queue call or `drain()`.
3. The padded equivalent (metrics) pads each field to the longest cell of the step's global batch.
4. Ids are deterministic (local_count * world + rank), so a resumed run sees the same rows in order.

Above the marker ("# ====" in DistQueue's body): the default path, put, serve and a DP group's get.
Below: log formats, checks, recovery, metrics, options' hooks (ids=, min_rows=, group=), state_dict.
Run: python -m pytest tests/test_distqueue.py ; python bench/distqueue.py --lengths lognormal:5,1.2
Shapes: B rows, C fields of a stage, K cells (row x field) in one transfer, N elements, T longest.
Copy alone: torch (CPU tensors, a gloo group) and a TCPStore or a HashStore (one process); the
example runs in a folder holding only this file (tests/test_copy_alone.py):

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
        rows = q.get("train", 4, dp_group=dist.group.WORLD)  # 4 rows in all, split by tokens
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
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "bool": torch.bool}
CLAIM_BLOCK = 1024  # row ids per claim log: a claim reads its logs whole, so they stay short

# ------------------------------------------------------------------------------ packing primitives


def pad(seqs, pad_value=0):
    """Naive: pad every sample to the longest one. Returns padded (B, T) and lengths (B,)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)  # (B,)
    T = int(lengths.max()) if len(seqs) else 0
    dtype = seqs[0].dtype if seqs else torch.int64
    out = torch.full((len(seqs), T), pad_value, dtype=dtype)  # (B, T)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out, lengths


def pack(seqs):
    """Packed: concatenate along the sequence dim; no padding. Returns flat (N,), lengths (B,)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)  # (B,)
    flat = torch.cat([s.reshape(-1) for s in seqs]) if seqs else torch.empty(0)  # (N,)
    return flat, lengths


def pack_cells(cells):
    """Many fields, many dtypes -> header (K,) int64 of lengths and ONE payload (bytes,) uint8."""
    header = torch.tensor([c.numel() for c in cells], dtype=torch.int64)  # (K,)
    if not cells:
        return header, torch.empty(0, dtype=torch.uint8)
    payload = torch.cat([c.contiguous().reshape(-1).view(torch.uint8) for c in cells])  # (bytes,)
    return header, payload


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


def balance_split(tokens, parts, homes=None):
    """Rows into `parts` lists of near-equal tokens (>= 0): greedy longest-first (LPT), each row to
    the lightest part, so max - min <= max(tokens).
    homes (optional): the part each row already lives in, or None. A row stays home if its home,
    with it, holds at most a fair share (total / parts); the others go by LPT. The bound holds: the
    heaviest part either took an LPT row while lightest, or holds at most the mean. A part left
    empty takes the shortest row of the part with the most rows."""
    homes = [None] * len(tokens) if homes is None else homes
    fair = sum(tokens) / parts
    load = [0] * parts
    out = [[] for _ in range(parts)]
    rest = []
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):  # longest first
        h = homes[i]
        if h is not None and load[h] + tokens[i] <= fair:
            out[h].append(i)
            load[h] += tokens[i]
        else:
            rest.append(i)
    for i in rest:
        p = min(range(parts), key=lambda p: (load[p], len(out[p]), p))  # ties: fewest rows
        out[p].append(i)
        load[p] += tokens[i]
    for q in [q for q in range(parts) if not out[q]]:  # a row for every part while there are enough
        donor = max(range(parts), key=lambda p: (len(out[p]), -p))
        if len(out[donor]) < 2:
            break
        i = min(out[donor], key=lambda i: (tokens[i], i))
        out[donor].remove(i)
        out[q].append(i)
    return [sorted(o) for o in out]


# ------------------------------------------------------------------------------ config and batch


@dataclass
class QueueSpec:
    columns: dict            # field name -> dtype name ("int64", "float32", ...)
    stages: dict             # stage name -> tuple of the fields it reads
    scalars: tuple = ()      # fields with one value per row (stored as (1,) tensors)
    timeout_s: float = 60.0  # every wait raises after this long
    poll_s: float = 0.002    # sleep between control-plane polls
    name: str = "dq"         # key prefix: several queues can share one store

    def __post_init__(self):
        check_spec(self)  # below the marker: known dtypes, valid names, every column read


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
    """The rendezvous' store: a TCPStore client of MASTER_ADDR:MASTER_PORT (set by torchrun or any
    env:// start), or an in-process HashStore in a world of one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dist.HashStore()
    check_master_env()  # below the marker: without MASTER_ADDR/MASTER_PORT, says what to pass
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


# ------------------------------------------------------------------------------ the queue


class DistQueue:
    """One rank's handle on the queue. store: a TCPStore or HashStore every rank reaches (default:
    default_store()); rank, world_size: this rank in the ranks that share the queue (default: the
    default process group's); pg: a gloo process group over them for the data (default: the
    default group, if gloo)."""

    def __init__(self, spec: QueueSpec, store=None, rank=None, world_size=None, pg=None):
        store = default_store(spec.timeout_s) if store is None else store
        check_store(store)  # below the marker: the store has the operations the protocol uses
        rank, world_size = _rank_and_world(rank, world_size, store, spec.name)  # default: the pg's
        self.spec, self.store, self.rank, self.world, self.pg = spec, store, rank, world_size, pg
        # per column, the stages that read it: a cell is freed once that many kept it
        self.needers = {c: sum(c in cols for cols in spec.stages.values()) for c in spec.columns}
        self.col_index = {c: i for i, c in enumerate(spec.columns)}  # a column's number in the log
        self.cells = {}       # (row, col) -> 1-D tensor this rank owns and has not fully delivered
        self.served = {}      # (row, col) -> stages whose reader acknowledged keeping it
        self.next_local = 0   # rows this rank created (ids = next_local * world + rank)
        self.steps = {s: 0 for s in spec.stages}  # reads per stage: they name a DP group's keys
        self.inflight = {}    # tag -> (works, tensors, cells, stage): sent, alive until acked
        self.claimer = int(store.add(self._k("claimers"), 1))  # unique per queue on this store
        self.claims_made = 0  # reads this queue claimed for (their tokens: claimer.count)
        self._reset_caches()
        check_pg(pg)  # below the marker: host tensors, async p2p, so a gloo group

    def row_id(self, j, rank=None):
        """The id of the j-th row a rank (default: this one) creates, known to every rank."""
        return j * self.world + (self.rank if rank is None else rank)

    def _reset_caches(self):
        # per stage: the rows not seen claimed, {row: {col: (owner, length)}}; the log keys read
        self.unclaimed = {s: {} for s in self.spec.stages}
        self.ready_off = dict.fromkeys(self.spec.stages, 0)

    def _k(self, *parts):
        return "/".join([self.spec.name, *map(str, parts)])

    # --- producers and owners
    def put(self, columns, ids=None):
        """Write the cells of new rows and return their ids (ids=: an option's hook, see below)."""
        n = len(next(iter(columns.values()), []))  # rows: the first column's count
        self._check_columns(columns, n)  # everything is validated before anything is published
        new = ids is None
        ids = [self.row_id(self.next_local + i) for i in range(n)] if new else list(ids)
        if columns and len(ids) != n:
            raise ValueError(f"{len(ids)} ids for {n} rows")
        cells = {}
        for c, vals in columns.items():
            want = DTYPES[self.spec.columns[c]]
            for r, v in zip(ids, vals):
                t = v if torch.is_tensor(v) else _from_python(v, want, r, c)
                self._check_cell(r, c, t, want)  # below the marker: dtype, shape, written once
                cells[(r, c)] = t.detach().reshape(-1).to("cpu", copy=True)  # the queue's own copy
        self.cells.update(cells)
        self.next_local += len(ids) if new else 0
        self._publish(self._entries(cells))  # one ready-log key for this put's cells
        self.serve()
        return ids

    def serve(self):
        """Answer the requests waiting for this rank, one packed transfer each; then retire the
        transfers that their readers acknowledged: kept (the cells reached a stage) or dropped."""
        requests = self._k("req", self.rank)
        while self.store.queue_len(requests) > 0:
            self._answer(self.store.queue_pop(requests, block=False).decode())
        for tag in [t for t in self.inflight if self.store.check([self._k("ack", t)])]:
            works, _, keys, stage = self.inflight.pop(tag)
            for w in works:  # the reader received it all before acknowledging: returns at once
                w.wait()
            if self.store.get(self._k("ack", tag)) == b"kept":
                for k in keys:
                    self._delivered(k, stage)
            self.store.delete_key(self._k("ack", tag))

    def _publish(self, entries):
        """Append to the ready log: count the key in ready/n, then write it."""
        i = int(self.store.add(self._k("ready", "n"), 1)) - 1
        self.store.set(self._k("ready", i), entries)

    def _answer(self, request):
        """One request "reader|tag|stage|longest cells|row:col,...": unless the reader cancelled,
        write "sent" (or the missing cells) in state/<tag>, then send a header (K,), one payload."""
        reader, tag, stage, tmax, wanted = request.split("|")
        tag = int(tag)
        keys = [(int(r), c) for r, c in (x.split(":") for x in wanted.split(","))]
        if not self._may_send(tag, keys):  # below the marker: the first writer of state/<tag> wins
            return
        cells = [self.cells[k] for k in keys]
        header, payload = pack_cells(cells)  # (K,), (bytes,)
        works = [dist.isend(header, int(reader), group=self.pg, tag=2 * tag)]
        if payload.numel():
            works.append(dist.isend(payload, int(reader), group=self.pg, tag=2 * tag + 1))
        self.inflight[tag] = (works, (header, payload), keys, stage)
        self._count_sent(keys, cells, tmax, header, payload)  # metrics, below the marker

    def _delivered(self, key, stage):
        stages = self.served.setdefault(key, set())
        stages.add(stage)
        if len(stages) >= self.needers[key[1]]:  # every stage that reads it has it: free the cell
            del self.cells[key], self.served[key]

    def _wait(self, done, deadline, what):
        """Poll `done` until the deadline, serving peers all along: even a wait that succeeds at
        once serves, or a rank that only polls (get(min_rows=0)) would starve its readers."""
        while not (self.serve() or done()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distqueue '{self.spec.name}' rank {self.rank}: timed out "
                                   f"after {self.spec.timeout_s}s {what()}{_refused(self)}")
            time.sleep(self.spec.poll_s)

    # --- consumers
    def get(self, stage, n, dp_group=None, group=None, min_rows=None, only=None):
        """Read n rows that `stage` has not consumed, from the ids in `only` if given. dp_group: n
        is the global batch, split by tokens across its ranks; the get returns once every rank of
        the group has its rows. A get that raises keeps no row. min_rows, group: hooks for the
        options, see below."""
        min_rows = n if min_rows is None else min_rows
        self._check_get(stage, n, min_rows, dp_group, group)  # below the marker
        deadline = time.monotonic() + self.spec.timeout_s
        step = self.steps[stage]  # the same count on every rank (SPMD)
        self.steps[stage] += 1
        if group is not None:  # the hierarchical read, below the marker
            return self._read_in_group(stage, n, min_rows, dp_group, group, step, deadline, only)
        return self._read(stage, n, min_rows, dp_group, step, deadline, only)

    def _read(self, stage, n, min_rows, dp_group, step, deadline, only):
        """One read, in four steps, each with the store keys it uses:
        1. claim (dp rank 0): the new ready/<i> keys show which rows are complete; it appends
           "token:rows;" to claims/<stage>/<block>, reads that log back and keeps the rows that
           its token holds; for a DP group it writes them in plan/<stage>/<step>/<root>;
        2. share: each DP rank takes its part of the rows by tokens (balance_split);
        3. fetch: per owner, a request in req/<owner>; the owner's answer in state/<tag>; then a
           header (K,) and one payload, point to point;
        4. agree (a DP group): every rank votes in done/... or outcome/..., so that every rank
           keeps what it fetched, or none does; ack/<tag> tells each owner "kept" or "dropped".
        A read that fails drops its transfers, and dp rank 0 releases the claims (the vote and the
        recovery: below the marker)."""
        cols = self.spec.stages[stage]
        dp_rank = dist.get_rank(dp_group) if dp_group else 0
        dp_size = dist.get_world_size(dp_group) if dp_group else 1
        # dp rank 0's global rank: it names the group's keys, plan/, done/ and outcome/
        root = dist.get_global_rank(dp_group, 0) if dp_group else self.rank
        plan = self._k("plan", stage, step, root)
        token, claimed, tags, error = self._token(), {}, [], None
        try:
            if dp_rank == 0:
                least = n if dp_size > 1 else min_rows  # a DP group shares all n rows
                claimed = self._claim(stage, n, least, deadline, token, only)
                rows = claimed
                if dp_size > 1:
                    self.store.set(plan, f"{n}|{self._entries(self._cells_of(claimed, cols))}")
            else:  # wait past dp rank 0's deadline: if its claim times out, that is the error
                late = deadline + self.spec.timeout_s
                rows = self._take_plan(stage, n, dp_rank, step, root, late)
            # per field, the longest cell of the global batch: the padded equivalent's measure
            tmax = {c: max(rows[r][c][1] for r in rows) for c in cols} if rows else {}
            if dp_size > 1:
                rows = self._share(rows, cols, dp_group)
            got, tags = self._fetch(stage, rows, tmax, deadline)
        except Exception as e:
            error = e
        if dp_size > 1:
            error = self._agree(stage, step, root, dp_rank, dp_size, error, deadline)
            if dp_rank == 0:  # every rank has read the plan, or the group failed
                self.store.delete_key(plan)
        self._ack(tags, keep=error is None)
        if error is not None:
            if dp_rank == 0:  # its claim holds the whole group's rows
                self._release(stage, token, claimed)
            raise error
        for r in rows:
            for c in cols:
                if rows[r][c][0] == self.rank:
                    self._delivered((r, c), stage)
        if rows:  # a poll that found nothing (min_rows=0) is no read
            self.store.add(self._k("reads", stage), 1)
        ids = sorted(rows)
        return Rows(ids, {c: [got[(r, c)] for r in ids] for c in cols}, tmax)

    # step 1, claim: rows that the ready log shows complete, won in the claim logs (their formats,
    # the token that names a read's claims, and their release: below the marker)
    def _claim(self, stage, n, min_rows, deadline, token, only):
        """Claim up to n complete rows (at least min_rows) as token -> {row: {col: (owner, len)}}.
        A claim that times out releases what it won, so its rows go to the next reader."""
        cols, seen, mine = self.spec.stages[stage], self.unclaimed[stage], {}

        def poll():
            self._refresh(stage)
            ready = sorted(r for r, cells in seen.items()
                           if len(cells) == len(cols) and (only is None or r in only))
            if len(mine) + len(ready) < min_rows:  # not enough yet: claim nothing
                return False
            mine.update(self._claim_rows(stage, ready[: n - len(mine)], token))
            # done: n rows, or at least min_rows once every ready row has been tried
            return len(mine) >= n or (len(mine) >= min_rows and len(ready) <= n - len(mine))
        try:
            self._wait(poll, deadline, lambda: self._lacking(stage, n, min_rows, len(mine), only))
        except Exception:
            self._release(stage, token, mine)
            raise
        return mine

    def _refresh(self, stage):
        """Read the ready log's new keys into self.unclaimed[stage]: one store round trip when
        there is nothing new, three when there is. A key counted but not yet written stops the
        read: it and the keys after it wait for a later poll (if its writer died, for ever)."""
        n = int(self.store.add(self._k("ready", "n"), 0))
        keys = [self._k("ready", i) for i in range(self.ready_off[stage], n)]
        while keys and not self.store.check(keys):  # some key is not written yet:
            keys = keys[:-1] if self.store.check(keys[:1]) else []  # drop the last, or all
        for entries in self.store.multi_get(keys) if keys else []:
            self._parse(entries.decode(), stage, self.unclaimed[stage])
        self.ready_off[stage] += len(keys)

    def _claim_rows(self, stage, rows, token):
        """Claim rows as token; returns {row: cells} of those won. Per block of CLAIM_BLOCK ids, one
        append to its claim log, then one read of it. The rows it shows held leave
        self.unclaimed, so a poll scans only the rows this reader has not seen claimed."""
        won = {}
        for block, ids in self._blocks(rows):
            key = self._k("claims", stage, block)
            self.store.append(key, f"{token}:{ids};")
            held = self._holders(self.store.get(key))  # row -> the token whose claim holds it
            for r in held:
                cells = self.unclaimed[stage].pop(r, None)
                if held[r] == token and cells is not None:  # None: won at an earlier poll
                    won[r] = cells
        return won

    # step 2, share: each rank of a DP group takes its part of the claimed rows
    def _take_plan(self, stage, n, dp_rank, step, root, deadline):
        """dp rank > 0: the rows dp rank 0 claimed, unless the group failed first; checks n."""
        plan, outcome = self._k("plan", stage, step, root), self._k("outcome", stage, step, root)
        self._wait(lambda: self.store.check([plan]) or self.store.check([outcome]), deadline,
                   lambda: f"in stage '{stage}' waiting for dp rank 0's plan for step {step}")
        if not self.store.check([plan]):  # the group failed: _agree says why
            raise RuntimeError(f"dp rank 0 published no plan for step {step}")
        n0, entries = self.store.get(plan).decode().split("|")
        self._check_same_n(stage, n, n0, dp_rank)  # below the marker
        return self._parse(entries, stage, {})

    def _share(self, rows, cols, dp_group):
        """This rank's share of rows by tokens (balance_split), a row's home being the DP rank that
        holds most of its elements, if any: a rank reading what it wrote pulls nothing."""
        dp_index = {g: i for i, g in enumerate(dist.get_process_group_ranks(dp_group))}
        ids = sorted(rows)
        homes = []
        for r in ids:
            held = {}  # DP rank -> elements of row r it holds
            for owner, length in rows[r].values():
                if owner in dp_index:
                    held[dp_index[owner]] = held.get(dp_index[owner], 0) + length
            homes.append(max(held, key=lambda i: (held[i], -i)) if held else None)
        var = [c for c in cols if c not in self.spec.scalars]
        tokens = [sum(rows[r][c][1] for c in var) for r in ids]
        share = balance_split(tokens, len(dp_index), homes)[dist.get_rank(dp_group)]
        return {ids[j]: rows[ids[j]] for j in share}

    # step 3, fetch: one request and one packed transfer per owner
    def _fetch(self, stage, rows, tmax, deadline):
        """The cells of rows and the tags of the transfers received, acknowledging nothing. On an
        error it cancels the requests not yet answered, drops what came, and raises."""
        owners = {}
        for r in sorted(rows):
            for c in self.spec.stages[stage]:
                owners.setdefault(rows[r][c][0], []).append((r, c))
        # this rank's own cells: copies (the consumer may write into them), but the last stage
        # that reads a cell takes the queue's own tensor, freed from the queue as the read keeps it
        got = {k: self.cells[k] if self._read_last(k) else self.cells[k].clone()
               for k in owners.pop(self.rank, [])}
        longest = ",".join(f"{c}={length}" for c, length in tmax.items())
        tags, received = {}, []
        for o, keys in owners.items():
            tags[o] = int(self.store.add(self._k("tag"), 1))  # state/, ack/, p2p tags 2t, 2t+1
            wanted = ",".join(f"{r}:{c}" for r, c in keys)
            request = f"{self.rank}|{tags[o]}|{stage}|{longest}|{wanted}"
            self.store.queue_push(self._k("req", o), request)
        try:
            for o, tag in list(tags.items()):
                self._wait(lambda: self.store.check([self._k("state", tag)]), deadline,
                           lambda: self._silent(stage, o, owners[o]))
                del tags[o]  # answered: received next, or a broken transfer (an error, not retried)
                received.append(tag)  # acknowledged, kept or dropped, whatever _recv finds
                got.update(self._recv(o, tag, owners[o], rows))
        except Exception:
            self._cancel(tags, owners, rows, received)  # below the marker
            raise
        return got, received

    def _read_last(self, key):
        """Whether the stage reading this cell now is the last that needs it."""
        return len(self.served.get(key, ())) + 1 >= self.needers[key[1]]

    def _recv(self, o, tag, keys, rows):
        """One transfer from owner o: its answer in state/<tag>, a header (K,), one payload."""
        state = self._k("state", tag)
        answer = self.store.get(state).decode()
        self.store.delete_key(state)
        self._check_sent(o, answer)  # below the marker: "sent", or the owner lacked cells
        header = torch.empty(len(keys), dtype=torch.int64)  # (K,)
        dist.recv(header, o, group=self.pg, tag=2 * tag)
        dtypes = [DTYPES[self.spec.columns[c]] for _, c in keys]
        nbytes = sum(n * d.itemsize for n, d in zip(header.tolist(), dtypes))
        payload = torch.empty(nbytes, dtype=torch.uint8)  # (bytes,)
        if nbytes:
            dist.recv(payload, o, group=self.pg, tag=2 * tag + 1)
        # received whole first: the owner's sends complete either way
        self._check_header(o, header, [rows[r][c][1] for r, c in keys])
        return dict(zip(keys, unpack_cells(header, payload, dtypes)))

    # step 4, agree: all or nothing in a DP group (the vote, _agree, is below the marker); then
    # the transfers are kept or dropped
    def _ack(self, tags, keep):
        for tag in tags:
            self.store.set(self._k("ack", tag), "kept" if keep else "dropped")

# ==================================================================================================
# What follows, in DistQueue's body and then in the module: helpers that the default path calls and
# a learner can take on trust (the store logs' formats; the checks of the caller's input, with their
# long errors; recovery from failures, with a DP group's all-or-nothing vote; metrics); what only
# the options use (put(ids=), get(min_rows=), drain, the hierarchical read get(group=)); checkpoint
# state; the module's checks of a spec, the environment, a store and a process group; unpad and
# unpack. The default path reads complete above, but for one helper worth reading: the DP group's
# vote (_agree, step 4 of a read). A learner can stop here.
# ==================================================================================================

    # --- the logs' formats: ready-log entries, claim tokens, claim logs
    def _entries(self, cells, stage=""):
        """{(row, col): tensor or (owner, length)} -> "row,column,owner,length;" per cell, the
        column by its number in the spec. A stage ends each entry: only its readers see the cell."""
        out = []
        for (r, c), v in cells.items():
            owner, length = (self.rank, v.numel()) if torch.is_tensor(v) else v
            tail = f",{stage}" if stage else ""
            out.append(f"{r},{self.col_index[c]},{owner},{length}{tail};")
        return "".join(out)

    def _parse(self, entries, stage, rows):
        """Entries of this stage's columns -> rows {row: {col: (owner, length)}}; returns rows."""
        names = list(self.spec.columns)
        for e in entries.split(";")[:-1]:
            r, c, owner, length, *released = e.split(",")  # released: in that stage only
            if names[int(c)] in self.spec.stages[stage] and released in ([], [stage]):
                rows.setdefault(int(r), {})[names[int(c)]] = (int(owner), int(length))
        return rows

    @staticmethod
    def _cells_of(rows, cols):
        """{row: {col: (owner, length)}} -> {(row, col): (owner, length)}, rows ascending."""
        return {(r, c): rows[r][c] for r in sorted(rows) for c in cols}

    def _token(self):
        """A name for one read's claims, unique among this queue's readers."""
        self.claims_made += 1
        return f"{self.claimer}.{self.claims_made}"

    @staticmethod
    def _blocks(rows):
        """Rows by claim log: (block, "3,7,12") for each block of CLAIM_BLOCK ids holding some."""
        for block in sorted({r // CLAIM_BLOCK for r in rows}):
            yield block, ",".join(str(r) for r in sorted(rows) if r // CLAIM_BLOCK == block)

    @staticmethod
    def _holders(log):
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

    # --- checks of the caller's input
    def _check_columns(self, columns, n):
        """put's columns: each known, each with n rows."""
        for c, vals in columns.items():
            if c not in self.spec.columns:
                raise KeyError(f"unknown column '{c}'; valid: {list(self.spec.columns)}")
            if len(vals) != n:
                raise ValueError(f"column '{c}' has {len(vals)} rows, others {n}")

    def _check_cell(self, r, c, t, want):
        """One cell of put: its dtype, its shape, and not written before."""
        scalar = c in self.spec.scalars
        if t.dtype != want:
            raise TypeError(f"column '{c}' row {r}: dtype {t.dtype}, expected {want}")
        if scalar and t.numel() != 1 or not scalar and t.dim() != 1:
            raise ValueError(f"column '{c}' row {r}: shape {tuple(t.shape)}; scalar fields "
                             f"take one value, others a 1-D tensor")
        if (r, c) in self.cells or any(c in s.get(r, ()) for s in self.unclaimed.values()):
            raise ValueError(f"cell (row {r}, column '{c}') written twice")

    def _check_get(self, stage, n, min_rows, dp_group, group):
        """get's arguments: a known stage, 0 <= min_rows <= n, n >= the DP size, this rank in the
        groups it passed, and a gloo group to broadcast in."""
        if stage not in self.spec.stages:
            raise KeyError(f"unknown stage '{stage}'; valid: {list(self.spec.stages)}")
        dp = dist.get_world_size(dp_group) if dp_group else 1
        if not 0 <= min_rows <= n or n < max(dp, 1):
            raise ValueError(f"n={n}, min_rows={min_rows}, dp size {dp}: need 0 <= min_rows <= n "
                             f"and n >= dp")
        for g, what in ((dp_group, "dp_group"), (group, "group")):
            if g is not None and dist.get_rank(g) < 0:
                raise ValueError(f"rank {self.rank} is not in the {what} it passed (ranks "
                                 f"{dist.get_process_group_ranks(g)})")
        if group is not None and dist.get_backend(group) != "gloo":
            raise ValueError(f"group backend is {dist.get_backend(group)}; the broadcast needs a "
                             f"gloo group")

    @staticmethod
    def _check_same_n(stage, n, n0, dp_rank):
        """Every rank of a DP group passes the global batch as n: dp rank 0 planned for n0."""
        if int(n0) != n:
            raise ValueError(f"get('{stage}', n={n}) on dp rank {dp_rank}, but dp rank 0 asked "
                             f"for n={n0}: every rank of a dp_group passes the same n (the global "
                             f"batch)")

    def _check_sent(self, o, answer):
        """A pull's answer: "sent", or the owner lacked some of the cells."""
        if answer != "sent":
            raise RuntimeError(f"rank {o}, asked by rank {self.rank} for cells it does not hold, "
                               f"answered {answer}")

    @staticmethod
    def _check_header(o, header, expect):
        """A transfer's header (K,) against the lengths the ready log published."""
        if header.tolist() != expect:
            raise RuntimeError(f"header {header.tolist()} from rank {o} != published lengths "
                               f"{expect}")

    # --- recovery: why a wait still waits, claims given back, pulls cancelled, the vote
    def _lacking(self, stage, n, min_rows, claimed, only):
        """Why a claim still waits: rows that miss columns, fewer complete rows than asked, none."""
        cols, seen = self.spec.stages[stage], self.unclaimed[stage]
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

    def _silent(self, stage, o, keys):
        """Why a pull still waits: its owner has not answered."""
        waiting = self.store.queue_len(self._k("req", o))
        return (f"in stage '{stage}' waiting for rows {sorted({r for r, _ in keys})[:32]} from "
                f"rank {o}, which has not answered ({waiting} requests wait in its queue): rank "
                f"{o} is alive but not calling the queue (busy elsewhere: in a collective, in "
                f"compute), or it is gone. A rank whose cells are still wanted must keep calling "
                f"the queue, or drain(), before blocking elsewhere")

    def _may_send(self, tag, keys):
        """_answer's handshake: write "sent" in state/<tag> (or the missing cells) unless the
        reader cancelled first; True if the transfer goes. A cancelled tag's key is deleted (the
        reader never reads it)."""
        missing = [k for k in keys if k not in self.cells]
        state = self._k("state", tag)
        answer = self.store.compare_set(state, "", f"missing {missing[:8]}" if missing else "sent")
        if answer == b"cancelled":
            self.store.delete_key(state)
        return answer == b"sent"

    def _release(self, stage, token, rows):
        """Give back rows claimed as token: "-token:ids;" in the claim logs ends the claims, and
        ready-log entries for this stage show the rows again to its readers."""
        for block, ids in self._blocks(rows):
            self.store.append(self._k("claims", stage, block), f"-{token}:{ids};")
        if rows:
            self._publish(self._entries(self._cells_of(rows, self.spec.stages[stage]), stage))

    def _cancel(self, tags, owners, rows, received):
        """A fetch failed: cancel the requests not yet answered (an owner that answered first is
        received, to drop it), and acknowledge every transfer received as dropped."""
        for o, tag in tags.items():  # not answered: cancelled, unless the owner answers first
            if self.store.compare_set(self._k("state", tag), "", "cancelled") == b"sent":
                self._recv(o, tag, owners[o], rows)  # it sent just now: take it, to drop it
                received.append(tag)
        self._ack(received, keep=False)

    def _agree(self, stage, step, root, dp_rank, dp_size, error, deadline):
        """Each rank votes, ok (counted in done/...) or its error. The last ok vote, or the first
        error, writes outcome/... (the first writer wins), and every rank waits for it. Returns
        None, or the error this rank raises: the first failure's, on every rank."""
        outcome = self._k("outcome", stage, step, root)
        if error is None and int(self.store.add(self._k("done", stage, step, root), 1)) == dp_size:
            self.store.compare_set(outcome, "", "ok")
            for key in ("done", "outcome"):  # every rank voted here: it read the last outcome
                self.store.delete_key(self._k(key, stage, step - 1, root))
        elif error is not None:
            self.store.compare_set(outcome, "", f"{dp_rank}|{type(error).__name__}|{error}")
        try:
            self._wait(lambda: self.store.check([outcome]), deadline,
                       lambda: f"in stage '{stage}' waiting for the other DP ranks to receive "
                               f"their rows")
        except TimeoutError as e:
            error = e
            self.store.compare_set(outcome, "", f"{dp_rank}|TimeoutError|{e}")
        verdict = self.store.get(outcome).decode()
        if verdict == "ok":
            return None
        first, kind, why = verdict.split("|", 2)
        if int(first) == dp_rank:
            return error
        kinds = {"TimeoutError": TimeoutError, "ValueError": ValueError}
        return kinds.get(kind, RuntimeError)(f"dp rank {first} of this get's dp_group failed, so "
                                             f"this rank keeps no row: {why}")

    # --- observability
    COUNTERS = ("bytes_sent", "bytes_padded_equiv", "bytes_bcast")

    def _count(self, name, n):
        self.store.add(self._k("count", name), int(n))

    def _count_sent(self, keys, cells, tmax, header, payload):
        """One transfer's bytes, and what padding each field to the step's longest cell (tmax,
        "col=length,...") would have sent."""
        longest = {c: int(n) for c, n in (x.split("=") for x in tmax.split(",") if x)}
        padded = sum(longest.get(c, t.numel()) * t.itemsize for (_, c), t in zip(keys, cells))
        self._count("bytes_sent", header.nbytes + payload.nbytes)
        self._count("bytes_padded_equiv", header.nbytes + padded)

    def metrics(self):
        """The whole queue's traffic, counted in the store by the ranks that sent it: packed bytes
        sent (headers included), what padding each field to the step's longest cell would have
        sent, bytes broadcast inside model-parallel groups, and stage reads."""
        out = {f"queue/{c}": int(self.store.add(self._k("count", c), 0)) for c in self.COUNTERS}
        out["queue/reads"] = sum(self.reads(s) for s in self.spec.stages)
        return out

    def reads(self, stage):
        return int(self.store.add(self._k("reads", stage), 0))

    # --- what only the options use. put(ids=): more columns of rows put before (ids: theirs).
    # get(min_rows=m): at least m rows, up to n (default n; 0 = a poll, which may find none).
    # drain(), and get(group=): the hierarchical read, which follows.
    def drain(self, timeout_s=None):
        """A producer that is done serves until each cell it owns reached each stage reading it."""
        deadline = time.monotonic() + (timeout_s or self.spec.timeout_s)
        self._wait(lambda: not self.cells and not self.inflight, deadline,
                   lambda: f"in drain: rows {sorted({r for r, _ in self.cells})[:16]} not yet read "
                           f"by every stage, transfers {sorted(self.inflight)} not acknowledged")

    # --- the hierarchical read: a group's leader reads, then broadcasts what it read
    def _read_in_group(self, stage, n, min_rows, dp_group, group, step, deadline, only):
        """get(group=): only the group's first rank reads; it broadcasts the rows, or its error."""
        leader = dist.get_global_rank(group, 0)
        batch, error = None, None
        if leader == self.rank:
            try:
                batch = self._read(stage, n, min_rows, dp_group, step, deadline, only)
            except Exception as e:  # told to the group first, so that its members raise too
                error = e
        return self._bcast(batch, error, stage, group, leader, deadline + self.spec.timeout_s)

    def _bcast(self, batch, error, stage, group, leader, deadline):
        """Leader -> its model-parallel group: the size B (or the leader's failure: < 0), a header
        (B, 1+C) [ids, lengths], one payload. The deadline is the leader's plus timeout_s."""
        cols = self.spec.stages[stage]
        dtypes = [DTYPES[self.spec.columns[c]] for c in cols]
        failures = (TimeoutError, ValueError, RuntimeError)  # a leader's failure -> -1, -2, -3

        def bcast(t, what):
            w = dist.broadcast(t, leader, group=group, async_op=True)
            self._wait(w.is_completed, deadline,
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
            lengths, payload = pack_cells(flat)  # (K,), (bytes,)
            ids = torch.tensor(batch.ids).view(B, 1)  # (B, 1)
            header = torch.cat([ids, lengths.view(B, len(cols))], 1)  # (B, 1+C)
            self._count("bytes_bcast", header.nbytes + payload.nbytes)
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
        return Rows(header[:, 0].tolist(), {c: cells[j::len(cols)] for j, c in enumerate(cols)})

    # --- checkpointing
    def state_dict(self):
        """This rank's part of the queue, saved by every rank where no get runs (a consistent cut,
        such as the end of a training step): the cells it holds and the stages that read each, its
        row and read counters; rank 0 adds the queue-wide counters. It first serves until every
        transfer it sent is acknowledged. Nothing of the store is saved: load_state_dict publishes
        the held cells again, so the file does not grow with the rows ever put."""
        self._wait(lambda: not self.inflight, time.monotonic() + self.spec.timeout_s,
                   lambda: f"in state_dict: transfers {sorted(self.inflight)} not acknowledged")
        keys = [f"count/{c}" for c in self.COUNTERS] + [f"reads/{s}" for s in self.spec.stages]
        keys.append("tag")
        counters = {}
        if self.rank == 0:
            counters = {k: int(self.store.add(self._k(*k.split("/")), 0)) for k in keys}
        cells = {k: t.clone() for k, t in self.cells.items()}  # the last stage takes the originals
        return {"cells": cells, "served": {k: sorted(v) for k, v in self.served.items()},
                "next_local": self.next_local, "steps": dict(self.steps), "counters": counters}

    def load_state_dict(self, sd):
        """Every rank loads its own dict into a queue whose store holds none of this queue's keys (a
        new store, or a new spec.name). It publishes its cells in the ready log, and claims them for
        the stages that read them already; rank 0 restores the counters. Collective over the
        queue's ranks: it returns once every rank has published."""
        self.cells = {k: t.clone() for k, t in sd["cells"].items()}  # this queue's own copies
        self.next_local = sd["next_local"]
        self.served = {k: set(v) for k, v in sd["served"].items()}
        self.steps = dict(sd["steps"])
        self._reset_caches()
        if self.cells:  # one ready-log key, as one put writes
            self._publish(self._entries(dict(sorted(self.cells.items()))))
        for s in self.spec.stages:  # read by s already: claimed in s's logs
            read = sorted({r for (r, _), stages in self.served.items() if s in stages})
            for block, ids in self._blocks(read):
                self.store.append(self._k("claims", s, block), f"restored:{ids};")
        for k, v in sd["counters"].items():
            self.store.set(self._k(*k.split("/")), str(v))
        done = self._k("restored")
        self.store.add(done, 1)
        self._wait(lambda: int(self.store.add(done, 0)) >= self.world,
                   time.monotonic() + self.spec.timeout_s,
                   lambda: f"waiting for the other ranks to restore their cells "
                           f"({int(self.store.add(done, 0))} of {self.world} have)")


# ----------------------------------- checks of a spec, the environment, a store and a process group


def check_spec(spec):
    """QueueSpec's fields: known dtypes, stages that read known columns, every column read by a
    stage, positive times, and names that fit in control messages and store keys."""
    bad = {c: d for c, d in spec.columns.items() if d not in DTYPES}
    if bad:
        raise ValueError(f"unknown dtypes {bad}; valid: {sorted(DTYPES)}")
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


def _from_python(v, want, r, c):
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


def _rank_and_world(rank, world_size, store, name):
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


def _refused(queue):
    """A peer's refusal of its own queue (_rank_and_world), for this rank's timeout message."""
    key = f"{queue.spec.name}/refused"
    if not queue.store.check([key]):
        return ""
    return f"; a peer's queue was refused: {queue.store.get(key).decode()}"


def check_pg(pg):
    """The queue's data moves host tensors, point to point: pg must be a gloo group."""
    if dist.is_initialized() and dist.get_backend(pg) != "gloo":
        raise ValueError(f"pg backend is {dist.get_backend(pg)}; "
                         f"pass pg=dist.new_group(backend='gloo')")


# -------------------------------------------------- unpad and unpack: the inverses of pad and pack


def unpad(padded, lengths):
    return [padded[i, : int(n)].clone() for i, n in enumerate(lengths)]


def unpack(flat, lengths):
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    if lengths.dim() != 1 or (lengths < 0).any() or int(lengths.sum()) != flat.numel():
        raise ValueError(f"lengths {lengths.tolist()} (sum {int(lengths.sum())}) do not split a "
                         f"payload of {flat.numel()} elements; they must be >= 0 and sum to it")
    return [t.clone() for t in torch.split(flat, lengths.tolist())]
