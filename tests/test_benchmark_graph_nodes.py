"""benchmarks/graph_nodes.py: the dependency order and summary on the CPU; on the GPU, a
graph's nodes and edge types read through the driver, and the decode engine's batch-1 FULL
graph as round 18 found it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_main_needs_cuda

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import graph_nodes as G  # noqa: E402

KERNEL = {"type": "kernel", "name": "k", "grid": [1, 1, 1], "block": [32, 1, 1]}


def test_dependency_order_puts_every_node_after_its_inputs():
    # listed out of order: 30 -> 10 -> 20, 30 -> 40 (programmatic), 40 -> 20
    nodes = [20, 10, 40, 30]
    edges = [(30, 10, 0), (10, 20, 0), (30, 40, 1), (40, 20, 0)]
    order = G.dependency_order(nodes, edges)
    assert order[0] == 30 and order[-1] == 20
    assert order.index(10) < order.index(20) and order.index(40) < order.index(20)
    assert G.dependency_order([2, 1], []) == [2, 1]  # ties keep the listed order


def test_dependency_order_refuses_a_cycle():
    with pytest.raises(ValueError, match="cycle: 2 nodes"):
        G.dependency_order([1, 2, 3], [(1, 2, 0), (2, 3, 0), (3, 2, 0)])


def test_describe_counts_types_and_names_each_nodes_inputs():
    nodes = {
        1: KERNEL | {"name": "stage"},
        2: {"type": "event record"},
        3: KERNEL | {"name": "first"},
        4: KERNEL | {"name": "pdl"},
    }
    edges = [(1, 2, 0), (1, 3, 0), (3, 4, 1)]
    d = G.describe(nodes, edges)
    assert d["nodes"] == 4
    assert d["by_type"] == {"kernel": 3, "event record": 1}
    assert d["edges"] == {"default": 2, "programmatic": 1}
    assert [n.get("name", n["type"]) for n in d["order"]] == [
        "stage",
        "event record",
        "first",
        "pdl",
    ]
    assert d["order"][0]["after"] == []
    assert d["order"][3]["after"] == [{"from": 2, "edge": "programmatic"}]
    lines = G.format_graph("g", d, head=1, tail=1)
    assert lines[1].endswith("<- root") and lines[2].strip() == "..."
    assert "programmatic from 2" in lines[3]


def test_graphs_kept_asks_for_the_topology_and_restores_the_class(monkeypatch):
    made = []

    class Fake:
        def __init__(self, keep_graph=False):
            made.append(keep_graph)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Fake)
    with G.graphs_kept():
        torch.cuda.CUDAGraph()
    torch.cuda.CUDAGraph()
    assert made == [True, False]
    assert torch.cuda.CUDAGraph is Fake


def test_import_runs_first_and_a_missing_module_is_named(capsys, monkeypatch):
    assert G.main(["--import", "no_such_module_here"]) == 2
    assert "--import no_such_module_here" in capsys.readouterr().err
    if torch.cuda.is_available():
        pytest.skip("the rest needs main to stop for want of CUDA")
    monkeypatch.delitem(sys.modules, "json.tool", raising=False)
    assert G.main(["--import", "json.tool"]) == 2  # imported, then no CUDA device
    assert "json.tool" in sys.modules


def test_without_cuda_it_says_so(capsys):
    assert_main_needs_cuda(G.main, capsys)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reads_kernels_events_and_programmatic_edges():
    """A graph of a torch kernel, an event recorded on a forked stream, and two chained
    graphattn GEMVs (launched with PDL on Hopper): the driver's view of it."""
    from graphattn.kernels import pdl
    from graphattn.kernels.gemv import gemv

    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    gemv(gemv(x, w), w)  # compile outside the capture
    event, side = torch.cuda.Event(external=True), torch.cuda.Stream()
    torch.cuda.synchronize()
    with G.graphs_kept():
        graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        side.wait_stream(torch.cuda.current_stream())
        event.record(side)
        out = gemv(gemv(y, w), w)
        torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    ref = (((y.float() @ w.float().T).to(y.dtype)).float() @ w.float().T).to(y.dtype)
    assert torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-1)
    d = G.read_graph(G.Driver(), graph.raw_cuda_graph())
    assert d["by_type"]["kernel"] == 3
    assert d["by_type"]["event record"] == 1
    names = [n.get("name", "") for n in d["order"]]
    assert sum("_gemv_kernel" in n for n in names) == 2
    second = max(i for i, n in enumerate(names) if "_gemv_kernel" in n)
    expected = "programmatic" if pdl.use_pdl(torch.device("cuda")) else "default"
    assert d["order"][second]["after"][0]["edge"] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_batch1_full_graph_holds_only_kernels_and_its_event(tmp_path):
    """Round 18's reading of the decode engine's batch-1 FULL graph: the staging kernel
    first, the copies-done event on a branch after it, no other node that is not a kernel;
    on Hopper the layers' kernels chained by programmatic edges."""
    from graphattn.kernels import pdl

    out = tmp_path / "nodes.json"
    assert G.main(["--batches", "1", "--out", str(out), "--dot", str(tmp_path)]) == 0
    graphs = json.loads(out.read_text())["graphs"]
    d = graphs["tokens 1, requests 1, uniform decode"]
    assert d["by_type"]["event record"] == 1
    assert set(d["by_type"]) == {"kernel", "event record"}
    assert "_stage_kernel" in d["order"][0]["name"]
    (event,) = [n for n in d["order"] if n["type"] == "event record"]
    assert event["after"] == [{"from": 0, "edge": "default"}]  # right after the staging
    if pdl.use_pdl(torch.device("cuda")):
        assert d["edges"]["programmatic"] > d["edges"]["default"]
    assert (tmp_path / "graph-1-decode.dot").stat().st_size > 0
