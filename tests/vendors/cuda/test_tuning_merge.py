"""`hal tune --merge`: a fresh table joins an earlier one of the same device without losing entries."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.tuning_merge import check_device, merge_tables, read_table
from hal import InvalidInput
from vendors.cuda.tuning import FORMAT, PACKAGED, TuningTable


def _table(device="NVIDIA H200", date="2026-11-24", **entries):
    return {
        "format": FORMAT,
        "device": device,
        "date": date,
        "torch": "2.11",
        "note": f"tuned {date}",
        "entries": entries,
    }


def _choice(us):
    return {"backend": "torch-grouped-mm", "us": us, "default_us": us}


def test_new_entries_replace_the_same_rows_and_every_other_entry_is_kept():
    earlier = _table(
        **{"bf16 E=8 K=64 N=32": {"2": _choice(1.0), "16": _choice(2.0)}, "bf16 E=8 K=32 N=64": {"2": _choice(3.0)}}
    )
    fresh = _table(
        date="2026-11-26",
        **{
            "bf16 E=8 K=64 N=32": {"16": _choice(9.0), "32768": _choice(7.0)},
            "fp8-block128 E=8 K=64 N=32": {"2": _choice(5.0)},
        },
    )
    merged = merge_tables(earlier, fresh)
    assert merged["entries"] == {
        "bf16 E=8 K=32 N=64": {"2": _choice(3.0)},
        "bf16 E=8 K=64 N=32": {"2": _choice(1.0), "16": _choice(9.0), "32768": _choice(7.0)},
        "fp8-block128 E=8 K=64 N=32": {"2": _choice(5.0)},
    }
    assert list(merged["entries"]["bf16 E=8 K=64 N=32"]) == ["2", "16", "32768"]  # numeric order
    assert merged["date"] == "2026-11-26"
    assert merged["history"] == [{"date": "2026-11-24", "torch": "2.11", "note": "tuned 2026-11-24"}]
    again = merge_tables(merged, _table(date="2026-11-27"))
    assert [h["date"] for h in again["history"]] == ["2026-11-24", "2026-11-26"]
    assert again["entries"] == merged["entries"]


def test_other_fields_of_the_earlier_table_are_kept_unless_the_fresh_one_sets_them():
    earlier = {**_table(**{"fp8-block128 E=8 K=64 N=32": {"4096": _choice(1.0)}}), "note_deep_gemm": "why deep-gemm"}
    merged = merge_tables(earlier, _table(date="2026-11-28", **{"bf16 E=8 K=64 N=32": {"2": _choice(2.0)}}))
    assert merged["note_deep_gemm"] == "why deep-gemm" and merged["note"] == "tuned 2026-11-28"
    assert merged["history"] == [{"date": "2026-11-24", "torch": "2.11", "note": "tuned 2026-11-24"}]
    fresh = {**_table(date="2026-11-29"), "note_deep_gemm": "retuned"}
    assert merge_tables(merged, fresh)["note_deep_gemm"] == "retuned"


def test_the_packaged_table_merged_with_a_new_entry_loads_with_all_of_them(tmp_path):
    path = PACKAGED / "nvidia-h200.json"
    merged = merge_tables(read_table(path), _table(**{"bf16 E=8 K=64 N=32": {"2": _choice(1.0)}}))
    out = tmp_path / "merged.json"
    out.write_text(json.dumps(merged))
    loaded = TuningTable.load(out)
    assert set(loaded.entries) == set(TuningTable.load(path).entries) | {"bf16 E=8 K=64 N=32"}
    assert loaded.meta["history"][-1]["date"] == read_table(path)["date"]


@pytest.mark.parametrize("field, value", [("device", "NVIDIA H100 80GB HBM3"), ("format", "other v2")])
def test_tables_of_another_device_or_format_are_refused(field, value):
    with pytest.raises(InvalidInput, match=field):
        merge_tables(_table(), {**_table(), field: value})


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[]",
        json.dumps({"device": "x", "format": "f"}),
        json.dumps({"device": "x", "format": "f", "entries": {"k": [1]}}),
    ],
)
def test_a_file_that_is_not_a_table_is_refused_naming_it(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InvalidInput, match="bad.json"):
        read_table(path)


def test_a_table_of_another_device_is_refused_before_tuning(tmp_path):
    with pytest.raises(InvalidInput, match="NVIDIA H200"):
        check_device(_table(), "NVIDIA H100 80GB HBM3", tmp_path / "t.json")


@pytest.mark.parametrize(
    "content, status, message",
    [
        ("nope", 2, "cannot be read"),
        (json.dumps(_table(device="NVIDIA H200")), 2, "was tuned on 'NVIDIA H200'"),  # the cpu vendor's device differs
    ],
)
def test_hal_tune_merge_refuses_with_the_readme_exit_codes_and_leaves_the_file(tmp_path, content, status, message):
    path = tmp_path / "table.json"
    path.write_text(content)
    done = subprocess.run(
        [sys.executable, "-m", "hal", "tune", "--vendor", "cpu", "--merge", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == status, done.stderr
    assert message in done.stderr + done.stdout and "Traceback" not in done.stderr
    assert path.read_text() == content
