"""The CUDA vendor's tuning tables (`hal tune`'s output): reading, lookup, validation, the packaged
H100 table, and the command's refusals on a machine that cannot tune. The search itself runs on
a GPU only (`tests/vendors/cuda/test_cuda_kernels.py` checks tuned configurations compute the same results)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.shapes import SHAPES
from bench.tune_cli import problems_for
from hal import ActivationKind, GemmKind, GemmProblem, InvalidInput
from vendors.cuda.tuning import (
    DEEP_GEMM,
    GROUPED_MM,
    REACH,
    TRITON,
    TRITON_THEN_ACTIVATION,
    Choice,
    TuningTable,
    device_slug,
    packaged_devices,
    problem_key,
)
from vendors.cuda.vendor import CudaVendor


def _table() -> TuningTable:
    return TuningTable(
        "Test GPU",
        {
            problem_key("bf16", 8, 64, 32): {
                8: Choice(TRITON, (16, 64, 64, 4, 3, 0), 10.0, 12.0),
                512: Choice(TRITON, (64, 128, 64, 4, 3, 1), 20.0, 30.0),
                8192: Choice(GROUPED_MM, None, 40.0, 50.0),
            }
        },
        {"date": "2026-11-23"},
    )


@pytest.mark.parametrize(
    "rows, expected", [(4, 8), (8, 8), (60, 8), (70, 512), (512, 512), (2000, 512), (2100, 8192), (2 * 8192, 8192)]
)
def test_lookup_takes_the_nearest_row_count_on_a_log_scale(rows, expected):
    table = _table()
    assert table.lookup("bf16", 8, 64, 32, rows) == table.entries[problem_key("bf16", 8, 64, 32)][expected]


@pytest.mark.parametrize("rows", [1, 3, 2 * 8192 + 1, 4 * 8192, 10**6])
def test_rows_beyond_the_reach_of_the_tuned_rows_take_the_defaults(rows):
    assert REACH == 2  # the table's smallest M is 8, its largest 8192
    assert _table().lookup("bf16", 8, 64, 32, rows) is None


def test_a_problem_the_table_does_not_hold_takes_the_defaults():
    table = _table()
    assert table.lookup("bf16", 8, 64, 33, 8) is None and table.lookup("fp8-block128", 8, 64, 32, 8) is None


def test_a_call_with_its_activation_takes_its_own_entry_else_the_plain_one_then_the_pass():
    table = _table()
    plain = table.lookup("bf16", 8, 64, 32, 8)
    fallback = table.lookup_activated("bf16", 8, 64, 32, 8, "silu-glu")
    assert plain.backend == TRITON and fallback.backend == TRITON_THEN_ACTIVATION and fallback.tiles == plain.tiles
    own = Choice(TRITON, (16, 32, 128, 4, 4, 0), 5.0)
    table.entries[problem_key("bf16", 8, 64, 32, "silu-glu")] = {16: own}
    assert problem_key("bf16", 8, 64, 32, "silu-glu") == "bf16 E=8 K=64 N=32 +silu-glu"
    assert table.lookup_activated("bf16", 8, 64, 32, 8, "silu-glu") == own
    assert table.lookup_activated("bf16", 8, 64, 33, 8, "silu-glu") is None


def test_a_table_round_trips_through_its_json(tmp_path):
    path = tmp_path / "t.json"
    _table().write(path)
    again = TuningTable.load(path)
    assert again.entries == _table().entries and again.device == "Test GPU" and again.source == str(path)
    assert "Test GPU" in again.describe() and "3 entries" in again.describe()


def test_tiles_with_bands_of_row_blocks_round_trip(tmp_path):
    """A seventh tile value (`group_m`, bands of row blocks) is read back; six-value tiles stay valid."""
    table = _table()
    table.entries[problem_key("fp8-block128", 32, 7168, 4096)] = {131072: Choice(TRITON, (128, 128, 128, 8, 3, 1, 32))}
    table.write(tmp_path / "t.json")
    again = TuningTable.load(tmp_path / "t.json")
    assert again.lookup("fp8-block128", 32, 7168, 4096, 131072).tiles == (128, 128, 128, 8, 3, 1, 32)
    assert again.lookup("bf16", 8, 64, 32, 512).tiles == (64, 128, 64, 4, 3, 1)


def test_tiles_for_the_tma_kernel_round_trip(tmp_path):
    """An eighth tile value (`tma`) is read back; tiles without it mean pointer loads."""
    table = _table()
    table.entries[problem_key("fp8-block128", 128, 768, 2048)] = {131072: Choice(TRITON, (128, 64, 128, 4, 3, 1, 1, 1))}
    table.write(tmp_path / "t.json")
    tiles = TuningTable.load(tmp_path / "t.json").lookup("fp8-block128", 128, 768, 2048, 131072).tiles
    assert tiles == (128, 64, 128, 4, 3, 1, 1, 1)


def test_a_first_projection_choice_keeps_how_it_reads_its_rows(tmp_path):
    """`gather` (rows gathered first, or read through the index) is read back as written; a choice without it
    leaves the way to the vendor's rule, and the activated lookup's fallback to a plain entry carries none."""
    table = _table()
    key = problem_key("fp8-block128", 128, 2048, 1536, "silu-glu")
    table.entries[key] = {
        4096: Choice(TRITON, (64, 128, 128, 4, 3, 0)),
        32768: Choice(TRITON, (128, 64, 128, 8, 3, 1), 700.0, 720.0, gather=False),
        131072: Choice(TRITON_THEN_ACTIVATION, (128, 128, 128, 8, 3, 1), gather=True),
    }
    table.write(tmp_path / "t.json")
    assert '"gather": false' in (tmp_path / "t.json").read_text()
    loaded = TuningTable.load(tmp_path / "t.json")
    assert [loaded.entries[key][m].gather for m in (4096, 32768, 131072)] == [None, False, True]
    assert loaded.lookup_activated("fp8-block128", 128, 2048, 1536, 30000, "silu-glu").gather is False
    assert loaded.entries == table.entries
    fallback = loaded.lookup_activated("bf16", 8, 64, 32, 512, "silu-glu")
    assert fallback.backend == TRITON_THEN_ACTIVATION and fallback.gather is None


def test_the_vendor_reads_rows_the_way_its_table_says_else_by_its_rule():
    """`reads_through_index`: a choice's `gather` decides; without one (or without a choice) one-byte rows are
    read through the index up to 32 per group and gathered beyond, wider rows always read through it."""
    pytest.importorskip("triton", reason="Triton is not installed (it is not a test dependency)")
    from vendors.cuda.ops import ONE_BYTE_GATHER_MAX_ROWS_PER_GROUP as most, reads_through_index

    tiles = (64, 128, 128, 4, 3, 0)
    for choice in (None, Choice(TRITON, tiles)):
        assert reads_through_index(choice, most * 8, 8, 1) and not reads_through_index(choice, most * 8 + 1, 8, 1)
        assert reads_through_index(choice, 10**6, 8, 2)
    assert reads_through_index(Choice(TRITON, tiles, gather=False), 10**6, 8, 1)
    assert not reads_through_index(Choice(TRITON, tiles, gather=True), 8, 8, 2)


def test_tile_configs_with_the_tma_setting_parse_and_print_back():
    """`TileConfig` reads and writes the eighth value (Triton needed: the kernels module imports it)."""
    pytest.importorskip("triton", reason="Triton is not installed (it is not a test dependency)")
    from vendors.cuda.kernels.grouped_gemm import TileConfig

    tiles = (128, 64, 128, 4, 3, 1, 1, 1)
    assert TileConfig.from_list(list(tiles)) == TileConfig(128, 64, 128, 4, 3, n_fastest=True, tma=True)
    assert TileConfig.from_list([128, 64, 128, 4, 3, 1, 32]).tma is False
    for config in (
        TileConfig(128, 64, 128, 4, 3, n_fastest=True, tma=True),
        TileConfig(64, 128, 128, 4, 3, group_m=8),
        TileConfig(64, 128, 128, 4, 3, group_m=8, tma=True),
        TileConfig(16, 32, 64, 4, 3),
    ):
        assert TileConfig.from_list(config.as_list()) == config
    with pytest.raises(ValueError, match="tma"):
        TileConfig.from_list([128, 64, 128, 4, 3, 1, 1, 3])


@pytest.mark.parametrize(
    "mutate, names",
    [
        (lambda d: d.update(format="other"), "format"),
        (lambda d: d.update(entries=[]), "entries"),
        (
            lambda d: d["entries"]["bf16 E=8 K=64 N=32"].update({"0": {"backend": "triton", "tiles": [1] * 5}}),
            "row counts",
        ),
        (lambda d: d["entries"]["bf16 E=8 K=64 N=32"]["8"].update(tiles=[16, 64, -1, 4, 3]), "tiles"),
        (lambda d: d["entries"]["bf16 E=8 K=64 N=32"]["8"].update(tiles=[16, 64, 64, 4, 3, 1, 0]), "group_m"),
        (lambda d: d["entries"]["bf16 E=8 K=64 N=32"]["8"].update(tiles=[16, 64, 64, 4, 3, 1, 8, 2]), "tma"),
        (lambda d: d["entries"]["bf16 E=8 K=64 N=32"]["8"].update(tiles=[16, 64, 64, 4, 3, 1, 8, 1, 0]), "tiles"),
        (lambda d: d["entries"]["bf16 E=8 K=64 N=32"]["8"].update(backend="cutlass"), "backend"),
        (lambda d: d["entries"]["bf16 E=8 K=64 N=32"]["8"].update(gather="yes"), "gather"),
        (lambda d: d["entries"]["bf16 E=8 K=64 N=32"]["8"].update(gather=1), "gather"),
    ],
)
def test_a_malformed_table_is_refused_naming_the_file(tmp_path, mutate, names):
    data = _table().as_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidInput, match=names):
        TuningTable.load(path)
    with pytest.raises(InvalidInput, match="bad.json"):
        CudaVendor(tuning=path)


@pytest.mark.parametrize(
    "device, kinds",
    [
        (
            "NVIDIA H100 80GB HBM3",
            {"qwen3-30b-a3b": ("bf16", "fp8"), "mixtral-8x7b": ("bf16", "fp8"), "deepseek-v3-ep8": ("bf16", "fp8")},
        ),
        (
            "NVIDIA H200",
            {"qwen3-30b-a3b": ("bf16", "fp8"), "mixtral-8x7b": ("bf16", "fp8"), "deepseek-v3-ep8": ("bf16", "fp8")},
        ),
    ],
)
def test_the_packaged_tables_cover_the_benchmarked_models(device, kinds):
    """Both grouped matmuls of each model `hal tune` ran on that device, for each precision, at 1 to 4096
    tokens at least; every entry records its tuned and built-in time (a `deep-gemm` entry, chosen by a whole-layer
    A/B: its fallback's)."""
    assert device_slug(device) in packaged_devices()
    table = TuningTable.packaged(device)
    assert table is not None and table.device == device
    for name, precisions in kinds.items():
        shape = SHAPES[name]
        for precision in precisions:
            kind = GemmKind.BF16 if precision == "bf16" else GemmKind.FP8_BLOCK128
            for problem in problems_for([shape], [kind], (1,)):
                activation = problem.activation.value if problem.activation else None
                key = problem_key(problem.kind.value, problem.experts, problem.k, problem.n, activation)
                assert key in table.entries, key
                rows = table.entries[key]
                assert min(rows) == shape.top_k and max(rows) >= 4096 * shape.top_k, (key, sorted(rows))
                for choice in rows.values():
                    if choice.backend == DEEP_GEMM:  # chosen by a whole-layer A/B the table's note states
                        assert "deep-gemm" in table.meta.get("note_deep_gemm", "")
                        if (choice := choice.fallback) is None:
                            continue
                    assert choice.us is not None and choice.default_us is not None
                    assert choice.us <= choice.default_us * 1.0001  # the built-in choice was a candidate
                    assert choice.backend == GROUPED_MM or kind is GemmKind.BF16 or choice.tiles[2] == 128
    assert TuningTable.packaged("NVIDIA Z80") is None
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_the_vendor_refuses_a_tuning_argument_of_the_wrong_type():
    with pytest.raises(InvalidInput, match="tuning"):
        CudaVendor(tuning=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(experts=0), "experts"),
        (dict(top_k=9), "top_k"),
        (dict(tokens=()), "tokens"),
        (dict(tokens=(0,)), "tokens"),
        (dict(k=True), "k"),
        (dict(activation="tanh"), "activation"),
    ],
)
def test_a_gemm_problem_validates_its_fields(kwargs, name):
    fields = dict(kind="bf16", experts=8, k=64, n=32, top_k=2, tokens=(1, 8))
    with pytest.raises(InvalidInput, match=name):
        GemmProblem(**{**fields, **kwargs})


def test_problems_for_covers_both_projections_once():
    problems = problems_for([SHAPES["qwen3-30b-a3b"], SHAPES["qwen3-30b-a3b"]], [GemmKind.BF16], (1, 8))
    assert {(p.k, p.n, p.activation) for p in problems} == {(2048, 1536, ActivationKind.SILU_GLU), (768, 2048, None)}
    assert len(problems) == 2


@pytest.mark.parametrize(
    "argv, status",
    [
        (["--vendor", "cpu"], 1),
        (["--vendor", "cpu", "--model", "gpt-5"], 2),
        (["--output", "/nonexistent-dir/t.json"], 2),
        (["--tokens", "0"], 2),
    ],
)
def test_hal_tune_refuses_with_the_readme_exit_codes(argv, status):
    done = subprocess.run([sys.executable, "-m", "hal", "tune", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr
