"""--infer-tp t: the rollout engine tensor-parallel over groups of t adjacent ranks (t = 2 or 4).

    torchrun --standalone --nproc_per_node=2 train_grpo.py --infer-tp 2

Applied where the run is built: the engine is rebuilt with its attention heads and every expert's
hidden units split over its TP group (model.Policy with a tp_group), and the switch hands it full
weights through its load_weights, which cuts each rank's piece (fusion.py's load_weights path). The
replicas are the TP groups: each generates its own slice of the prompts, one rank of each writes its
samples into the queue. Training stays FSDP2 over every rank.

    python -m pytest tests/test_fusion.py tests/test_train_grpo.py -k tensor
"""
from config import model_config
from model import Policy, TPLayout


def apply(run):
    """The engine rebuilt tensor-parallel over this rank's TP group (a collective: every rank makes
    every group)."""
    cfg = run.cfg
    layout = TPLayout(run.roles.world, cfg.infer_tp, n_heads=cfg.n_heads)
    tp_group = layout.new_groups(cfg.pg_timeout_s)[0]
    run.engine = Policy(model_config(cfg), tp_group).to(run.device).eval().requires_grad_(False)
