"""--eplb 1: expert load balancing, carried through the switch to rollout.

    torchrun --standalone --nproc_per_node=4 train_grpo.py --train-ep 2 --infer-ep 4 --eplb 1
    python bench/eplb.py        # balancedness, the busiest rank's rows, decode time, bytes moved

Under expert parallelism a rank's work is the token rows its experts are sent. A router that
favours a few experts makes the rank that holds them the step's straggler: the others wait for it
at the all-to-all. Balancing places the experts by their measured load instead of in blocks:
  1. Measure: each MoE layer sums the rows each slot is sent (CountingEPMoE.load), in rollout and
     in training. At the end of the switch back to training, every rank all-reduces the rollout's
     counts: every rank holds the same loads (integers: exact). The log gets moe/* for both
     phases; only the rollout's loads place the experts.
  2. Replicate: the inference layout may hold up to `redundant` extra slots (one a rank by
     default), the fewest whose predicted balancedness reaches 0.95 (none where packing alone
     does). Each goes to the expert with the most load per copy. A copy takes an equal share of
     its expert's rows.
  3. Pack: the experts, most copies first, then the heaviest, each copy onto the lightest EP rank
     with room that does not hold it yet: every rank holds as many experts, all distinct.
  4. Switch: at each switch to rollout, each layer's placement from its loads (each rollout's,
     the evaluation's included, added to half the older ones); moe_switch.py moves exactly what
     each rank lacks for it, a bucket at a time, and the switch back restores the training layout
     bit for bit. The first rollout (the warm-up's evaluation) has no loads: it keeps the blocks.
The placement is a function of loads that every rank holds alike, so every rank computes the same
one (and the switch's agreement compares its digest). It may change at every switch: each switch
starts from the training layout, so a placement's cost does not depend on the one before.

Memory rule: with R redundant slots at inference EP P, a rank holds up to R / P more experts per
layer in rollout than the blocks would (E / P + R / P); the switch's peak grows by them. No rank
holds two copies of one expert, so an expert has at most P copies.
Placement changes where an expert runs: every token still meets its k experts with their weights,
and the outputs match the blocks' up to float rounding (about 5e-7, as EP's own).
Built into moe_switch.py's classes by subclassing: PlacedLayout (an EPLayout whose rows are a
placement), CountingEPMoE (an EPMoE that counts), BalancedExperts (an ExpertParallel whose rollout
layouts are placed by load; train_grpo.build_policy builds it under --eplb 1).

    python -m pytest tests/test_eplb.py
"""
import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import moe_switch



# ---------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class PlacedLayout(moe_switch.EPLayout):
    """An EPLayout whose row p holds placement[p]: any L experts in increasing order, an expert
    held by several rows copied, each copy taking its share of the expert's rows (slot_of). A
    placement with copies is for inference: no grad sums over the copies. It need not nest with
    the training layout: the switch then holds up to max(source, target) + one bucket
    (plan_reshard's memory bound), not target + one bucket."""
    placement: tuple = ()  # each row's experts, increasing

    def __post_init__(self):
        super().__post_init__()  # P divides E and W; ranks distinct, in order
        check_placement(self)

    @property
    def slots(self):
        """The experts each rank holds: E / P, and more with copies."""
        return len(self.placement[0])

    def owned(self, rank):
        """The global expert ids that `rank` holds, in slot order: its row of the placement."""
        return self.placement[rank // self.dp]

    def slot_of(self, experts, rank=0):
        """(n,) expert ids -> (n,) slots, p * L + j for row p's j-th expert. The i-th token row
        (in order) of an expert with c copies goes to copy (i + rank) mod c: each copy gets its
        share of the expert's rows, to within one on each rank, and the ranks start at different
        copies."""
        E = self.n_experts
        table, n_copies = copies_of(self, experts.device)                     # (E, P), (E,)
        if self.slots * self.ep == E:  # no copies: each expert's one slot
            return table[experts, 0]
        order = experts.argsort(stable=True)                                   # (n,) by expert
        counts = torch.bincount(experts, minlength=E)                          # (E,)
        first = counts.cumsum(0) - counts                                      # (E,) of each
        nth = torch.empty_like(experts)                                        # (n,) i: its rank
        nth[order] = torch.arange(len(experts), device=experts.device) - first[experts[order]]
        return table[experts, (nth + rank) % n_copies[experts]]


def check_placement(layout):
    """PlacedLayout's checks: P rows of L expert ids each, increasing (so distinct), and every
    expert held."""
    rows, E = layout.placement, layout.n_experts
    lengths = {len(r) for r in rows}
    held = {e for r in rows for e in r}
    bad = (not isinstance(rows, tuple) or not all(isinstance(r, tuple) for r in rows)
           or len(rows) != layout.ep or len(lengths) != 1 or held != set(range(E))
           or any(list(r) != sorted(set(r)) for r in rows)
           or any(not isinstance(e, int) for r in rows for e in r))
    if bad:
        raise ValueError(f"placement {rows} must be a tuple of P = {layout.ep} tuples of the same "
                         f"length, each of int expert ids in increasing order, holding all of "
                         f"0 .. {E - 1}")


@functools.lru_cache(maxsize=256)
def copies_of(layout, device):
    """A placement's slots of each expert, (E, P) padded with its first, and their counts (E,)."""
    L, P = layout.slots, layout.ep
    copies = [[p * L + j for p in range(P) for j, x in enumerate(layout.placement[p]) if x == e]
              for e in range(layout.n_experts)]
    return (torch.tensor([c + c[:1] * (P - len(c)) for c in copies], device=device),
            torch.tensor([len(c) for c in copies], device=device))


# ---------------------------------------------------------------------------- the placement
def balancedness(rows):
    """The mean over the max of the rows each EP rank gets: 1 even, 1 / P one rank doing all."""
    rows = np.asarray(rows, dtype=np.float64)
    return float(rows.mean() / rows.max()) if rows.max() > 0 else 1.0


def replicate(load, ep, slots):
    """How many copies of each expert fill ep * slots slots: one each, then each extra slot to the
    expert with the most load per copy (at most ep copies: one a row)."""
    load = np.asarray(load, dtype=np.float64)
    if not len(load) <= ep * slots <= len(load) * ep:
        raise ValueError(f"{ep} rows of {slots} slots cannot hold each of {len(load)} experts "
                         "at least once and at most once a row")
    copies = np.ones(len(load), dtype=np.int64)                                        # (E,)
    for _ in range(ep * slots - len(load)):
        per_copy = np.where(copies < ep, load / copies, -np.inf)                         # (E,)
        copies[int(np.argmax(per_copy))] += 1  # on a tie, the lowest id
    return copies


def placement_by_load(load, ep, slots):
    """(E,) loads -> a placement: ep rows of `slots` distinct experts each, every expert held. The
    experts with the most copies first, then by load per copy, each copy onto the lightest rows with
    room (the greedy packing of the heaviest item onto the lightest bin). Where the lightest would
    leave too few rows with room for a later expert's copies, the roomiest instead: filling the
    roomiest first, copies in decreasing number, always finishes."""
    load = np.asarray(load, dtype=np.float64)
    copies = replicate(load, ep, slots)
    rows, weight = [[] for _ in range(ep)], np.zeros(ep)
    order = sorted(range(len(load)), key=lambda e: (-copies[e], -load[e] / copies[e], e))
    for i, e in enumerate(order):
        room = [p for p in range(ep) if len(rows[p]) < slots]
        chosen = sorted(room, key=lambda p: (weight[p], p))[:copies[e]]
        later = max((copies[x] for x in order[i + 1:]), default=0)
        if sum(len(rows[p]) + (p in chosen) < slots for p in range(ep)) < later:
            chosen = sorted(room, key=lambda p: (len(rows[p]), weight[p], p))[:copies[e]]
        for p in chosen:
            rows[p].append(e)
            weight[p] += load[e] / copies[e]
    return tuple(tuple(sorted(r)) for r in rows)


def predicted(load, rows):
    """A placement's balancedness under `load`, each copy taking an equal share of its expert's."""
    copies = np.bincount([e for r in rows for e in r], minlength=len(load))
    return balancedness([sum(load[e] / copies[e] for e in r) for r in rows])


def fewest_copies(load, ep, slots, redundant, target):
    """The placement with the fewest extra slots (0, ep, 2 ep, ... up to `redundant`) whose
    predicted balancedness reaches `target`, else the one with the most: a copy costs memory and,
    where experts are cheap, an expert call per layer and step."""
    for extra in range(0, redundant + 1, ep):
        rows = placement_by_load(load, ep, slots + extra // ep)
        if predicted(load, rows) >= target:
            break
    return rows


# ---------------------------------------------------------------------------- the measure
def rows_per_rank(load, layout):
    """A layer's (P * L,) rows per slot -> (P,) rows per EP rank."""
    return load.view(layout.ep, layout.slots).sum(1).tolist()


def per_expert(load, layout):
    """A layer's (P * L,) rows per slot -> (E,) rows per expert, its copies summed."""
    experts = [e for p in range(layout.ep) for e in layout.owned(p * layout.dp)]  # slot order
    return np.bincount(experts, weights=load.tolist(), minlength=layout.n_experts)


class CountingEPMoE(moe_switch.EPMoE):
    """An EP layer that sums the rows each slot is sent into `load`, a (P * L,) tensor, while it
    is one (_start_counting); none on the EP 1 path that runs every expert."""
    load = None  # None: not counting

    def _rows_per_slot(self, slots):
        counts = super()._rows_per_slot(slots)                                       # (P * L,)
        if self.load is not None:
            self.load += counts
        return counts


class BalancedExperts(moe_switch.ExpertParallel):
    """ExpertParallel whose layers count their rows (CountingEPMoE) and whose rollout layouts are
    balancer.place(self)'s; at the end of each switch back, balancer.rollout_done(self) reads the
    rollout's loads. `balancer` may be swapped between switches (bench/eplb.py's modes)."""
    layer = CountingEPMoE

    def __init__(self, *args, balancer, **kwargs):
        super().__init__(*args, **kwargs)
        self.balancer = balancer  # its loads are saved with a checkpoint

    def _rollout_layouts(self):
        return self.balancer.place(self)

    @torch.no_grad()
    def to_train(self):
        super().to_train()
        self.balancer.rollout_done(self)


class Balancer:
    """BalancedExperts.balancer: place(ep) at each switch to rollout, rollout_done(ep) at the end
    of each switch back. Figures in ep.stats (so in the step's record, as the switch's):
      moe/{rollout,train}_balancedness  mean over layers of balancedness, under the layout used
      moe/{rollout,train}_busiest_share the busiest rank's rows over all rows, mean over layers
      moe/{rollout,train}_busiest_rows  the busiest rank's rows, summed over layers
      moe/{rollout,train}_expert_rows   rows per expert, summed over layers
    Rollout's are the last rollout's (the evaluation's too: it is a rollout). Training's are counted
    from one switch back to the next switch to rollout: a step's record holds the step before's.
    Only rollout loads place the experts. by_load=False measures only: the rollout keeps the
    blocks (a baseline)."""

    def __init__(self, redundant, target=0.95, decay=0.5, by_load=True):
        self.redundant, self.target, self.decay, self.by_load = redundant, target, decay, by_load
        self.loads = None  # per layer, (E,) rows per expert, decayed: what the placement packs

    def place(self, ep):
        """Each layer's rollout layout: the blocks until a rollout was measured, then by load."""
        self._measure(ep, ep.model_layers, "train")  # the training since the last switch back
        base = ep.infer_layout
        layouts = [base] * len(ep.model_layers)
        if self.by_load and self.loads is not None and base.ep > 1:
            placements = [fewest_copies(load, base.ep, base.slots, self.redundant, self.target)
                          for load in self.loads]
            layouts = [PlacedLayout(base.ep, base.world_size, base.n_experts, base.ranks, p)
                       for p in placements]
        for layer, layout in zip(ep.engine_layers, layouts):
            _start_counting(layer, layout)
        return layouts

    def rollout_done(self, ep):
        """The rollout's loads, summed over every rank: the figures, and the next placement's.
        The model's layers are back in the training layout: they count from here."""
        new = self._measure(ep, ep.engine_layers, "rollout")
        if new is not None:
            old = self.loads if self.loads is not None else [0.0] * len(new)
            self.loads = [self.decay * o + n for o, n in zip(old, new)]
        for layer in ep.model_layers:
            _start_counting(layer, ep.train_layout)

    def state_dict(self):
        return {"loads": None if self.loads is None else [x.tolist() for x in self.loads]}

    def load_state_dict(self, sd):
        self.loads = None if sd["loads"] is None else [np.array(x) for x in sd["loads"]]

    def _measure(self, ep, layers, phase):
        """Every layer's counts since _start_counting, all-reduced over the layout's ranks; the
        counting stops. None where nothing was counted (the same on every rank)."""
        counted = [m for m in layers if m.load is not None]
        if not counted or len(counted) != len(layers):
            return None
        loads = torch.cat([m.load for m in counted])
        try:
            dist.all_reduce(loads, group=ep.group)  # the same loads on every rank
        except RuntimeError as err:  # gloo and nccl report a timeout as a RuntimeError
            raise RuntimeError(f"--eplb 1: the {phase} loads' all-reduce failed; every rank of "
                               f"the layout must switch together, each with a balancer ({err})"
                               ) from err
        for m in counted:
            m.load = None
        if not loads.sum():
            return None
        loads = loads.cpu().split([m.layout.ep * m.layout.slots for m in counted])
        ranks = [rows_per_rank(c, m.layout) for c, m in zip(loads, counted)]
        experts = [per_expert(c, m.layout) for c, m in zip(loads, counted)]
        ep.stats.update({
            f"moe/{phase}_balancedness": float(np.mean([balancedness(r) for r in ranks])),
            f"moe/{phase}_busiest_share": float(np.mean([max(r) / max(sum(r), 1)
                                                          for r in ranks])),
            f"moe/{phase}_busiest_rows": int(sum(max(r) for r in ranks)),
            f"moe/{phase}_expert_rows": [int(x) for x in np.sum(experts, axis=0)]})
        return experts


def _start_counting(layer, layout):
    layer.load = torch.zeros(layout.ep * layout.slots, dtype=torch.long,
                             device=layer.router.weight.device)                     # (P * L,)


# ---------------------------------------------------------------------------- the run
def errors(cfg, world):
    """--eplb's checks, before any process group."""
    if not cfg.eplb:
        if cfg.eplb_redundant is not None:
            return [f"--eplb-redundant {cfg.eplb_redundant} sizes --eplb 1's copies: it needs "
                    "--eplb 1"]
        return []
    P, E = cfg.infer_ep, cfg.n_experts
    if not cfg.train_ep or P < 2:
        return [f"--eplb 1 places the experts over the inference EP ranks: it needs --train-ep > 0 "
                f"and --infer-ep >= 2 (got --train-ep {cfg.train_ep}, --infer-ep {P})"]
    R = redundant(cfg)
    if R < 0 or R % P or E // P + R // P > E:
        return [f"--eplb-redundant {R} must be a multiple of --infer-ep {P}, from 0 to "
                f"{E * (P - 1)} (a rank holds each of the {E} experts at most once)"]
    return []


def redundant(cfg):
    return cfg.infer_ep if cfg.eplb_redundant is None else cfg.eplb_redundant


def balanced_experts(cfg):
    """The run's ExpertParallel class (train_grpo.build_policy calls it with its arguments): its
    layers measure their loads, and each switch to rollout places the experts by them."""
    return functools.partial(BalancedExperts, balancer=Balancer(redundant(cfg)))
