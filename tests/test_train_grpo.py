"""train_grpo.py end to end: its arguments, and every deployment against a world of one."""
import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import train_grpo as T
from options import hybrid, hybrid_aux
from plumbing import checkpoint
from plumbing.config import Config, parse_args, validate
from tests.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- arguments ------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, text", [
    (["--group-size", "1"], "--group-size 1"),
    (["--prompts-per-step", "3"], "--prompts-per-step 3 must be a positive multiple of the 2 rollout replicas"),
    (["--deploy", "separated", "--infer-tp", "2"], "--deploy separated needs an even world size"),
    (["--staleness", "-1"], "--staleness -1"),
    (["--threshold", "1.5"], "threshold=1.5 is outside the valid range (0, 1]"),
    (["--chunk-steps", "0"], "--chunk-steps 0 must be >= 1"),
    (["--grad-clip", "0"], "--grad-clip 0.0 and --warmup-lr 0.005 must be > 0"),
    (["--warmup-steps", "-5"], "--warmup-steps -5 must be >= 0"),
    (["--pg-timeout-s", "0"], "--pg-timeout-s 0 must be >= 1"),
    # every size >= 1 and every float finite, before the model is built or a process group exists
    (["--n-heads", "0"], "--n-heads 0 must be >= 1"),
    (["--d-model", "0"], "--d-model 0 must be >= 1"),
    (["--d-expert", "0"], "--d-expert 0 must be >= 1"),
    (["--n-layers", "0"], "--n-layers 0 must be >= 1"),
    (["--group-size", "0", "--adv-estimator", "reinforce++", "--filter-groups", "0"], "--group-size 0 must be >= 1"),
    (["--lr", "nan"], "--lr nan must be a finite number"),
    (["--lr-decay", "1.5"], "--lr-decay 1.5 must be in [0, 1] (1: a constant learning rate)"),
    (["--kl-coef", "nan"], "--kl-coef nan must be a finite number"),
    (["--clip-eps", "nan"], "--clip-eps nan must be a finite number"),
    (["--rl-seconds", "nan"], "--rl-seconds nan must be a finite number"),
    (["--temperature", "inf"], "--temperature inf must be a finite number"),
    (["--infer-tp", "2", "--d-expert", "33"], "--d-expert 33 must be a multiple of --infer-tp 2"),
    (["--d-model", "62"], "--d-model 62 must split into --n-heads 4 heads of even width"),
    (["--top-k", "5"], "--top-k 5 must be at most --n-experts 4"),
    (["--bucket-kb", "1", "--train-ep", "0"], "--bucket-kb 1 is smaller than the largest weight, blocks.0.moe.w_gate "
                                               "(131072 bytes)"),
    # EP on (auto, at world 2): an expert moves alone, one slice of its stack
    (["--bucket-kb", "1"], "--bucket-kb 1 is smaller than the largest weight, blocks.0.attn.qkv.weight (49152 bytes)"),
    (["--bucket-kb", "50", "--d-expert", "256"], "--bucket-kb 50 is smaller than the largest weight, "
                                                 "blocks.0.moe.w_gate[e], one expert's, (65536 bytes)"),
    (["--infer-tp", "4"], "--infer-tp 4 must be 1, 2 or 4 and divide both the world size 2"),
    (["--top-p", "1.5"], "--top-p 1.5"),
    (["--max-new-tokens", "10"], "--max-new-tokens 10 cannot hold"),
    (["--n-heads", "3"], "--d-model 64 must split into --n-heads 3 heads"),
    (["--train-ep", "2", "--infer-ep", "0"], "--train-ep 2 and --infer-ep 0: set both"),
    (["--train-ep", "3", "--infer-ep", "1"], "--train-ep 3: EP degree 3 does not divide n_experts 4 or world size 2"),
    (["--train-ep", "2", "--infer-ep", "2", "--infer-tp", "2"], "--train-ep needs a colocated deployment with "
                                                                 "--infer-tp 1"),
    (["--train-ep", "2", "--infer-ep", "1", "--deploy", "separated"], "--train-ep needs a colocated deployment"),
    (["--train-pp", "2", "--n-layers", "3"], "--train-pp 2 must divide the world size 2 and --n-layers 3"),
    (["--train-pp", "2", "--train-ep", "2", "--infer-ep", "1"], "--train-pp 2 with --train-ep 2 is not supported"),
    (["--train-pp", "2", "--deploy", "separated"], "--train-pp 2 with --deploy separated is not supported"),
    (["--train-pp", "2", "--micro-batches", "3"], "must split into --micro-batches x --updates-per-batch = 3"),
    (["--train-pp", "0"], "--train-pp 0 must be >= 1"),
    (["--train-pp", "2", "--micro-batches", "1"], "--micro-batches 1 must be at least --train-pp 2"),
    (["--reward-model", "1", "--deploy", "separated"], "--reward-model 1 with --deploy separated is not supported"),
    (["--reward-model", "1", "--rm-steps", "0"], "--rm-steps 0 must be >= 1"),
    (["--reward-model", "1", "--rm-watch-below", "1.5"], "--rm-watch-below 1.5 must be in [0, 1]"),
    (["--rm-watch-below", "nan"], "--rm-watch-below nan must be in [0, 1]"),
    (["--nodes", "3"], "--nodes 3 must divide the world size 2"),
    (["--nodes", "0"], "--nodes 0 must be >= 1"),
    (["--nodes", "2", "--deploy", "separated"], "--nodes 2 with --deploy separated is not supported"),
    (["--nodes", "2", "--train-ep", "2", "--infer-ep", "1"], "--nodes 2 with --train-ep 2 is not supported"),
    (["--nodes", "2", "--grad-topk", "0"], "--grad-topk 0.0 must be in (0, 1]"),
    (["--nodes", "2", "--grad-topk", "nan"], "--grad-topk nan must be a finite number"),
    (["--grad-topk", "1.5"], "--grad-topk 1.5 must be in (0, 1]"),  # at --nodes 1 too
    (["--grad-topk", "0"], "--grad-topk 0.0 must be in (0, 1]"),
    (["--grad-compress", "int8"], "--grad-compress int8 acts on the gradient average across nodes: it needs --nodes > 1"),
    (["--grad-overlap", "1"], "--grad-overlap 1 acts on the gradient average across nodes"),
    (["--aux-ranks", "1"], "--aux-ranks 1 places the auxiliary stage of --deploy hybrid (got --deploy colocated)"),
    (["--deploy", "hybrid", "--aux-ranks", "2"], "--aux-ranks 2 must be in [1, world size 2)"),
    (["--deploy", "hybrid", "--aux-ranks", "0"], "--aux-ranks 0 must be in [1, world size 2)"),
    (["--deploy", "hybrid", "--train-pp", "2"], "--deploy hybrid with --train-pp 2 is not supported: the pipeline"),
    (["--deploy", "hybrid", "--eplb", "1", "--train-ep", "2", "--infer-ep", "2", "--aux-ranks", "1"],
     "--deploy hybrid with --eplb 1 is not supported"),
    (["--deploy", "hybrid", "--liveness-s", "0"], "--liveness-s 0.0 must be > 0"),
    (["--deploy", "hybrid", "--kl-coef", "0"], "--deploy hybrid with --kl-coef 0 and no --reward-model leaves the "
                                               "auxiliary ranks nothing to compute"),
])
def test_bad_arguments_are_named(flags, text):
    _, cfg = parse_args(flags)
    with pytest.raises(ValueError) as e:
        validate(cfg, world_size=2)
    assert text in str(e.value)


def test_expert_layouts_that_do_not_nest_and_pipelines_over_2_stages_are_refused():
    _, cfg = parse_args(["--n-experts", "6", "--train-ep", "2", "--infer-ep", "3"])
    with pytest.raises(ValueError, match="--train-ep 2 and --infer-ep 3: one must divide the other"):
        validate(cfg, world_size=6)
    _, cfg = parse_args(["--train-pp", "4", "--n-layers", "4"])
    with pytest.raises(ValueError, match="--train-pp 4: 1 or 2"):
        validate(cfg, world_size=4)


def test_cli_rejects_bad_arguments_before_starting(capsys):
    r = subprocess.run([sys.executable, "train_grpo.py", "--group-size", "1", "--loss-agg", "token-mean"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--group-size 1" in r.stderr
    with pytest.raises(SystemExit) as e:  # the same main, in this process: refused before any process group
        T.main(["--loss-agg", "mean"])
    assert e.value.code == 2 and "invalid choice: 'mean'" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_each_rank_takes_its_own_gpu_or_the_launch_is_refused():
    from plumbing.distributed import local_gpu
    assert local_gpu({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, n_gpus=8) == 3
    assert local_gpu({}, n_gpus=1) == 0  # a world of one
    with pytest.raises(ValueError, match="RANK 1 of WORLD_SIZE 2 and no LOCAL_RANK"):
        local_gpu({"RANK": "1", "WORLD_SIZE": "2"}, n_gpus=2)  # would put both ranks on GPU 0
    with pytest.raises(ValueError, match="LOCAL_RANK 2, but this node has 2 GPUs"):
        local_gpu({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}, n_gpus=2)


def test_import_starts_no_training(tmp_path):
    r = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); import train_grpo"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "" and os.listdir(tmp_path) == []


# --- end to end -----------------------------------------------------------------------------

# Short strings and a short warm-up, so that groups get mixed rewards and the GRPO updates are not zero.
TINY = dict(max_digits=2, max_new_tokens=4, eval_prompts=8, d_model=32, d_expert=32, warmup_steps=30,
            warmup_batch=8, steps=3, prompts_per_step=4, group_size=4, eval_every=2, updates_per_batch=1,
            kl_coef=0.05, lr=3e-3, lr_decay=0.1, rl_seconds=0,  # the lr annealed by the steps alone, not a clock
            device="cpu",  # gloo ranks on CPU, even where a GPU is present
            staleness=0, threshold=0.5)  # synchronous: every world the same (dynamic sampling and curriculum on)
# --reward-model 1 at TINY's size: a short fit, checked on 8 fresh prompts a length bucket.
RM = {"reward_model": True, "rm_samples": 64, "rm_steps": 20, "rm_check": 8}


# The hybrid's reference: its actor's layout, colocated with the reference on host, EP off as the hybrid has it (an
# EP run's float order differs, and Adam can turn that into an lr-sized step on a few weights; EP has its own tests).
COLOCATED_ALL = {"deploy": "colocated-all", "train_ep": 0}


def full_state_dict(model):
    """The whole trained policy on every rank, in the dense model's names and order (collective)."""
    from options import pipeline
    if isinstance(model, pipeline.Stage):
        return pipeline.full_state_dict(model)
    return checkpoint.dense_state_dict(model)


def _train_tiny(rank, world_size, out_dir, overrides=None):
    summary, model = T.train(Config(**dict(TINY, **(overrides or {})), out=out_dir), out_dir=out_dir)
    if model is None:  # a generator rank of the separated deployment holds no training model
        return summary, None
    full = full_state_dict(model)  # every stage's (PP), shards and experts gathered
    return summary, torch.cat([v.flatten() for v in full.values()])


def _train_learning(rank, world_size, out_dir, overrides=None):
    """_train_tiny, also returning the curriculum's counts this rank ends with (a generator's: the counts every
    rollout replica sums; a separated trainer's stay empty)."""
    runs, build_queue = [], T.build_queue  # every deployment's build calls it: the run, this rank's process only
    T.build_queue = lambda run, *a, **k: runs.append(run) or build_queue(run, *a, **k)
    summary, params = _train_tiny(rank, world_size, out_dir, overrides)
    return summary, params, runs[0].curriculum.counts


def assert_same_training(p, ref, what):
    """Equal up to float reduction order. Adam divides each gradient by its own scale, so a float-level
    difference in a near-zero gradient can move a weight by a fraction of lr: allow that on a handful of
    weights, never on the bulk (a wrong sample or a wrong loss scale moves nearly every weight)."""
    close = (p - ref).abs() <= 2e-5 + 1e-4 * ref.abs()
    assert close.float().mean() > 0.999 and (p - ref).abs().max() < 0.1 * TINY["lr"], \
        f"{what}: {int((~close).sum())} of {p.numel()} weights differ, by up to {(p - ref).abs().max():.2e}"


class _NoOptions:
    """An import finder that refuses every module of options/."""
    def find_spec(self, name, path=None, target=None):
        if name == "options" or name.startswith("options."):
            raise ImportError(f"the default run imported {name}")
        return None


def _without_options(rank, world_size, out_dir):
    """_train_tiny with the defaults, options/ made unimportable first (this process imported it with
    the test module): the run's EP layout, its summary and its parameters."""
    for name in [m for m in sys.modules if m == "options" or m.startswith("options.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _NoOptions())
    summary, model = T.train(Config(**TINY, out=out_dir), out_dir=out_dir)
    params = torch.cat([v.flatten() for v in checkpoint.dense_state_dict(model).values()])  # as _train_tiny's
    return (summary["config"]["train_ep"], summary["config"]["infer_ep"]), summary, params


@pytest.fixture(scope="module")
def world_of_two(tmp_path_factory):
    """The default run (TINY) at world 2, options/ unimportable: each rank's (EP layout, summary, parameters), and
    the run's folder. Two tests read it: made once."""
    out = tmp_path_factory.mktemp("w2")
    return run_distributed(_without_options, world_size=2, args=(str(out),)), out


def test_the_default_run_uses_no_option_and_every_mechanism(world_of_two):
    """The default run at 2 ranks imports nothing of options/ (the core alone runs it), and runs the four
    mechanisms: the phase switch (fusion.py), StaleSync's rounds, the queue, and the experts re-sharded from EP 2
    in training to EP 1 in rollout and back (moe_switch.py)."""
    ranks, out = world_of_two
    layouts = [layout for layout, _, _ in ranks]
    assert layouts == [(2, 1), (2, 1)], layouts
    lines = [json.loads(l) for l in open(out / "metrics.jsonl")][1:]
    assert all(l["switch/round_trips"] >= 1 and l["queue/reads"] > 0 for l in lines)
    assert all(l["ep/to_train_bytes_moved"] == 0 < l["ep/to_rollout_bytes_moved"] == l["ep/to_rollout_bytes_min"]
               for l in lines)  # EP 2 -> 1 receives the minimum (the experts a rank lacks); 1 -> 2 nests: frees half


def _warmed_up(rank, world_size, out_dir, train_ep):
    """The whole policy after the warm-up, built with --train-ep `train_ep`."""
    run = T.build(Config(**dict(TINY, train_ep=train_ep), out=out_dir), out_dir=out_dir)
    T.warm_up(run)
    return checkpoint.dense_state_dict(run.model)


def test_the_warm_up_ends_at_the_same_weights_with_ep_on_or_off(tmp_path):
    """Under EP a dense twin warms up and loads into the EP layout: every weight, each expert
    included, equals the EP-off run's, bit for bit (RL starts alike whatever the layout)."""
    on = run_distributed(_warmed_up, world_size=2, args=(str(tmp_path / "on"), "auto"))
    off = run_distributed(_warmed_up, world_size=2, args=(str(tmp_path / "off"), 0))
    assert list(on[0]) == list(off[0])
    for (a, b), name in ((pair, n) for pair in zip(on, off) for n in pair[0]):
        assert torch.equal(a[name], b[name]), name


def test_two_ranks_train_to_identical_parameters(tmp_path, world_of_one, world_of_two):
    (_, p0), (_, p1) = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "mb"), {"updates_per_batch": 2}))
    assert torch.equal(p0, p1)                          # every rank holds the same model
    ((_, s0, p0), (_, _, p1)), w2 = world_of_two  # the defaults: EP 2 in training, 1 in rollout
    s_one, p_one = world_of_one.summary, world_of_one.params
    # Same prompts, same samples, global token-mean loss: world 2 computes what world 1 does. (With
    # several updates per batch the mini-batches are per-rank slices, so worlds would differ there.)
    assert_same_training(p0, p_one, "world 2")
    assert s0["eval_accuracy_after"] == s_one["eval_accuracy_after"]
    lines = [json.loads(l) for l in open(w2 / "metrics.jsonl")]
    assert [l["step"] for l in lines] == [0, 1, 2, 3]
    for a, b in zip(lines[1:], [json.loads(l) for l in open(world_of_one.out / "metrics.jsonl")][1:]):
        for key in ("loss", "clip_frac", "ratio_mean", "k3_mean"):  # means over the whole batch, whatever
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(b[key])), (key, a[key], b[key])  # the split
    assert any(0 < l["reward/mean"] < 1 and abs(l["loss"]) > 1e-4 for l in lines[1:])  # real RL updates
    assert sum(l["rollout/filtered_groups"] for l in lines[1:]) > 0  # the refill by slot is exercised
    for key in ["reward/mean", "perf/tokens_per_s", "time/rollout_s", "time/train_s", "time/switch_s",
                "mem/train_bytes", "mem/rollout_bytes", "time/to_rollout_s", "queue/bytes_sent", "perf/queue_frac"]:
        assert all(key in l for l in lines[1:]), key
    assert all(0 < l["perf/queue_frac"] <= l["perf/idle_frac"] < 1 for l in lines[1:])  # the queue's share of a step
    assert "eval/accuracy" in lines[1] and "eval/accuracy" in lines[-1]
    lr, decay = TINY["lr"], TINY["lr_decay"]  # a cosine over the --steps: after 0, 1 and 2 of the 3 steps
    assert [l["train/lr"] for l in lines[1:]] == pytest.approx([lr, lr * (decay + (1 - decay) * 0.75),
                                                               lr * (decay + (1 - decay) * 0.25)])
    # the step's own switches (not an evaluation's): back in TRAIN at step 1, AdamW has no state yet
    assert lines[1]["mem/train_optim_bytes"] == 0 < lines[2]["mem/train_optim_bytes"]
    assert lines[2]["mem/rollout_optim_bytes"] == 0
    summary = json.load(open(w2 / "summary.json"))
    assert {"eval_accuracy_before", "eval_accuracy_after", "wall_s", "tokens_per_s", "config"} <= set(summary)
    assert os.path.exists(w2 / "spans_rank1.jsonl")
    from plumbing import timeline  # the run drew itself: a trace with a track per rank, properly nested spans, pictures
    spans = timeline.load_spans(w2)
    timeline.check_nesting(spans)
    trace = json.load(open(w2 / "trace.json"))
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert {s["name"] for s in spans} >= {"warmup", "switch_to_rollout", "rollout", "switch_to_train", "score",
                                          "queue", "reference", "train", "eval"}
    assert all(os.path.getsize(w2 / f) for f in ("timeline.svg", "curves.svg"))
    # Every deployment runs the same algorithm on the same samples: the same parameters come out.
    # (EP 2 in training, 1 in rollout: the experts leave FSDP, tokens cross ranks by all_to_all, the
    # expert weights are re-sharded at every phase change; the math is the dense model's.)
    # (EP 2 in rollout too: the engine's ranks decode in lock-step, a rank with no rows left joining the
    # other's forwards with zero rows; the response tokens replay the experts the rollout chose, which are the
    # ones the training forward would choose anyway: the same parameters.)
    replay = {"train_ep": 2, "infer_ep": 2, "routing_replay": True}
    # (EP 2 in training, 1 in rollout, as --train-ep 2 --infer-ep 1 gives it: the defaults at world 2, above.)
    for mode in [{"deploy": "separated"}, {"deploy": "colocated-all"}, {"infer_tp": 2}, {"fsdp_units": "block"},
                 replay]:
        (s, p), (_, q) = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / str(mode)), mode))
        assert_same_training(p, p_one, str(mode))
        assert s["eval_accuracy_after"] == s_one["eval_accuracy_after"]
        lines = [json.loads(l) for l in open(tmp_path / str(mode) / "metrics.jsonl")][1:]
        if mode is replay:  # the rollout's routes reached the trainers; the record used: 0 by construction; the
            assert all(l["moe/routed_tokens"] > 0 for l in lines), mode  # router's own choice agrees (same weights)
            assert all(l["moe/routing_mismatch"] == 0 and l["moe/router_mismatch_free"] == 0 for l in lines)
            assert lines[-1]["lockstep/dummy_forwards"] > 0  # EP 2 in rollout: rank 0 idled through rank 1's forwards
        else:  # nothing recorded without routing replay
            assert not any(k.startswith("moe/") for l in lines for k in l), mode
    assert torch.equal(p, q) and torch.equal(p0, p1)  # under EP too (2 -> 2, 2 -> 1), both ranks: the same model
    lines = [json.loads(l) for l in open(w2 / "metrics.jsonl")][1:]  # the defaults: EP 2 -> 1
    assert not any(k.startswith("moe/") for l in lines for k in l)  # nothing recorded without routing replay
    ep = lines[0]
    half = ep["ep/to_rollout_bytes_min"]  # each rank lacks the other half of the experts
    assert half > 0 and ep["ep/to_rollout_bytes_moved"] == half and ep["ep/to_rollout_peak_extra_bytes"] == 0
    assert ep["ep/to_train_bytes_moved"] == 0  # EP 1 -> 2 nests: each rank keeps its half, frees the rest
    assert ep["mem/rollout_optim_bytes"] == 0 and ep["mem/rollout_params_bytes"] > ep["mem/train_params_bytes"]


@pytest.mark.slow
def test_expert_parallel_over_part_of_the_world_with_a_reference_trains_as_one(tmp_path):
    """World 4 with EP 2 in training (two EP groups of 2, each expert on 2 replicas), the KL term on, 3 RL
    steps: a world of one's parameters. In this draw every group is all-wrong, so the policy-gradient
    term is exactly 0 and the KL term is the whole gradient: the reference must compute exactly what the
    policy computes (k3 and its gradient exactly 0), or Adam turns a float-level difference into an
    lr-sized step on nearly every weight. (The reference once ran the dense MoE kernels and the policy
    the EP ones: 2e-3 apart after 2 steps.)"""
    mode = {"prompts_per_step": 8, "max_digits": 3, "max_new_tokens": 5, "filter_groups": False}  # all-wrong kept
    [(_, p_one)] = run_distributed(_train_tiny, world_size=1, args=(str(tmp_path / "w1"), mode))
    out = run_distributed(_train_tiny, world_size=4, timeout_s=240,
                          args=(str(tmp_path / "w4"), dict(mode, train_ep=2, infer_ep=1)))
    lines = [json.loads(l) for l in open(tmp_path / "w4" / "metrics.jsonl")][1:]
    assert all(l["reward/mean"] == 0 for l in lines), "the draw changed: this test needs all-wrong groups"
    assert all(torch.equal(p, out[0][1]) for _, p in out[1:])  # every rank holds the same model
    assert all(l["k3_mean"] == 0.0 for l in lines)  # the reference computes what the policy does, bit for bit
    assert_same_training(out[0][1], p_one, "world 4, EP 2, KL")


@pytest.mark.slow
def test_world_4_expert_parallel_rollout_trains_as_one(tmp_path):
    """World 4, colocated, the experts re-sharded from their training EP degree to the engine's at every
    switch, both ways, the engine decoding in lock-step (dynamic sampling on: a replica whose batch is
    complete idles through the others' refills; 2/4 once more with the experts placed by load, --eplb 1).
    S = 0: a world of one's parameters. S = 1, where the cut depends on the replicas: EP 4 in rollout trains
    to the parameters of EP 1 at the same world. (2/2 replays the rollout's routes: the ones the training
    forward picks anyway, so the parameters stay the same.)"""
    [(s_one, p_one)] = run_distributed(_train_tiny, world_size=1, args=(str(tmp_path / "w1"),))
    for train_ep, infer_ep, replay, balance in ((2, 4, False, False), (4, 2, False, False), (2, 2, True, False),
                                                (2, 4, False, True)):
        name = f"ep{train_ep}to{infer_ep}" + ("eplb" if balance else "")
        out = run_distributed(_train_tiny, world_size=4, timeout_s=240, args=(str(tmp_path / name), dict(
            train_ep=train_ep, infer_ep=infer_ep, routing_replay=replay, eplb=balance)))
        assert all(torch.equal(p, out[0][1]) for _, p in out[1:])
        assert_same_training(out[0][1], p_one, name)
        lines = [json.loads(l) for l in open(tmp_path / name / "metrics.jsonl")][1:]
        assert sum(l["rollout/filtered_groups"] for l in lines) > 0, "no refill: no rank idled"
        assert lines[0]["ep/to_rollout_bytes_moved"] == lines[0]["ep/to_rollout_bytes_min"]
        # rank 0 ran forwards of zero rows for its peers (a decode's rows end before its first agreement, 8 forwards)
        assert lines[-1]["lockstep/dummy_forwards"] > 0, name
        if balance:  # placed by load from the second rollout on: the placement's minimum moved, balance logged
            assert all(0 < l["moe/rollout_balancedness"] <= 1 for l in lines), name
        if replay:  # the rollout's routes reached the trainers, and the record was used
            assert all(l["moe/routed_tokens"] > 0 for l in lines), name
            assert all(l["moe/routing_mismatch"] == 0 and l["moe/router_mismatch_free"] == 0 for l in lines), name
    stale = dict(train_ep=2, staleness=1, chunk_steps=2, steps=4)
    (_, p_ep1), *_ = run_distributed(_train_tiny, world_size=4, timeout_s=240,
                                     args=(str(tmp_path / "s1ep1"), dict(stale, infer_ep=1)))
    (_, p_ep4), *_ = run_distributed(_train_tiny, world_size=4, timeout_s=240,
                                     args=(str(tmp_path / "s1ep4"), dict(stale, infer_ep=4)))
    lines = [json.loads(l) for l in open(tmp_path / "s1ep4" / "metrics.jsonl")][1:]
    assert max(l["stale/age_max"] for l in lines) == 1  # samples that started a version earlier were trained
    assert lines[-1]["lockstep/agreements"] > 0
    assert_same_training(p_ep4, p_ep1, "S = 1, EP 4 against EP 1 in rollout")


@pytest.mark.slow  # gradsync.py's own tests (fast) check the mechanism bit for bit at worlds 2 and 4
def test_nodes_average_gradients_across_nodes_as_one_world_and_compressed_stay_in_step(tmp_path):
    """--nodes 2 at world 2 (a node of one rank each, FSDP2 within it, gradsync.py across): full precision, one
    FSDP unit per block, each block's sync started from its hook (overlap), trains to a world of one's parameters.
    Compressed (top-k int8 with error feedback) the nodes stay bit-identical, each sends over 4x fewer bytes
    than the dense average would, and the wait for the syncs is a span of the run's timeline."""
    [(_, p_one)] = run_distributed(_train_tiny, world_size=1, args=(str(tmp_path / "w1"),))
    full = {"nodes": 2, "fsdp_units": "block", "grad_overlap": True}
    (_, p), _ = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "full"), full))
    assert_same_training(p, p_one, "--nodes 2")
    (_, p), (_, q) = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "topk"),
                                                                      dict(full, grad_compress="topk-int8")))
    assert torch.equal(p, q) and not torch.equal(p, p_one)
    last = [json.loads(l) for l in open(tmp_path / "topk" / "metrics.jsonl")][-1]
    assert 0 < 4 * last["gradsync/sent_bytes"] < last["gradsync/dense_bytes"]
    from plumbing import timeline
    assert "grad_sync_wait" in {s["name"] for s in timeline.load_spans(tmp_path / "topk")}


def test_a_learned_reward_model_scores_the_same_on_every_deployment(tmp_path):
    """--reward-model 1: fit after the warm-up on the policy's samples labelled by the rule, then frozen; it scores
    every group (the filter's verdict and the trained rewards). World 2 (two replicas sampling half the fit's data
    each, every rank fitting the same model on all of it) trains to a world of one's parameters; the rule is logged
    beside the model's reward, and its agreement on the held-out prompts' samples is in step 0's record. At each
    evaluation the gap is watched (rm/watch_*, the same at both worlds), with a warning below --rm-watch-below."""
    mode = {**RM, "rm_watch_below": 0.95}
    [(_, p_one)] = run_distributed(_train_tiny, world_size=1, args=(str(tmp_path / "w1"), mode))
    (_, p), (_, q) = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "w2"), mode))
    assert torch.equal(p, q)
    assert_same_training(p, p_one, "--reward-model 1, world 2")
    lines = [json.loads(l) for l in open(tmp_path / "w2" / "metrics.jsonl")]
    fit = lines[0]  # checked on 8 fresh samples a bucket (1 digit, 2 digits), and a near miss of each right one
    assert [fit[f"rm/check_{b}_n"] >= 8 for b in ("1-1", "2-2")] == [True, True], fit
    assert fit["rm/labels"] >= 64 and fit["rm/check_min_balanced"] <= fit["rm/check_2-2_balanced"], fit
    watched = [{k: v for k, v in l.items() if k.startswith("rm/watch")} for l in lines if "eval/accuracy" in l]
    alone = [{k: v for k, v in l.items() if k.startswith("rm/watch")}
             for l in map(json.loads, open(tmp_path / "w1" / "metrics.jsonl")) if "eval/accuracy" in l]
    assert len(watched) == 4 and watched == alone  # steps 0 to 3; the same answers, the same verdicts
    for w in watched:
        assert 0 <= w["rm/watch_agreement"] <= 1
        assert w["rm/watch_warning"] == float(w["rm/watch_agreement"] < 0.95)
    assert all(0 <= l["reward/rule_mean"] <= 1 for l in lines[1:])
    from plumbing import timeline
    assert {"reward_model_fit", "reward_model"} <= {s["name"] for s in timeline.load_spans(tmp_path / "w2")}


@pytest.mark.parametrize("S", [0, 1, pytest.param(2, marks=pytest.mark.slow)])
def test_hybrid_places_the_reference_on_an_auxiliary_rank_and_trains_as_colocated_all(tmp_path, S):
    """--deploy hybrid at world 3: ranks 0 and 1 are the actor (colocated: FSDP2 over the two, phase switches), rank 2
    holds the frozen reference, a queue stage between rollout and training: the actor puts each group as it completes
    (S = 0 decodes in chunks, here of 1 token), rank 2 adds the reference's log-probs as a column while the round
    decodes on, the actor's trainers read each micro-batch's columns as their update reaches it. With the KL term on,
    it trains to the parameters that colocated-all's two replicas train to (the reference on the actor's ranks, one
    sampler call per round). At S = 1 the groups that complete beyond a batch wait in the queue for the next: never
    more than S batches of them (S = 2 too)."""
    mode = {"chunk_steps": 1, "staleness": S}
    (_, p), (_, q), (_, aux) = run_distributed(_train_tiny, world_size=3,
                                               args=(str(tmp_path / "h"), dict(mode, deploy="hybrid")))
    assert torch.equal(p, q) and aux is None  # the auxiliary rank holds no policy
    (_, c), _ = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "ca"), dict(mode, **COLOCATED_ALL)))
    assert_same_training(p, c, "hybrid at world 3 against colocated-all at world 2")
    lines = [json.loads(l) for l in open(tmp_path / "h" / "metrics.jsonl")][1:]
    assert any(l["k3_mean"] > 0 for l in lines)  # the reference's log-probs reached the loss
    per_step = TINY["prompts_per_step"] * TINY["group_size"]
    assert all(0 <= l["queue/rows_ahead"] <= S * per_step for l in lines)  # S = 0: nothing put for a later batch
    from plumbing import timeline
    spans = timeline.load_spans(tmp_path / "h")
    assert {"reference", "idle"} <= {s["name"] for s in spans if s["rank"] == 2}
    assert not any(s["name"] == "reference" for s in spans if s["rank"] < 2)  # the actor computes no reference
    rollouts = [s for s in spans if s["rank"] == 0 and s["name"] == "rollout"]
    assert any(r["start"] < s["start"] < r["end"] for s in spans if s["rank"] == 2 and s["name"] == "reference"
               for r in rollouts)  # the reference of the first groups ran while the actor still decoded


@pytest.mark.parametrize("world,deploy", [(2, "colocated"), pytest.param(3, "hybrid", marks=pytest.mark.slow)])
def test_a_reward_model_fit_on_a_policy_that_answers_nothing_right_still_has_both_labels(tmp_path, world, deploy):
    """No warm-up: the policy answers none of the fit's 8 samples right. The fit still has both labels, the right
    answer beside each wrong sample and a near miss of it (8 + 8 + 8 rule labels), and the run goes on, the hybrid's
    auxiliary rank too. (When the fit had the policy's samples alone, this was refused after the sampling.)"""
    overrides = dict(reward_model=True, rm_samples=8, rm_steps=5, rm_check=4, warmup_steps=0, deploy=deploy)
    if deploy == "hybrid":
        overrides.update(filter_groups=False, curriculum=False, train_ep=0)
    run_distributed(_train_tiny, world_size=world, timeout_s=120, args=(str(tmp_path), overrides))
    fit = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert fit["rm/labels"] == 24 and fit["rm/check_1-1_policy_accuracy"] == 0.0, fit
    assert fit["rm/check_1-1_n"] == fit["rm/check_2-2_n"] == 12, fit  # 4 fresh prompts a bucket, 3 rows each


@pytest.mark.parametrize("estimator,kl,rules", [pytest.param("grpo", 0.05, False, marks=pytest.mark.slow),
                                                pytest.param("reinforce++", 0.05, False, marks=pytest.mark.slow),
                                                pytest.param("grpo", 0.0, True, marks=pytest.mark.slow),
                                                ("grpo", 0.05, True)])
def test_hybrid_with_a_reward_model_on_the_auxiliary_rank_trains_as_colocated_all(tmp_path, estimator, kl, rules):
    """--deploy hybrid --reward-model 1: the actor's ranks fit the reward model, rank 2 keeps it. Each group, as it
    completes, is scored by rank 2 at the actor's request (a notice in its inbox, the rewards back through the
    store), so that dynamic sampling and the curriculum (rules) judge it by the model's rewards, as colocated-all's
    do; the put carries them. It trains to colocated-all's parameters with the same reward model, with reinforce++
    (advantages normalised over the batch) too. With --kl-coef 0 nothing reads the reference: rank 2 neither
    receives nor runs it, and only scores."""
    mode = {**RM, "filter_groups": rules, "curriculum": rules,
            "adv_estimator": estimator, "kl_coef": kl}
    (_, p), _, _ = run_distributed(_train_tiny, world_size=3, args=(str(tmp_path / "h"), dict(mode, deploy="hybrid")))
    (_, c), _ = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "ca"), dict(mode, **COLOCATED_ALL)))
    assert_same_training(p, c, "hybrid with a reward model against colocated-all")
    from plumbing import timeline
    on_aux = {s["name"] for s in timeline.load_spans(tmp_path / "h") if s["rank"] == 2}
    assert "reward_model" in on_aux and ("reference" in on_aux) == (kl > 0), on_aux
    lines = [json.loads(l) for l in open(tmp_path / "h" / "metrics.jsonl")]
    assert 0 <= lines[0]["rm/check_min_balanced"] <= 1 and all(0 <= l["reward/rule_agreement"] <= 1 for l in lines[1:])


def _train_with_a_slow_fit(rank, world_size, out_dir, overrides=None, pause_s=0.4):
    """_train_tiny, each step of the reward model's fit made pause_s longer (its heartbeat still posted)."""
    from options import reward_model
    fit = reward_model.train_reward_model

    def slow(*args, on_step=None, **kwargs):
        def step(i):
            time.sleep(pause_s)
            if on_step is not None:
                on_step(i)
        return fit(*args, on_step=step, **kwargs)
    reward_model.train_reward_model = slow
    return _train_tiny(rank, world_size, out_dir, overrides)


@pytest.mark.slow
def test_a_hybrid_reward_model_fit_longer_than_the_timeout_is_waited_out_on_its_heartbeat(tmp_path):
    """The actor's ranks fit the reward model (20 steps of 0.4 s here: 8 s) while the auxiliary rank waits. It waits on
    rank 0's heartbeat in the store, not in a collective: a fit longer than --pg-timeout-s (5 s) that keeps stepping
    does not time out."""
    mode = {"deploy": "hybrid", **RM, "filter_groups": False,
            "curriculum": False, "pg_timeout_s": 5, "steps": 1}
    out = run_distributed(_train_with_a_slow_fit, world_size=3, timeout_s=120, pg_timeout_s=5,
                          args=(str(tmp_path), mode))
    assert [p is None for _, p in out] == [False, False, True]
    from plumbing import timeline
    fit = [s for s in timeline.load_spans(tmp_path) if s["name"] == "reward_model_fit"]
    assert fit and min(s["end"] - s["start"] for s in fit) > mode["pg_timeout_s"]  # longer than the timeout


@pytest.mark.slow
def test_world_4_hybrid_with_two_auxiliary_ranks_trains_as_colocated_all(tmp_path):
    """World 4 as 2 actor ranks and 2 auxiliary ones, each serving every other whole group of a batch: colocated-all's
    parameters (world 2)."""
    out = run_distributed(_train_tiny, world_size=4, timeout_s=240,
                          args=(str(tmp_path / "h"), {"deploy": "hybrid", "aux_ranks": 2}))
    assert [p is None for _, p in out] == [False, False, True, True]
    (_, c), _ = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "ca"), COLOCATED_ALL))
    assert_same_training(out[0][1], c, "hybrid at world 4 (2 auxiliary ranks) against colocated-all at world 2")
    from plumbing import timeline
    assert {2, 3} <= {s["rank"] for s in timeline.load_spans(tmp_path / "h") if s["name"] == "reference"}


@pytest.mark.slow
def test_hybrid_with_a_tensor_parallel_engine_trains_as_colocated_all(tmp_path):
    """--infer-tp 2 on the hybrid's actor at world 3: ranks 0 and 1 one rollout replica, the engine cut over the two
    (rank 0 its writer: the only rank that puts), rank 2 the reference. It trains to the parameters of colocated-all
    with the same engine at world 2 (S = 1)."""
    mode = {"infer_tp": 2, "chunk_steps": 1, "staleness": 1}
    hybrid_mode = dict(mode, deploy="hybrid")
    (_, p), (_, q), _ = run_distributed(_train_tiny, world_size=3, args=(str(tmp_path / "h"), hybrid_mode))
    assert torch.equal(p, q)
    (_, c), _ = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "ca"), dict(mode, **COLOCATED_ALL)))
    assert_same_training(p, c, "hybrid with --infer-tp 2 at world 3 against colocated-all at world 2")
    lines = [json.loads(l) for l in open(tmp_path / "h" / "metrics.jsonl")][1:]
    assert any(l["k3_mean"] > 0 for l in lines)  # the reference's log-probs reached the loss


@pytest.mark.slow
@pytest.mark.parametrize("infer_ep", [1, 2])
def test_hybrid_with_expert_parallel_experts_trains_as_colocated_all(tmp_path, infer_ep):
    """--train-ep 2 on the hybrid's actor at world 3: the experts expert-parallel over ranks 0 and 1 (EP 2 in training,
    re-sharded to the engine's EP at each switch), rank 2 the reference, pushed to it as the dense model rank 0
    gathers. It trains to the parameters of colocated-all with the same EP layouts at world 2 (up to float order:
    colocated-all's reference runs the policy's EP forward, rank 2's a dense one)."""
    mode = {"train_ep": 2, "infer_ep": infer_ep, "chunk_steps": 1, "staleness": 1}
    hybrid_mode = dict(mode, deploy="hybrid")
    (_, p), (_, q), _ = run_distributed(_train_tiny, world_size=3, args=(str(tmp_path / "h"), hybrid_mode))
    assert torch.equal(p, q)
    colocated_all = dict(mode, deploy="colocated-all")
    (_, c), _ = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "ca"), colocated_all))
    assert_same_training(p, c, f"hybrid with EP 2 -> {infer_ep} at world 3 against colocated-all at world 2")
    lines = [json.loads(l) for l in open(tmp_path / "h" / "metrics.jsonl")][1:]
    assert any(l["k3_mean"] > 0 for l in lines)  # the reference's log-probs reached the loss


def _train_counting_rows(rank, world_size, out_dir, overrides=None):
    """_train_tiny, also returning the (writer, sample id) of every row this rank's trainer read, the ids of the rows
    whose auxiliary columns it read, the sample ids its scheduler emitted in batches (an actor rank's; an auxiliary
    rank's: none), and: the sample ids of the rows it put into the queue (a writer's), those still in flight at the
    end, those regenerated, and the row ids its trainer read and let go (put, then regenerated)."""
    runs, build, read, read_aux = [], hybrid.build, hybrid.read_share, hybrid.read_from_aux
    put, seen, seen_aux, dropped = [], [], [], []
    put_group, discard = hybrid.put_group, hybrid.discard_dropped
    hybrid.build = lambda *a, **k: runs.append(build(*a, **k)) or runs[-1]

    def counting(run, *args):
        samples, rows, queued = read(run, *args)
        seen.extend((r, r % world_size, int(s[0])) for r, s in zip(rows.ids, rows.cols["stale"]))  # STALE_FACTS[0]
        return samples, rows, queued

    def counting_aux(run, *args):
        rows = read_aux(run, *args)
        seen_aux.extend(rows.ids)
        return rows

    def counting_puts(run, group):
        if run.rank in run.roles.writers():
            put.extend(group.ids)
        return put_group(run, group)

    def counting_dropped(run, step):
        ids = discard(run, step)
        dropped.extend(ids)
        return ids
    hybrid.read_share, hybrid.read_from_aux, hybrid.put_group = counting, counting_aux, counting_puts
    hybrid.discard_dropped = counting_dropped
    _train_tiny(rank, world_size, out_dir, overrides)
    none = {"trained": [], "in_flight": [], "regenerated": []}
    fates = runs[0].sched.accounting() if runs[0].sched is not None else none
    held = {r for r, _ in runs[0].queue.cells}  # rows whose cells this rank still holds for a reader
    ahead = {r for r in runs[0].rows_ahead.values() if r is not None}
    return seen, seen_aux, sorted(fates["trained"]), {"put": put, "in_flight": sorted(fates["in_flight"]),
                                                      "regenerated": fates["regenerated"], "dropped": dropped,
                                                      "held": held, "ahead": ahead}


@pytest.mark.parametrize("S", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_hybrid_trains_every_sample_its_actor_emits_exactly_once(tmp_path, S):
    """Counted over sample ids at S = 1 (groups completing beyond a batch wait in the queue for the next; the filter
    off, so that they complete together, more than the shared cut takes): the rows the actor's trainers read, over
    the run, are the samples its schedulers emitted in batches, each exactly once, and each row's auxiliary columns
    were read once, by the trainer that read the row. At S = 2 too, where a group put as it completed can be
    regenerated (left out of every batch): its writer reads its rows and their columns and lets them go."""
    mode = {"deploy": "hybrid", "staleness": S, "chunk_steps": 1, "steps": 5, "threshold": 0.5, "filter_groups": 0}
    if S == 2:  # a group a replica a step, lengths up to 40 tokens at random (no warm-up): groups pile up due at once
        mode.update(warmup_steps=0, max_new_tokens=40, steps=20, prompts_per_step=2, group_size=1, threshold=1 / 3,
                    adv_estimator="reinforce++")
    out = run_distributed(_train_counting_rows, world_size=3, args=(str(tmp_path), mode))
    read = [key[1:] for seen, *_ in out for key in seen]
    emitted = [(rank, i) for rank, (_, _, trained, _) in enumerate(out) for i in trained]
    queued = [q for *_, q in out]  # per rank: what it put, its fates at the end, what it let go and still holds
    put, in_flight, regenerated = ([(rank, i) for rank, q in enumerate(queued) for i in q[name]]
                                   for name in ("put", "in_flight", "regenerated"))
    steps = mode["steps"]
    per_step = mode.get("prompts_per_step", TINY["prompts_per_step"]) * mode.get("group_size", TINY["group_size"])
    assert len(read) == len(set(read)) == steps * per_step  # none read twice
    assert sorted(read) == sorted(emitted)  # none lost, none extra
    # every row put into the queue was trained, or is in a group put ahead of a batch the run ended before, or was
    # regenerated (S = 2) and then read by its writer and let go, with its auxiliary columns
    assert set(put) <= set(emitted) | set(in_flight) | set(regenerated) and len(put) == len(set(put))
    put_then_regenerated = set(put) & set(regenerated)
    for seen, seen_aux, _, q in out:  # per trainer: its rows' columns, and its dropped rows', once
        assert sorted(seen_aux) == sorted([key[0] for key in seen] + q["dropped"])
    assert sum(len(q["dropped"]) for q in queued) == len(put_then_regenerated)
    # at the end the queue holds only the rows put ahead of a batch the run ended before (and their columns)
    ahead = set().union(*(q["ahead"] for q in queued))
    assert all(q["held"] <= ahead for q in queued), [sorted(q["held"] - ahead) for q in queued]
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")][1:]
    assert any(l["queue/rows_ahead"] > 0 for l in lines)  # some groups were put ahead of their batch
    assert sum(l["queue/rows_dropped"] for l in lines) == len(put_then_regenerated)
    if S == 2:  # the case that leaves rows in the queue unless their writer lets them go
        assert put_then_regenerated, "no group put was regenerated: the test does not exercise it"


def _train_with_a_silent_aux(rank, world_size, out_dir, overrides=None, how="silent"):
    """_train_tiny, the auxiliary rank alive but never serving its stage (as a hung or dead one looks to the queue), or
    (how="no columns") hung once it has taken every group of the first batch, before it puts the last ones' columns,
    or (how="dead") its process gone at that point, holding the columns it put of that batch's other groups."""
    if rank == world_size - 1 and how == "silent":
        hybrid.aux_loop = lambda run: time.sleep(120)
    if rank == world_size - 1 and how in ("no columns", "dead"):
        taken, columns = [], hybrid_aux.aux_columns

        def stopped_at_the_batch_end(run, rows, ids):
            taken.extend(ids)
            if len(taken) >= TINY["prompts_per_step"] * TINY["group_size"]:
                if how == "dead":
                    os._exit(9)  # as a SIGKILL would: no exception, no goodbye to the store or to gloo
                time.sleep(120)
            return columns(run, rows, ids)
        hybrid_aux.aux_columns = stopped_at_the_batch_end
    return _train_tiny(rank, world_size, out_dir, overrides)


@pytest.mark.parametrize("how", ["silent", pytest.param("dead", marks=pytest.mark.slow),
                                 pytest.param("no columns", marks=pytest.mark.slow)])
def test_hybrid_with_a_silent_auxiliary_rank_fails_naming_the_stage(tmp_path, how):
    # A silent or hung rank 2 still beats (its watchdog's thread). After the 5 s timeout, the actor's ranks wait out
    # --liveness-s (10 s by default) to find which peer is lost, and find none. 3 s, shorter than the timeout, still
    # watches rank 2 through the whole wait. A dead rank 2 keeps the default: 3 s would name it before the timeout.
    mode = {"deploy": "hybrid", "pg_timeout_s": 5}
    if how != "dead":
        mode["liveness_s"] = 3.0
    with pytest.raises(RuntimeError) as e:
        run_distributed(_train_with_a_silent_aux, world_size=3, timeout_s=100, may_die=(2,) if how == "dead" else (),
                        args=(str(tmp_path), mode, how))
    message = str(e.value)
    assert "the auxiliary stage (ranks [2]) did not add its columns" in message and "of step 1's batch" in message
    assert "is it alive?" in message


def _train_saying_its_error(rank, world_size, out_dir, overrides=None, dies=None):
    """_train_with_a_silent_aux's "dead" auxiliary rank (dies="aux"), or the actor's rank 1 gone once the second step's
    rollout has begun (dies="actor"); every other rank returns its error's message, and the seconds from its start
    to the error."""
    if dies == "aux" and rank == world_size - 1:
        return _train_with_a_silent_aux(rank, world_size, out_dir, overrides, how="dead")
    if dies == "actor" and rank == 1:
        rollout = hybrid.serve_then

        def dead_in_step_2(queue, cut, sched):
            if sched.version >= 1:
                os._exit(9)
            return rollout(queue, cut, sched)
        hybrid.serve_then = dead_in_step_2
    t0 = time.monotonic()
    try:
        _train_tiny(rank, world_size, out_dir, overrides)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("dies", ["aux", "actor"])
def test_a_lost_hybrid_peer_is_named_within_the_liveness_interval(tmp_path, dies):
    """A peer's process gone (os._exit: no exception, no goodbye), with --pg-timeout-s 60 and --liveness-s 3: the
    ranks that wait on it through the store name it, its role and the phase it was last seen in, within the liveness
    interval and well before the timeout (its heartbeat, posted by a thread of its own, stopped)."""
    lost = 2 if dies == "aux" else 1
    mode = {"deploy": "hybrid", "pg_timeout_s": 60, "liveness_s": 3.0}
    out = run_distributed(_train_saying_its_error, world_size=3, timeout_s=55, may_die=(lost,),
                          args=(str(tmp_path), mode, dies))
    role = "auxiliary" if dies == "aux" else "actor"
    watchers = [0, 1] if dies == "aux" else [0, 2]  # rank 0's collective with rank 1 breaks: it names rank 1 too
    for r in watchers:
        message, seconds = out[r]
        assert message is not None and f"rank {lost} ({role}) gave no sign of life for" in message, (r, message)
        assert "--liveness-s 3" in message and "last seen in" in message and seconds < 45, (r, message, seconds)


def _train_with_a_silent_actor(rank, world_size, out_dir, overrides=None):
    """_train_tiny, the actor's ranks hung after the warm-up: they never put a group."""
    if rank < world_size - 1:
        hybrid.actor_loop = lambda run: time.sleep(120)
    return _train_tiny(rank, world_size, out_dir, overrides)


@pytest.mark.slow
def test_hybrid_with_a_silent_actor_fails_on_the_auxiliary_rank_naming_the_groups(tmp_path):
    with pytest.raises(RuntimeError) as e:
        run_distributed(_train_with_a_silent_actor, world_size=3, timeout_s=100,
                        args=(str(tmp_path), {"deploy": "hybrid", "pg_timeout_s": 5}))
    message = str(e.value)
    assert "rank 2 failed" in message and "the actor put none of groups [(0, 0), (0, 1)" in message
    assert "is the actor alive?" in message


@pytest.mark.slow
def test_world_4_as_two_nodes_trains_as_one(tmp_path):
    """World 4 as 2 nodes of 2 (FSDP2 over each node's pair, the shards averaged across nodes in full precision),
    with a unit per block and overlap: a world of one's parameters."""
    [(_, p_one)] = run_distributed(_train_tiny, world_size=1, args=(str(tmp_path / "w1"),))
    out = run_distributed(_train_tiny, world_size=4, timeout_s=240, args=(str(tmp_path / "w4"), dict(
        nodes=2, fsdp_units="block", grad_overlap=True)))
    assert all(torch.equal(p, out[0][1]) for _, p in out)
    assert_same_training(out[0][1], p_one, "world 4, --nodes 2")


@pytest.mark.slow
def test_world_4_tensor_parallel_and_separated_with_dynamic_sampling_train_as_one(tmp_path):
    """World 4, S = 0, dynamic sampling and the curriculum on: two TP-2 replicas (colocated), and two trainers
    with two generators (separated), train to a world of one's parameters: a dropped group's slot is refilled
    with the same prompt and samples, and the pass rates are summed to the same counts, however the batch is
    split over replicas."""
    mode = {"prompts_per_step": 8}
    [(s_one, p_one, counts)] = run_distributed(_train_learning, world_size=1, args=(str(tmp_path / "w1"), mode))
    for name, deploy in (("tp2", {"infer_tp": 2}), ("separated", {"deploy": "separated"})):
        out = run_distributed(_train_learning, world_size=4, timeout_s=300,
                              args=(str(tmp_path / name), dict(mode, **deploy)))
        lines = [json.loads(l) for l in open(tmp_path / name / "metrics.jsonl")][1:]
        assert sum(l["rollout/filtered_groups"] for l in lines) > 0, "no group was dropped: nothing refilled"
        assert_same_training(out[0][1], p_one, name)
        assert out[0][0]["eval_accuracy_after"] == s_one["eval_accuracy_after"]
        assert all(np.array_equal(c, counts) for _, _, c in out[-2:]), name  # the generators' curriculum


@pytest.mark.parametrize("deploy", ["colocated", "separated"])
def test_dynamic_sampling_that_keeps_nothing_stops_the_run_naming_the_flags(tmp_path, deploy):
    """A policy that solves nothing (no warm-up): every group's rewards are equal, every group is dropped.
    The run stops at the brake, with the count and the flags, never spins (the generator's error, separated)."""
    mode = {"deploy": deploy, "warmup_steps": 0, "filter_limit": 2, "staleness": 1}
    with pytest.raises(RuntimeError) as e:
        run_distributed(_train_tiny, world_size=2, args=(str(tmp_path), mode), timeout_s=120)
    said = str(e.value)
    assert re.search("dynamic sampling dropped [0-9]+ groups while making batch 0, past the limit of [48]:", said)
    assert "--filter-limit 2 groups dropped per prompt" in str(e.value) and "--filter-groups 0" in str(e.value)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_separated_generators_run_ahead_within_s(tmp_path, world):
    """--deploy separated --staleness 1: the generators decode on while the trainers train, take new
    weights between decode chunks, and no trained sample is more than 1 version old (world 4: two
    generator replicas, one of which may run ahead of the other; step k still trains batch k - 1 of each)."""
    mode = {"deploy": "separated", "staleness": 1, "threshold": 0.5, "chunk_steps": 1, "steps": 6,
            "eval_every": 3, "max_digits": 4, "max_new_tokens": 6, "filter_groups": False}  # few groups mixed
    out = run_distributed(_train_tiny, world_size=world, args=(str(tmp_path), mode), timeout_s=240)
    (s, p), gens = out[0], out[world // 2:]
    assert all(q is None for _, q in gens) and torch.isfinite(p).all()  # generator ranks hold no model
    assert all(torch.equal(p, q) for _, q in out[1:world // 2])
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    steps = lines[1:]
    assert [l["step"] for l in steps] == list(range(1, 7))
    assert all(l["rollout/response_tokens"] > 0 for l in steps) and s["queue_bytes_sent"] > 0
    assert all(l["stale/age_max"] <= 1 for l in steps) and any(l["stale/age_max"] == 1 for l in steps)
    # (how many samples a new version reaches mid-decode depends on timing: only the counters are checked)
    assert all(l["stale/partial_continued"] >= 0 and l["stale/regenerated"] >= 0 for l in steps)
    assert [l["step"] for l in steps if "eval/accuracy" in l] == [1, 3, 6]
    assert s["eval_accuracy_after"] == steps[-1]["eval/accuracy"]
    # trainer 0's push of each version ends once the generators have it: after their receipt, on one time axis
    spans = {r: [json.loads(l) for l in open(tmp_path / f"spans_rank{r}.jsonl")] for r in range(world)}
    pushes = [x for x in spans[0] if x["name"] == "push"]
    for g in range(world // 2, world):
        recvs = [x for x in spans[g] if x["name"] == "recv"]
        assert len(recvs) == len(pushes) == 7  # versions 0 to 6
        assert all(push["end"] >= recv["end"] - 0.005 for push, recv in zip(pushes, recvs))  # 5 ms: the clocks


@pytest.mark.slow
def test_separated_generators_wait_out_a_warm_up_longer_than_the_timeout(tmp_path):
    """The generators wait for the trainers' warm-up on a heartbeat in the store, not in the first weight
    broadcast: a warm-up several times --pg-timeout-s long is not taken for a dead peer."""
    mode = {"deploy": "separated", "warmup_steps": 1000, "pg_timeout_s": 2, "steps": 1, "eval_every": 1,
            "filter_groups": False}  # a policy this trained solves every prompt: no group would be kept
    (s, p), _ = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path), mode), timeout_s=120)
    assert torch.isfinite(p).all() and s["eval_accuracy_after"] >= 0
    spans = [json.loads(l) for l in open(tmp_path / "spans_rank0.jsonl")]
    warm = sum(x["end"] - x["start"] for x in spans if x["name"] == "warmup")
    if warm < 1.5 * mode["pg_timeout_s"]:  # a machine fast enough to beat the timeout proves nothing here
        pytest.skip(f"the warm-up took {warm:.1f}s, too little against a {mode['pg_timeout_s']}s timeout")


@pytest.mark.parametrize("world,infer_tp", [(2, 1), (2, 2), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_bounded_staleness_run_keeps_ages_within_s(tmp_path, world, infer_tp):
    """Colocated S = 1: a round ends at the replicas' shared cut; with two replicas (world 2 at TP 1; world 4 at TP 2,
    one rank of each speaking for it) one gives groups for the other, held back by its dropped groups
    (stale/filled_in; never with --shared-cut 0); world 2 at TP 2 is one replica, which has no peer to fill in for."""
    mode = {"staleness": 1, "threshold": 0.5, "chunk_steps": 2, "steps": 4, "decoupled": True, "infer_tp": infer_tp}
    params = [p for _, p in run_distributed(_train_tiny, world_size=world, args=(str(tmp_path), mode), timeout_s=240)]
    assert all(torch.equal(p, params[0]) for p in params)
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")][1:]
    assert all(l["stale/age_max"] <= 1 for l in lines) and any(l["stale/age_max"] == 1 for l in lines)
    assert all(l["rollout/response_tokens"] > 0 for l in lines)
    assert any(l["stale/filled_in"] > 0 for l in lines) == (world // infer_tp == 2)
    if world // infer_tp == 2:  # --shared-cut 0: each replica gives its own share, never more
        apart = [p for _, p in run_distributed(_train_tiny, world_size=world, timeout_s=240,
                                               args=(str(tmp_path / "apart"), dict(mode, shared_cut=False)))]
        lines = [json.loads(l) for l in open(tmp_path / "apart" / "metrics.jsonl")][1:]
        assert all(torch.equal(p, apart[0]) for p in apart) and all(l["stale/filled_in"] == 0 for l in lines)


def test_the_learning_rate_follows_a_cosine_over_the_share_of_the_run_behind():
    """anneal_lr: --lr at the start, --lr x --lr-decay at the end and after it (the step that passes --rl-seconds
    ends past 1), halfway between at the middle, in every param group (EP has two); --lr-decay 1 keeps it constant."""
    for decay in (0.1, 1.0):
        cfg = Config(lr=1e-3, lr_decay=decay)
        groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(3))]}]
        run = SimpleNamespace(cfg=cfg, optimizer=torch.optim.AdamW(groups, lr=cfg.lr))
        lrs = []
        for done in (0.0, 0.5, 1.0, 1.3):
            T.anneal_lr(run, done)
            lrs.append([g["lr"] for g in run.optimizer.param_groups])
        expected = [1e-3, 1e-3 * (1 + decay) / 2, 1e-3 * decay, 1e-3 * decay]
        assert lrs == [pytest.approx([lr, lr]) for lr in expected]


@pytest.mark.parametrize("deploy", ["colocated", "separated", "hybrid"])
def test_rl_seconds_stops_every_rank_after_the_same_step_and_evaluates_it(tmp_path, deploy):
    """--rl-seconds: rank 0's clock ends RL after the step that passes the budget; every rank agrees (a
    separated generator, or a hybrid's auxiliary rank, learns the last version from the store), the last step is
    evaluated, and the run exits cleanly, separated generators and auxiliary ranks included."""
    mode = {"deploy": deploy, "steps": 50, "eval_every": 100, "rl_seconds": 1e-3, "staleness": 1}
    out = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path), mode), timeout_s=120)
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["step"] for l in lines] == [0, 1] and "eval/accuracy" in lines[-1]
    assert out[0][0]["eval_accuracy_after"] == lines[-1]["eval/accuracy"]


@pytest.mark.parametrize("mode", [{}, pytest.param({"adv_estimator": "reinforce++", "loss_agg": "seq-mean-token-mean",
                                                      "mask_truncated": True}, marks=pytest.mark.slow)],
                         ids=["grpo", "reinforce++-seq-mean-masked"])
def test_pipeline_parallel_training_trains_as_one(tmp_path, mode, request):
    """--train-pp 2 at world 2 (a stage per rank), with the KL term's reference as stages too: a world of one's
    parameters, up to float summation order (micro-batches padded to one length), and the same held-out answers.
    reinforce++ normalises over the whole batch: each row counted once, not once per stage."""
    if mode:
        [(s_one, p_one)] = run_distributed(_train_tiny, world_size=1, args=(str(tmp_path / "w1"), mode))
    else:  # the defaults: the session's world of one
        one = request.getfixturevalue("world_of_one")
        s_one, p_one = one.summary, one.params
    out = run_distributed(_train_tiny, world_size=2, args=(str(tmp_path / "pp2"), dict(mode, train_pp=2)),
                          timeout_s=180)
    assert torch.equal(out[0][1], out[1][1])
    assert_same_training(out[0][1], p_one, "PP 2")
    assert out[0][0]["eval_accuracy_after"] == s_one["eval_accuracy_after"]
    lines = [json.loads(l) for l in open(tmp_path / "pp2" / "metrics.jsonl")][1:]
    assert any(abs(l["loss"]) > 1e-4 for l in lines) and all(l["k3_mean"] >= 0 for l in lines)


@pytest.mark.slow
def test_world_4_pipeline_by_fsdp_trains_as_one(tmp_path):
    """--train-pp 2 at world 4: two pipelines of two stages, each stage FSDP2 over its 2 ranks."""
    [(s_one, p_one)] = run_distributed(_train_tiny, world_size=1, args=(str(tmp_path / "w1"),))
    out = run_distributed(_train_tiny, world_size=4, args=(str(tmp_path / "pp2x2"), {"train_pp": 2}), timeout_s=240)
    assert all(torch.equal(p, out[0][1]) for _, p in out[1:])
    assert_same_training(out[0][1], p_one, "PP 2 x FSDP 2")
