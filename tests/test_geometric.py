"""PyTorch Geometric models, watched: small seeded GCN / GAT / GIN + SAGE models on random
graphs (node classification on one Data, graph classification on a DataLoader of Batches).

PyTorch Geometric is no dependency of nanwidget: these run only where torch_geometric is
installed.
"""

from __future__ import annotations

import linecache
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

torch_geometric = pytest.importorskip("torch_geometric", reason="PyG models: pip install torch_geometric")

from torch_geometric.data import Data  # noqa: E402
from torch_geometric.loader import DataLoader  # noqa: E402
from torch_geometric.nn import GATConv, GCNConv, GINConv, SAGEConv, global_add_pool  # noqa: E402
from torch_geometric.nn import global_max_pool, global_mean_pool  # noqa: E402

import nanwidget as nw  # noqa: E402
from conftest import hook_count  # noqa: E402
from test_replay import line_of  # noqa: E402

WATCHES = [{}, {"mode": "sentinel"}, {"backward": True}]


def random_graph(nodes: int, edges: int, generator: torch.Generator, y=None) -> Data:
    data = Data(x=torch.randn(nodes, 8, generator=generator),
                edge_index=torch.randint(0, nodes, (2, edges), generator=generator))
    if y is not None:
        data.y = y
    return data


def graphs(count: int = 12) -> list[Data]:
    generator = torch.Generator().manual_seed(0)
    return [random_graph(int(torch.randint(4, 10, (1,), generator=generator)), 16, generator,
                         y=torch.tensor([i % 2])) for i in range(count)]


class NodeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gcn = GCNConv(8, 16)
        self.gat = GATConv(16, 4, heads=2, dropout=0.2)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, edge_index):
        return self.gat(self.drop(F.relu(self.gcn(x, edge_index))), edge_index)


class GraphNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gin = GINConv(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16)))
        self.sage = SAGEConv(16, 16, aggr="max")
        self.head = nn.Linear(32, 2)

    def forward(self, data):
        x = F.relu(self.sage(F.relu(self.gin(data.x, data.edge_index)), data.edge_index))
        return self.head(torch.cat([global_mean_pool(x, data.batch), global_max_pool(x, data.batch)], 1))


def train_node(watch_kwargs):
    torch.manual_seed(0)
    model = NodeNet()
    data = random_graph(30, 90, torch.Generator().manual_seed(1), y=torch.arange(30) % 8)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    watch = nw.watch(model, **watch_kwargs) if watch_kwargs is not None else None
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data.x, data.edge_index), data.y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return model, watch, losses


def train_graphs(watch_kwargs):
    torch.manual_seed(0)
    model = GraphNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    watch = nw.watch(model, **watch_kwargs) if watch_kwargs is not None else None
    losses = []
    for batch in DataLoader(graphs(), batch_size=4, shuffle=True):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch), batch.y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return model, watch, losses


@pytest.mark.parametrize("train", [train_node, train_graphs], ids=["node", "graph"])
@pytest.mark.parametrize("watch_kwargs", WATCHES, ids=["full", "sentinel", "backward"])
def test_a_watched_gnn_trains_bit_identically_and_quietly(train, watch_kwargs):
    reference, _, reference_losses = train(None)
    reference_rng = torch.rand(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, watch, losses = train(watch_kwargs)
    assert torch.equal(torch.rand(3), reference_rng)
    assert not watch.events and not watch.warnings
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    watch.close()
    assert hook_count(model) == 0


def test_nan_in_one_graphs_node_features_is_bad_data_naming_the_node_row():
    torch.manual_seed(0)
    model = GraphNet()
    data = graphs()
    data[6].x[2, 3] = float("nan")  # batch 1 holds graphs 4..7
    with nw.watch(model, on_nan="record") as w:
        for batch in DataLoader(data, batch_size=4):
            model(batch)
    event = w.event
    assert event.batch == 1 and event.diagnosis.kind == "bad-data"
    assert event.diagnosis.rows == [data[4].num_nodes + data[5].num_nodes + 2]


class PooledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = GCNConv(8, 16, normalize=False)
        self.head = nn.Linear(16, 2)

    def forward(self, x, edge_index, batch):
        return self.head(global_add_pool(F.relu(self.conv(x, edge_index)), batch))


def run_half(model, nodes: int, edge_index) -> None:
    x = (torch.rand(nodes, 8, generator=torch.Generator().manual_seed(0)) * 8).half()
    with torch.no_grad():
        model(x, edge_index, torch.zeros(nodes, dtype=torch.long))


@pytest.mark.parametrize("watch_kwargs", WATCHES[:2], ids=["full", "sentinel"])
def test_a_float16_overflow_in_global_add_pool_names_the_models_line_not_pygs_scatter(watch_kwargs):
    # The sum over 20000 nodes passes 65504 in scatter_add_, which every PyG reduction runs
    # through torch_geometric/utils/_scatter.py: the diagnosis named that line and told the user
    # to keep the values smaller there.
    torch.manual_seed(0)
    model = PooledNet().half()
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record", **watch_kwargs) as w:
            run_half(model, 50, torch.randint(0, 50, (2, 200), generator=generator))
            run_half(model, 20000, torch.randint(0, 20000, (2, 80000), generator=generator))
    diagnosis = w.event.diagnosis
    line = line_of(PooledNet.forward, "global_add_pool(")
    assert diagnosis.kind == "overflow" and "scatter_add" in diagnosis.summary
    fixes = " ".join(diagnosis.suggestion)
    assert line in diagnosis.summary and "_scatter.py" not in fixes
    assert "global_mean_pool" in fixes and "attention scores" not in fixes


def test_a_float16_overflow_in_a_convs_aggregation_names_the_convs_propagate_line():
    # All 20000 nodes send to node 0: GCNConv's sum aggregation passes 65504. The source was
    # torch_geometric/experimental.py (a decorator) or PyG's scatter, never the conv.
    torch.manual_seed(0)
    model = PooledNet().half()
    nodes = 20000
    edge_index = torch.stack([torch.arange(nodes), torch.zeros(nodes, dtype=torch.long)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record") as w:
            run_half(model, nodes, edge_index)
            trace = w.replay(0)
    assert w.event.module == "conv.aggr_module" and w.event.diagnosis.kind == "overflow"
    source = trace.first_bad["source"]
    assert trace.first_bad["op"] == "scatter_add_"
    assert os.path.basename(source.rpartition(":")[0]) == "gcn_conv.py", source
    filename, _, line = source.rpartition(":")
    assert "self.propagate(" in linecache.getline(filename, int(line))
