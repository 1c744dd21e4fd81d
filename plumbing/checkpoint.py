# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""Checkpoint and resume of the whole RL run: the weights, the optimizer, and everything in flight.

    torchrun --standalone --nproc_per_node=2 train_grpo.py --out runs/a --save-every 20

One checkpoint is one folder, <out>/checkpoints/step_<N>/, which exists only once complete:
  .metadata, __<r>_0.distcp  torch.distributed.checkpoint (DCP), tensors only: the model and the
                             optimizer's state as FSDP shards (a load at another world size
                             reshards them), EP's experts stacked as the dense model holds them,
                             and the reference and reward models
  rank_<r>.pt                each rank's plain data (loaded with weights_only=True): RNG, the
                             warm-up's prompts, the curriculum's counts, the queue's unread rows,
                             StaleSync's groups in flight (partial rollouts), the --nodes
                             residual, the optimizer's param_groups (a record)
  meta.json                  the step, the world size, the config, the log's figures so far, and
                             the name and size of every file above

Two halves: `folder`, `write`, `complete_checkpoints`, `prune` and `read_*` are the mechanism (any
run's dicts); `find`, `save` and `resume` decide what a train_grpo.py run saves, where and when.
`dense_state_dict` gathers a model under EP (moe_switch.py) into the dense model's names, whole on
every rank, and `load_dense_state_dict` loads it back into any layout: the warm-up's dense twin,
the reference, the log's params_sha256.
Every rank writes into one folder: the ranks must share a filesystem.

A checkpoint is code to trust: DCP's .metadata is a pickle that its load unpickles (whoever can
write it runs code as the user who resumes). So only tensors go to DCP, `write` leaves the files
writable by their owner alone, and `find` refuses a folder that another user owns or may write
(`untrusted`) unless --trust-checkpoint-perms 1.

- Atomic: every rank writes into .tmp_step_<N>; after a barrier rank 0 lists the files with their
  sizes in meta.json and renames the folder to step_<N>, what --resume auto finds. --keep-last K
  keeps the newest K; a run resumed from step N moves later ones (abandoned) to superseded/.
- Checked before anything changes: rank 0 chooses the folder, every rank checks it (meta.json, the
  files' sizes, owners and modes, the config's SHAPE_FIELDS), and all fail with the name of the
  file, field or flag and of the rank that found it.
- A consistent cut: every rank saves at one policy version: colocated, at the end of RL step N;
  separated, trainers after pushing version N and generators right after receiving it.
- Exact: at the same world size and deployment, a resumed run trains to the parameters of a run
  that never stopped (CPU, fixed seed, --rl-seconds 0, new weights reaching the samplers at fixed
  points: colocated, or separated at S = 0). At another world size or deployment the model and
  optimizer reshard, and the groups in flight or queued are dropped (stale/regenerated).

Shapes: none; one dict per rank.
"""
import dataclasses
import hashlib
import json
import os
import shutil
import stat

import torch
import torch.distributed as dist

SHAPE_FIELDS = ("max_digits", "d_model", "n_layers", "n_heads", "n_experts", "top_k", "d_expert",
                "group_size", "prompts_per_step", "max_new_tokens", "staleness", "threshold",
                "chunk_steps", "filter_groups", "seed", "kl_coef")
# with the world size: may differ, then the in-flight groups regenerate
LAYOUT_FIELDS = ("deploy", "infer_tp")


# --- the mechanism: write, list, read -------------------------------------------------------------
def folder(out_dir, step):
    return os.path.join(out_dir, "checkpoints", f"step_{step}")


def write(out_dir, step, rank, own, meta=None, dcp_state=None, dcp_group=None, keep_last=None,
          group=None):
    """Collective over `group` (every rank): each rank's `own` dict to rank_<r>.pt, the DCP state
    (held by the ranks of dcp_group) to its shards; then rank 0 writes meta.json and renames the
    folder."""
    import torch.distributed.checkpoint as dcp
    root = os.path.join(out_dir, "checkpoints")
    tmp, final = os.path.join(root, f".tmp_step_{step}"), folder(out_dir, step)
    if rank == 0:
        # writable by this user only, as `untrusted` asks (umask 002)
        os.makedirs(root, mode=0o755, exist_ok=True)
        for name in os.listdir(root):
            if name.startswith((".tmp_step_", ".old_step_")):  # a crashed save's leftovers
                shutil.rmtree(os.path.join(root, name))
        os.makedirs(tmp, mode=0o755)
    dist.barrier(group=group)
    if dcp_state is not None:
        crc = torch.serialization.get_crc32_options()
        # skip a checksum per tensor that no load ever reads
        torch.serialization.set_crc32_options(False)
        # plan caching: a save laid out as the last one skips DCP's planning round
        try:
            dcp.save(dcp_state, checkpoint_id=tmp, process_group=dcp_group,
                     planner=dcp.DefaultSavePlanner(enable_plan_caching=True))
        finally:
            torch.serialization.set_crc32_options(crc)
    _write_file(os.path.join(tmp, f"rank_{rank}.pt"), lambda f: torch.save(own, f))
    dist.barrier(group=group)  # every file is written
    if rank == 0:
        _write_protect(tmp)
        files = {name: os.path.getsize(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
        text = json.dumps(dict(meta or {}, step=step, files=files), indent=1)
        _write_file(os.path.join(tmp, "meta.json"), lambda f: f.write(text.encode()))
        _publish(tmp, final)
        prune(out_dir, keep_last)
    dist.barrier(group=group)  # once write returns, the checkpoint exists for every rank
    return final


def _write_file(path, fill):
    # 0o644: see _write_protect
    with open(path, "wb", opener=lambda p, flags: os.open(p, flags, 0o644)) as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())


def _write_protect(tmp):
    """No group or other user may write the files (DCP opens its own with the umask's mode, 0o664
    under umask 002), or a load would refuse them (`untrusted`). A file another uid wrote is left as
    it is: refused."""
    if not hasattr(os, "geteuid"):  # no POSIX owners and modes (Windows)
        return
    for name in os.listdir(tmp):
        st = os.stat(os.path.join(tmp, name))
        if st.st_uid == os.geteuid() and st.st_mode & 0o022:
            os.chmod(os.path.join(tmp, name), st.st_mode & 0o7755)


def _publish(tmp, final):
    """The step that makes a checkpoint exist: one rename. An older folder of that step is first
    renamed away, then removed (meanwhile the previous step's is the newest complete checkpoint)."""
    old = os.path.join(os.path.dirname(final), ".old_" + os.path.basename(final))
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(os.path.dirname(final), os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself reaches the disk
    finally:
        os.close(fd)


def complete_checkpoints(out_dir):
    """The complete checkpoints under out_dir, oldest first: [(step, folder)]."""
    root = os.path.join(out_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    steps = sorted(int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit())
    return [(s, folder(out_dir, s)) for s in steps
            if os.path.exists(os.path.join(folder(out_dir, s), "meta.json"))]


def prune(out_dir, keep_last):
    """Remove all but the newest keep_last complete checkpoints (0 or None: keep every one)."""
    if not keep_last:
        return
    for _, path in complete_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(path)


def read_meta(path):
    """meta.json, after checking that it holds what `write` puts there (the step, every file's name
    and size) and that every file it lists is there with its size: a field, or a missing or
    truncated file, is named before anything is loaded."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint: it has no meta.json "
                                "(a save that did not finish leaves .tmp_step_<N>; "
                                "complete ones are step_<N> with meta.json)")
    with open(meta_path, "rb") as f:
        text = f.read()
    try:
        meta = json.loads(text)
    except ValueError as e:  # json's JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"{meta_path} is not valid JSON ({e}): "
                         "cut short, or edited by hand") from None
    require(meta_path, meta, {"step": int, "files": dict})
    bad = []
    for name, size in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            bad.append(f"{name} (missing)")
        elif os.path.getsize(file) != size:
            bad.append(f"{name} (size {os.path.getsize(file)}, meta.json says {size})")
    if bad:
        raise ValueError(f"checkpoint {path} is damaged: {', '.join(bad)}")
    return meta


def require(meta_path, meta, fields):
    """Each of `fields` ({"step": int, "config.seed": object, ...}, dotted into nested dicts) in
    meta and of its type, or a ValueError naming the file and the field."""
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} is not a JSON object but a {type(meta).__name__}")
    for name, kind in fields.items():
        value = meta
        for key in name.split("."):
            value = value[key] if isinstance(value, dict) and key in value else _MISSING
        if value is _MISSING:
            raise ValueError(f"{meta_path}: the field {name} is missing")
        if not isinstance(value, kind):
            raise ValueError(f"{meta_path}: the field {name} is {value!r}, not {kind.__name__}")


_MISSING = object()


def untrusted(path):
    """Why the checkpoint at `path` may hold another user's code, or None: the folder holding it,
    the folder and every entry in it must belong to this user (or root) and be writable by no group
    and no other user (the holding folder may be, with the sticky bit: no one else can rename this
    user's folder away). Loading unpickles DCP's .metadata: whoever can write it runs code as the
    user who loads it."""
    if not hasattr(os, "geteuid"):  # no POSIX owners and modes (Windows)
        return None
    me, path = os.geteuid(), os.path.realpath(path)
    holder = os.path.dirname(path)
    for p in [holder, path] + [os.path.join(path, n) for n in sorted(os.listdir(path))]:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            return f"{p} is a symbolic link (a checkpoint holds none)"
        if st.st_uid not in (me, 0):
            return f"{p} is owned by uid {st.st_uid}, not this process's uid {me}"
        if st.st_mode & 0o022 and not (p == holder and st.st_mode & stat.S_ISVTX):
            return f"{p} has mode {oct(st.st_mode & 0o777)}: group- or world-writable"
    return None


def read_own(path, rank):
    """A rank's own file: plain data only (weights_only=True): opening it runs no pickled code."""
    return torch.load(os.path.join(path, f"rank_{rank}.pt"), weights_only=True)


def read_dcp(path, dcp_state, dcp_group=None):
    """Fill dcp_state (the same keys as saved, in this run's layout) from the shards (resharded)."""
    import torch.distributed.checkpoint as dcp
    dcp.load(dcp_state, checkpoint_id=path, process_group=dcp_group)


def params_sha256(state):
    """A hash of a full state dict (names, shapes, dtypes, bytes, in name order): two runs that
    trained to the same parameters print the same hash."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# --- what a train_grpo.py run saves ---------------------------------------------------------------
def find(cfg, out_dir):
    """--resume: (folder, meta) to resume from, or None for a fresh start (auto with no checkpoint
    yet). Every rank calls it before anything is written. Rank 0 chooses the folder (auto: the
    newest complete checkpoint it lists); each rank then checks that folder itself (its meta.json
    and files, their owners and modes, the config), and if one rank cannot load it, every rank fails
    with that rank's reason. Under auto, a run that already ended exits 0 (`_finished`)."""
    if not cfg.resume:
        return None
    path = _choose(cfg, out_dir)
    if path is None:
        return None
    if cfg.resume == "auto" and _finished(cfg, out_dir, path):  # a restart after the run's end
        raise SystemExit(0)  # every rank: the caller's finally tears the process group down
    try:
        found, error = _check(cfg, path), None
    # OSError: FileNotFoundError, PermissionError, an unreadable file
    except (ValueError, OSError) as e:
        found, error = None, (type(e).__name__, str(e))
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, (kind, text) = failed[0]
        raise _ERRORS.get(kind, RuntimeError)(f"rank {r}: {text}" if len(errors) > 1 else text)
    return found


_ERRORS = {e.__name__: e for e in (ValueError, FileNotFoundError, PermissionError)}


def _choose(cfg, out_dir):
    """The folder to resume from, as rank 0 sees it (None: a fresh start). Were each rank to list
    checkpoints/ itself, two nodes of a shared disk that caches file attributes could pick different
    steps, and DCP would load shards of both without an error."""
    if cfg.resume != "auto":
        return cfg.resume
    lists = not dist.is_initialized() or dist.get_rank() == 0
    found = complete_checkpoints(out_dir) if lists else None
    choice = [found[-1][1] if found else None]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _finished(cfg, out_dir, path):
    """Whether the run in out_dir already ended: its newest checkpoint is at --steps and its
    summary.json was written after it. Then a restart (torchrun's, after a crash at teardown) has
    nothing to do, and says so. Rank 0 decides, as it chose the folder; it says why on stdout."""
    done = [False]
    if not dist.is_initialized() or dist.get_rank() == 0:
        summary, meta = os.path.join(out_dir, "summary.json"), os.path.join(path, "meta.json")
        try:
            with open(meta) as f:
                step = json.load(f)["step"]
            done = [step >= cfg.steps and os.path.getmtime(summary) >= os.path.getmtime(meta)]
        except (OSError, ValueError, KeyError, TypeError):  # _check names what is wrong
            done = [False]
        if done[0]:
            print(f"{out_dir}: the run is complete (checkpoint at step {step}, --steps "
                  f"{cfg.steps}, summary.json written after it): nothing to run", flush=True)
    if dist.is_initialized():
        dist.broadcast_object_list(done, src=0)
    return done[0]


def _check(cfg, path):
    """(path, meta) if this rank can resume this run from `path`; else an error naming the file, the
    field or the flag."""
    from plumbing.runlog import SAVED
    fields = {"world": int, "reference": bool, "log": dict, **{f"log.{k}": object for k in SAVED},
              "config": dict, **{f"config.{k}": object for k in SHAPE_FIELDS + LAYOUT_FIELDS}}
    try:
        meta = read_meta(path)
        require(os.path.join(path, "meta.json"), meta, fields)
    except ValueError as e:
        raise ValueError(f"{e}; remove it, "
                         "or name an older checkpoint with --resume FOLDER") from None
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}; remove it, "
                                "or name an older checkpoint with --resume FOLDER") from None
    why = None if cfg.trust_checkpoint_perms else untrusted(path)
    if why:
        raise PermissionError(f"checkpoint {path}: {why}. Another user could have put code in it "
                              "(a load unpickles DCP's .metadata): check who wrote it, "
                              "then pass --trust-checkpoint-perms 1 to load it anyway "
                              "(e.g. a disk shared by a group)")
    saved = meta["config"]
    diff = [f"--{k.replace('_', '-')} {saved[k]} there, {getattr(cfg, k)} here"
            for k in SHAPE_FIELDS if saved[k] != getattr(cfg, k)]
    if diff:
        raise ValueError(f"checkpoint {path} does not fit this run: {'; '.join(diff)}")
    if (cfg.kl_coef > 0 or cfg.deploy == "colocated-all") and not meta["reference"]:
        raise ValueError(f"checkpoint {path} holds no reference model, "
                         f"and --deploy {cfg.deploy} needs one")
    saved_rm = bool(meta.get("reward_model"))
    if cfg.reward_model != saved_rm:
        raise ValueError(f"checkpoint {path} was saved with --reward-model {int(saved_rm)}: "
                         f"resume it with the same (here --reward-model {int(cfg.reward_model)}), "
                         "the reward it trains on")
    if saved.get("train_ep") and meta.get("experts") != "stacked":
        raise ValueError(f"checkpoint {path} was saved by older code "
                         f"with --train-ep {saved['train_ep']}, "
                         "each expert under a name of its own: resume it with that code")
    _check_hybrid(cfg, path, meta)
    if meta["step"] >= cfg.steps:
        raise ValueError(f"checkpoint {path} is at step {meta['step']}: "
                         f"--steps {cfg.steps} leaves nothing to run")
    return path, meta


def save(run, step):
    """--save-every: the whole run at policy version `step`, every rank at the module's cut."""
    cfg = run.cfg
    if not cfg.save_every or step % cfg.save_every:
        return
    with run.spans("checkpoint"):
        own = {"rng": {"torch": torch.get_rng_state()}, "queue": run.queue.state_dict(),
               "warm_stream": run.warm_stream.state_dict(),
               "curriculum": run.curriculum.state_dict()}
        # the accelerator's own generator, under its type ("cuda", "xpu", ...)
        if run.device.type != "cpu":
            own["rng"][run.device.type] = _device_rng(run.device)
        if run.sched is not None:
            own["sched"] = run.sched.state_dict()
        if run.actor is not None:
            own["actor"] = run.actor.state_dict()
        if hasattr(run.experts, "balancer"):  # --eplb (options/eplb.py): its loads
            own["eplb"] = run.experts.balancer.state_dict()
        # --nodes: the error-feedback residual, this rank's shard of its node's
        if run.grad_sync is not None:
            own["grad_sync"] = run.grad_sync.state_dict()
        own["run"] = run.own_state()  # a deployment's loop's own (the hybrid's counters)
        dcp_state, own["optim_groups"] = _dcp_state(run)
        meta = {"world": run.roles.world, "config": dataclasses.asdict(cfg),
                "log": run.log.state_dict(), **run.saved_models(),
                "experts": "stacked"}  # under EP too (_dcp_state)
        write(run.out_dir, step, run.rank, own, meta, dcp_state=dcp_state,
              dcp_group=run.train_group, keep_last=cfg.keep_last)


def _dcp_state(run):
    """(state, param_groups). The state, DCP's part, is tensors only (a non-tensor entry, DCP would
    pickle and its load unpickle): the trainers' model and optimizer state as FSDP shards
    (DTensors), and the reference model. The optimizer's param_groups (its settings, and its
    parameters' names: plain data) go to the rank files. Under EP the experts (a tensor per expert,
    on the ranks that hold it) are saved as the dense model stacks them, (E, ...) under the dense
    names (_stacked), so that a load finds them whatever the layout it loads into: EP at any degree,
    or none, at any world size. (None, None) on a generator."""
    if run.model is None:
        return None, None
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, optim = get_state_dict(run.model, run.optimizer)
    state = {"model": _stacked(model, run.model),
             "optim": {"state": _stacked(optim["state"], run.model)}}
    if run.reference is not None:
        # host copies: an offloaded reference frees its storages on exit
        with run.reference.on_device() as ref:
            host = {k: v.detach().to("cpu", copy=True) for k, v in ref.state_dict().items()}
            state["reference"] = _stacked(host, ref)
    if run.reward_model is not None:  # --reward-model: frozen after its fit, the same on every rank
        with run.reward_model.on_device() as rm:
            state["reward_model"] = {k: v.detach().to("cpu", copy=True)
                                     for k, v in rm.state_dict().items()}
    return state, optim["param_groups"]


def _expert_layers(module):
    """{name: EPMoE} of a module's expert-parallel MoE layers (none without EP)."""
    import moe_switch
    return {name: m for name, m in module.named_modules() if isinstance(m, moe_switch.EPMoE)}


def _stacked(entries, module):
    """A state dict of `module` (its parameters' tensors, or the optimizer's state per parameter: a
    dict of tensors) with each EP expert entry, `<layer>.w_gate.<e>` held by some ranks, made the
    dense model's stack `<layer>.w_gate` (E, ...), whole on every rank: each expert broadcast by its
    first holder (collective over the layout's ranks). The optimizer's step, the same for every
    expert, stays one scalar."""
    import moe_switch
    out = dict(entries)
    for name, layer in _expert_layers(module).items():
        for n in moe_switch.EXPERT_NAMES:
            parts = []
            for e in range(layer.layout.n_experts):
                key = f"{name}.{n}.{e}"
                box = [out.pop(key, None) if e in layer.layout.owned(layer.rank) else None]
                out.pop(key, None)  # an expert this rank does not hold: an empty tensor
                first_holder = layer.layout.global_rank(layer.layout.holders(e)[0])
                dist.broadcast_object_list(box, src=first_holder, group=layer.world_group)
                parts.append(box[0])
            if torch.is_tensor(parts[0]):
                out[f"{name}.{n}"] = torch.stack(parts)                                  # (E, ...)
            else:
                out[f"{name}.{n}"] = {k: v if v.dim() == 0 else torch.stack([p[k] for p in parts])
                                      for k, v in parts[0].items()}
    return out


def _unstacked(entries, module):
    """_stacked's inverse on a load: each stack's slices of this rank's experts, by EP names."""
    import moe_switch
    out = dict(entries)
    for name, layer in _expert_layers(module).items():
        for n in moe_switch.EXPERT_NAMES:
            stack = out.pop(f"{name}.{n}")
            for e in layer.layout.owned(layer.rank):
                # own storage each: an optimizer steps each expert's state in place, its step too
                if torch.is_tensor(stack):
                    out[f"{name}.{n}.{e}"] = stack[e].clone()
                else:
                    out[f"{name}.{n}.{e}"] = {k: (v if v.dim() == 0 else v[e]).clone()
                                              for k, v in stack.items()}
    return out


# --- the whole model's dense state under EP: what a dense reference or an export loads ---------
def dense_state_dict(model, group=None):
    """The whole model on every rank, in the dense model's names and order: what a checkpoint or a
    dense reference loads. Collective over `group` (None: the EP layout's ranks). FSDP2 shards
    are gathered; each expert is broadcast by its first holder, then stacked (E, ...)."""
    import moe_switch
    state = model.state_dict()
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    ep = _expert_layers(model)
    out = {}
    for k, v in full.items():
        name = k.rsplit(".", 2)[0]
        # the dense MoE's order: its own w_gate, w_up and w_down, then its router.weight
        if name in ep and f"{name}.w_gate" not in out:
            m = ep[name]
            for n in moe_switch.EXPERT_NAMES:
                like = getattr(m, n)[m.layout.owned(m.rank)[0]]
                experts = [p.detach().clone() if p.numel() else torch.empty_like(like)
                           for p in getattr(m, n)]
                for e, t in enumerate(experts):
                    src = m.layout.global_rank(m.layout.holders(e)[0])
                    dist.broadcast(t, src=src, group=m.world_group if group is None else group)
                out[f"{name}.{n}"] = torch.stack(experts)              # (E, ...)
        if name not in ep or k.endswith(".router.weight"):
            out[k] = v
    return out


@torch.no_grad()
def load_dense_state_dict(model, full):
    """dense_state_dict's inverse: load a dense model's whole state (the experts stacked (E, ...))
    into `model`, whatever its layout: an EP layer takes its experts' slices, an FSDP2 shard its
    part of the whole tensor, any other weight the whole. No communication: every rank holds it."""
    import moe_switch
    from torch.distributed.tensor import distribute_tensor
    ep = _expert_layers(model)
    for k, p in model.named_parameters():
        name, n, e = (k.rsplit(".", 2) + ["", ""])[:3]  # an expert's: <layer>, w_up, <e>
        if name in ep and n in moe_switch.EXPERT_NAMES:
            if p.numel():  # owned here
                p.copy_(full[f"{name}.{n}"][int(e)])
        elif hasattr(p, "device_mesh"):  # an FSDP2 shard (a DTensor)
            part = distribute_tensor(full[k], p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(part.to_local())
        else:
            p.copy_(full[k])


def _check_hybrid(cfg, path, meta):
    """A hybrid checkpoint holds the reference (and the reward model) in its auxiliary ranks' files:
    it resumes as it was saved, at the same world and --aux-ranks, and nothing else resumes it."""
    saved = meta["config"]
    world = dist.get_world_size() if dist.is_initialized() else 1

    def placed(deploy, aux, w):
        return (deploy, (aux or 1) if deploy == "hybrid" else None, w)
    there = placed(saved["deploy"], saved.get("aux_ranks"), meta["world"])
    here = placed(cfg.deploy, cfg.aux_ranks, world)
    if "hybrid" in (there[0], here[0]) and there != here:
        raise ValueError(f"checkpoint {path} was saved by --deploy {there[0]} at world {there[2]}"
                         f"{f' (--aux-ranks {there[1]})' if there[1] else ''}, this run is "
                         f"--deploy {here[0]} at world {here[2]}"
                         f"{f' (--aux-ranks {here[1]})' if here[1] else ''}: a hybrid run's "
                         "reference lives on its auxiliary ranks, so it resumes only as it was "
                         "saved")


def resume(run):
    """Load the checkpoint `find` chose into a built run: the trainers' DCP state, resharded if the
    world changed; then each rank's own state, or, at another layout, the in-flight prompts to
    regenerate; last, metrics.jsonl, cut back to the checkpoint's step. Nothing without a
    checkpoint. The optimizer: its state (each parameter's step and Adam moments) from the
    checkpoint; every setting of its param_groups (the learning rate from --lr, betas, eps, weight
    decay, foreach, ...) from this run as train_grpo.py built it, which then anneals the learning
    rate to where the run stopped (run_loop). The saved param_groups stay in the rank files as a
    record, never applied: a checkpoint of older code does not undo a choice made since (foreach,
    say)."""
    if run.resume_from is None:
        return
    path, meta = run.resume_from
    run.log.load_state_dict(meta["log"])
    if run.model is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        state, groups = _dcp_state(run)  # groups: this run's settings
        # an older checkpoint's param_groups in DCP are not read
        read_dcp(path, state, run.train_group)
        optim_state = _unstacked(state["optim"]["state"], run.model)
        set_state_dict(run.model, run.optimizer,
                       model_state_dict=_unstacked(state["model"], run.model),
                       optim_state_dict=dict(state["optim"], state=optim_state,
                                             param_groups=groups),
                       options=StateDictOptions(strict=run.experts is None))  # EP: held here only
        if run.reference is not None:
            with run.reference.on_device() as ref:
                ref.load_state_dict(_unstacked(state["reference"], ref), strict=run.experts is None)
        if run.reward_model is not None:
            with run.reward_model.on_device() as rm:
                rm.load_state_dict(state["reward_model"])
    saved_layout = (meta["world"], *(meta["config"][k] for k in LAYOUT_FIELDS))
    own = None
    if saved_layout == (run.roles.world, *(getattr(run.cfg, k) for k in LAYOUT_FIELDS)):
        own = read_own(path, run.rank)
        _load_own(run, own)
    else:
        _regenerate(run, path, meta)
    _load_residual(run, own, meta)
    run.log.reopen_metrics()
    if run.rank == 0:
        run.log.say(f"resumed from {path}: step {meta['step']}, "
                    f"held-out accuracy {run.log.accuracy:.3f}")
        _supersede_later(run.out_dir, meta["step"])


def _supersede_later(out_dir, step):
    """Checkpoints after the one resumed from belong to an abandoned timeline: moved aside, kept."""
    for later, path in complete_checkpoints(out_dir):
        if later > step:
            aside = os.path.join(out_dir, "checkpoints", "superseded", f"step_{later}")
            shutil.rmtree(aside, ignore_errors=True)
            os.renames(path, aside)


def _device_rng(device, state=None):
    """The RNG state of an accelerator's default generator (CPU's is saved as "torch"), or, given
    `state`, set it: through the device's own module (torch.cuda, torch.xpu, a plugin's torch.npu),
    as torch has no device-generic call for it."""
    module = getattr(torch, device.type)
    if state is None:
        return module.get_rng_state(device)
    module.set_rng_state(state, device)


def _load_own(run, own):
    _drop_per_token(own, set(run.queue.spec.columns), set(run.per_token))
    cells = own["queue"]["cells"]
    # else a read would wait on it (a row written here: a hybrid's auxiliary rank holds only the
    # columns it added)
    if any(c == "reward" and (row, "prompt") in cells and (row, "rule_reward") not in cells
           for (row, c) in cells):
        raise ValueError("the checkpoint's queued rows have no rule_reward column "
                         "(saved by older code): resume it with that code, "
                         "or from a checkpoint without queued rows")
    torch.set_rng_state(own["rng"]["torch"])
    # saved on this kind of accelerator
    if run.device.type != "cpu" and run.device.type in own["rng"]:
        _device_rng(run.device, own["rng"][run.device.type])
    run.warm_stream.load_state_dict(own["warm_stream"])
    run.curriculum.load_state_dict(own["curriculum"])
    if run.sched is not None:
        run.sched.load_state_dict(own["sched"])
    if run.actor is not None:
        run.actor.load_state_dict(own["actor"])
    if hasattr(run.experts, "balancer") and "eplb" in own:
        run.experts.balancer.load_state_dict(own["eplb"])  # else the blocks, until a rollout
    run.load_own_state(own.get("run", {}))
    run.queue.load_state_dict(own["queue"])  # collective: every rank publishes the rows it holds


def _drop_per_token(own, columns, keep):
    """The sampler's per-token fields this run does not carry (a checkpoint of a run that recorded
    each token's experts, resumed without routing replay: older code always recorded them) leave the
    queued rows (`columns`: this queue's) and the samples in flight (`keep`: this run's fields)."""
    queue = own["queue"]
    queue["cells"] = {k: v for k, v in queue["cells"].items() if k[1] in columns}
    queue["served"] = {k: v for k, v in queue["served"].items() if k[1] in columns}
    for group in own.get("sched", {}).get("pool", []):
        for sample in group["samples"]:
            fields = sample.get("per_token", {})
            sample["per_token"] = {n: v for n, v in fields.items() if n in keep}


def _load_residual(run, own, meta):
    """--nodes: the gradient sync's error-feedback residual, where this rank saved it in the same
    layout of nodes, units and compression; otherwise it starts at zero, said on rank 0 (what it
    held, at most the gradient that compression had not yet sent, is lost)."""
    defaults = {"nodes": 1, "grad_compress": "none", "fsdp_units": "model"}
    if run.grad_sync is None:
        if run.rank == 0 and meta["config"].get("grad_compress", "none") != "none":
            print(f"resuming at --nodes {run.cfg.nodes} from a checkpoint of --nodes "
                  f"{meta['config'].get('nodes', 1)} --grad-compress "
                  f"{meta['config']['grad_compress']}: its error-feedback residual (the gradient "
                  "that compression had not yet sent) is dropped", flush=True)
        return
    same = all(meta["config"].get(k, d) == getattr(run.cfg, k) for k, d in defaults.items())
    if own is not None and same and "grad_sync" in own:
        run.grad_sync.load_state_dict(own["grad_sync"])
    elif run.rank == 0 and run.cfg.grad_compress != "none":
        saved = ", ".join(f"--{k.replace('_', '-')} {meta['config'].get(k, d)}"
                          for k, d in defaults.items())
        print(f"resuming with --nodes {run.cfg.nodes} --grad-compress {run.cfg.grad_compress} "
              f"from a checkpoint of world {meta['world']}, {saved}: "
              "the error-feedback residual starts at zero", flush=True)


def _regenerate(run, path, meta):
    """Another world size or deployment: the saved replicas' groups (queued, or in flight) have no
    replica to continue on. They are dropped and counted in stale/regenerated; this run's replicas
    start at the checkpoint's step, their first slots again, at their first attempts, drawn with the
    counts of the curriculum a saved generator held (the same on every generator; a separated
    trainer's are empty). At S > 0 a batch may have taken slots beyond the step's (a later slot that
    completed first, or, under the shared cut, a replica's groups given for a held-back peer): those
    are drawn again. The run trains as many groups, not the same ones."""
    from plumbing.config import Roles
    cfg, step, saved = run.cfg, meta["step"], meta["config"]
    old = Roles(meta["world"], saved["deploy"] == "separated", saved["infer_tp"])
    owns = [read_own(path, r) for r in old.writers()]
    dropped = sum(_groups_not_trained(own, cfg.group_size) for own in owns)
    run.curriculum.load_state_dict(owns[0]["curriculum"])
    run.log.regenerated += dropped
    run.log.extra_groups += dropped
    rows = step * cfg.prompts_per_step * cfg.group_size
    run.queue.next_local = rows // max(run.roles.replicas, 1)
    if run.sched is not None:
        run.sched.start_at(step)
    if run.rank == 0:
        print(f"resuming at world {run.roles.world} ({cfg.deploy}) from world {meta['world']} "
              f"({saved['deploy']}): {dropped} groups not yet trained are regenerated", flush=True)


def _groups_not_trained(own, group_size):
    """How many groups a saved replica held untrained: queued (group_size rows each), in flight."""
    queued = sum(c == "prompt" for (_, c) in own["queue"]["cells"])
    return queued // group_size + len(own["sched"]["pool"])
