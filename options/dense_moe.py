"""DenseMoE: another codebase's MoE in the dense layout that moe_switch.py makes expert-parallel.

    python -m pytest tests/test_dense_moe.py

moe_switch.py finds a dense MoE layer by its attributes: router (E, D), w_gate and w_up (E, D, H),
w_down (E, H, D) in x @ w orientation, and top_k. model.MoE, the default run's, has them already.
A codebase whose experts are per-expert nn.Linear layers (Mixtral's w1, w3, w2) converts them
first with DenseMoE.from_linear; one holding stacks of nn.Linear weights (E, out, in) with
DenseMoE(..., orientation="nn.Linear"). Both copy the weights once; a bias is refused by name, not
dropped (this MoE has none). The forward is moe_switch.moe_reference, the slow loop that the EP
layer must match, so a converted layer can be checked against the original before it is sharded.

Shapes: E experts, D model width, H expert hidden width.
"""
import torch
import torch.nn as nn

from moe_switch import EXPERT_NAMES, moe_reference
from plumbing.moe_switch_details import check_dense

ORIENTATIONS = ("x @ w", "nn.Linear")  # w_gate (E, D, H) used as x @ w; or (E, H, D), x @ w.T


class DenseMoE(nn.Module):
    """The dense MoE as a module: router (E, D), w_gate and w_up (E, D, H), w_down (E, H, D).
    orientation is required: "x @ w" takes the stacks as they are; "nn.Linear" takes stacks of
    nn.Linear weights (E, out, in) and transposes them (a copy). A square stack (H == D) fits both,
    so no default could catch the wrong one."""

    def __init__(self, router_weight, w_gate, w_up, w_down, top_k, *, orientation):
        super().__init__()
        if orientation not in ORIENTATIONS:
            raise ValueError(f"orientation {orientation!r} must be one of {ORIENTATIONS}: 'x @ w' "
                             "for w_gate, w_up (E, D, H) and w_down (E, H, D); 'nn.Linear' for "
                             "stacks of nn.Linear weights (out, in)")
        if orientation == "nn.Linear":  # (E, out, in) -> (E, in, out)
            w_gate, w_up, w_down = (w.transpose(1, 2).contiguous() for w in (w_gate, w_up, w_down))
        check_dense(router_weight, w_gate, w_up, w_down, top_k)
        E, D = router_weight.shape
        self.router = nn.Linear(D, E, bias=False)
        self.router.weight = nn.Parameter(router_weight)            # (E, D)
        self.w_gate, self.w_up, self.w_down = (nn.Parameter(w) for w in (w_gate, w_up, w_down))
        self.top_k = top_k

    @classmethod
    def from_linear(cls, router, experts, top_k, names=("gate_proj", "up_proj", "down_proj")):
        """router: nn.Linear(D, E); experts: E modules holding nn.Linear gate (D -> H), up (D -> H)
        and down (H -> D) under `names` (Mixtral: ("w1", "w3", "w2")). A bias is refused by name,
        not dropped. Copies: (E, D, H) x2, (E, H, D)."""
        _check_expert_names(experts, names)
        biased = [f"experts[{e}].{n}" for e, m in enumerate(experts) for n in names
                  if getattr(m, n).bias is not None]
        biased = ["router"] * (getattr(router, "bias", None) is not None) + biased
        if biased:
            raise ValueError(f"{biased[0]} has a bias; this file's MoE has no biases, it would "
                             f"drop them and compute something else ({len(biased)} biased Linear "
                             "layers in all): build them with bias=False, or keep this MoE out of "
                             "a model that has them")
        stacks = [torch.stack([getattr(m, n).weight.detach() for m in experts]) for n in names]
        return cls(router.weight.detach().clone(), *stacks, top_k, orientation="nn.Linear")

    def forward(self, x):
        experts = {n: getattr(self, n) for n in EXPERT_NAMES}
        y = moe_reference(x.reshape(-1, x.shape[-1]), self.router.weight, experts, self.top_k)
        return y.view_as(x)


def _check_expert_names(experts, names):
    """from_linear's: every expert holds an nn.Linear under each of names."""
    for e, m in enumerate(experts):
        missing = [n for n in names if not isinstance(getattr(m, n, None), nn.Linear)]
        if missing:
            held = [n for n, c in m.named_children() if isinstance(c, nn.Linear)]
            raise ValueError(f"experts[{e}] holds no nn.Linear named {missing}: it holds {held}; "
                             "pass names=(gate, up, down), e.g. ('w1', 'w3', 'w2') for Mixtral")
