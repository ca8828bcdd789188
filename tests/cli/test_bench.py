"""`hal bench` on a CPU-only machine: the small shape runs, the JSON parses, and the report says
that roofline figures need a GPU. Also the shared combine and sort the bench's cases lean on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.shapes import SHAPES, parse_shapes, peak_of
from hal.reference import weighted_combine
from hal import InvalidInput
from hal.reference import sort_by_expert
from tests.support.paths import REPO

ROOT = REPO


def _hal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hal.cli", *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_bench_runs_the_small_shape_and_says_roofline_needs_a_gpu(tmp_path):
    done = _hal(
        "bench",
        "--vendor",
        "cpu",
        "--tokens",
        "1",
        "8",
        "--json",
        "--output",
        str(tmp_path / "b.json"),
        "--markdown",
        str(tmp_path / "b.md"),
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report == json.loads((tmp_path / "b.json").read_text())
    assert report["ceilings"] is None and "roofline figures need a GPU" in report["note"]
    assert [(c["model"], c["tokens"], c["precision"]) for c in report["cases"]] == [
        ("tiny", 1, "bf16"),
        ("tiny", 8, "bf16"),
        ("tiny", 1, "fp8"),
        ("tiny", 8, "fp8"),
    ]
    for case in report["cases"]:
        assert case["eager_us"] > 0 and case["direct_eager_us"] > 0 and case["loop_us"] > 0
        assert case["graph_us"] is None and case["roofline_us"] is None
        assert case["flops"] == 2 * case["tokens"] * 2 * (256 * 256 + 128 * 256)  # 2 * pairs * (H*2I + I*H)
    assert "[1/4] tiny bf16 1 tokens" in done.stderr  # progress, on stderr with --json
    assert (tmp_path / "b.md").read_text().startswith("| model | tokens |")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_bench_times_the_row_wise_fp8_scheme_when_asked():
    done = _hal("bench", "--vendor", "cpu", "--tokens", "8", "--precision", "fp8-rowwise", "--json")
    assert done.returncode == 0, done.stderr
    (case,) = json.loads(done.stdout)["cases"]
    assert (case["model"], case["tokens"], case["precision"]) == ("tiny", 8, "fp8-rowwise") and case["eager_us"] > 0


def test_fp8_schemes_take_the_fp8_matmul_peak():
    assert [peak_of(p) for p in ("bf16", "fp8", "fp8-rowwise")] == ["bf16", "fp8", "fp8"]


def test_bench_refuses_an_unknown_model_with_the_known_ones():
    done = _hal("bench", "--vendor", "cpu", "--model", "gpt-5")
    assert done.returncode == 2 and "unknown model shape(s) gpt-5" in done.stderr and "qwen3-30b-a3b" in done.stderr
    with pytest.raises(ValueError, match="known: qwen3-30b-a3b"):
        parse_shapes(["nope"], ())
    assert SHAPES["deepseek-v3-ep8"].experts == 32 and SHAPES["mixtral-8x7b"].top_k == 2


def test_weighted_combine_is_the_weighted_sum_of_each_tokens_rows():
    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # row r is [2r, 2r+1]
    index = torch.tensor([5, 0, 1, 4, 2, 3])  # token 0 takes rows 5, 0; token 1 rows 1, 4; token 2 rows 2, 3
    weights = torch.tensor([[0.5, 2.0], [1.0, 1.0], [0.25, 0.0]])
    out = weighted_combine(rows, index, weights, torch.float32)
    expected = torch.tensor([[0.5 * 10 + 2 * 0, 0.5 * 11 + 2 * 1], [2 + 8, 3 + 9], [0.25 * 4, 0.25 * 5]])
    assert torch.equal(out, expected)
    assert torch.equal(weighted_combine(rows[index], None, weights, torch.float32), expected)
    with pytest.raises(InvalidInput, match="index"):
        weighted_combine(rows, index[:5], weights, torch.float32)


def test_sort_by_expert_is_stable_and_counts_every_expert():
    ids = torch.tensor([[2, 0], [0, 3], [2, 1]])  # pairs 0..5 -> experts 2, 0, 0, 3, 2, 1
    order, inverse, counts = sort_by_expert(ids, 5)
    assert order.tolist() == [1, 2, 5, 0, 4, 3] and counts.tolist() == [2, 1, 2, 1, 0]
    assert torch.equal(order[inverse], torch.arange(6))


@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-fp8-block"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_the_direct_baseline_computes_the_layer_bit_for_bit(scheme, tokens):
    """`direct_forward` is only a fair baseline for the abstraction's overhead if it makes the layer's own
    kernel calls: the same output bits."""
    from bench.baselines import direct_forward
    from moe import MoELayer
    from vendors.cpu import CpuVendor

    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 16, 320, 96, 4
    w13 = torch.randn(experts, hidden, 2 * inter, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, inter, hidden, generator=gen) / inter**0.5
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen)
    for vendor in (CpuVendor(),):
        layer = MoELayer.from_float(w13, w2, top_k, scheme=scheme, vendor=vendor)
        assert torch.equal(direct_forward(vendor, layer, x, logits), layer(x, logits))
