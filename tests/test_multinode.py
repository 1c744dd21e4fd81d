"""The multi-node launch, the only way one machine can run it: two torchrun agents on 127.0.0.1, each
agent a "node" with one process (LOCAL_RANK 0 on both), meeting through c10d rendezvous. A tiny run trains
to the parameters of one agent with two processes, colocated and separated (where every row and weight
crosses between the nodes); the switch never reads another node's memory (it broadcasts); a checkpoint
saved across the two nodes resumes there to the parameters of a run that never stopped."""
import json
import os
import subprocess
import sys

import pytest

from tests.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--max-digits=2", "--max-new-tokens=4", "--eval-prompts=8", "--d-model=32", "--d-expert=32",
         "--warmup-steps=30", "--warmup-batch=8", "--prompts-per-step=4", "--group-size=4", "--eval-every=2",
         "--kl-coef=0.05", "--lr=3e-3", "--device=cpu", "--staleness=0", "--rl-seconds=0", "--steps=4",
         "--pg-timeout-s=60"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args, "train_grpo.py"]


def two_nodes(out, *flags):
    """Two agents, one process each, on 127.0.0.1: returns their outputs (agent 0 runs rank 0)."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen(torchrun("--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                                        f"--rdzv-endpoint={endpoint}", "--rdzv-id=two_nodes", "--max-restarts=0")
                               + [*FLAGS, f"--out={out}", *flags],
                               cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=300)[0] for a in agents]
    except subprocess.TimeoutExpired:  # a hang: what each agent said up to it, not a bare timeout
        for a in agents:
            a.kill()
        said = "\n".join(f"agent {i}:\n{a.communicate()[0][-3000:]}" for i, a in enumerate(agents))
        raise AssertionError(f"the two agents ran past 300 s:\n{said}") from None
    finally:
        for a in agents:
            a.kill()
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outputs)
    return outputs


def one_node(out, *flags):
    r = subprocess.run(torchrun("--standalone", "--nproc_per_node=2") + [*FLAGS, f"--out={out}", *flags],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout + r.stderr


def summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_two_torchrun_agents_train_as_one_agent_with_two_processes_and_resume(tmp_path):
    one, two, resumed = (str(tmp_path / name) for name in ("one", "two", "resumed"))
    said_one = one_node(one, "--shm-transport=1")
    said_two = "".join(two_nodes(two, "--save-every=2"))
    assert "switch: in place, SharedMemory" in said_one             # one node: the peers' shards in shared memory
    assert "switch: in place, Broadcasts" in said_two               # two nodes: never another node's memory
    assert summary(two)["params_sha256"] == summary(one)["params_sha256"]
    assert os.path.exists(os.path.join(two, "checkpoints", "step_4", "meta.json"))
    # resume the two-node run from its step-2 checkpoint, on two nodes again
    os.makedirs(os.path.join(resumed, "checkpoints"))
    os.rename(os.path.join(two, "checkpoints", "step_2"), os.path.join(resumed, "checkpoints", "step_2"))
    two_nodes(resumed, "--resume=auto")
    assert summary(resumed)["resumed_at_step"] == 2
    assert summary(resumed)["params_sha256"] == summary(one)["params_sha256"]


@pytest.mark.slow
def test_two_torchrun_agents_separated_move_every_row_between_the_nodes(tmp_path):
    """Separated, rank 0 trains and rank 1 generates: each on its own node, every row and every weight
    crosses between them, and the run trains to the parameters of one agent with two processes."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    one_node(one, "--deploy=separated")
    two_nodes(two, "--deploy=separated")
    assert summary(two)["params_sha256"] == summary(one)["params_sha256"]
    assert summary(two)["queue_bytes_sent"] > 0 and summary(two)["queue_bytes_sent"] == summary(one)["queue_bytes_sent"]
