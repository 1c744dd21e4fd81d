"""checkpoint.py: a stopped and resumed run trains to the parameters of one that never stopped; the
checkpoint is atomic, reshards, refuses what does not fit, what is damaged (naming the file and the field)
and what another user may have written, and its own files load no pickled code (DCP gets tensors only); rank
0 chooses the checkpoint for every rank; a dead rank ends the job with an error, and under torchrun's
restarts the job comes back on its own."""
import functools
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

from plumbing import checkpoint
from plumbing.runlog import STALE_FACTS
import train_grpo as T
from plumbing.config import Config
from tests.distributed import free_port, run_distributed
from tests.test_train_grpo import RM, TINY, _train_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = dict(steps=6, save_every=3, keep_last=0)


def _lines(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


SLOW = pytest.mark.slow  # the fast suite keeps one run per deployment; these layouts resume in the slow one


@pytest.mark.parametrize("mode", [{"staleness": 0}, {"staleness": 2, "chunk_steps": 1},
                                  {"deploy": "separated", "staleness": 0},
                                  pytest.param({"train_ep": 2, "infer_ep": 1, "staleness": 1, "chunk_steps": 1},
                                               marks=SLOW),
                                  pytest.param({"nodes": 2, "grad_compress": "topk-int8", "staleness": 0}, marks=SLOW),
                                  pytest.param({**RM, "staleness": 0},
                                               marks=SLOW),
                                  pytest.param({"train_ep": 2, "infer_ep": 2, "eplb": True, "staleness": 0}, marks=SLOW)],
                         ids=["colocated-S0", "colocated-S2-partial", "separated-S0", "expert-parallel",
                              "nodes-compressed", "reward-model", "eplb"])
def test_stopped_and_resumed_run_trains_to_the_same_parameters(tmp_path, mode):
    """Run 6 steps saving at step 3; then, in new processes, resume from step 3 and run 3 more: the final
    parameters are bit-identical, and metrics.jsonl holds every step once."""
    mode = dict(CKPT, **mode)
    straight = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path), mode))
    step_3 = checkpoint.folder(str(tmp_path), 3)
    own = torch.load(os.path.join(step_3, f"rank_{1}.pt"), weights_only=True)
    if mode["staleness"] == 2:  # the checkpoint holds partial rollouts: samples with tokens, not done
        pool = own["sched"]["pool"]
        assert any(s["tokens"].numel() and not s["done"] for g in pool for s in g["samples"])
    if "nodes" in mode:  # the error-feedback residual: part of the cut, and not zero
        assert any(r.abs().sum() > 0 for r in own["grad_sync"].values())
    if "eplb" in mode:  # the loads that place the experts at the next switch: part of the cut
        assert own["eplb"]["loads"] is not None
    straight_lr = [l["train/lr"] for l in _lines(tmp_path)[1:]]
    resumed = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path), dict(mode, resume=step_3)))
    assert [l["train/lr"] for l in _lines(tmp_path)[1:]] == straight_lr  # resumed where it was: steps 4 to 6
    assert torch.equal(straight[0][1], resumed[0][1])
    assert straight[0][0]["params_sha256"] == resumed[0][0]["params_sha256"] is not None
    assert resumed[0][0]["resumed_at_step"] == 3
    lines = _lines(tmp_path)
    assert [l["step"] for l in lines] == list(range(7))
    assert any(abs(l["loss"]) > 1e-4 for l in lines[4:])  # real updates after the resume
    # the first run's step_6 belongs to the abandoned timeline: set aside, and step_6 saved anew
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path))] == [3, 6]
    assert os.path.exists(tmp_path / "checkpoints" / "superseded" / "step_6" / "meta.json")
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["params_sha256"] == straight[0][0]["params_sha256"]


@pytest.mark.parametrize("mode", [{"staleness": 0},
                                  pytest.param({"staleness": 1, "chunk_steps": 1, "filter_groups": 0}, marks=SLOW),
                                  pytest.param({**RM, "staleness": 1,
                                                "chunk_steps": 1, "filter_groups": 0, "curriculum": 0}, marks=SLOW),
                                  pytest.param({"staleness": 2, "chunk_steps": 1, "filter_groups": 0}, marks=SLOW),
                                  pytest.param({"staleness": 1, "train_ep": 2, "infer_ep": 1}, marks=SLOW)],
                         ids=["S0", "S1-ahead", "reward-model", "S2", "EP"])
def test_a_stopped_and_resumed_hybrid_run_trains_to_the_same_parameters(tmp_path, mode):
    """--deploy hybrid at world 3 (the actor on ranks 0 and 1, the reference and the reward model on rank 2), 6 steps
    saving at step 3, then resumed from step 3 in new processes: the parameters of the run that never stopped, bit for
    bit. Rank 2's file holds the reference (and the reward model) and its progress through the groups; at S = 1 the
    actor's groups put ahead of their batch, and their columns on rank 2, wait in the queue's saved rows (S = 2 too)."""
    mode = dict(CKPT, deploy="hybrid", **mode)
    straight = run_distributed(_train_tiny, world_size=3, args=(str(tmp_path), mode))
    step_3 = checkpoint.folder(str(tmp_path), 3)
    aux = torch.load(os.path.join(step_3, "rank_2.pt"), weights_only=True)["run"]
    assert "reference" in aux and ("reward_model" in aux) == bool(mode.get("reward_model"))
    if mode["staleness"] >= 1:  # groups put ahead: in the actor's saved queue, their columns in rank 2's
        ahead = [torch.load(os.path.join(step_3, f"rank_{r}.pt"), weights_only=True)["run"]["rows_ahead"]
                 for r in (0, 1)]
        assert any(ahead)
    resumed = run_distributed(_train_tiny, world_size=3, args=(str(tmp_path), dict(mode, resume=step_3)))
    assert torch.equal(straight[0][1], resumed[0][1]) and torch.equal(straight[1][1], resumed[1][1])
    assert straight[0][0]["params_sha256"] == resumed[0][0]["params_sha256"] is not None
    assert [l["step"] for l in _lines(tmp_path)] == list(range(7))


@SLOW
def test_a_hybrid_checkpoint_resumes_only_as_it_was_saved(tmp_path):
    """Its reference lives in the auxiliary ranks' files: another deployment or world is refused at the start, before
    anything is built or written, naming both placements."""
    run_distributed(_train_tiny, world_size=3, args=(str(tmp_path), dict(CKPT, deploy="hybrid", steps=3)))
    step_3 = checkpoint.folder(str(tmp_path), 3)
    with pytest.raises(RuntimeError) as e:
        run_distributed(_train_tiny, world_size=2, args=(str(tmp_path), dict(CKPT, resume=step_3)))
    assert "was saved by --deploy hybrid at world 3 (--aux-ranks 1), this run is --deploy colocated at world 2" \
        in str(e.value)


def _train_recording(rank, world_size, out_dir, overrides):
    """_train_tiny, also returning the sample ids this rank read from the queue at each step, and its
    scheduler's accounting of every sample id (generators)."""
    import distqueue
    reads, runs, get, build_queue = [], [], distqueue.DistQueue.get, T.build_queue

    def recording_get(self, *args, **kwargs):
        rows = get(self, *args, **kwargs)
        reads.append([int(t[STALE_FACTS.index("sample_id")]) for t in rows.cols["stale"]])
        return rows
    distqueue.DistQueue.get = recording_get  # this rank's process only
    T.build_queue = lambda run, *a, **k: runs.append(run) or build_queue(run, *a, **k)  # every deployment's
    summary, params = _train_tiny(rank, world_size, out_dir, overrides)
    sched = runs[0].sched
    return summary, params, reads, sched.accounting() if sched else None, sched.next_id if sched else None


def test_separated_with_staleness_resumes_with_every_sample_trained_once(tmp_path):
    """Separated, S = 1: the generators run ahead, so at the checkpoint rows of the next batch are queued
    and groups are in flight. Resumed from step 3, the run trains every sample id exactly once over steps
    1-6, no age exceeds S, and the generator's accounting covers every id it ever issued."""
    mode = dict(CKPT, deploy="separated", staleness=1, chunk_steps=1, threshold=0.5)
    first = run_distributed(_train_recording, world_size=2, args=(str(tmp_path), mode))
    step_3 = checkpoint.folder(str(tmp_path), 3)
    own = torch.load(os.path.join(step_3, "rank_1.pt"), weights_only=True)
    ahead = len(own["queue"]["cells"]) + len(own["sched"]["pool"])
    resumed = run_distributed(_train_recording, world_size=2, args=(str(tmp_path), dict(mode, resume=step_3)))
    trained = [i for step in first[0][2][:3] + resumed[0][2] for i in step]  # trainer 0's reads, steps 1-6
    per_step = TINY["prompts_per_step"] * TINY["group_size"]
    assert len(trained) == len(set(trained)) == 6 * per_step
    accounting, issued = resumed[1][3], resumed[1][4]
    assert accounting["trained"] == set(trained)
    fates = [accounting[k] for k in ("trained", "regenerated", "filtered", "in_flight")]
    assert sum(map(len, fates)) == len(set().union(*fates)) == issued  # a partition of every id issued
    assert all(l["stale/age_max"] <= 1 for l in _lines(tmp_path)[1:])
    assert ahead > 0, "nothing was ahead of the trainers at the checkpoint: the test proves less than it says"


@pytest.mark.slow  # the colocated resumes (fast) carry the curriculum's counts too
def test_a_separated_run_resumes_its_curriculum_exactly(tmp_path):
    """Separated, S = 0: a generator saves its curriculum right after it learned from the groups of the version it
    received; resumed from step 3, it must not learn again at start (a second decay would change every draw):
    its counts at the end, and the parameters, are those of the run that never stopped."""
    from tests.test_train_grpo import _train_learning
    mode = dict(CKPT, deploy="separated", staleness=0)
    straight = run_distributed(_train_learning, world_size=2, args=(str(tmp_path), mode))
    resumed = run_distributed(_train_learning, world_size=2,
                              args=(str(tmp_path), dict(mode, resume=checkpoint.folder(str(tmp_path), 3))))
    assert straight[1][2].any() and np.array_equal(straight[1][2], resumed[1][2])  # the generator's counts
    assert torch.equal(straight[0][1], resumed[0][1])


def _loaded_state(rank, world_size, out_dir, overrides):
    """Build a run and resume it from its checkpoint, train nothing: the full model and optimizer state, in the
    dense model's layout (EP's experts stacked, as a checkpoint holds them), whatever this run's layout."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    run = T.build(Config(**dict(TINY, **overrides), out=out_dir), out_dir)
    T.attach_reference(run)
    checkpoint.resume(run)
    model, optim = get_state_dict(run.model, run.optimizer, options=StateDictOptions(full_state_dict=True))
    model, optim = checkpoint._stacked(model, run.model), checkpoint._stacked(optim["state"], run.model)
    return model, optim, run.log.regenerated, (run.sched.slots_opened, run.curriculum.counts)


def _saved_state(rank, world_size, out_dir, overrides):
    _train_tiny(rank, world_size, out_dir, overrides)
    return _loaded_state(rank, world_size, out_dir, dict(overrides, resume="auto", steps=overrides["steps"] + 1))


def test_a_checkpoint_saved_at_two_ranks_resumes_at_one(tmp_path):
    """Model and optimizer reshard on load (FSDP shards of 2 ranks -> 1); the groups in flight on the two
    saved replicas are counted as regenerated, and the one replica now starts at the checkpoint's slots,
    drawing their prompts with the curriculum's saved counts."""
    mode = dict(CKPT, steps=3, staleness=2, chunk_steps=1)
    (model2, optim2, _, _), _ = run_distributed(_saved_state, world_size=2, args=(str(tmp_path), mode))
    [(model1, optim1, regenerated, (slots, counts))] = run_distributed(
        _loaded_state, world_size=1, args=(str(tmp_path), dict(mode, resume="auto", steps=4)))
    assert model1.keys() == model2.keys() and all(torch.equal(model1[k], model2[k]) for k in model2)
    assert optim1.keys() == optim2.keys()
    assert all(torch.equal(optim1[k][s], optim2[k][s]) for k in optim2 for s in optim2[k])
    saved = [torch.load(os.path.join(checkpoint.folder(str(tmp_path), 3), f"rank_{r}.pt"), weights_only=True)
             for r in range(2)]
    in_flight = sum(len(o["sched"]["pool"]) for o in saved)
    assert regenerated == in_flight > 0 and slots == 3 * TINY["prompts_per_step"]
    assert saved[0]["curriculum"] == saved[1]["curriculum"] and counts.tolist() == saved[0]["curriculum"]["counts"]


@pytest.mark.parametrize("saved_pp, resumed_pp", [(2, 1), pytest.param(1, 2, marks=SLOW)])
def test_a_pipeline_checkpoint_resumes_without_the_pipeline_and_back(tmp_path, saved_pp, resumed_pp):
    """A checkpoint holds every weight and optimizer state under the whole model's names, whatever the stages:
    saved at --train-pp 2 it resumes at 1 (and back), the reference too, and trains on to the parameters of a run
    that never stopped, up to the float summation order the two layouts differ by (tests/test_train_grpo.py)."""
    from tests.test_train_grpo import assert_same_training
    mode = dict(CKPT, staleness=0)
    straight = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "a"), dict(mode, train_pp=saved_pp)))
    step_3 = checkpoint.folder(str(tmp_path / "a"), 3)
    resumed = run_distributed(_train_tiny, world_size=2, timeout_s=180, args=(
        str(tmp_path / "a"), dict(mode, train_pp=resumed_pp, resume=step_3)))
    assert resumed[0][0]["resumed_at_step"] == 3 and torch.equal(resumed[0][1], resumed[1][1])
    assert_same_training(resumed[0][1], straight[0][1], f"PP {saved_pp} -> {resumed_pp}")
    assert any(abs(l["loss"]) > 1e-4 for l in _lines(tmp_path / "a")[4:])


@pytest.mark.parametrize("saved_ep, resumed_ep", [(0, "auto"), pytest.param("auto", 0, marks=SLOW)])
def test_a_checkpoint_saved_without_ep_resumes_under_it_and_back(tmp_path, saved_ep, resumed_ep):
    """The experts are saved as the dense model stacks them, whatever the layout: a checkpoint of a run with its
    experts in FSDP2 (--train-ep 0, as older code saved by default) resumes with EP 2 in training (auto, at world 2)
    and the reverse, and trains on to the parameters of a run that never stopped, up to the float summation order
    the two layouts differ by; the optimizer's state and the reference come along."""
    from tests.test_train_grpo import assert_same_training
    mode = dict(CKPT, staleness=0)
    straight = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "a"), dict(mode, train_ep=saved_ep)))
    step_3 = checkpoint.folder(str(tmp_path / "a"), 3)
    resumed = run_distributed(_train_tiny, world_size=2, args=(
        str(tmp_path / "a"), dict(mode, train_ep=resumed_ep, resume=step_3)))
    assert resumed[0][0]["resumed_at_step"] == 3 and torch.equal(resumed[0][1], resumed[1][1])
    assert_same_training(resumed[0][1], straight[0][1], f"EP {saved_ep} -> {resumed_ep}")
    assert any(abs(l["loss"]) > 1e-4 for l in _lines(tmp_path / "a")[4:])


def test_a_checkpoint_with_recorded_routes_resumes_without_them(tmp_path):
    """Older code recorded each token's experts in every run (a queue column and a per-token field of the samples
    in flight): such a checkpoint (here: routing replay on, its experts in FSDP2, S = 1, rows queued and groups in
    flight at the save) resumes under today's defaults (no routing replay, EP on), the routes dropped, and trains
    on to the end."""
    mode = dict(CKPT, staleness=1, chunk_steps=1)
    run_distributed(_train_tiny, world_size=2, args=(str(tmp_path), dict(mode, routing_replay=True, train_ep=0)))
    step_3 = checkpoint.folder(str(tmp_path), 3)
    own = torch.load(os.path.join(step_3, "rank_0.pt"), weights_only=True)
    assert any(c == "routes" for _, c in own["queue"]["cells"]) or any(
        "routes" in s["per_token"] for g in own["sched"]["pool"] for s in g["samples"])  # there was something to drop
    resumed = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path), dict(mode, resume=step_3)))
    assert resumed[0][0]["resumed_at_step"] == 3 and torch.equal(resumed[0][1], resumed[1][1])
    lines = _lines(tmp_path)
    assert [l["step"] for l in lines][-3:] == [4, 5, 6] and not any(k.startswith("moe/") for k in lines[-1])


def test_a_separated_checkpoint_resumes_colocated_at_one_rank_and_trains_on(tmp_path):
    """Separated S = 1 at 2 ranks, saved with rows of the next batch queued and groups in flight; resumed
    colocated at 1 rank: both kinds of groups are regenerated (counted) and the run trains to the end."""
    mode = dict(CKPT, deploy="separated", staleness=1, chunk_steps=1, filter_groups=False)  # no refills: it runs
    run_distributed(_train_tiny, world_size=2, args=(str(tmp_path), mode))  # ahead (6 steps: rows queued at step 3)
    step_3 = checkpoint.folder(str(tmp_path), 3)
    own = torch.load(os.path.join(step_3, "rank_1.pt"), weights_only=True)
    queued = sum(c == "prompt" for (_, c) in own["queue"]["cells"]) // TINY["group_size"]  # group_size rows a group
    groups = queued + len(own["sched"]["pool"])
    [(summary, p)] = run_distributed(_train_tiny, world_size=1, args=(
        str(tmp_path), dict(mode, deploy="colocated", resume=step_3, steps=5)))
    lines = _lines(tmp_path)
    assert queued > 0 and [l["step"] for l in lines] == list(range(6)) and torch.isfinite(p).all()
    assert lines[4]["stale/regenerated"] - lines[3]["stale/regenerated"] == groups
    assert summary["resumed_at_step"] == 3


def _crash_at_third_save(rank, world_size, out_dir, overrides):
    publish = checkpoint._publish
    calls = []

    def crash_once_written(tmp, final):
        calls.append(final)
        if len(calls) == 3:  # the third save: its files are written, the rename never happens
            raise OSError("injected crash between the write and the rename")
        publish(tmp, final)
    checkpoint._publish = crash_once_written
    return _train_tiny(rank, world_size, out_dir, overrides)


def test_a_crash_before_the_rename_leaves_the_previous_checkpoint(tmp_path):
    """--save-every 1 --keep-last 1: steps 1 and 2 save (step_1 removed once step_2 exists), step 3's save dies
    before its rename: the newest complete checkpoint is step 2's, and --resume auto picks it."""
    mode = dict(CKPT, steps=5, save_every=1, keep_last=1)
    with pytest.raises(RuntimeError, match="injected crash"):
        run_distributed(_crash_at_third_save, world_size=1, args=(str(tmp_path), mode))
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == [".tmp_step_3", "step_2"]  # keep-last 1 removed step_1
    assert checkpoint.complete_checkpoints(str(tmp_path)) == [(2, checkpoint.folder(str(tmp_path), 2))]
    [(summary, _)] = run_distributed(_train_tiny, world_size=1, args=(str(tmp_path), dict(mode, resume="auto")))
    assert summary["resumed_at_step"] == 2
    assert [l["step"] for l in _lines(tmp_path)] == list(range(6))
    assert sorted(os.listdir(root)) == ["step_5"]  # the leftover is replaced by step 3's own save, then pruned


def test_a_checkpoint_that_does_not_fit_or_is_damaged_is_refused_before_anything_changes(tmp_path):
    mode = dict(CKPT, steps=2, save_every=2)
    run_distributed(_train_tiny, world_size=1, args=(str(tmp_path), mode))
    path = checkpoint.folder(str(tmp_path), 2)
    metrics = open(tmp_path / "metrics.jsonl").read()
    ended = Config(**dict(TINY, **dict(mode, resume="auto")), out=str(tmp_path))
    with pytest.raises(SystemExit) as restart:  # the run ended: torchrun's restart has nothing to do
        checkpoint.find(ended, str(tmp_path))
    assert restart.value.code == 0
    os.utime(tmp_path / "summary.json", (0, 0))  # a summary older than the checkpoint: no end seen
    with pytest.raises(ValueError, match="--steps 2 leaves nothing to run"):
        checkpoint.find(ended, str(tmp_path))

    def refused(overrides, text):
        cfg = Config(**dict(TINY, **dict(mode, resume="auto", steps=4, **overrides)), out=str(tmp_path))
        with pytest.raises((ValueError, FileNotFoundError), match=text):
            checkpoint.find(cfg, str(tmp_path))
    refused({"d_model": 16}, "--d-model 32 there, 16 here")
    refused({"group_size": 2}, "--group-size 4 there, 2 here")
    refused({"reward_model": True}, "saved with --reward-model 0: resume it with the same")  # another reward
    with pytest.raises(RuntimeError, match="--group-size 4 there, 2 here"):  # the whole run, before any write
        run_distributed(_train_tiny, world_size=1, args=(str(tmp_path), dict(mode, resume="auto", steps=4,
                                                                            group_size=2)))
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:  # a shard cut short
        f.truncate(100)
    refused({}, r"damaged: __0_0.distcp \(size 100, meta.json says \d+\)")
    os.remove(os.path.join(path, "rank_0.pt"))
    refused({}, r"rank_0.pt \(missing\)")
    with pytest.raises(RuntimeError, match="damaged"):
        run_distributed(_train_tiny, world_size=1, args=(str(tmp_path), dict(mode, resume="auto", steps=4)))
    assert open(tmp_path / "metrics.jsonl").read() == metrics
    os.remove(os.path.join(path, "meta.json"))
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        checkpoint.read_meta(path)


class _Payload:
    def __reduce__(self):
        return os.system, ("echo pwned > pwned.txt",)


def test_a_rank_file_loads_no_pickled_code(tmp_path):
    """What the checkpoint adds beside DCP's shards is plain data: a file carrying code is refused."""
    os.makedirs(tmp_path / "step")
    with open(tmp_path / "step" / "rank_0.pt", "wb") as f:
        pickle.dump({"rng": _Payload()}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        checkpoint.read_own(str(tmp_path / "step"), 0)
    assert not os.path.exists("pwned.txt") and not os.path.exists(tmp_path / "pwned.txt")


def _train_with_old_optimizer_settings(rank, world_size, out_dir, overrides):
    """_train_tiny, its RL optimizer set as before commit e9fabe9 (foreach=None) and with other betas."""
    build = T.build

    def old_build(*args, **kwargs):
        run = build(*args, **kwargs)
        for group in run.optimizer.param_groups:
            group.update(foreach=None, betas=(0.5, 0.5))
        return run
    T.build = old_build  # this rank's process only
    return _train_tiny(rank, world_size, out_dir, overrides)


def _resumed_optimizer(rank, world_size, out_dir, overrides):
    """Build a run and resume it, train nothing: its optimizer's settings (no params) and Adam step counts."""
    run = T.build(Config(**dict(TINY, **overrides), out=out_dir), out_dir)
    T.attach_reference(run)
    checkpoint.resume(run)
    T.anneal_lr(run, run.log.share(run.log.start - 1, run.log.seconds))  # as run_loop does, resumed
    groups = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
    return groups, sorted({float(s["step"]) for s in run.optimizer.state.values()})


def test_dcp_holds_only_tensors_and_the_optimizer_settings_are_this_runs(tmp_path):
    """DCP's load unpickles every non-tensor entry with weights_only=False: the checkpoint gives it tensors
    only, and the optimizer's settings (param_groups) go to the rank files, plain data. On resume the
    state (Adam's moments and step) comes from the checkpoint, every setting from this run: a checkpoint
    saved with foreach=None (before commit e9fabe9) and other betas resumes with foreach=True, the betas
    train_grpo.py builds, and this run's --lr, annealed to the checkpoint's place (step 2 of 3)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    mode = dict(CKPT, steps=2, save_every=2)
    run_distributed(_train_with_old_optimizer_settings, world_size=2, args=(str(tmp_path), mode))
    path = checkpoint.folder(str(tmp_path), 2)
    saved = FileSystemReader(path).read_metadata().state_dict_metadata  # DCP's pickle, written by this test
    assert [k for k, m in saved.items() if not isinstance(m, TensorStorageMetadata)] == []
    groups = checkpoint.read_own(path, 0)["optim_groups"]  # its settings (the lr: the next step's), a record
    assert groups and all(g["foreach"] is None and g["betas"] == (0.5, 0.5) for g in groups)
    resumed = run_distributed(_resumed_optimizer, world_size=2, args=(str(tmp_path), dict(mode, steps=3, lr=1e-3,
                                                                                          resume=path)))
    for groups, steps in resumed:
        lr = 1e-3 * (0.1 + 0.9 * 0.25)  # --lr-decay 0.1: a cosine of 2/3 of the way is 0.25
        assert all(g["foreach"] is True and g["betas"] == (0.9, 0.98) and g["lr"] == pytest.approx(lr) for g in groups)
        assert steps == [2.0]  # two optimizer steps, from the checkpoint


def _umask_002_train(rank, world_size, out_dir, overrides):
    """_train_tiny under umask 002 (a user's own group may write what it creates, as on many desktops)."""
    os.umask(0o002)  # this rank's process only
    return _train_tiny(rank, world_size, out_dir, overrides)


def test_a_checkpoint_another_user_owns_or_may_write_is_refused_unless_trusted(tmp_path, monkeypatch):
    """Loading a checkpoint unpickles DCP's .metadata: whoever can write the folder can run code as the
    user who resumes. The folder, the folder holding it and every file in it must be this user's (or
    root's) and writable by no one else, or --trust-checkpoint-perms 1; what the project writes passes,
    even under umask 002."""
    mode = dict(CKPT, steps=2, save_every=2)
    run_distributed(_umask_002_train, world_size=1, args=(str(tmp_path), mode))
    path = checkpoint.folder(str(tmp_path), 2)
    cfg = Config(**dict(TINY, **dict(mode, resume="auto", steps=4)), out=str(tmp_path))
    trusting = Config(**dict(TINY, **dict(mode, resume="auto", steps=4, trust_checkpoint_perms=True)),
                      out=str(tmp_path))
    assert checkpoint.find(cfg, str(tmp_path))[0] == path

    def refused(target, text):
        with pytest.raises(PermissionError, match=text) as e:
            checkpoint.find(cfg, str(tmp_path))
        assert target in str(e.value) and "--trust-checkpoint-perms 1" in str(e.value)  # tmp_path: a real path
        assert checkpoint.find(trusting, str(tmp_path))[0] == path
    for target in (path, os.path.dirname(path), os.path.join(path, ".metadata")):
        mode_was = os.stat(target).st_mode & 0o777
        for writable in (0o020, 0o002):
            os.chmod(target, mode_was | writable)
            refused(target, f"mode {oct(mode_was | writable)}: group- or world-writable")
        os.chmod(target, mode_was)
    os.chmod(os.path.dirname(path), 0o1777)  # a holding folder like /tmp: no one else renames this user's folder
    assert checkpoint.find(cfg, str(tmp_path))[0] == path
    os.chmod(os.path.dirname(path), 0o755)
    os.symlink(os.path.join(path, "meta.json"), os.path.join(path, "extra"))
    refused(os.path.join(path, "extra"), "is a symbolic link")
    os.remove(os.path.join(path, "extra"))
    meta = os.path.join(path, "meta.json")
    if os.geteuid() == 0:
        os.chown(meta, 4242, -1)
        refused(meta, "owned by uid 4242")
    else:  # files of this user, seen by another
        monkeypatch.setattr(os, "geteuid", lambda uid=os.geteuid(): uid + 1)
        refused(os.path.dirname(path), f"owned by uid {os.stat(meta).st_uid}")  # the first one checked
        monkeypatch.undo()
    os.chmod(path, 0o777)
    with pytest.raises(RuntimeError, match="--trust-checkpoint-perms 1"):  # the whole run, before any write
        run_distributed(_train_tiny, world_size=1, args=(str(tmp_path), dict(mode, resume="auto", steps=4)))


def test_a_hand_edited_meta_json_is_refused_naming_the_file_and_the_field(tmp_path):
    """meta.json cut short, or without a field the resume reads, is refused with the file's name and the
    field's, not a TypeError of json's or a bare KeyError."""
    mode = dict(CKPT, steps=2, save_every=2)
    run_distributed(_train_tiny, world_size=1, args=(str(tmp_path), mode))
    meta_path = os.path.join(checkpoint.folder(str(tmp_path), 2), "meta.json")
    text = open(meta_path).read()
    cfg = Config(**dict(TINY, **dict(mode, resume="auto", steps=4)), out=str(tmp_path))

    def refused(edited, field):
        with open(meta_path, "w") as f:
            f.write(edited)
        with pytest.raises(ValueError, match=field) as e:
            checkpoint.find(cfg, str(tmp_path))
        assert meta_path in str(e.value) and "--resume FOLDER" in str(e.value)
    refused(text[:len(text) // 2], "not valid JSON")
    refused("[]", "not a JSON object")
    for field in ("step", "files", "world", "reference", "log", "config", "config.seed", "config.deploy"):
        meta = json.loads(text)
        *parents, key = field.split(".")
        del functools.reduce(dict.__getitem__, parents, meta)[key]
        refused(json.dumps(meta), f"the field {field} is missing")
    meta = dict(json.loads(text), step="2")
    refused(json.dumps(meta), "the field step is '2', not int")


def _resumed_from(rank, world_size, out_dir, overrides, hide):
    """Build a run and resume it, rank 1 seeing the disk as a lagging node may: `hide` "listing", its list
    of checkpoints ends one step early; "meta", step_6's meta.json is not there (yet) for it."""
    if rank == 1 and hide == "listing":
        listed = checkpoint.complete_checkpoints
        checkpoint.complete_checkpoints = lambda out: listed(out)[:-1]
    if rank == 1 and hide == "meta":
        exists = os.path.exists
        os.path.exists = lambda p: not p.endswith(os.path.join("step_6", "meta.json")) and exists(p)
    run = T.build(Config(**dict(TINY, **overrides), out=out_dir), out_dir)
    T.attach_reference(run)
    checkpoint.resume(run)
    return run.resume_from[0], run.log.start


def test_rank_0_chooses_the_checkpoint_and_the_others_follow_or_fail_together(tmp_path):
    """--resume auto: rank 0 lists the checkpoints and chooses; a rank whose listing lags (a shared disk's
    attribute cache) loads rank 0's choice, not an older step's shards; a rank that cannot read the
    chosen folder's meta.json makes every rank fail, naming it."""
    run_distributed(_train_tiny, world_size=2, args=(str(tmp_path), CKPT))  # step_3 and step_6
    mode = dict(CKPT, resume="auto", steps=8)
    step_6 = checkpoint.folder(str(tmp_path), 6)
    resumed = run_distributed(_resumed_from, world_size=2, args=(str(tmp_path), mode, "listing"))
    assert resumed == [(step_6, 7), (step_6, 7)]
    with pytest.raises(RuntimeError, match=r"rank 1: .*step_6 is not a complete checkpoint: it has no meta.json"):
        run_distributed(_resumed_from, world_size=2, args=(str(tmp_path), mode, "meta"))


# --- processes that die ------------------------------------------------------------------------

TINY_FLAGS = [f"--{k.replace('_', '-')}={int(v) if isinstance(v, bool) else v}" for k, v in TINY.items()]


def _wait_for_step(out_dir, step, procs, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    path = os.path.join(out_dir, "metrics.jsonl")
    while time.monotonic() < deadline:
        if os.path.exists(path) and any(json.loads(l)["step"] >= step for l in open(path) if l.strip()):
            return
        assert all(p.poll() is None for p in procs), "a rank exited before the kill"
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} in {path} after {timeout_s}s")


def test_a_killed_rank_makes_its_peer_exit_with_an_error_not_hang(tmp_path):
    """Two ranks started as torchrun would (env://), no restarts: rank 1 is SIGKILLed mid-run; rank 0
    exits non-zero within the timeout, naming the phase it was in (a collective with the dead rank fails
    at once; a wait for its rows in the queue, begun at most at the kill, lasts the timeout)."""
    port, timeout_s = free_port(), 15
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "train_grpo.py", *TINY_FLAGS, "--steps=200", "--rl-seconds=0",
           f"--pg-timeout-s={timeout_s}", f"--out={tmp_path}"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        _wait_for_step(str(tmp_path), 2, procs)
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=timeout_s + 30)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode != 0 and took < timeout_s + 5  # + the exit itself
    assert "rank 0 stopped in" in err, err[-2000:]


def _workers(pid):
    """The train_grpo.py processes whose parent is pid (Linux /proc)."""
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                mine = b"train_grpo.py" in f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and mine:
            out.append(int(d))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds torchrun's workers in /proc")
def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint(tmp_path):
    """torchrun --max-restarts 3 with --resume auto: a worker SIGKILLed after the first checkpoint brings
    the job back from it; the job finishes, every step logged once, with the parameters of a run that
    never stopped (colocated, S = 0). 48 steps: the kill must land before the last checkpoint, and the
    test's poll shares 2 cores with the workers (at 16 steps a loaded machine once saw the run end first)."""
    steps = 48
    flags = [*TINY_FLAGS, f"--steps={steps}", "--save-every=2", "--rl-seconds=0", "--resume=auto",
             f"--out={tmp_path}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=3",
           "train_grpo.py", *flags]
    job = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)  # killpg ends its workers
    try:
        deadline = time.monotonic() + 120
        while not checkpoint.complete_checkpoints(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = _workers(job.pid)
        assert checkpoint.complete_checkpoints(str(tmp_path)) and workers, "no checkpoint, or no worker to kill"
        os.kill(workers[-1], signal.SIGKILL)
        out, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["resumed_at_step"] is not None and summary["resumed_at_step"] >= 2
    assert [l["step"] for l in _lines(tmp_path)] == list(range(steps + 1))
    [(straight, _)] = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "straight"),
                                                                         dict(CKPT, steps=steps, save_every=0)))[:1]
    assert summary["params_sha256"] == straight["params_sha256"]


def test_a_compressed_residual_dropped_at_one_node_is_said(capsys):
    """Resumed at --nodes 1 from a --nodes 2 --grad-compress topk-int8 checkpoint: rank 0 says that the
    unsent gradient is dropped (there is no gradient sync to carry it); other ranks stay quiet."""
    meta = {"world": 4, "config": {"nodes": 2, "grad_compress": "topk-int8", "fsdp_units": "model"}}
    for rank in (0, 1):
        run = types.SimpleNamespace(grad_sync=None, rank=rank, cfg=Config(nodes=1))
        checkpoint._load_residual(run, {"grad_sync": {}}, meta)
        said = capsys.readouterr().out
        assert ("its error-feedback residual (the gradient that compression had not yet sent) is dropped"
                in said) == (rank == 0)
    quiet = {"world": 2, "config": {"nodes": 1, "grad_compress": "none"}}
    checkpoint._load_residual(types.SimpleNamespace(grad_sync=None, rank=0, cfg=Config()), None, quiet)
    assert capsys.readouterr().out == ""
