"""Per-expert load statistics: the counts equal a bincount of the routing, the window keeps exactly the last
W forwards, slots count what they received, the state dict is untouched, and dumps summarise per layer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import moe
from hal import InvalidInput
from moe.expert_load import summarize
from moe.routing_traces import RoutingTrace
from tests.support.moe_reference import random_weights
from tests.support.replay_vendor import ReplayingCpu

E, H, I, K = 32, 192, 64, 4


def _layer(**kwargs) -> moe.MoELayer:
    w13, w2 = random_weights(E, H, I, 1)
    return moe.MoELayer.from_float(w13, w2, K, environ={}, **{"vendor": "cpu", **kwargs})


def _batches(n: int, tokens: int = 200):
    trace = RoutingTrace.parse("zipf:1.3")
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        yield torch.randn(tokens + seed, H, generator=g).to(torch.bfloat16), trace.logits(tokens + seed, E, seed=seed)


def test_counts_equal_the_routing_and_the_window_keeps_the_last_forwards():
    layer = _layer(load_stats=moe.LoadStats(window=3), redundant_experts=8)
    per_call = []
    for x, logits in _batches(5):
        layer(x, logits)
        per_call.append(torch.bincount(layer.router(logits).topk_ids.flatten(), minlength=E))
    snap = layer.expert_load.snapshot()
    assert snap.forwards == 5 and snap.window_forwards == 3
    assert snap.expert_total == torch.stack(per_call).sum(0).tolist()
    assert snap.expert_window == torch.stack(per_call[-3:]).sum(0).tolist()
    slots = torch.tensor(layer.placement.slots)
    by_expert = torch.zeros(E, dtype=torch.int64).index_add_(0, slots, torch.tensor(snap.slot_window))
    assert by_expert.tolist() == snap.expert_window  # every pair reached a slot of its expert
    window = torch.tensor(snap.expert_window, dtype=torch.float64)
    assert snap.imbalance == pytest.approx(float(window.max() / window.mean()))
    layer.expert_load.reset()
    assert layer.expert_load.snapshot().forwards == 0


def test_statistics_leave_the_output_and_the_state_dict_alone():
    plain, counted = _layer(), _layer(load_stats=moe.LoadStats())
    x, logits = next(_batches(1))
    assert torch.equal(plain(x, logits), counted(x, logits))
    assert plain.state_dict().keys() == counted.state_dict().keys()


def test_statistics_are_recorded_by_replayed_forwards_too():
    layer = _layer(vendor=ReplayingCpu(), load_stats=moe.LoadStats(window=2), graphs=moe.GraphConfig())
    x, logits = next(_batches(1))
    for _ in range(3):
        layer(x, logits)
    assert layer.graph_count == 1
    assert layer.expert_load.snapshot().forwards == 3  # the capture's warm-up runs are not counted


def test_dumps_summarise_each_layer_and_the_cli_reads_them(tmp_path):
    layers = {"model.layers.0.mlp": _layer(load_stats=moe.LoadStats()), "model.layers.1.mlp": _layer()}
    for x, logits in _batches(2):
        layers["model.layers.0.mlp"](x, logits)
    path = tmp_path / "load.json"
    document = moe.dump_expert_load(layers, path)
    assert list(document["layers"]) == ["model.layers.0.mlp"]  # the layer without statistics is skipped
    (row,) = summarize(json.loads(path.read_text()))
    assert row["forwards"] == 2 and row["pairs"] == sum(document["layers"]["model.layers.0.mlp"]["expert_window"])
    done = subprocess.run(
        [sys.executable, "-m", "hal", "load", str(path), "--ranks", "4", "--redundant", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (out,) = json.loads(done.stdout)["layers"]
    assert out["imbalance"] == pytest.approx(row["imbalance"]) and out["balanced"] <= out["greedy"] + 1e-9
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    done = subprocess.run([sys.executable, "-m", "hal", "load", str(bad)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "layers" in done.stderr and "Traceback" not in done.stderr


def test_bad_statistics_settings_are_refused():
    with pytest.raises(InvalidInput, match="LoadStats.window"):
        moe.LoadStats(window=0)
    with pytest.raises(InvalidInput, match="load_stats"):
        _layer(load_stats=16)
    with pytest.raises(InvalidInput, match="malformed"):
        summarize({"layers": {"a": {"forwards": 1}}})


@pytest.mark.parametrize(
    ("document", "match"),
    [
        ({"layers": {"a": {"expert_window": [1e400, 2], "forwards": 1}}}, "malformed"),
        ({"layers": {"a": {"expert_window": [-4, 2], "forwards": 1}}}, "whole numbers >= 0, got -4"),
        ({"layers": {"a": {"expert_window": [4, 2.5], "forwards": 1}}}, "got 2.5"),
        ({"layers": {"a": {"expert_window": [4, 2], "forwards": -1}}}, "got -1"),
        ({"a": 1}, '"layers" missing'),
        ([], "got 'a list'"),
    ],
)
def test_malformed_load_documents_are_refused_saying_what_is_wrong(document, match):
    with pytest.raises(InvalidInput, match=match):
        summarize(document)


def test_whole_float_counts_are_read_as_counts():
    (row,) = summarize({"layers": {"a": {"expert_window": [4.0, 2], "forwards": 1.0}}})
    assert row["pairs"] == 6 and row["forwards"] == 1


@pytest.mark.parametrize("pattern", ["uniform", "zipf:1.2", "hot:2:0.6", "rank-skew:3"])
def test_routing_traces_follow_their_pattern(pattern):
    trace = RoutingTrace.parse(pattern)
    probs = trace.popularity(16, ranks=4, seed=2)
    assert float(probs.sum()) == pytest.approx(1.0)
    ids = trace.topk_ids(20000, 16, 1, seed=2, ranks=4)
    observed = torch.bincount(ids.flatten(), minlength=16).double() / ids.numel()
    assert torch.allclose(observed, probs, atol=0.01)
    assert torch.equal(ids, trace.topk_ids(20000, 16, 1, seed=2, ranks=4))
    top2 = trace.topk_ids(50, 16, 2, seed=3, ranks=4)
    assert (top2[:, 0] != top2[:, 1]).all()


@pytest.mark.parametrize("text", ["zipf:-1", "hot:2", "hot:2:1.5", "gauss", "zipf:x"])
def test_malformed_routing_traces_are_refused(text):
    with pytest.raises(InvalidInput):
        RoutingTrace.parse(text)


def test_redundant_slots_without_ranks_are_refused(tmp_path, capsys):
    from hal.cli.app import main

    path = tmp_path / "load.json"
    path.write_text(json.dumps({"layers": {"a": {"expert_window": [4, 2], "forwards": 1}}}))
    assert main(["load", str(path), "--redundant", "2"]) == 2
    assert "--redundant: expected --ranks as well" in capsys.readouterr().err
    assert main(["load", str(path), "--ranks", "2", "--redundant", "2", "--json"]) == 0
