"""The one helper for multi-rank tests: run a function on N gloo processes.

    from tests.distributed import run_distributed
    results = run_distributed(fn, world_size=2, args=(x,))   # fn(rank, world_size, *args)

- each rank is a new process with its own gloo process group (explicit timeout), started by a
  forkserver that has imported torch once (spawn where there is no forkserver): it shares nothing
  with the test process but what it is passed, and the environment the server started with;
- the port is picked free, never hard-coded;
- every line a rank prints is tagged `[rank N]`;
- `destroy_process_group()` runs in a `finally`, rank 0's last: it hosts the store the others may still call
  (leave_together=False lets each rank leave when its fn returns, for a test of a peer that leaves);
- a rank that raises fails the test with its traceback, at once; so does a rank that dies without
  reporting (killed, or unable to start), unless the test names it in `may_die`; a rank that hangs fails it
  after `timeout_s`.
`fn` must be a module-level function (it is pickled by name). Returns the ranks' return values.
"""
import datetime
import io
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Tagged(io.TextIOBase):
    """Prefix every line written to the wrapped stream with `[rank N] `."""

    def __init__(self, stream, rank):
        self.stream, self.tag, self.at_line_start = stream, f"[rank {rank}] ", True

    def write(self, s):
        for piece in s.splitlines(keepends=True):
            if self.at_line_start:
                self.stream.write(self.tag)
            self.stream.write(piece)
            self.at_line_start = piece.endswith("\n")
        return len(s)

    def flush(self):
        self.stream.flush()


def _worker(rank, world_size, port, fn, args, pg_timeout_s, results, leave_together, may_die):
    import torch
    import torch.distributed as dist

    sys.stdout, sys.stderr = _Tagged(sys.stdout, rank), _Tagged(sys.stderr, rank)
    # 2 cores in CI: keep processes x threads at or below the core count.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        # Plain pickle: tensors travel as bytes, not as shared memory that dies with this process.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if leave_together:
            _leave_together(port, rank, [r for r in range(world_size) if r not in may_die], pg_timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush(), sys.stderr.flush()


def _leave_together(port, rank, leavers, timeout_s):
    """Rank 0 hosts the rendezvous store, so it leaves last: a peer's last store call (a queue read's outcome,
    say) must not find the store gone. Each rank says it is leaving; rank 0 waits for the ranks in `leavers` (those
    not in may_die), up to the timeout (the parent kills every rank at the first error, so a dead peer ends it
    too). A test that restarted its process group elsewhere (MASTER_PORT changed or gone) has no such store."""
    import datetime
    import torch.distributed as dist
    if os.environ.get("MASTER_PORT") != str(port):
        return
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        store.set(f"tests/leaving/{rank}", "1")
        deadline = time.monotonic() + timeout_s
        keys = [f"tests/leaving/{r}" for r in leavers]
        while rank == 0 and not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - no store (rank 0 gone, or none started): nothing to wait for
        pass


def _context():
    """forkserver with torch imported once in its server: each rank starts from a fork of it, not from a
    fresh interpreter that imports torch again (seconds per rank on 2 cores). Like spawn, it pickles
    `fn` by name and shares no CUDA or thread state with the test process. torch._dynamo too: FSDP2
    imports it at its first use, which took each rank of each run 0.6 s of CPU. And pytest and the
    core (train_grpo and what it imports), which nearly every rank's `fn` imports (0.15 s a rank):
    they import nothing of options/, and no environment variable is read at their import."""
    if "forkserver" not in mp.get_all_start_methods():  # Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo",
                                "pytest", "train_grpo"])
    return ctx


def run_distributed(fn, world_size=2, args=(), timeout_s=120, pg_timeout_s=60, leave_together=True, may_die=()):
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    worker_args = [(r, world_size, port, fn, args, pg_timeout_s, results, leave_together, may_die)
                   for r in range(world_size)]
    procs = [ctx.Process(target=_worker, args=a) for a in worker_args]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        _collect(procs, results, timeout_s, out, errors, may_die)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank, tb = errors[0]
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    return [out[r] for r in range(world_size)]


def _collect(procs, results, timeout_s, out, errors, may_die=()):
    """Every rank's report; the first error ends it at once (the other ranks may be blocked on the dead
    one), and so does a rank that died without reporting (killed, or unable to start), unless it is one of
    may_die (a test of what its peers do when it dies): its result is then None."""
    deadline = time.monotonic() + timeout_s
    while len(out) < len(procs):
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
            if dead and results.empty():
                time.sleep(0.5)  # a report may still be in flight from a rank that just returned
                out.update({r: None for r in dead if r in may_die and results.empty()})
                dead = [r for r in dead if r not in out]
                if dead and results.empty():
                    errors.append((dead[0], f"the process exited with code {procs[dead[0]].exitcode} without "
                                            "reporting (killed, or it could not start: its stderr is above)"))
                    return
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(out))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s}s") from None
            continue
        if status != "ok":
            errors.append((rank, value))
            return
        out[rank] = pickle.loads(value)
