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
The thread costs one store write and one read a second; the main thread is never polled.
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
        self.quiet = False  # explain(): the thread finds the peer, the main thread asks
        signal.signal(signal.SIGUSR1, self._raise)  # the main thread's handler (set here)
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
        self.quiet = True
        self.thread.join(self.dead_after_s + 2 * self.every_s)
        return self.error

    def close(self, error=None):
        """This rank ends: its last beat says "left", or "failed" with the error."""
        self.quiet = True
        self.stop.set()
        self.thread.join()
        said = "left" if error is None else f"failed|{self._phase()}|{error}"
        self.store.set(self._beat(self.rank), said[:2000])
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)

    # --- the thread
    def _run(self):
        seen = {p: (None, time.monotonic()) for p in self.peers}  # peer -> (last beat, when)
        while not self.stop.wait(self.every_s):
            self._post(self._phase())
            self.error = self._lost(seen)
            if self.error is not None and not self.quiet:
                if self.wake is not None:
                    self.wake(self.store)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            if self.error is not None:
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
