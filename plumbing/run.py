"""The run object every loop reads, and what every deployment starts the same way.

`start` joins the process group (torchrun's, or a world of one), resolves the flags that say auto,
names the output folder and this start (rank 0's names, broadcast), finds the checkpoint to resume
(checked on every rank before anything is written), and makes the store, the prompts and the
curriculum. train_grpo.build (or a deployment's own build in options/) then adds the queue, the
policy, the engine, the scheduler and the phase switch.
"""
import datetime
import os
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import curriculum
import distqueue
import fusion
import grpo
import moe_switch
import stalesync
import task
from model import Policy, Sampler
from plumbing import checkpoint
from plumbing.config import Config, Roles, grpo_config, model_config, resolve
from plumbing.distributed import keep_freed_memory, setup_distributed
from plumbing.runlog import RunLog
from plumbing.timeline import Spans


@dataclass
class Run:
    """Everything the loop uses, built once. A field a rank does not need is None."""
    cfg: Config
    rank: int
    roles: Roles
    device: torch.device
    out_dir: str
    key: str                      # this start's store-key prefix (a restarted job reuses the store)
    resume_from: tuple            # (folder, meta) of the checkpoint resumed from, or None
    spans: Spans                  # every timed phase of this rank
    store: object                 # the process group's store: the queue's control plane
    eval_prompts: list            # the held-out set, never trained on
    warm_stream: task.PromptStream
    rl_prompts: task.SlotPrompts  # the RL prompt of a global batch slot and attempt
    curriculum: curriculum.Curriculum  # per prompt length: the RL prompts' weights
    algo: grpo.GRPOConfig         # the algorithm's settings
    queue: distqueue.DistQueue = None  # rollout -> training, packed
    log: RunLog = None
    train_group: object = None    # the trainers (FSDP2's ranks)
    rollout_group: object = None  # the generators
    data_index: int = 0           # this trainer's slice of a global batch, of data_size
    data_size: int = 1
    model: torch.nn.Module = None  # the trained policy
    optimizer: torch.optim.Optimizer = None
    clip_grads: object = None     # the update's clip (EP: the experts' own; None: clip_grad_norm_)
    experts: moe_switch.ExpertParallel = None  # EP on: the experts' two layouts and their re-shard
    reference: fusion.HostOffloaded = None  # the frozen initial policy
    engine: Policy = None         # the rollout engine
    sampler: Sampler = None       # the engine's sampler; keeps its KV cache between decode chunks
    sched: stalesync.StaleSync = None
    actor: fusion.FusedActor = None  # the phase switch
    cut: object = None            # how the replicas cut each batch: SharedCut (AllReady: apart)
    batch_ids: set = None         # the batch's row ids, where a deployment reads them by name
    score: object = task.rewards  # (prompts, responses) -> (B,) rewards (options: a model's)
    watch: object = dict          # () -> figures, at each evaluation (a learned scorer's checks)
    per_token: dict = field(default_factory=dict)  # the sampler's per-token fields: queue dtypes
    around: object = None         # grpo's context around each forward (Samples.around)
    step0: dict = field(default_factory=dict)  # figures an option adds to step 0's record
    grad_sync: object = None      # --nodes (options/nodes.py): the gradients' average across nodes
    actor_class: type = fusion.FusedActor  # the switch's class (--infer-tp, --nodes: a subclass)
    reward_model: fusion.HostOffloaded = None  # --reward-model (options/learned_reward.py)

    # a deployment whose loop keeps state of its own saves it with the rank's (options/hybrid.py)
    def own_state(self):
        return {}

    def load_own_state(self, state):
        pass

    def saved_models(self):
        """Which frozen models this run's checkpoint holds (on some rank)."""
        return {"reference": self.reference is not None,
                "reward_model": self.reward_model is not None}


def start(cfg, out_dir=None, roles=None, cls=Run):
    """A `cls` (Run, or a deployment's subclass) with what every deployment has (see above)."""
    rank, world, device = setup_distributed(cfg)
    cfg = resolve(cfg, world)  # --train-ep auto: EP on where the layout allows it
    if device.type == "cpu":  # what a phase frees stays with the process for the next, as on CUDA
        keep_freed_memory()
    default = cfg.out or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    names = [out_dir or default, uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(names, src=0)
    out_dir, key = names[0], f"{names[0]}:{names[1]}"
    resume_from = checkpoint.find(cfg, out_dir)
    os.makedirs(out_dir, exist_ok=True)
    learned = curriculum.Curriculum(cfg.max_digits)
    eval_prompts, warm_stream, rl_prompts = task.prompt_streams(  # --curriculum: weighted by length
        cfg.seed, cfg.max_digits, cfg.eval_prompts, learned.draw if cfg.curriculum else None)
    run = cls(cfg, rank, roles or Roles.of(cfg, world), device, out_dir, key, resume_from,
              Spans(device=device), distqueue.default_store(), eval_prompts, warm_stream,
              rl_prompts, learned, grpo_config(cfg))
    if cfg.routing_replay:  # each token's experts, (L K,), through the queue (routing_replay.py)
        run.per_token["routes"] = "int32"
    return run


def planned(cfg):
    """--layout auto: the Config with the planner's layout for this world (every rank measures,
    rank 0 prints the table; options/layout_auto.py); else cfg as it is."""
    if cfg.layout != "auto":
        return cfg
    from options import layout_auto
    rank, _, device = setup_distributed(cfg)
    return layout_auto.choose(cfg, device, rank)


def say_layout(run):
    """Rank 0 prints, once at start, how the phases switch and how the experts are laid out."""
    cfg = run.cfg
    if run.rank != 0:
        return
    experts = f"EP {cfg.train_ep} -> {cfg.infer_ep}" if cfg.train_ep else "in FSDP2 (EP off)"
    placed = ", placed by load (--eplb 1)" if cfg.eplb else ""
    print(f"switch: {run.actor.path} | experts: {experts}{placed}", flush=True)


def warm_up_target(run):
    """What the supervised warm-up trains, and its clip (None: clip_grad_norm_): the policy, or
    under EP its dense twin, built as the run builds it with EP off (the same seed, the same
    initial weights, FSDP2 over every weight and trainer), to be loaded into the policy after."""
    if run.experts is None:
        return run.model, run.clip_grads
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(run.cfg.seed)
    twin = Policy(model_config(run.cfg)).to(run.device)
    if run.roles.experts_over is None:  # every rank trains
        mesh = torch.distributed.device_mesh.init_device_mesh(run.device.type, (run.roles.world,))
    else:  # the trainers are part of the job (the hybrid's actor)
        mesh = torch.distributed.device_mesh.DeviceMesh.from_group(run.train_group, run.device.type)
    fully_shard(twin, mesh=mesh, reshard_after_forward=False)
    return twin, None


def optimizer_groups(model):
    """The parameters in two groups, FSDP2 shards (DTensors) and plain tensors (the EP experts):
    a multi-tensor (foreach) optimizer step, CUDA's default, refuses to mix the two kinds."""
    params = list(model.parameters())
    shards = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": g} for g in (shards, plain) if g]
