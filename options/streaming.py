"""Streaming groups: a StaleSync that hands on each group the moment it completes, the hybrid
deployment's actor (options/hybrid.py puts it into the queue then, for the auxiliary ranks to work
on while the round decodes on).

At S = 0 it decodes in chunks of chunk_steps too (chunk_s0), so that the groups complete, and go,
over several calls rather than all at the round's end. A counter-based sampler then makes the same
tokens, its log-probs equal up to float rounding.

    python -m pytest tests/test_stalesync.py -k on_group
"""
from plumbing.stalesync_details import as_batch


def scheduler_class(base, on_group, chunk_s0=True):
    """`base` (stalesync.StaleSync or a subclass) that calls on_group(batch) once for each group as
    it completes and is kept (dynamic sampling judges it first): a Batch of that group alone, of
    version None. chunk_s0: S = 0 decodes in chunks too."""

    class StreamingSync(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if chunk_s0:
                self.max_steps = self.cfg.chunk_steps

        def _keep_completed(self, groups):
            kept = super()._keep_completed(groups)
            for g in kept:
                on_group(as_batch([g], None, {}, self._per_token([g])))
            return kept

    return StreamingSync
