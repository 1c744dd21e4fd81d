"""options/dense_moe.py: another codebase's experts (per-expert nn.Linear layers, stacks of nn.Linear weights)
converted to the dense layout moe_switch.py makes expert-parallel, the same outputs, a bias or a wrong name refused."""
import pytest
import torch

from moe_switch import EPLayout, EPMoE
from options.dense_moe import DenseMoE

E, D, H, K = 8, 16, 24, 2


class _Expert(torch.nn.Module):
    """The common per-expert format, Mixtral's names: w1 gate (D -> H), w3 up (D -> H), w2 down (H -> D)."""

    def __init__(self, d, h, bias=False):
        super().__init__()
        self.w1, self.w3, self.w2 = torch.nn.Linear(d, h, bias=bias), torch.nn.Linear(d, h, bias=bias), \
            torch.nn.Linear(h, d, bias=bias)


def _per_expert_loop(router, experts, x):
    """The MoE computed token by token through the Linear layers themselves (biases included)."""
    probs = torch.softmax(router(x), -1)
    top_p, top_e = probs.topk(K, -1)
    want = torch.zeros_like(x)
    for n in range(len(x)):
        for p, e in zip(top_p[n] / top_p[n].sum(), top_e[n].tolist()):
            ex = experts[e]
            want[n] += p * ex.w2(torch.nn.functional.silu(ex.w1(x[n])) * ex.w3(x[n]))
    return want


def test_per_expert_linear_layers_convert_to_the_dense_layout():
    """DenseMoE.from_linear: the common per-expert format (nn.Linear gate/up/down, weights (H, D), (H, D),
    (D, H)) gives the stacked layout, and the same outputs as a loop over the Linear experts."""
    torch.manual_seed(0)
    router, experts = torch.nn.Linear(D, E, bias=False), [_Expert(D, H) for _ in range(E)]
    dense = DenseMoE.from_linear(router, experts, top_k=K, names=("w1", "w3", "w2"))  # Mixtral's names
    assert tuple(dense.w_gate.shape) == (E, D, H) and tuple(dense.w_down.shape) == (E, H, D)
    x = torch.randn(7, D)
    want = _per_expert_loop(router, experts, x)
    torch.testing.assert_close(dense(x), want, atol=1e-5, rtol=1e-5)
    layer = EPMoE.from_dense(dense, EPLayout(1, 1, E))
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


def test_a_bias_is_refused_by_name_not_dropped():
    """This MoE has no biases: from_linear refuses a biased router or expert Linear, naming it, before
    building anything (it used to drop them, and the outputs were off)."""
    names = ("w1", "w3", "w2")
    experts = [_Expert(D, H) for _ in range(E)]
    experts[2].w1 = torch.nn.Linear(D, H)
    with pytest.raises(ValueError, match=r"^experts\[2\]\.w1 has a bias; .*\(1 biased"):
        DenseMoE.from_linear(torch.nn.Linear(D, E, bias=False), experts, top_k=K, names=names)
    with pytest.raises(ValueError, match=r"^router has a bias; .*\(4 biased"):  # the router, expert 5's three
        DenseMoE.from_linear(torch.nn.Linear(D, E), [_Expert(D, H, bias=i == 5) for i in range(E)], K, names)
    router = torch.nn.Linear(D, E)
    dense = DenseMoE.from_linear(torch.nn.Linear(D, E, bias=False), [_Expert(D, H) for _ in range(E)], K, names)
    dense.router = router  # a biased router put in by hand: from_dense refuses it too
    with pytest.raises(ValueError, match="^router has a bias"):
        EPMoE.from_dense(dense, EPLayout(1, 1, E))


def test_wrong_expert_names_and_a_rectangular_stack_in_the_wrong_orientation_are_named():
    """from_linear with names the experts do not hold: a ValueError naming what they hold (a bare
    AttributeError before); nn.Linear stacks given as x @ w: the orientation named, not router.weight."""
    experts = [_Expert(D, H) for _ in range(E)]  # w1, w3, w2
    with pytest.raises(ValueError, match=r"experts\[0\] holds no nn.Linear named \['gate_proj', 'up_proj', "
                                         r"'down_proj'\]: it holds \['w1', 'w3', 'w2'\]"):
        DenseMoE.from_linear(torch.nn.Linear(D, E, bias=False), experts, top_k=K)
    linear = [torch.stack([getattr(m, n).weight.detach() for m in experts]) for n in ("w1", "w3", "w2")]
    with pytest.raises(ValueError, match="the expert stacks are in nn.Linear orientation .*orientation='nn.Linear'"):
        DenseMoE(torch.randn(E, D), *linear, top_k=K, orientation="x @ w")


def test_a_square_stack_must_name_its_orientation():
    """H == D: a stack of nn.Linear weights, (E, out, in), has the shape of an x @ w stack, (E, in, out), so
    no shape check can tell them apart. DenseMoE requires orientation= (no default to be silently wrong):
    without it a TypeError; "nn.Linear" transposes, and both orientations match the per-expert loop."""
    torch.manual_seed(0)
    router, experts = torch.nn.Linear(D, E, bias=False), [_Expert(D, D) for _ in range(E)]
    linear = [torch.stack([getattr(m, n).weight.detach() for m in experts]) for n in ("w1", "w3", "w2")]  # (E, D, D)
    x = torch.randn(7, D)
    want = _per_expert_loop(router, experts, x)
    with pytest.raises(TypeError, match="orientation"):
        DenseMoE(router.weight.detach(), *linear, top_k=K)
    with pytest.raises(ValueError, match=r"orientation 'linear' must be one of \('x @ w', 'nn.Linear'\)"):
        DenseMoE(router.weight.detach(), *linear, top_k=K, orientation="linear")
    got = DenseMoE(router.weight.detach(), *linear, top_k=K, orientation="nn.Linear")
    torch.testing.assert_close(got(x), want, atol=1e-5, rtol=1e-5)
    x_at_w = [t.transpose(1, 2) for t in linear]
    torch.testing.assert_close(DenseMoE(router.weight.detach(), *x_at_w, top_k=K, orientation="x @ w")(x), want,
                               atol=1e-5, rtol=1e-5)
    wrong = DenseMoE(router.weight.detach(), *linear, top_k=K, orientation="x @ w")  # only by saying so
    assert not torch.allclose(wrong(x), want, atol=1e-3)
