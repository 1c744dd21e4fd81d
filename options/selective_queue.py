"""SelectiveQueue: DistQueue with the reads and puts that only the options make.

    from options.selective_queue import SelectiveQueue
    queue = SelectiveQueue(spec, store, rank, world_size, pg)  # DistQueue's arguments

The default run reads whole batches: get(stage, n, dp_group=) claims n complete rows, any of them,
and one DP group reads each stage. The deployments whose stages run apart need more, and build this
subclass of DistQueue instead (train_grpo.build_queue(run, cls=SelectiveQueue)):
- several readers of one stage (the hybrid's trainers, one pipeline's first stage per pipeline):
  a claim goes through the store's claim logs, so that no two reads keep a row (_claim_rows);
- get(..., only=ids): only rows from the given ids (the separated trainer takes the batch that the
  cut named while the generators run ahead; the hybrid's reads; a pipeline's batch);
- get(..., min_rows=m): at least m rows, up to n: what there is (0: a poll, which may find none;
  the hybrid's auxiliary stage). A DP group still shares all n rows;
- get(..., group=mp_group): the hierarchical read: only the group's first rank reads the queue,
  then it broadcasts the packed batch, or its failure, to the rest of its model-parallel group
  (the pipeline's stages read once per pipeline);
- put(columns, ids=): more columns of rows put before (the hybrid's auxiliary stage adds the
  reference's log-probs to the actor's rows);
- drain(): a producer that is done serves until each cell it owns reached every stage reading it.
A get keeps its choices on the queue while it runs. The claim reads them, and _read is wrapped for
the broadcast. put(ids=) writes through DistQueue._write.

    python -m pytest tests/test_distqueue.py
"""
import time

import torch
import torch.distributed as dist

from distqueue import DTYPES, DistQueue, Rows, pack_cells
from plumbing.distqueue_details import cells_of, count, lacking, ready_entries, unpack_cells

CLAIM_BLOCK = 1024  # row ids per claim log: a claim reads its logs whole, so they stay short


class SelectiveQueue(DistQueue):
    """DistQueue, plus get(only=, min_rows=, group=), put(ids=) and drain()."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._only = self._least = self._group = None  # the running get's choices, else None
        self.claims_made = 0  # this queue's claims: a claim's token is "me.count"
        self._token = None    # the running get's claim

    def get(self, stage, n, dp_group=None, group=None, min_rows=None, only=None):
        """DistQueue.get: n rows of `stage`, from the ids in `only` if given. min_rows (default
        n): without a DP group, take at least that many, up to n. group: a model-parallel group
        that reads once, through its first rank, and gets the same rows on every rank."""
        min_rows = n if min_rows is None else min_rows
        check_choices(self, n, min_rows, group)  # before any collective
        dp = dist.get_world_size(dp_group) if dp_group else 1
        self._only, self._group = only, group
        self._least = n if dp > 1 else min_rows  # a DP group shares all n rows
        try:
            return super().get(stage, n, dp_group)
        finally:
            self._only = self._least = self._group = None

    # The claim, by several readers of a stage: each appends to the stage's claim logs, and the
    # logs, read in order, give each row to one claim (holders)
    def _claim(self, stage, n, deadline):
        """Claim rows (those in `only`, if given) whole, at least min_rows and up to n, as {row:
        {col: (owner, length)}}. A claim that times out releases what it won."""
        cols, seen, mine = self.spec.stages[stage], self.unclaimed[stage], {}
        least = self._least if self._least is not None else n
        token = self._token = new_token(self)  # _release gives back this claim's rows

        def claimable():
            return [r for r in seen if self._only is None or r in self._only]

        def poll():
            self._read_ready(stage)  # the ready log's new keys, into seen
            ready = sorted(r for r in claimable() if len(seen[r]) == len(cols))
            if len(mine) + len(ready) < least:  # not enough yet: claim nothing
                return False
            mine.update(self._claim_rows(stage, ready[: n - len(mine)], token))
            # Done at n rows, or at least min_rows once it tried every ready row
            return len(mine) >= n or (len(mine) >= least and len(ready) <= n - len(mine))
        try:
            self._wait(poll, deadline, lambda: lacking(self, stage, n, least, len(mine),
                                                       claimable()))
        except Exception:
            self._release(stage, mine)
            raise
        return mine

    def _retire(self, keys):
        """Keep the ready log whole: with several readers a stage, none knows who read a key."""

    def _claim_rows(self, stage, rows, token):
        """Claim `rows` under `token`, and return {row: cells} for those won. For each block of
        CLAIM_BLOCK ids, it appends once to that block's claim log, then reads the log once. Read in
        order, the log gives a row to a claim made while no claim held it. That claim keeps the row
        until its release, whatever comes after (holders). Every reader reads the same append-only
        log up to some entry, so no two readers each see themselves hold a row. Rows the log shows
        held leave self.unclaimed, so a poll scans only rows this reader has not seen claimed."""
        won = {}
        for block, ids in claim_blocks(rows, CLAIM_BLOCK):  # (block, "3,7,12")
            key = self._k("claims", stage, block)
            self.store.append(key, f"{token}:{ids};")
            held = holders(self.store.get(key))  # row -> the token whose claim holds it
            for r in held:
                cells = self.unclaimed[stage].pop(r, None)
                if held[r] == token and cells is not None:  # None: won at an earlier poll
                    won[r] = cells
        return won

    def _release(self, stage, rows):
        """Give back the rows of the last claim, for the next reader. It first appends
        "-token:ids;" to the claim logs, so that a claim appended later wins (holders). Then new
        ready-log entries show the rows again to this stage's readers, which dropped them on seeing
        them held. In the other order, a reader could claim before the release, lose, and never see
        the rows again."""
        for block, ids in claim_blocks(rows, CLAIM_BLOCK):
            self.store.append(self._k("claims", stage, block), f"-{self._token}:{ids};")
        if rows:
            self._publish(ready_entries(self, cells_of(rows, self.spec.stages[stage]), stage))

    def _read(self, stage, n, dp_group, step, deadline):
        """With a group, only its first rank reads; it broadcasts the rows, or its error."""
        if self._group is None:
            return super()._read(stage, n, dp_group, step, deadline)
        leader = dist.get_global_rank(self._group, 0)
        batch, error = None, None
        if leader == self.rank:
            try:
                batch = super()._read(stage, n, dp_group, step, deadline)
            except Exception as e:  # told to the group first, so that its members raise too
                error = e
        return self._bcast(batch, error, stage, leader, deadline + self.spec.timeout_s)

    def _bcast(self, batch, error, stage, leader, deadline):
        """Leader -> its model-parallel group: the size B (or the leader's failure: < 0), a header
        (B, 1+C) [ids, lengths], one payload. The deadline is the leader's plus timeout_s."""
        cols, group = self.spec.stages[stage], self._group
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
            count(self, "bytes_bcast", header.nbytes + payload.nbytes)
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

    def put(self, columns, ids=None):
        """DistQueue.put; with ids, more columns of rows put before (theirs), returned."""
        if ids is None:
            return super().put(columns)
        ids, n = list(ids), len(next(iter(columns.values()), []))  # n: the first column's rows
        if columns and len(ids) != n:
            raise ValueError(f"{len(ids)} ids for {n} rows")
        self._write(columns, ids)
        return ids

    def drain(self, timeout_s=None):
        """A producer that is done serves until this rank holds no cell, and no transfer that its
        reader has not acknowledged."""
        deadline = time.monotonic() + (timeout_s or self.spec.timeout_s)
        self._wait(lambda: not self.cells and not self.inflight, deadline,
                   lambda: f"in drain: rows {sorted({r for r, _ in self.cells})[:16]} not yet read "
                           f"by every stage, transfers {sorted(self.inflight)} not acknowledged")


def check_choices(q, n, min_rows, group):
    """get's choices: 0 <= min_rows <= n, this rank in the group, a gloo group to broadcast in."""
    if not 0 <= min_rows <= n:
        raise ValueError(f"n={n}, min_rows={min_rows}: need 0 <= min_rows <= n")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"rank {q.rank} is not in the group it passed (ranks "
                         f"{dist.get_process_group_ranks(group)})")
    if group is not None and dist.get_backend(group) != "gloo":
        raise ValueError(f"group backend is {dist.get_backend(group)}; the broadcast needs a "
                         f"gloo group")


def announce_rows(run, mine):
    """The batch's row ids, every writer's (`mine`: this rank's) gathered over the trainers, for a
    deployment that reads them by name (get(only=)): the shared cut's shares vary from step to
    step, so a writer's rows are named, not counted."""
    everyone = [None] * dist.get_world_size(run.train_group)
    dist.all_gather_object(everyone, mine or [], group=run.train_group)
    return {r for part in everyone for r in part}


def new_token(q):
    """A name for one read's claims, unique among this queue's readers."""
    q.claims_made += 1
    return f"{q.me}.{q.claims_made}"


def holders(log):
    """A claim log, "token:ids;" claims and "-token:ids;" releases -> {row: its holder}. Read in
    order, a claim takes the rows that no claim holds, and a release frees its own token's rows:
    so a claim that took a row holds it, whatever is appended after, until its release (why no
    two reads keep a row: SelectiveQueue._claim_rows)."""
    held = {}
    for entry in log.decode().split(";")[:-1]:
        who, ids = entry.split(":")
        for r in map(int, ids.split(",")):
            if not who.startswith("-"):
                held.setdefault(r, who)
            elif held.get(r) == who[1:]:
                del held[r]
    return held


def claim_blocks(rows, size):
    """Rows by claim log: (block, "3,7,12") for each block of `size` ids (CLAIM_BLOCK) holding
    some."""
    for block in sorted({r // size for r in rows}):
        yield block, ",".join(str(r) for r in sorted(rows) if r // size == block)
