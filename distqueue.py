# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""DistQueue: the data queue between RL stages, packed and balanced by length.

The queue holds rows (samples) in columns (fields), from rollout to training. A cell stays on the
rank that wrote it until each stage that reads it has it. Two ideas make it fast, an option a third:
- Zero-padding transfer. The naive way (`pad`) pads each field to its longest cell, which sends
  mostly zeros when lengths are long-tailed. Instead, a reader pulls each owner's cells as one
  header of lengths (K,) int64 and ONE uint8 payload (`pack_cells`). The spec gives the dtypes.
- Balance. With `dp_group=`, n is the global batch, and `balance_split` splits it by length. A
  row stays on the rank that wrote it, up to a fair share per rank, so few rows move.
- Hierarchical transfer, an option. One reader in each model-parallel group broadcasts the batch
  to the rest of its group. options/selective_queue.py holds the options' reads and puts.

A read (DistQueue._read) coordinates the ranks through keys "<name>/..." in a torch.distributed
Store. It has four steps, and only a DP group takes the last one:
1. Claim. Each put lists its cells in the ready log, in a key ready/<i> that ready/n counts, a
   cell as "row,column index,owner,length;". Dp rank 0 of the DP group that reads the stage claims
   the n lowest rows whose cells are all listed, and writes them in plan/... for its group.
2. Share. Each DP rank takes its part of the plan, split by length (balance_split).
3. Fetch. A rank asks each owner of its cells for one packed transfer. It pushes the request
   "reader|tag|stage|longest cells|row:column,..." to req/<owner>.
4. Agree. Each DP rank votes in done/..., and outcome/... holds the verdict. Then each rank
   acknowledges its transfers as "kept" in ack/<tag>. An owner frees a cell once every stage
   that reads the cell has kept it.
A read that fails keeps nothing, and loses nothing a live rank holds (the class's last section).
The claimed rows go back (_release). Each request is either sent or cancelled, never both: the
owner and the reader race to write state/<tag>, and the first write stays (_answer, _cancel). A
failed rank votes its error, so every rank of its group raises and acks its transfers "dropped".
docs/walkthrough.md traces one read's store operations and follows each key from write to delete.
Every wait serves the requests of other ranks (_wait). So a rank whose cells are still wanted
must call the queue (serve()) before it blocks elsewhere.

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
1. Data lives in host memory and moves on a gloo group (`pg`). The source's queue is an RDMA store.
2. There are no separate queue servers. An owner serves its own cells inside any queue call.
3. Ids are deterministic (local_count * world + rank), so a resumed run sees the same rows in order.
The companion plumbing/distqueue_details.py holds the store, the log formats, the checks, the
metrics and the checkpoints.
Run: python -m pytest tests/test_distqueue.py ; python bench/distqueue.py --lengths lognormal:5,1.2
Shapes: B rows, K cells in one transfer (a cell is one row's field), T the longest cell.
Copy alone: torch (CPU tensors, a gloo group), and a TCPStore or, in one process, a HashStore. Copy
the file with its companion and keep the folder, or change the one import line. The companion's
docstring ends with a usage example, which tests/test_copy_alone.py runs in a folder of the two.
"""
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plumbing.distqueue_details import (  # helpers a learner can take on trust, by role
    default_store,  # the rendezvous' store (a TCPStore client), or a HashStore in a world of one
    ready_entries, parse_entries, cells_of, request, parse_request, retire_keys,
    ack,  # the store's logs: the ready log's formats and its retiring, plans, requests, acks
    check_spec, check_store, rank_and_world, check_pg, put_cells, check_columns, check_get,
    check_reader, check_same_n, check_sent, check_header, refused, lacking, silent,
    peer_failed,  # the checks, and the messages that say why a wait still waits
    read_last, count_sent, traffic,  # whether a read is a cell's last, and the traffic metrics
    queue_state, load_queue_state, unpack_cells)  # checkpoints, and the inverse of pack_cells

DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "bool": torch.bool}


# ------------------------------------------------------------------------------ packing primitives
def pad(seqs, pad_value=0):
    """Pad every sample to the longest one, the naive way. Return padded (B, T) and lengths (B,)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)  # (B,)
    T = int(lengths.max()) if len(seqs) else 0
    dtype = seqs[0].dtype if seqs else torch.int64
    out = torch.full((len(seqs), T), pad_value, dtype=dtype)  # (B, T)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out, lengths


def pack_cells(cells):
    """Pack cells of mixed dtypes into a header of lengths (K,) int64 and ONE uint8 payload."""
    header = torch.tensor([c.numel() for c in cells], dtype=torch.int64)  # (K,)
    if not cells:
        return header, torch.empty(0, dtype=torch.uint8)
    payload = torch.cat([c.contiguous().reshape(-1).view(torch.uint8) for c in cells])  # (bytes,)
    return header, payload


def balance_split(tokens, parts, homes=None):
    """Split rows into `parts` lists with near-equal token sums (tokens >= 0). Longest-first greedy
    (LPT) gives each row in turn to the lightest part, so part sums differ by at most max(tokens).
    `homes`, if given, names the part each row already lives in, or None. A row stays home if its
    home part, with the row added, holds at most a fair share (total / parts). LPT places the other
    rows. The bound still holds: the heaviest part either took its last row from LPT while it was
    the lightest, or it holds at most the mean. A part left empty takes the shortest row of the part
    with the most rows."""
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


def row_homes(rows, ids, dp_index):
    """Return the home of each row in `ids`, for balance_split. A row's home is the DP rank that
    holds most of its elements, and the lower index wins a tie. It is None if no DP rank holds any.
    `dp_index` maps a global rank to its index in the DP group."""
    homes = []
    for r in ids:
        held = {}  # DP rank -> elements of row r it holds
        for owner, length in rows[r].values():
            if owner in dp_index:
                held[dp_index[owner]] = held.get(dp_index[owner], 0) + length
        homes.append(max(held, key=lambda i: (held[i], -i)) if held else None)
    return homes



# ------------------------------------------------------------------------------ config and batch
@dataclass
class QueueSpec:
    columns: dict            # field name -> dtype name ("int64", "float32", ...)
    stages: dict             # stage name -> tuple of the fields it reads
    scalars: tuple = ()      # fields with one value per row (stored as (1,) tensors)
    timeout_s: float = 60.0  # a wait raises after this long (for the plan, dp ranks but 0: twice)
    poll_s: float = 0.002    # sleep between control-plane polls
    name: str = "dq"         # the prefix of the queue's keys, so queues can share one store

    def __post_init__(self):
        check_spec(self, DTYPES)  # known dtypes, valid names, and each column read by a stage


@dataclass
class Rows:
    """What a stage read: the row ids, and for each field one 1-D tensor per row."""
    ids: list               # (B,) row ids, ascending
    cols: dict              # field -> list of B 1-D tensors
    tmax: dict = field(default_factory=dict)  # field -> longest cell of the step's global batch

    def stack(self, col):
        return torch.cat(self.cols[col])  # (B,) for a scalar field



# ------------------------------------------------------------------------------ the queue
class DistQueue:
    """One rank's handle on the queue. `store` is a store that every rank reaches. `rank` is this
    rank among the `world_size` ranks that share it. `pg` is a gloo group over them, which carries
    the data. Each argument left out comes from the default process group."""

    def __init__(self, spec: QueueSpec, store=None, rank=None, world_size=None, pg=None):
        store = default_store(spec.timeout_s) if store is None else store
        check_store(store)  # the store has the operations the protocol uses
        rank, world_size = rank_and_world(rank, world_size, store, spec.name)
        self.spec, self.store, self.rank, self.world, self.pg = spec, store, rank, world_size, pg
        # For each column, how many stages read it. A cell is freed once that many have kept it.
        self.needers = {c: sum(c in cols for cols in spec.stages.values()) for c in spec.columns}
        self.col_index = {c: i for i, c in enumerate(spec.columns)}  # a column's number in the log
        self.cells = {}       # (row, col) -> 1-D tensor this rank owns and has not fully delivered
        self.served = {}      # (row, col) -> stages whose reader acknowledged keeping it
        self.next_local = 0   # how many rows this rank has created (row_id gives their ids)
        self.steps = {s: 0 for s in spec.stages}  # reads per stage so far, part of each read's keys
        self.inflight = {}    # tag -> (works, tensors, cells, stage) of a transfer not yet acked
        self.me = int(store.add(self._k("queues"), 1))  # unique per queue on this store
        self.reading = set()  # the stages that this queue is the only reader of (check_reader)
        self._reset_caches()
        check_pg(pg)  # the data moves as host tensors by async p2p, so pg must be a gloo group

    def row_id(self, j, rank=None):
        """The id of the j-th row that a rank creates (default: this rank). Every rank knows it."""
        return j * self.world + (self.rank if rank is None else rank)

    def _reset_caches(self):
        # For each stage, the rows not claimed yet and the number of ready-log keys already read
        self.unclaimed = {s: {} for s in self.spec.stages}
        self.ready_off = dict.fromkeys(self.spec.stages, 0)

    def _k(self, *parts):
        return "/".join([self.spec.name, *map(str, parts)])

    # --- producers and owners
    def put(self, columns):
        """Write the cells of new rows and return their ids."""
        n = len(next(iter(columns.values()), []))  # the number of rows, from the first column
        ids = [self.row_id(self.next_local + i) for i in range(n)]
        self._write(columns, ids)
        self.next_local += n
        return ids

    def _write(self, columns, ids):
        """Keep the queue's own copies of the cells of rows `ids`, publish them, then serve."""
        check_columns(self.spec, columns, len(ids))  # checks all columns before publishing any
        cells = put_cells(self, columns, ids, DTYPES)  # checked host copies that the queue owns
        self.cells.update(cells)
        self._publish(ready_entries(self, cells))  # one ready-log key for this put's cells
        self.serve()

    def _publish(self, entries):
        """Append one key to the ready log. Count it in ready/n first, then write it."""
        i = int(self.store.add(self._k("ready", "n"), 1)) - 1
        self.store.set(self._k("ready", i), entries)

    def _read_ready(self, stage):
        """Read the ready log's new keys into self.unclaimed[stage]. That takes one store round trip
        when there is nothing new, or else three plus _retire's. A key counted but not yet
        written stops the read. It and the keys after it wait for a later poll, or the get's
        timeout. So the log is read in order, and a row shows only the cells already written."""
        n = int(self.store.add(self._k("ready", "n"), 0))
        keys = [self._k("ready", i) for i in range(self.ready_off[stage], n)]
        while keys and not self.store.check(keys):  # some key is not written yet
            keys = keys[:-1] if self.store.check(keys[:1]) else []  # drop the last key, or all
        for entries in self.store.multi_get(keys) if keys else []:
            parse_entries(self.spec, entries.decode(), stage, self.unclaimed[stage])
        self.ready_off[stage] += len(keys)
        self._retire(keys)

    def _retire(self, keys):
        """Delete the ready-log keys that every stage has read (the companion's retire_keys)."""
        retire_keys(self, keys, readers=len(self.spec.stages))  # one reader a stage

    def serve(self):
        """Answer the requests waiting for this rank, with one packed transfer each. Then retire the
        transfers that readers acknowledged, as kept (the cells reached a stage) or dropped."""
        requests = self._k("req", self.rank)
        while self.store.queue_len(requests) > 0:
            self._answer(self.store.queue_pop(requests, block=False).decode())
        for tag in [t for t in self.inflight if self.store.check([self._k("ack", t)])]:
            works, _, keys, stage = self.inflight.pop(tag)
            for w in works:  # the reader got it all before acking, so this returns at once
                w.wait()
            if self.store.get(self._k("ack", tag)) == b"kept":
                for k in keys:
                    self._delivered(k, stage)
            self.store.delete_key(self._k("ack", tag))

    def _delivered(self, key, stage):
        stages = self.served.setdefault(key, set())
        stages.add(stage)
        if len(stages) >= self.needers[key[1]]:  # every stage that reads it has it, so free it
            del self.cells[key], self.served[key]

    def _wait(self, done, deadline, what):
        """Poll `done` until it holds, and serve peers before each poll, even when `done` holds at
        once. Otherwise a rank that only polls (an option's read) would starve its readers. Past
        the deadline, raise a TimeoutError that names the rank, the stage and the rows."""
        while not (self.serve() or done()):  # serve() returns None, so done() runs after it
            if time.monotonic() > deadline:
                raise TimeoutError(f"distqueue '{self.spec.name}' rank {self.rank}: timed out "
                                   f"after {self.spec.timeout_s}s {what()}{refused(self)}")
            time.sleep(self.spec.poll_s)

    # --- consumers. A read's keys, less "<name>/": who writes each, and who deletes it.
    #   ready/<i>                   a put                      the last stage to read it (_retire)
    #   ready/n, reader/<stage>     each put; a stage's first read   nobody (counters and names)
    #   plan/<stage>/<step>/<root>  dp rank 0                  dp rank 0, after the vote
    #   req/<owner>                 a reader                   the owner, as it pops a request
    #   state/<tag>                 owner "sent" or reader "cancelled"  the side that did not write
    #   done/..., outcome/...       each rank of the DP group  the last voter of the next read
    #   ack/<tag>                   the reader                 the owner (serve)
    def get(self, stage, n, dp_group=None):
        """Read n rows that `stage` has not consumed. With `dp_group`, n is the global batch, split
        by length across the group's ranks, and the get returns once every rank has its rows. A get
        that raises keeps no row."""
        check_get(self, stage, n, dp_group)
        deadline = time.monotonic() + self.spec.timeout_s
        step = self.steps[stage]  # the same count on every rank (SPMD)
        self.steps[stage] += 1
        return self._read(stage, n, dp_group, step, deadline)

    def _read(self, stage, n, dp_group, step, deadline):
        """One read, in the four steps of the module docstring. The methods that follow do steps 1
        to 3 in order. Step 4 (_agree) follows _release and _cancel in the class's last section."""
        cols = self.spec.stages[stage]
        dp_rank = dist.get_rank(dp_group) if dp_group else 0
        dp_size = dist.get_world_size(dp_group) if dp_group else 1
        # The global rank of dp rank 0 names the group's keys plan/, done/ and outcome/
        root = dist.get_global_rank(dp_group, 0) if dp_group else self.rank
        plan = self._k("plan", stage, step, root)
        claimed, tags, error = {}, [], None
        try:
            if dp_rank == 0:  # 1. claim, and write the group's plan
                claimed = self._claim(stage, n, deadline)
                rows = claimed
                if dp_size > 1:
                    self.store.set(plan, f"{n}|{ready_entries(self, cells_of(claimed, cols))}")
            else:  # 1. read dp rank 0's plan
                # Wait longer than dp rank 0, so that its claim's timeout is the error raised
                late = deadline + self.spec.timeout_s
                rows = self._take_plan(stage, n, dp_rank, step, root, late)
            # For each field, the longest cell in the global batch. Padding would pad to this length
            tmax = {c: max(rows[r][c][1] for r in rows) for c in cols} if rows else {}
            if dp_size > 1:  # 2. share
                rows = self._share(rows, cols, dp_group)
            got, tags = self._fetch(stage, rows, tmax, deadline)  # 3. fetch
        except Exception as e:
            error = e
        if dp_size > 1:  # 4. agree. The whole group keeps the read, or every rank raises
            error = self._agree(stage, step, root, dp_rank, dp_size, error, deadline)
            if dp_rank == 0:  # every rank has read the plan, or the group failed
                self.store.delete_key(plan)
        ack(self, tags, keep=error is None)  # writes "kept" or "dropped" in each ack/<tag>
        if error is not None:
            if dp_rank == 0:  # its claim holds the whole group's rows
                self._release(stage, claimed)
            raise error
        for r in rows:
            for c in cols:
                if rows[r][c][0] == self.rank:
                    self._delivered((r, c), stage)
        if rows:  # a read that got no row (an option's poll that found none) is not counted
            self.store.add(self._k("reads", stage), 1)
        ids = sorted(rows)
        return Rows(ids, {c: [got[(r, c)] for r in ids] for c in cols}, tmax)

    # step 1, claim: dp rank 0 claims the rows, and the other dp ranks read its plan
    def _claim(self, stage, n, deadline):
        """Claim the n lowest row ids whose cells are all in the ready log, as {row: {col: (owner,
        length)}}. They leave self.unclaimed[stage], so no later read of this stage takes them. That
        is enough to give no row to two reads, because this queue is the stage's only reader."""
        check_reader(self, stage)  # the first read names this queue. Another queue is refused
        cols, seen = self.spec.stages[stage], self.unclaimed[stage]
        ready = []

        def poll():
            self._read_ready(stage)  # reads the ready log's new keys into seen
            ready[:] = sorted(r for r in seen if len(seen[r]) == len(cols))[:n]
            return len(ready) == n
        self._wait(poll, deadline, lambda: lacking(self, stage, n, n, 0, list(seen)))
        return {r: seen.pop(r) for r in ready}

    def _take_plan(self, stage, n, dp_rank, step, root, deadline):
        """Step 1 on the other dp ranks. Return the rows that dp rank 0 claimed, read from its plan
        "n|entries". Check that n is dp rank 0's n, since a DP group reads one global batch. If the
        group fails before the plan appears, raise an error, and _agree then reports why."""
        plan, outcome = self._k("plan", stage, step, root), self._k("outcome", stage, step, root)
        self._wait(lambda: self.store.check([plan]) or self.store.check([outcome]), deadline,
                   lambda: f"in stage '{stage}' waiting for dp rank 0's plan for step {step}")
        if not self.store.check([plan]):
            raise RuntimeError(f"dp rank 0 published no plan for step {step}")
        n0, entries = self.store.get(plan).decode().split("|")
        check_same_n(stage, n, n0, dp_rank)
        return parse_entries(self.spec, entries, stage, {})

    # step 2, share: each rank of a DP group takes its part of dp rank 0's plan
    def _share(self, rows, cols, dp_group):
        """Return this rank's share of the rows, split by weight (balance_split): a row weighs the
        elements of its variable-length cells. A row stays with its home rank when the split
        allows, and a rank pulls nothing for the rows it holds."""
        dp_index = {g: i for i, g in enumerate(dist.get_process_group_ranks(dp_group))}
        ids = sorted(rows)
        homes = row_homes(rows, ids, dp_index)
        var = [c for c in cols if c not in self.spec.scalars]
        tokens = [sum(rows[r][c][1] for c in var) for r in ids]
        share = balance_split(tokens, len(dp_index), homes)[dist.get_rank(dp_group)]
        return {ids[j]: rows[ids[j]] for j in share}

    # step 3, fetch: one packed transfer from each owner
    def _fetch(self, stage, rows, tmax, deadline):
        """Return the cells of `rows` and the tags of the transfers received, acknowledging none.
        On an error, cancel the requests not yet answered, drop what came, and raise."""
        owners = {}
        for r in sorted(rows):
            for c in self.spec.stages[stage]:
                owners.setdefault(rows[r][c][0], []).append((r, c))
        # This rank's own cells are copied, since the consumer may write into them. But the last
        # stage to read a cell gets the queue's tensor itself, which is freed once the read keeps it
        got = {k: self.cells[k] if read_last(self, k) else self.cells[k].clone()
               for k in owners.pop(self.rank, [])}
        tags, received = {}, []
        for o, keys in owners.items():
            tags[o] = int(self.store.add(self._k("tag"), 1))  # state/, ack/, p2p tags 2t, 2t+1
            self.store.queue_push(self._k("req", o), request(self.rank, tags[o], stage, tmax, keys))
        try:
            for o, tag in list(tags.items()):
                self._wait(lambda: self.store.check([self._k("state", tag)]), deadline,
                           lambda: silent(self, stage, o, owners[o]))
                del tags[o]  # answered: "sent", or the owner lacked cells and sent nothing
                check_sent(self, o, tag)  # reads and deletes state/<tag>, and raises unless "sent"
                received.append(tag)  # acked later as kept or dropped, even if _recv raises
                got.update(self._recv(o, tag, owners[o], rows))
        except Exception:
            self._cancel(tags, owners, rows, received)
            raise
        return got, received

    def _recv(self, o, tag, keys, rows):
        """Receive one transfer that owner o sent: a header, then a payload."""
        header = torch.empty(len(keys), dtype=torch.int64)  # (K,)
        dist.recv(header, o, group=self.pg, tag=2 * tag)
        dtypes = [DTYPES[self.spec.columns[c]] for _, c in keys]
        nbytes = sum(n * d.itemsize for n, d in zip(header.tolist(), dtypes))
        payload = torch.empty(nbytes, dtype=torch.uint8)  # (bytes,)
        if nbytes:
            dist.recv(payload, o, group=self.pg, tag=2 * tag + 1)
        # Both parts arrive before the check, so the owner's sends complete either way
        check_header(o, header, [rows[r][c][1] for r, c in keys])
        return dict(zip(keys, unpack_cells(header, payload, dtypes)))

    def _answer(self, request):
        """Answer one request, on the owner's side (serve calls it). Unless the reader cancelled
        first (see _cancel), write "sent", or the missing cells, in state/<tag>. After "sent", send
        a header (K,) and one payload."""
        reader, tag, stage, tmax, keys = parse_request(request)
        missing = [k for k in keys if k not in self.cells]
        state = self._k("state", tag)
        answer = self.store.compare_set(state, "", f"missing {missing[:8]}" if missing else "sent")
        if answer == b"cancelled":  # the reader wrote first. It gave up and never reads the key
            self.store.delete_key(state)
        if answer != b"sent":  # cancelled, or cells missing (then the reader raises)
            return
        cells = [self.cells[k] for k in keys]
        header, payload = pack_cells(cells)  # (K,), (bytes,)
        works = [dist.isend(header, reader, group=self.pg, tag=2 * tag)]
        if payload.numel():
            works.append(dist.isend(payload, reader, group=self.pg, tag=2 * tag + 1))
        self.inflight[tag] = (works, (header, payload), keys, stage)
        count_sent(self, keys, cells, tmax, header, payload)  # metrics

    # --- when a read fails, it keeps nothing and loses nothing (a first reading may skip to _agree)
    # Steps 1 to 3 above do a read's work, and step 4 below settles it. If a step fails, the read
    # gives back what it holds. _release returns the claimed rows, _cancel cancels the requests
    # not yet answered, and the transfers received are acknowledged as "dropped". In a DP group,
    # one rank's failure fails the group's read. Each rank learns of it in the vote of step 4.
    def _release(self, stage, rows):
        """Give back the rows of a failed read, so that the next read of this stage claims them."""
        self.unclaimed[stage].update(rows)

    def _cancel(self, tags, owners, rows, received):
        """The reader's half of the handshake, after a fetch failed. For each request not yet
        answered, write "cancelled" in state/<tag> by compare_set from "". The first writer wins,
        and the other reads the winner's word back. Where the owner won, delete the key. If its word
        is "sent", still receive the transfer, so that the owner's sends complete. Acknowledge it as
        "dropped", like each transfer received before. The owner's serve then keeps their cells."""
        for o, tag in tags.items():
            answer = self.store.compare_set(self._k("state", tag), "", "cancelled")
            if answer != b"cancelled":  # the owner answered first ("sent", or cells it lacks)
                self.store.delete_key(self._k("state", tag))
            if answer == b"sent":
                received.append(tag)
                self._recv(o, tag, owners[o], rows)
        ack(self, received, keep=False)

    def _agree(self, stage, step, root, dp_rank, dp_size, error, deadline):
        """Step 4, agree. Each rank votes ok, counted in done/..., or votes its error. The last ok
        vote writes "ok" in outcome/..., and a failed rank writes its error there. Both write by
        compare_set from "", so the first writer wins. Every rank acts on what it reads there, so
        either all ranks keep the read or none does. "ok" means that every rank fetched its rows,
        so a rank that times out after voting ok keeps the read if "ok" won. Return None or the
        error to raise: this rank's own if it failed first, else one naming the first to fail."""
        outcome = self._k("outcome", stage, step, root)
        if error is None and int(self.store.add(self._k("done", stage, step, root), 1)) == dp_size:
            self.store.compare_set(outcome, "", "ok")
            for key in ("done", "outcome"):  # all ranks voted, so all read step - 1's outcome
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
        verdict = self.store.get(outcome).decode()  # the same on every rank
        if verdict == "ok":
            return None
        first, kind, why = verdict.split("|", 2)  # the first failure's dp rank, kind and message
        return error if int(first) == dp_rank else peer_failed(first, kind, why)

    # --- observability and checkpointing. The companion holds the bodies and full docstrings.
    def metrics(self):
        """Return the whole queue's traffic counters, which the companion's traffic lists."""
        return traffic(self)

    def reads(self, stage):
        return int(self.store.add(self._k("reads", stage), 0))

    def state_dict(self):
        """Return this rank's part of the queue, to save where no get runs (see queue_state)."""
        return queue_state(self)

    def load_state_dict(self, sd):
        """Load what state_dict saved, into a queue on a fresh store (load_queue_state)."""
        load_queue_state(self, sd)
