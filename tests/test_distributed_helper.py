import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print("hello")
    return t.item()


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_all_ranks_run_and_return():
    assert run_distributed(_sum_ranks, world_size=2) == [1.0, 1.0]


def test_a_failing_rank_fails_the_call():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*boom on purpose"):
        run_distributed(_fail_on_rank_1, world_size=2)


def _killed_on_rank_1(rank, world_size):
    import os
    import time
    import torch.distributed as dist
    dist.barrier()  # both ranks past the process group's start: rank 0's connect cannot fail on the exit
    if rank == 1:
        os._exit(9)  # dies as a SIGKILL would: no exception, no report
    time.sleep(60)  # rank 0 would wait here: the helper must not wait for it


def test_a_rank_that_dies_without_reporting_fails_the_call_at_once():
    """Rank 0 outlives the helper's timeout: had the helper waited for it, this would be a TimeoutError."""
    with pytest.raises(RuntimeError, match="rank 1 failed:\nthe process exited with code 9 without reporting"):
        run_distributed(_killed_on_rank_1, world_size=2, timeout_s=30)


def _rank_1_dies_rank_0_reports(rank, world_size):
    import os
    if rank == 1:
        os._exit(9)
    return "alive"


def test_a_rank_named_in_may_die_may_die_and_its_peers_report():
    assert run_distributed(_rank_1_dies_rank_0_reports, world_size=2, timeout_s=30, may_die=(1,)) == ["alive", None]
