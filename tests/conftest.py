"""Fixtures that more than one test file shares."""
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def world_of_one(tmp_path_factory):
    """tests/test_train_grpo.py's TINY run, its defaults, at world 1: the parameters that every deployment of the
    same flags trains to. Made once a session: its summary, its parameters, and its folder (metrics.jsonl)."""
    from tests.distributed import run_distributed
    from tests.test_train_grpo import _train_tiny
    out = tmp_path_factory.mktemp("w1")
    [(summary, params)] = run_distributed(_train_tiny, world_size=1, args=(str(out),))
    return SimpleNamespace(summary=summary, params=params, out=out)
