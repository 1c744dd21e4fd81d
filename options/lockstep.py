"""Decoding in lock-step, for an expert-parallel engine (--infer-ep above 1).

    torchrun --standalone --nproc_per_node=2 train_grpo.py --train-ep 2 --infer-ep 2

An expert-parallel engine's MoE layers send each rank's tokens to the experts' owners and back
(all-to-alls), every layer, every forward. A rank that stopped calling forward would leave its peers
waiting for its experts, so every rank runs the same number of forwards. Each Sampler call agrees
once on its number of prefill forwards (one per length bucket: data-dependent), and its decode
agrees every `every` forwards whether any rank still has rows; meanwhile a rank with none runs
"dummy" forwards of zero rows of its own, which still compute its experts on its peers' tokens
(vLLM's data-parallel dummy batch, SGLang's idle batch). Each agreement is one all-reduce of one
integer: per decode chunk, never per token. A rank with nothing to decode calls Sampler.idle()
(its StaleSync does: scheduler_class).

    python -m pytest tests/test_model.py -k lock_step
"""
import torch
import torch.distributed as dist

import model as M


class LockStep:
    """The group's agreements and dummy forwards, counted for the run's figures."""

    def __init__(self, group, device, every=8):
        if every < 1:
            raise ValueError(f"every={every} must be >= 1 (decode forwards between agreements)")
        self.group, self.device, self.every = group, torch.device(device), every
        self.agreements = self.dummy_forwards = 0

    def most(self, n):
        """The largest n over the group: one all-reduce MAX."""
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self.agreements += 1
        return int(t.item())

    def dummy(self, model):
        """One forward of zero rows through every layer: its MoE layers join their all-to-alls."""
        model(torch.zeros(0, 1, dtype=torch.long, device=model.head.weight.device))
        self.dummy_forwards += 1

    def metrics(self):
        return {"lockstep/dummy_forwards": self.dummy_forwards,
                "lockstep/agreements": self.agreements}


def sampler_class(base, lockstep):
    """`base` (model.Sampler or a subclass) whose calls run as many forwards as the group's."""

    class LockStepSampler(base):
        def _before_prefill(self, contexts, call, n_done, new):
            """The group's most prefill forwards (this rank's: one per length bucket)."""
            mine = len(M._length_buckets([len(contexts[i]) for i in new])) if new else 0
            self._prefills = lockstep.most(mine) - mine
            self._forwards = 0  # this call's decode forwards so far
            super()._before_prefill(contexts, call, n_done, new)

        def _after_prefill(self):
            super()._after_prefill()
            for _ in range(self._prefills):  # the peers' extra prefill forwards, zero rows here
                lockstep.dummy(self.model)

        def _decode_forward(self, tok, pos, valid, cache, rows):
            self._agree(self._forwards, live=True)
            self._forwards += 1
            return super()._decode_forward(tok, pos, valid, cache, rows)

        def _after_decode(self, out, forwards, call, n_done):
            """This rank's rows are done: dummy forwards until the group agrees every rank's are."""
            while self._agree(forwards, live=False):
                lockstep.dummy(self.model)
                forwards += 1
            return super()._after_decode(out, forwards, call, n_done)

        def _agree(self, forward, live):
            """Before decode forward number `forward`, every `every`: does any rank still decode?"""
            if forward % lockstep.every:
                return True
            return bool(lockstep.most(int(live)))

    LockStepSampler.lockstep = lockstep
    return LockStepSampler


def scheduler_class(base):
    """`base` (stalesync.StaleSync or a subclass) whose decode() with no row in flight calls the
    sampler's idle(): this rank's forwards then join its peers' (LockStepSampler's)."""

    class LockStepSync(base):
        def decode(self):
            if self.in_flight():
                return super().decode()
            getattr(self.step_fn, "__self__", self.step_fn).idle()  # a bound method: its sampler
            return 0

    return LockStepSync


def rollout_classes(sampler, scheduler, run):
    """The run's sampler and scheduler classes in lock-step over its inference EP group: every
    rank runs the group's forwards, and a rank with no row in flight idles through them."""
    step = LockStep(run.experts.infer_groups[0], run.device, run.cfg.chunk_steps)
    return sampler_class(sampler, step), scheduler_class(scheduler)
