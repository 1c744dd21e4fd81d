# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""Liveness for a deployment of two roles: a lost peer is named within --liveness-s, not after
the whole --pg-timeout-s.

    python -m pytest tests/test_train_grpo.py -k "lost or liveness"

The hybrid's ranks wait on each other through the store (a group put, a column added), where a
dead peer looks like a slow one until a timeout. So every rank runs a Watchdog:
  1. beat: a thread, on a store connection of its own, posts "<count>|<phase>" every `every_s`
     seconds; the phase is the rank's open spans (the main thread may be busy: the thread beats
     beside it);
  2. watch: the same thread reads its peers' beats. A peer whose count has not moved for
     `dead_after_s` is lost: its process died, or its host stopped answering;
  3. raise: the thread then wakes the main thread where it may block in the store (`wake`, which
     posts to the rank's inbox) and signals it; the handler raises PeerLost naming the peer, the
     phase it was last seen in and this rank's own. The run's error handling adds the phase, as
     for any error.
A rank that ends says so in its beat ("left", or "failed" with its error): its peers stop watching
it, or name its failure at once. A rank whose own collective broke (a peer's socket closed) first
waits out the interval (explain): the dead peer's name is worth more than the socket's.
Each beat costs the thread one store write and a read per peer; the main thread is never polled.
"""
import signal
import threading
import time

import torch.distributed as dist

from distqueue import default_store


class PeerLost(RuntimeError):
    """A peer stopped beating, or said it failed."""


class Watchdog:
    """Beats for `rank` and watches `peers` ({rank: role}) through the store, under `key`.
    wake(store), optional: called from the thread on a loss, with the thread's store."""

    def __init__(self, key, rank, peers, spans, dead_after_s=10.0, every_s=1.0, wake=None):
        if not dead_after_s > 0 or not every_s > 0:
            raise ValueError(f"liveness: dead_after_s {dead_after_s} and every_s {every_s} "
                             "must be > 0")
        self.key, self.rank, self.peers = key, rank, dict(peers)
        self.spans, self.wake = spans, wake
        self.dead_after_s, self.every_s = dead_after_s, min(every_s, dead_after_s / 5)
        self.store = default_store()  # its own connection: the main thread's is not shared
        self.error, self.stop, self.count = None, threading.Event(), 0
        self.quiet = False  # set (under the lock) once the main thread no longer wants the signal
        self.lock = threading.Lock()
        self.handler = signal.signal(signal.SIGUSR1, self._raise)  # the main thread's (set here)
        self._post(self._phase())
        self.thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self.thread.start()

    def explain(self, error):
        """The lost peer behind `error`, a broken collective or a timed-out wait, as a message;
        None for any other error, or where no peer is lost within the interval."""
        chain, e = [], error
        while e is not None and len(chain) < 32:
            chain.append(e)
            e = e.__cause__ or e.__context__
        if not any(isinstance(x, (TimeoutError, dist.DistError, PeerLost)) or "gloo" in str(x)
                   for x in chain):
            return None
        self._hush()
        self.thread.join(self.dead_after_s + 2 * self.every_s)
        return self.error

    def close(self, error=None):
        """This rank ends: its last beat says "left", or "failed" with the error (where the
        store still answers: at a run's end its host may have left first)."""
        self._hush()
        self.stop.set()
        self.thread.join()
        said = "left" if error is None else f"failed|{self._phase()}|{error}"
        try:
            self.store.set(self._beat(self.rank), said[:2000])
        except dist.DistError:
            pass
        signal.signal(signal.SIGUSR1, self.handler)

    def _hush(self):
        with self.lock:  # no signal is sent after this, and one already sent is ignored
            self.quiet = True

    # --- the thread
    def _run(self):
        seen = {p: (None, time.monotonic()) for p in self.peers}  # peer -> (last beat, when)
        while not self.stop.wait(self.every_s):
            try:
                self._post(self._phase())
                self.error = self._lost(seen)
            except dist.DistError:  # the store is gone: the job is ending, or its errors say why
                return
            if self.error is None:
                continue
            with self.lock:
                if not self.quiet:
                    if self.wake is not None:
                        self.wake(self.store)
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            return

    def _lost(self, seen):
        """The first peer lost, as an error message, or None."""
        now = time.monotonic()
        for p in list(seen):
            key = self._beat(p)
            beat = self.store.get(key).decode() if self.store.check([key]) else None
            if beat == "left":
                del seen[p]
            elif beat is not None and beat.startswith("failed|"):
                _, phase, error = beat.split("|", 2)
                return f"{self._who(p)} failed in {phase}: {error}"
            elif beat != seen[p][0]:
                seen[p] = (beat, now)
            elif now - seen[p][1] > self.dead_after_s:
                phase = beat.split("|", 1)[1] if beat else "its start (it never beat)"
                return (f"{self._who(p)} gave no sign of life for {now - seen[p][1]:.1f}s "
                        f"(--liveness-s {self.dead_after_s:g}), last seen in {phase}, while rank "
                        f"{self.rank} was in {self._phase()}: its process died or its host is "
                        "unreachable")
        return None

    # --- helpers
    def _raise(self, signum, frame):  # the main thread, between two bytecodes
        if not self.quiet:
            raise PeerLost(self.error)

    def _post(self, phase):
        self.count += 1
        self.store.set(self._beat(self.rank), f"{self.count}|{phase}")

    def _phase(self):
        """The open spans; once an error struck, where it did."""
        if self.spans.failed_in:
            return self.spans.failed_in[0]
        return " > ".join(self.spans.open) or "its loop, between phases"

    def _beat(self, rank):
        return f"{self.key}/beat/{rank}"

    def _who(self, rank):
        return f"rank {rank} ({self.peers[rank]})"
