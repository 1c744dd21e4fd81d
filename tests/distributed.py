"""The one spawn helper for multi-rank tests: run a function on N gloo processes.

    from tests.distributed import run_distributed
    results = run_distributed(fn, world_size=2, args=(x,))   # fn(rank, world_size, *args)

- each rank is a fresh `spawn` process with its own gloo process group (explicit timeout);
- the port is picked free, never hard-coded;
- every line a rank prints is tagged `[rank N]`;
- `destroy_process_group()` runs in a `finally`;
- a rank that raises fails the test with its traceback; a rank that hangs fails it after `timeout_s`.
`fn` must be a module-level function (spawn pickles it by name). Returns the ranks' return values.
"""
import datetime
import io
import multiprocessing as mp
import os
import pickle
import socket
import sys
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


def _worker(rank, world_size, port, fn, args, pg_timeout_s, results):
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
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush(), sys.stderr.flush()


def run_distributed(fn, world_size=2, args=(), timeout_s=120, pg_timeout_s=60):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, pg_timeout_s, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        for _ in range(world_size):
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except Exception:  # queue.Empty: some rank never reported
                missing = sorted(set(range(world_size)) - set(out) - {e[0] for e in errors})
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s}s") from None
            if status == "ok":
                out[rank] = pickle.loads(value)
            else:
                errors.append((rank, value))
                break  # fail fast: the other ranks may be blocked on the dead one
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
