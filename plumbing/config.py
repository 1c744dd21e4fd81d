"""The run's configuration: every flag of train_grpo.py, grouped, with its help, and the checks that
refuse a bad value before any process group exists, naming the value and what is valid.

    python train_grpo.py --help
    python -c "from plumbing import config; print(config.Config())"

`resolve` turns the flags that say `auto` into numbers for the world at hand; `validate` checks a
Config against the world size (every error at once; an option's own checks live in its file, asked
only when the option is on); `Roles` says which ranks train and which generate.
"""
import argparse
import dataclasses
import math
from dataclasses import dataclass, field

import torch

import grpo
import moe_switch
import stalesync
import task
from model import ModelConfig, Policy
from plumbing.distributed import device_errors


def flag(default, help_):
    return field(default=default, metadata={"help": help_})


@dataclass
class Config:
    # task
    max_digits: int = flag(32, "longest digit string to reverse "
                               "(answers: up to max_digits + 1 tokens)")
    eval_prompts: int = flag(512, "held-out prompts, scored greedily")
    # model
    d_model: int = flag(64, "model width")
    n_layers: int = flag(2, "transformer blocks")
    n_heads: int = flag(4, "attention heads")
    n_experts: int = flag(4, "experts per MoE layer")
    top_k: int = flag(2, "experts chosen per token")
    d_expert: int = flag(128, "hidden width of one expert")
    # supervised warm-up
    warmup_steps: int = flag(500, "supervised steps before RL (0 to skip)")
    warmup_batch: int = flag(64, "global (prompt, answer) pairs per warm-up step")
    warmup_lr: float = flag(5e-3, "warm-up learning rate")
    # GRPO
    steps: int = flag(2000, "RL steps, at most (--rl-seconds stops the default run first)")
    prompts_per_step: int = flag(16, "global prompts per step")
    group_size: int = flag(8, "responses per prompt (>= 2)")
    lr: float = flag(7e-4, "RL learning rate at the start (--lr-decay anneals it)")
    lr_decay: float = flag(0.1, "the RL learning rate falls along a cosine from --lr "
                                "to --lr-decay x --lr at the run's end (--steps or "
                                "--rl-seconds, whichever binds first); 1: constant")
    adv_estimator: str = flag("grpo", "advantages: grpo (group-normalised), dr-grpo (no "
                                      "std scaling), rloo (leave-one-out baseline), "
                                      "reinforce++ (whole-batch baseline, normalised)")
    loss_agg: str = flag("auto", "token-mean, seq-mean-token-mean or seq-mean-token-sum-norm "
                                 "(over the response budget: Dr. GRPO's); auto: "
                                 "seq-mean-token-sum-norm for dr-grpo, else token-mean")
    clip_eps: float = flag(0.2, "PPO clip range: the ratio clipped to "
                                "[1 - clip_eps, 1 + clip_eps_high]")
    clip_eps_high: float = flag(None, "upper clip (DAPO's clip-higher); default: --clip-eps")
    kl_coef: float = flag(0.1, "k3 KL penalty weight against the frozen warm-up policy "
                               "(0: no reference model); it keeps the policy's entropy "
                               "up, so that groups keep disagreeing and few are dropped")
    filter_groups: bool = flag(True, "1: dynamic sampling, drop groups whose rewards "
                                     "are all equal and generate more, so every step "
                                     "trains on prompts_per_step informative groups")
    filter_limit: int = flag(128, "dynamic sampling's brake: the run stops once a "
                                  "replica has dropped more than this many groups "
                                  "per prompt of its share while making one batch "
                                  "(a policy that solves, or fails, everything)")
    curriculum: bool = flag(True, "1: draw the RL prompts' lengths where groups are "
                                  "informative (pass rates per length, learned from every "
                                  "scored group: curriculum.py); 0: the task's own draw")
    mask_truncated: bool = flag(False, "1: responses cut by the token budget contribute no loss")
    tis_cap: float = flag(None, "truncated importance sampling: weight each token by "
                                "min(pi_train / pi_rollout, C), pi_train recomputed "
                                "before the update (the decoupled objective, capped)")
    routing_replay: bool = flag(False, "1: each response token's MoE layers use, in training, "
                                       "the experts the rollout chose for it (recorded as it "
                                       "was generated, gated by the trained router): Rollout "
                                       "Routing Replay (options/routing_replay.py); "
                                       "moe/routing_mismatch is logged")
    reward_model: bool = flag(False, "1: a learned outcome reward model scores the responses "
                                     "instead of the rule (options/learned_reward.py): trained "
                                     "after the warm-up on the policy's own samples labelled "
                                     "by the rule, the right answers and near misses, then "
                                     "frozen; the rule is still logged (reward/rule_mean)")
    rm_samples: int = flag(2048, "--reward-model: the policy's samples it is trained on (with "
                                 "the right answer beside each wrong one and a near miss of "
                                 "each: at most 3 rule labels a sample)")
    rm_steps: int = flag(500, "--reward-model: its training steps (batches of 64)")
    rm_check: int = flag(256, "--reward-model: the fresh samples per length bucket (a quarter of "
                              "--max-digits) that its fit is checked on")
    rm_watch_below: float = flag(0.9, "--reward-model: at each evaluation, a warning when the "
                                      "model agrees with the rule on less than this share of "
                                      "the policy's sampled answers to held-out prompts (0: "
                                      "never)")
    updates_per_batch: int = flag(1, "optimizer steps per rollout batch")
    micro_batches: int = flag(4, "length-sorted chunks per mini-batch (less padding; "
                                 "hybrid: in put order; --train-pp: equal slices of one "
                                 "shape), gradients accumulated")
    grad_clip: float = flag(1.0, "gradient norm clip")
    # staleness (stalesync.py)
    staleness: int = flag(1, "S: most policy versions a trained sample may lag (0: synchronous)")
    threshold: float = flag(0.5, "in (0, 1]: a replica decodes at once its share of "
                                 "prompts_per_step / threshold groups; a round ends once the "
                                 "batch can be cut (its due groups and enough others complete)")
    chunk_steps: int = flag(8, "decode steps between checks for a finished batch (S > 0)")
    shared_cut: bool = flag(True, "colocated: 1, the replicas cut each batch from all "
                                  "their pools (a replica held back by dropped groups "
                                  "gives fewer); 0, each its own share once all are ready")
    decoupled: bool = flag(False, "1: decoupled objective (AReaL), clip around recomputed proximal "
                                  "log-probs")
    # rollout
    temperature: float = flag(1.0, "sampling temperature (> 0)")
    top_p: float = flag(1.0, "nucleus mass, in (0, 1]")
    max_new_tokens: int = flag(40, "response budget in tokens")
    # deployment (fusion.py, moe_switch.py, options/)
    deploy: str = flag("colocated", "colocated: every rank trains and generates, switching phases "
                                    "(fusion.py); separated: half the ranks train, half generate; "
                                    "colocated-all: colocated plus the reference model, kept on "
                                    "host except while it computes; hybrid: the actor colocated on "
                                    "ranks [0, W - aux), the reference and the reward model on "
                                    "--aux-ranks ranks, a queue stage between rollout and training")
    aux_ranks: int = flag(None, "--deploy hybrid: ranks holding the reference and the reward model "
                                "(default 1)")
    liveness_s: float = flag(10.0, "--deploy hybrid: a rank whose heartbeat stops this long is "
                                   "named lost by its peers (options/liveness.py)")
    infer_tp: int = flag(1, "tensor-parallel degree of the rollout engine: 1, 2 "
                            "or 4 (colocated modes; options/tensor_parallel.py)")
    layout: str = flag("manual", "manual: the layout flags as given; auto: the planner's "
                                 "fastest layout that fits, measured for this world "
                                 "(options/layout_auto.py): it sets --infer-tp, --train-ep, "
                                 "--infer-ep, --train-pp and --micro-batches")
    device_memory_gib: float = flag(None, "a rank's memory the planner checks the layout "
                                          "against, before any process group (default: none "
                                          "checked; --layout auto: the device's)")
    bucket_kb: int = flag(256, "bucket size in KiB: inference weights built or pushed, experts "
                                "moved per re-shard round")
    shm_transport: bool = flag(False, "1: the engine's weights gathered from the peers' FSDP2 "
                                      "shards in shared memory, on one CPU host "
                                      "(plumbing/shm_transport.py); 0: in-place broadcasts")
    train_pp: int = flag(1, "pipeline stages in training (options/pipeline.py): "
                            "each holds n_layers / train_pp blocks on world / "
                            "train_pp ranks (FSDP2 over them); 1: no pipeline")
    train_ep: str = flag("auto", "expert-parallel degree in training, re-sharded at "
                                 "each phase change (moe_switch.py); 0: the experts are "
                                 "FSDP-sharded like every weight; auto: 2 where the "
                                 "layout allows it (colocated, an even world and even "
                                 "--n-experts, TP 1, no PP or nodes), else 0")
    infer_ep: str = flag("auto", "expert-parallel degree of the rollout engine (with "
                                 "--train-ep); above 1 its ranks decode in lock-step "
                                 "(options/lockstep.py); auto: 1 where EP is on")
    eplb: bool = flag(False, "1: the rollout's experts placed by their measured load, the "
                             "hottest copied (options/eplb.py); needs --infer-ep >= 2")
    eplb_redundant: int = flag(None, "--eplb 1: extra expert slots in the inference layout, a "
                                     "multiple of --infer-ep (default: one a rank)")
    # gradient sync (options/gradsync.py)
    nodes: int = flag(1, "training's nodes: FSDP2 shards within each of --nodes groups of "
                         "world / nodes ranks and the gradients are averaged across them "
                         "(HSDP's layout, options/nodes.py); 1: FSDP2 over every rank")
    grad_compress: str = flag("none", "the cross-node gradient average: none (full "
                                      "precision), int8 (a scale per 128 values) or topk-int8 "
                                      "(the --grad-topk largest, int8), with error feedback")
    grad_topk: float = flag(0.1, "share of each gradient shard that topk-int8 sends, in (0, 1]")
    grad_overlap: bool = flag(False, "1: each FSDP unit's cross-node sync starts as its gradients "
                                     "are reduced and is waited before the clip (overlaps earlier "
                                     "blocks' backward with --fsdp-units block)")
    fsdp_units: str = flag("model", "model: one FSDP2 unit (one gather, one reduce-scatter "
                                    "per step); block: one per transformer block and one "
                                    "for the rest, with forward and backward prefetch")
    # run
    seed: int = flag(0, "seed of prompts, init and sampling")
    eval_every: int = flag(20, "steps between held-out evaluations (also the first and the last)")
    log_every: int = flag(8, "steps between printed step lines")
    rl_seconds: float = flag(200.0, "stop after the RL step that passes this many seconds of RL "
                                    "steps (evaluations excluded), and evaluate it; 0: run --steps")
    out: str = flag("", "output folder (default runs/<timestamp>)")
    save_every: int = flag(0, "RL steps between checkpoints in <out>/checkpoints (0: none; "
                              "plumbing/checkpoint.py)")
    keep_last: int = flag(2, "checkpoints kept, the newest (0: every one)")
    resume: str = flag("", "auto (the newest complete checkpoint in --out, "
                           "or a fresh start if none) or a checkpoint folder")
    trust_checkpoint_perms: bool = flag(False, "1: resume from a checkpoint that another "
                                               "user owns or may write (group- or "
                                               "world-writable, e.g. a group-shared "
                                               "disk); loading one runs its pickled code")
    device: str = flag("auto", "auto (the accelerator if there is one, else cpu), cpu, "
                               "or the accelerator's type that torch.accelerator finds "
                               "(cuda, xpu, npu with its plugin; not mps: gloo only)")
    pg_timeout_s: int = flag(300, "timeout in seconds of every process group")


SECTIONS = {"task": "max_digits", "model": "d_model", "supervised warm-up": "warmup_steps",
            "GRPO": "steps", "staleness": "staleness", "rollout": "temperature",
            "deployment": "deploy", "gradient sync": "nodes", "run": "seed"}
COMPRESS = ("none", "int8", "topk-int8")  # options/gradsync.py's (a test holds them equal)
CHOICES = {"loss_agg": ("auto",) + grpo.LOSS_AGGS, "adv_estimator": grpo.ESTIMATORS,
           "deploy": ("colocated", "separated", "colocated-all", "hybrid"),
           "grad_compress": COMPRESS, "fsdp_units": ("model", "block"),
           "layout": ("manual", "auto")}


def ep_degree(text):
    """--train-ep / --infer-ep: an integer, or auto."""
    return text if text == "auto" else int(text)


def parse_args(argv=None, description="GRPO post-training of a tiny MoE policy"):
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    starts = {name: title for title, name in SECTIONS.items()}  # at a section's first field
    for f in dataclasses.fields(Config):
        if f.name in starts:
            group = p.add_argument_group(starts[f.name])
        kind = {bool: lambda s: bool(int(s)), str: str}.get(f.type, f.type)
        if f.name in ("train_ep", "infer_ep"):
            kind = ep_degree
        group.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                           help=f.metadata["help"], choices=CHOICES.get(f.name))
    for old, new in RENAMED.items():  # an old name is refused with a pointer to the new one
        p.add_argument(old, help=argparse.SUPPRESS, default=argparse.SUPPRESS, action=_Renamed,
                       new=new)
    return p, Config(**vars(p.parse_args(argv)))


RENAMED = {"--scale-by-std": "--adv-estimator (--scale-by-std 0 is --adv-estimator dr-grpo)"}


class _Renamed(argparse.Action):
    def __init__(self, *args, new, **kwargs):
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed: use {self.new}")


def grpo_config(cfg):
    """The algorithm's own settings (grpo.GRPOConfig), from the flags; --loss-agg auto resolved: Dr.
    GRPO's constant normaliser (the response budget) for dr-grpo, token-mean otherwise."""
    agg = cfg.loss_agg
    if agg == "auto":
        agg = "seq-mean-token-sum-norm" if cfg.adv_estimator == "dr-grpo" else "token-mean"
    return grpo.GRPOConfig(clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                           kl_coef=cfg.kl_coef, loss_agg=agg, norm_len=cfg.max_new_tokens,
                           temperature=cfg.temperature, updates_per_batch=cfg.updates_per_batch,
                           micro_batches=cfg.micro_batches, grad_clip=cfg.grad_clip,
                           decoupled=cfg.decoupled, tis_cap=cfg.tis_cap,
                           mask_truncated=cfg.mask_truncated)


def model_config(cfg):
    return ModelConfig(vocab_size=task.VOCAB, d_model=cfg.d_model, n_layers=cfg.n_layers,
                       n_heads=cfg.n_heads, n_experts=cfg.n_experts, top_k=cfg.top_k,
                       d_expert=cfg.d_expert, max_seq_len=cfg.max_digits + 2 + cfg.max_new_tokens)


@dataclass(frozen=True)
class Roles:
    """Who does what. colocated: every rank trains and generates, in rollout replicas of infer_tp
    ranks. separated: ranks [0, W/2) train, ranks [W/2, W) generate. hybrid: ranks [0, W - aux)
    train and generate (the actor, colocated), ranks [W - aux, W) hold the frozen reference and the
    reward model (the auxiliary stage between rollout and training)."""
    world: int
    separated: bool
    infer_tp: int
    aux: int = 0

    @classmethod
    def of(cls, cfg, world):
        aux = (1 if cfg.aux_ranks is None else cfg.aux_ranks) if cfg.deploy == "hybrid" else 0
        return cls(world, cfg.deploy == "separated", cfg.infer_tp, aux)

    @property
    def hybrid(self):
        return self.aux > 0

    @property
    def trainers(self):
        return list(range(self.world // 2 if self.separated else self.world - self.aux))

    @property
    def generators(self):
        return list(range(self.world // 2 if self.separated else 0, self.world - self.aux))

    @property
    def auxiliaries(self):  # hybrid: the reference's and the reward model's ranks
        return list(range(self.world - self.aux, self.world))

    @property
    def replicas(self):  # rollout replicas: each generates its own slice of the prompts
        return len(self.generators) // self.infer_tp

    def replica(self, rank):
        return (rank - self.generators[0]) // self.infer_tp

    @property
    def experts_over(self):  # EP's ranks where they are part of the job (the hybrid's actor)
        return None if len(self.trainers) == self.world else self.trainers

    def writers(self):  # one rank per TP group puts the (identical) samples into the queue
        return self.generators[::self.infer_tp]


# ----------------------------------------------------------------------------- auto, resolved
def ep_allowed(cfg, world):
    """Whether this layout can spread the experts over pairs of ranks in training: colocated (the
    experts switch layouts on the ranks that hold them), an even world and an even number of
    experts, the engine at TP 1 (it cuts experts by expert, not by hidden unit), no pipeline stages
    and no nodes (their gradients bypass the experts' own sync)."""
    colocated = cfg.deploy in ("colocated", "colocated-all")
    even = world % 2 == 0 and cfg.n_experts % 2 == 0
    return colocated and even and cfg.infer_tp == 1 and cfg.train_pp == 1 and cfg.nodes == 1


def resolve(cfg, world):
    """The Config with --train-ep and --infer-ep auto made numbers. Where the layout allows it
    (ep_allowed): EP 2 in training (each expert on one rank of a pair, its tokens sent to it) and
    EP 1 in rollout (every rank holds every expert: decoding sends nothing); elsewhere EP off.
    Given one degree, auto makes the other nest with it. A checkpoint holds the experts as the
    dense model stacks them, so one saved with EP or without resumes either way."""
    if "auto" not in (cfg.train_ep, cfg.infer_ep):
        return cfg
    on = ep_allowed(cfg, world)
    infer_ep = cfg.infer_ep
    train_ep = cfg.train_ep
    if train_ep == "auto" and infer_ep == "auto":
        train_ep = 2 if on else 0
    elif train_ep == "auto":  # EP 2 where it nests with the degree given, else that degree
        nests = infer_ep == 1 or (infer_ep > 0 and infer_ep % 2 == 0)
        train_ep = 2 if on and nests else infer_ep
    if infer_ep == "auto":
        infer_ep = 1 if train_ep else 0
    return dataclasses.replace(cfg, train_ep=train_ep, infer_ep=infer_ep)


# ----------------------------------------------------------------------------- the checks
def validate(cfg, world_size):
    """Check the config against the world size before any collective; raise one ValueError naming
    every bad value and what is valid."""
    try:
        cfg = resolve(cfg, world_size)
    except ValueError as e:
        raise ValueError(f"bad arguments:\n  {e}") from None
    errors = layout_errors(cfg, world_size) + value_errors(cfg)
    if errors:
        raise ValueError("bad arguments:\n  " + "\n  ".join(errors))


def layout_errors(cfg, world):
    errors = []
    whole = cfg.deploy != "hybrid"  # the hybrid's engine is cut over its actor's ranks: its check
    bad_tp = cfg.infer_tp not in (1, 2, 4)  # first: 0 divides nothing
    if bad_tp or whole and world % cfg.infer_tp or cfg.n_heads % cfg.infer_tp:
        ranks = f"the world size {world}" if whole else "the actor's ranks"
        return [f"--infer-tp {cfg.infer_tp} must be 1, 2 or 4 and divide both {ranks} and "
                f"--n-heads {cfg.n_heads}"]
    errors += expert_errors(cfg, world) + option_errors(cfg, world)
    roles = Roles.of(cfg, world)
    trainers = max(1, len(roles.trainers))
    if cfg.prompts_per_step < 1 or cfg.prompts_per_step % max(roles.replicas, 1):
        errors.append(f"--prompts-per-step {cfg.prompts_per_step} must be a positive multiple "
                      f"of the {roles.replicas} rollout replicas (world size {world}, "
                      f"--deploy {cfg.deploy}, --infer-tp {cfg.infer_tp})")
    if not 1 <= cfg.updates_per_batch <= cfg.prompts_per_step * cfg.group_size // trainers:
        errors.append(f"--updates-per-batch {cfg.updates_per_batch} must be in [1, samples per "
                      "trainer]")
    if cfg.warmup_steps and (cfg.warmup_batch < trainers or cfg.warmup_batch % trainers):
        errors.append(f"--warmup-batch {cfg.warmup_batch} must be a positive multiple of the "
                      f"{trainers} training ranks")
    if cfg.eval_prompts < world:
        errors.append(f"--eval-prompts {cfg.eval_prompts} must be at least the world size {world}")
    return errors


def expert_errors(cfg, world):
    """--train-ep and --infer-ep (moe_switch.py): nested layouts that fit the world and experts."""
    if (cfg.train_ep > 0) != (cfg.infer_ep > 0):
        return [f"--train-ep {cfg.train_ep} and --infer-ep {cfg.infer_ep}: set both (EP on) or "
                "neither"]
    if not cfg.train_ep:
        return []
    errors = []
    ranks = len(Roles.of(cfg, world).trainers)  # the experts' ranks: the hybrid's actor, or all
    for name, ep in (("--train-ep", cfg.train_ep), ("--infer-ep", cfg.infer_ep)):
        try:
            moe_switch.EPLayout(ep, ranks, cfg.n_experts)
        except ValueError as e:
            errors.append(f"{name} {ep}: {e}")
    if cfg.deploy == "separated" or cfg.infer_tp != 1:
        errors.append(f"--train-ep needs a colocated deployment with --infer-tp 1 "
                      f"(got --deploy {cfg.deploy}, --infer-tp {cfg.infer_tp}): "
                      "the experts switch layouts on the ranks that hold them, "
                      "and the engine cuts them by expert, not by hidden unit")
    low, high = sorted((cfg.train_ep, cfg.infer_ep))
    if high % low:  # layouts that nest switch at target + one bucket (moe_switch.py)
        errors.append(f"--train-ep {cfg.train_ep} and --infer-ep {cfg.infer_ep}: one must divide "
                      "the other, so that the two expert layouts nest and the switch holds no more "
                      "than its target and one bucket")
    return errors


def option_errors(cfg, world):
    """Each option's own checks, in its file, asked only when it is on; a flag that only acts under
    an option that is off is refused here."""
    errors = []
    if cfg.deploy == "separated":
        from options import separated
        errors += separated.errors(cfg, world)
    if cfg.deploy == "hybrid":
        from options import hybrid
        errors += hybrid.errors(cfg, world)
    elif cfg.aux_ranks is not None:
        errors.append(f"--aux-ranks {cfg.aux_ranks} places the auxiliary stage of --deploy hybrid "
                      f"(got --deploy {cfg.deploy})")
    if cfg.eplb or cfg.eplb_redundant is not None:
        from options import eplb
        errors += eplb.errors(cfg, world)
    if cfg.layout == "auto" or cfg.device_memory_gib is not None:
        from options import layout_auto
        errors += layout_auto.errors(cfg, world)
    if cfg.train_pp != 1:
        from options import pipeline_run
        errors += pipeline_run.errors(cfg, world)
    if cfg.nodes != 1:
        from options import nodes
        errors += nodes.errors(cfg, world)
    unused = {"--grad-compress " + cfg.grad_compress: cfg.grad_compress != "none",
              "--grad-overlap 1": cfg.grad_overlap}
    errors += [f"{what} acts on the gradient average across nodes: it needs --nodes > 1"
               for what, bad in unused.items() if bad and cfg.nodes == 1]
    if not 0 < cfg.grad_topk <= 1:  # at any --nodes, as every other flag's range
        errors.append(f"--grad-topk {cfg.grad_topk} must be in (0, 1]")
    if not 0 <= cfg.rm_watch_below <= 1:  # NaN fails too
        errors.append(f"--rm-watch-below {cfg.rm_watch_below} must be in [0, 1]")
    if not cfg.liveness_s > 0:  # NaN fails too
        errors.append(f"--liveness-s {cfg.liveness_s} must be > 0")
    return errors


# Sizes: every count that a shape, a batch or a loop divides by or runs over, >= 1; counts that may
# be 0, >= 0.
POSITIVE = ("max_digits", "eval_prompts", "d_model", "n_layers", "n_heads", "n_experts", "top_k",
            "d_expert", "warmup_batch", "steps", "prompts_per_step", "group_size", "filter_limit",
            "updates_per_batch", "micro_batches", "chunk_steps", "max_new_tokens", "bucket_kb",
            "eval_every", "log_every", "pg_timeout_s", "train_pp", "nodes", "rm_samples",
            "rm_steps", "rm_check")
NON_NEGATIVE = ("warmup_steps", "train_ep", "infer_ep", "seed", "save_every", "keep_last")


def number_errors(cfg):
    """Every size >= 1 (or >= 0 where 0 means "none"), every float finite: a NaN learning rate or an
    infinite temperature would train on, or a NaN --rl-seconds never stop, without an error."""
    errors = [f"--{_flag(k)} {getattr(cfg, k)} must be >= 1" for k in POSITIVE
              if getattr(cfg, k) < 1]
    errors += [f"--{_flag(k)} {getattr(cfg, k)} must be >= 0" for k in NON_NEGATIVE
               if getattr(cfg, k) < 0]
    floats = [f.name for f in dataclasses.fields(Config) if f.type is float]
    errors += [f"--{_flag(k)} {getattr(cfg, k)} must be a finite number" for k in floats
               if getattr(cfg, k) is not None and not math.isfinite(getattr(cfg, k))]
    return errors


def _flag(name):
    return name.replace("_", "-")


def shape_errors(cfg):
    """The model's shapes: heads of even width (RoPE), top-k within the experts, and the rollout
    engine's TP cut (heads and each expert's hidden width split over --infer-tp ranks)."""
    errors = []
    if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
        errors.append(f"--d-model {cfg.d_model} must split into --n-heads {cfg.n_heads} heads of "
                      "even width (d_model / n_heads even, for the rotary embedding)")
    if cfg.top_k > cfg.n_experts:
        errors.append(f"--top-k {cfg.top_k} must be at most --n-experts {cfg.n_experts}")
    if cfg.infer_tp >= 1 and cfg.d_expert % cfg.infer_tp:
        errors.append(f"--d-expert {cfg.d_expert} must be a multiple of --infer-tp {cfg.infer_tp} "
                      "(each TP rank holds an equal share of every expert's hidden units)")
    return errors


def value_errors(cfg):
    errors = number_errors(cfg)
    if errors:  # the checks below divide by these sizes or build the model from them
        return errors
    errors = shape_errors(cfg)
    if cfg.group_size < 2 and (cfg.adv_estimator != "reinforce++" or cfg.filter_groups):
        errors.append(f"--group-size {cfg.group_size}: a group baseline (and --filter-groups) "
                      "needs at least 2 responses per prompt; "
                      "only --adv-estimator reinforce++ takes 1")
    try:
        stalesync.StaleConfig(cfg.staleness, 1, max(cfg.group_size, 1), cfg.threshold,
                              cfg.chunk_steps)
    except (ValueError, TypeError) as e:
        errors.append(f"--staleness {cfg.staleness} / --threshold {cfg.threshold} / --chunk-steps "
                      f"{cfg.chunk_steps}: {e}")
    if cfg.max_digits > 32:
        errors.append(f"--max-digits {cfg.max_digits} must be in [1, 32]")
    elif len(task.held_out(cfg.max_digits, cfg.eval_prompts)[1]) >= \
            task.n_possible_prompts(cfg.max_digits):
        errors.append(f"--eval-prompts {cfg.eval_prompts} with --max-digits {cfg.max_digits}: the "
                      "held-out set takes every possible prompt and leaves none to train on; allow "
                      "more digits or fewer prompts")
    if cfg.max_new_tokens < cfg.max_digits + 1:
        errors.append(f"--max-new-tokens {cfg.max_new_tokens} cannot hold the longest answer "
                      f"({cfg.max_digits + 1} tokens); use at least {cfg.max_digits + 1}")
    if not cfg.temperature > 0 or not 0 < cfg.top_p <= 1:
        errors.append(f"--temperature {cfg.temperature} must be > 0 and --top-p {cfg.top_p} in "
                      "(0, 1]")
    if cfg.kl_coef < 0 or cfg.clip_eps <= 0 or cfg.lr <= 0:
        errors.append(f"--kl-coef {cfg.kl_coef} must be >= 0, --clip-eps {cfg.clip_eps} and --lr "
                      f"{cfg.lr} > 0")
    if not 0 <= cfg.lr_decay <= 1:
        errors.append(f"--lr-decay {cfg.lr_decay} must be in [0, 1] (1: a constant learning rate)")
    if any(v is not None and not v > 0 for v in (cfg.clip_eps_high, cfg.tis_cap)):
        errors.append(f"--clip-eps-high {cfg.clip_eps_high} and --tis-cap {cfg.tis_cap} "
                      "must be > 0 when given")
    if not cfg.grad_clip > 0 or not cfg.warmup_lr > 0:
        errors.append(f"--grad-clip {cfg.grad_clip} and --warmup-lr {cfg.warmup_lr} must be > 0")
    if cfg.rl_seconds < 0:
        errors.append(f"--rl-seconds {cfg.rl_seconds} must be >= 0 (0: run --steps)")
    if cfg.resume == "auto" and not cfg.out:
        errors.append(f"--resume auto needs --out (the folder whose checkpoints it looks for; got "
                      f"{cfg.out!r})")
    errors += device_errors(cfg.device)
    if errors:  # the bucket check builds the model's shapes
        return errors
    return bucket_errors(cfg)


def bucket_errors(cfg):
    """A bucket must hold the largest weight it moves (under EP, one expert's slice of a stack)."""
    try:
        with torch.device("meta"):  # shapes only
            params = dict(Policy(model_config(cfg)).named_parameters())
    except ValueError as e:
        return [str(e)]
    expert = bool(cfg.train_ep)  # under EP an expert moves alone: one slice of a stack
    moved = [(p.nbytes // cfg.n_experts, f"{n}[e], one expert's,") if expert and ".moe.w_" in n else
             (p.nbytes, n) for n, p in params.items()]
    nbytes, name = max(moved, key=lambda x: x[0])  # the first of the largest
    if cfg.bucket_kb * 1024 < nbytes:
        return [f"--bucket-kb {cfg.bucket_kb} is smaller than the largest weight, {name} ({nbytes} "
                f"bytes); use at least {-(-nbytes // 1024)}"]
    return []
