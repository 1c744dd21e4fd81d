"""SelectiveQueue: DistQueue with the reads and puts that only the options make.

    from options.selective_queue import SelectiveQueue
    queue = SelectiveQueue(spec, store, rank, world_size, pg)  # DistQueue's arguments

The default run reads whole batches: get(stage, n, dp_group=) claims n complete rows, any of them.
The deployments whose stages run apart need more, and build this subclass of DistQueue instead
(train_grpo.build_queue(run, cls=SelectiveQueue)):
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
A get keeps its choices on the queue while it runs: DistQueue's claim asks them at its two seams,
_claimable (which complete rows it may take) and _enough (how many it waits for), and _read is
wrapped for the broadcast. put(ids=) writes through DistQueue._write.

    python -m pytest tests/test_distqueue.py
"""
import time

import torch
import torch.distributed as dist

from distqueue import DTYPES, DistQueue, Rows, pack_cells
from plumbing.distqueue_details import count, unpack_cells


class SelectiveQueue(DistQueue):
    """DistQueue, plus get(only=, min_rows=, group=), put(ids=) and drain()."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._only = self._least = self._group = None  # the running get's choices, else None

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

    def _claimable(self, rows):
        """The rows (ids, ascending) that this read may claim: those in `only`, if given."""
        return rows if self._only is None else [r for r in rows if r in self._only]

    def _enough(self, n):
        """How many complete rows a claim waits for before it takes any: min_rows (else all n)."""
        return n if self._least is None else self._least

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
