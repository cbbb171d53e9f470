"""The residual-addmm unfusion pass: on ATen graphs it must change and leave alone, and
through Inductor, where it has to undo Inductor's own ``add(mm) -> addmm`` pattern.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from graphattn.passes.inductor import compile_piece
from graphattn.passes.pass_manager import DEFAULT_PASSES, make_pass_manager
from graphattn.passes.unfuse_addmm import UnfuseResidualAddmmPass

aten = torch.ops.aten


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _residual_and_bias(r, x, w, bias):  # r [T, 6], x [T, 4], w [4, 6], bias [6]
    h = torch.addmm(r, x, w)  # residual: unfused
    return torch.addmm(bias, h[:, :4], w), torch.addmm(h, x, w, beta=2.0)  # bias, scaled: kept


def _inputs(t: int = 5):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) for s in ((t, 6), (t, 4), (4, 6), (6,))]


def test_residual_addmm_becomes_add_of_mm_and_others_stay():
    gm = make_fx(_residual_and_bias, tracing_mode="symbolic")(*_inputs())
    assert _targets(gm).count(aten.addmm.default) == 3, gm.code
    expected = gm(*_inputs(7))
    assert UnfuseResidualAddmmPass()(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    targets = _targets(gm)
    assert targets.count(aten.addmm.default) == 2  # the bias one and the beta=2 one
    assert aten.mm.default in targets and aten.add.Tensor in targets
    new = [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.add.Tensor)]
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in new)  # lowering reads them
    for got, want in zip(gm(*_inputs(7)), expected):
        torch.testing.assert_close(got, want)


def test_inductor_builds_mm_plus_add_not_addmm_for_a_residual():
    """Without the pass Inductor fuses the residual into an extern addmm (on CUDA that
    copies the residual into the output first); with it the output code calls mm.
    """

    def layer(r, x, w):
        h = r + x @ w  # Inductor's pattern turns this into addmm (h is a graph output)
        return h, h.float().pow(2).mean(-1)

    gm = fx.symbolic_trace(layer)
    args = _inputs()[:3]
    codes: dict[str, str] = {}
    for label, names in (("without", ["noop_elimination"]), ("with", list(DEFAULT_PASSES))):
        out = compile_piece(
            gm,
            args,
            dynamic=False,
            pass_manager=make_pass_manager(names),
            on_output_code=lambda code, _label=label: codes.__setitem__(_label, code),
        )(*args)
        torch.testing.assert_close(out[0], layer(*args)[0])
    assert "addmm" in codes["without"]  # the pattern this pass exists to undo
    assert "addmm" not in codes["with"] and "mm(" in codes["with"]
