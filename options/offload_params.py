# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""offload_params: fusion.py's switch with the training shards in host memory too during ROLLOUT.

The default switch keeps each rank's FSDP2 shards on the device in ROLLOUT: 1/W of the model,
beside the engine's whole model. ShardsOffloaded, a FusedActor, copies them to host once the engine
is built from them (the gather has read them) and frees their device storages in place, as the
grads and Adam states are. to_train() brings them back after the engine's weights are freed, first
among the train state: the switch is never above its start or its end. In ROLLOUT the model's
forward raises, naming the phase, where it would read a freed shard. A transport that keeps the
shards in place (SharedMemory: a shared storage cannot be freed) is refused as the actor is built.

    actor = ShardsOffloaded(model, optimizer, engine)  # FusedActor's arguments

    python -m pytest tests/test_fusion.py -k "offload or distributed"   (W 4: -m slow)
"""
from fusion import TRAIN, Broadcasts, FusedActor, offload, reload, storages


class ShardsOffloaded(FusedActor):
    """FusedActor whose training shards (the parameters it builds the engine from) go to host memory
    in ROLLOUT."""

    def __init__(self, model, optimizer, engine, transport=None, **kwargs):
        transport = transport if transport is not None else Broadcasts()
        if transport.keeps_shards:  # checked before any collective
            raise ValueError("offload_params=True frees the shards, which "
                             f"{type(transport).__name__} keeps in place: use FusedActor "
                             "(offload_params=False) or the Broadcasts transport")
        self._param_off, self._param_hosts = [], []  # the shards' storages, their host copies
        super().__init__(model, optimizer, engine, transport=transport, **kwargs)

    def _gathered(self, params):
        """The training shards to host memory, once the gather has read them (all or nothing)."""
        off = storages([p for n, p in params.items() if n not in self.skip], self.device)
        self._param_hosts, self._param_off = offload(off, self._param_hosts), off

    def _reload(self):
        reload(self._param_off, self._param_hosts)  # the shards first, then the train state
        self._param_off = []
        super()._reload()

    def _guard(self):
        def forward(module, args):
            why = "its shards are in host memory (offload_params)"
            self._expect(TRAIN, "the model was called", why)
        return super()._guard() + [self.model.register_forward_pre_hook(forward, prepend=True)]
