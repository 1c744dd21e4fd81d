"""--infer-tp t: the rollout engine tensor-parallel over groups of t adjacent ranks (t = 2 or 4).

    torchrun --standalone --nproc_per_node=2 train_grpo.py --infer-tp 2

A transform of the engine, applied where the run is built: attention keeps H/t heads (qkv cut by
head, the output projection by its input), every expert keeps F/t of its hidden width, and each
rank's partial sum is all-reduced over its TP group (inference only: a plain all_reduce, no
autograd); router, embedding, norms and head stay whole. The switch hands the engine full weights
through its load_weights, which cuts this rank's piece: actor_class(fusion.FusedActor) gathers each
bucket into a buffer of its own and hands it over (vLLM's interface: any engine, at any TP degree).
The replicas are the TP groups: each generates its own slice of the prompts, one rank of each
writes its samples into the queue. Training stays FSDP2 over every rank.

    python -m pytest tests/test_fusion.py tests/test_train_grpo.py -k "tp or tensor"
"""
import datetime
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import Attention, MoE, Policy

# How each weight is cut, by name suffix -> (dim, groups): `dim` is viewed as
# (groups, size / groups) and every group is cut into t contiguous pieces, piece r to TP rank r.
# qkv's rows are [q | k | v] x (H, hd), so groups=3 hands each rank H/t whole heads of q, k and v.
# Other weights are whole.
TP_PLAN = {"attn.qkv.weight": (0, 3), "attn.out.weight": (1, 1),            # (3D, D), (D, D)
           "moe.w_gate": (2, 1), "moe.w_up": (2, 1), "moe.w_down": (1, 1)}  # (E, D, F), (E, F, D)


@dataclass(frozen=True)
class TPLayout:
    """The rollout engine's layout over W ranks: rank grid arange(W).view(W // t, t), a TP group per
    row (t adjacent ranks: one replica), a DP group per column. (Training's is FSDP2's own.)"""
    world_size: int     # W
    tp: int = 1         # t, the tensor-parallel degree: 1, 2 or 4
    n_heads: int = 0    # attention heads, which t must divide (0: not checked)

    def __post_init__(self):
        errors = []
        if self.world_size < 1:
            errors.append("the world size must be >= 1")
        if self.tp not in (1, 2, 4):
            errors.append(f"TP degree {self.tp} must be 1, 2 or 4")
        elif self.world_size % self.tp:
            errors.append(f"TP degree {self.tp} does not divide the world size {self.world_size}")
        if self.n_heads and self.n_heads % self.tp:
            errors.append(f"TP degree {self.tp} does not divide n_heads {self.n_heads}")
        if errors:
            raise ValueError(f"bad layout (world size {self.world_size}, tp {self.tp}, n_heads "
                             f"{self.n_heads}): " + "; ".join(errors))

    def new_groups(self, timeout_s=300.0):
        """(TP group, DP group) of this rank (a row, a column of the grid; None: one rank); every
        rank makes every group."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.world_size:
            raise ValueError(f"layout world size {self.world_size} != process group size {world}")
        grid, mine = torch.arange(world).view(world // self.tp, self.tp), [None, None]  # (W/t, t)
        for kind, groups in enumerate((grid, grid.T)):  # the TP groups, then the DP groups
            for ranks in groups.tolist():
                if len(ranks) > 1:  # a group of one rank is None
                    group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
                    mine[kind] = group if dist.get_rank() in ranks else mine[kind]
        return tuple(mine)


class TPAttention(Attention):
    """This rank's H/t heads; its output projection's partial sum all-reduced over the group."""

    def __init__(self, cfg, group):
        super().__init__(cfg, n_heads=cfg.n_heads // dist.get_world_size(group))
        self.group = group

    def forward(self, x, cos, sin, mask=None, cache=None):
        y = super().forward(x, cos, sin, mask, cache)                              # (B, T, D)
        dist.all_reduce(y, group=self.group)
        return y


class TPMoE(MoE):
    """Every expert's F/t hidden units here; the partial sum all-reduced over the group."""

    def __init__(self, cfg, group):
        super().__init__(cfg, d_expert=cfg.d_expert // dist.get_world_size(group))
        self.group = group

    def forward(self, x):
        out = super().forward(x)                                                   # (..., D)
        dist.all_reduce(out, group=self.group)
        return out


def apply(policy, group):
    """Make `policy` (an inference engine) tensor-parallel over `group` (None or a group of one:
    left whole). Its cut layers start uninitialised: the switch fills them. Returns it."""
    t = 1 if group is None else dist.get_world_size(group)
    cfg = policy.cfg
    if cfg.n_heads % t or cfg.d_expert % t:
        raise ValueError(f"TP degree {t} must divide n_heads={cfg.n_heads} "
                         f"and d_expert={cfg.d_expert}")
    if t == 1:
        return policy
    device, frozen = policy.head.weight.device, not policy.head.weight.requires_grad
    for block in policy.blocks:
        block.attn, block.moe = TPAttention(cfg, group).to(device), TPMoE(cfg, group).to(device)
    policy.train(policy.training).requires_grad_(not frozen)  # the new layers as the rest
    policy.tp_group = group
    policy.load_weights = types.MethodType(load_weights, policy)
    return policy


@torch.no_grad()
def load_weights(policy, weights):
    """vLLM-style loader: each weight full, or already this rank's TP piece; a full weight that is
    cut is cut here, per TP_PLAN. Returns the names loaded."""
    params, loaded = dict(policy.named_parameters()), set()
    rank, t = dist.get_rank(policy.tp_group), dist.get_world_size(policy.tp_group)
    for name, w in weights:
        p = params[name]
        split = next((s for suffix, s in TP_PLAN.items() if name.endswith(suffix)), None)
        if w.shape != p.shape and split is not None:  # a full weight: dim as (groups, n), cut n
            dim, groups = split
            p, w = p.unflatten(dim, (groups, -1)), w.unflatten(dim, (groups, -1))
            w = w.narrow(dim + 1, rank * p.shape[dim + 1], p.shape[dim + 1])
        if w.shape != p.shape:
            raise ValueError(f"{name}: got shape {tuple(w.shape)}, expected {tuple(p.shape)} "
                             f"(or the full weight) on TP rank {rank} of {t}")
        p.copy_(w)
        loaded.add(name)
    return loaded


# ------------------------------------------------------- the switch's side: buckets to load_weights
def actor_class(base):
    """`base` (fusion.FusedActor or a subclass) for an engine whose parameters are not the model's
    (cut by TP, fused, renamed): each bucket of full weights is gathered into a flat buffer (B bytes
    at most) and handed to engine.load_weights(iterable of (name, full tensor)), vLLM's interface.
    The tensors live for the call only; it cuts its TP piece, fuses, renames, copies, and returns
    the names of its parameters it loaded (None: the model's names). Unchecked: a load_weights that
    claims a weight it never wrote (names are checked, not bytes)."""

    class LoadWeights(base):
        fills = "load_weights"  # its path: "load_weights, <transport>"

        def _check_engine(self, weights):
            """Nothing before a switch: load_weights checks each weight it is handed, and _fill
            that it loaded every one."""

        def _fill(self, params, eng):
            """Every bucket into a flat buffer handed to load_weights, whose error is held while
            this rank gathers on with its peers. Returns the bytes received from other ranks, and
            the most held beyond the engine's weights: the largest bucket."""
            received, extra, loaded, error = 0, 0, set(), None
            for bucket in self.buckets:
                flat, outs = bucket_views(bucket, self.device)  # (numels summed,), full views
                received += self.transport.fill(params, outs, self.layout, self.group)
                if error is None:  # after an error this rank only gathers, for its peers
                    extra = max(extra, flat.nbytes)
                    error = load_bucket(self.engine, outs, loaded)  # None, or its error, held
                flat = outs = None  # free the bucket before the next one
            if error is None:  # an engine weight re-allocated and never filled is an error too
                error = unloaded(eng, loaded)
            if error is not None:
                raise error
            return received, extra
    return LoadWeights


def bucket_views(bucket, device):
    """One flat buffer for a bucket and, per weight, its full view (rows, ...) into it."""
    sizes = [torch.Size(w[1]).numel() for w in bucket]
    flat = torch.empty(sum(sizes), dtype=bucket[0][2], device=device)    # (numels summed,)
    return flat, [(w[0], v.view(w[1])) for w, v in zip(bucket, flat.split(sizes))]


def load_bucket(engine, outs, loaded):
    """engine.load_weights on a bucket outs; adds the names it loaded to loaded. Returns its
    error instead of raising it, or None."""
    try:
        names = engine.load_weights(outs)  # None: the model's names
        loaded |= set(names if names is not None else (n for n, _ in outs))
    except Exception as e:  # noqa: BLE001 - held: the peers need this rank's gathers
        return e
    return None


def unloaded(eng, loaded):
    """The error where the engine's weights eng are not all in loaded (re-allocated and never
    filled: load_weights skipped them), else None."""
    missing = sorted(set(eng) - loaded)
    if missing:
        return ValueError(f"the engine's weights {missing[:8]} were not loaded: its "
                          "load_weights must load every one (or a mover name it) and return "
                          "the engine parameter names it loaded")
    return None


def engine(cfg, group):
    """A tensor-parallel engine over `group`: the Policy, cut."""
    return apply(Policy(cfg), group)


def apply_to_run(run):
    """--infer-tp: the run's engine cut over this rank's TP group (every rank makes every group),
    and the switch that fills it through its load_weights."""
    cfg = run.cfg
    layout = TPLayout(run.roles.world, cfg.infer_tp, n_heads=cfg.n_heads)
    group = layout.new_groups(cfg.pg_timeout_s)[0]
    apply(run.engine, group)
    run.actor_class = actor_class(run.actor_class)  # the switch hands it full weights
