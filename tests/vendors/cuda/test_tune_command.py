"""`hal tune` end to end with a vendor plugin whose ops can tune (installed as a real distribution): one case per
call, the table written after every case, so an interrupted run keeps what it measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.plugin_dist import environment_with, write_distribution

SOURCE = '''
from hal.reference import ReferenceOps
from vendors.cpu import CpuVendor


class TunableOps(ReferenceOps):
    """Times nothing: an entry per case (rows -> "us" = tokens); 99 tokens stands for a run stopped there."""

    def tune(self, problems, *, device, device_name, progress=None):
        entries = {}
        for p in problems:
            key = f"{p.kind.value} E={p.experts} K={p.k} N={p.n}" + (f" +{p.activation.value}" if p.activation else "")
            for tokens in p.tokens:
                if tokens == 99:
                    raise KeyboardInterrupt
                if progress is not None:
                    progress(f"{key} tokens {tokens}")
                entries.setdefault(key, {})[str(tokens * p.top_k)] = {"backend": "test", "us": float(tokens)}
        return {"format": "test tuning v1", "device": device_name, "date": "today", "entries": entries}


class TunableVendor(CpuVendor):
    name = "tunable"
    priority = -1

    def _make_ops(self):
        return TunableOps()


class OwnFormatOps(ReferenceOps):
    """A table of its own shape (no problem entries): tuned in one call."""

    def tune(self, problems, *, device, device_name, progress=None):
        return {"device": device_name, "cases": [[p.k, list(p.tokens)] for p in problems]}


class OwnFormatVendor(CpuVendor):
    name = "own-format"
    priority = -1

    def _make_ops(self):
        return OwnFormatOps()
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = write_distribution(
        tmp_path_factory.mktemp("tunable"),
        "hal-test-tunable",
        {"hal.vendors": {"tunable": "tunable_vendor:TunableVendor", "own-format": "tunable_vendor:OwnFormatVendor"}},
        {"tunable_vendor": SOURCE},
    )
    return environment_with(root)


def hal_tune(env, *argv):
    return subprocess.run(
        [sys.executable, "-m", "hal", "tune", "--model", "tiny", "--precision", "bf16", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_case_is_tuned_by_its_own_call_and_counted(env, tmp_path):
    out = tmp_path / "t.json"
    done = hal_tune(env, "--vendor", "tunable", "--tokens", "1", "8", "--output", str(out))
    assert done.returncode == 0, done.stderr
    table = json.loads(out.read_text())
    assert {key: sorted(rows, key=int) for key, rows in table["entries"].items()} == {
        "bf16 E=8 K=256 N=256 +silu-glu": ["2", "16"],
        "bf16 E=8 K=128 N=256": ["2", "16"],
    }
    assert [line.split("]")[0] + "]" for line in done.stderr.splitlines() if line.startswith("[")] == [
        "[1/4]",
        "[2/4]",
        "[3/4]",
        "[4/4]",
    ]
    assert not list(tmp_path.glob("*.partial"))


def test_an_interrupted_run_keeps_the_cases_it_finished(env, tmp_path):
    out = tmp_path / "t.json"
    done = hal_tune(env, "--vendor", "tunable", "--tokens", "1", "8", "99", "--output", str(out))
    assert done.returncode != 0 and "interrupted" in done.stderr
    table = json.loads(out.read_text())
    assert table["entries"] == {
        "bf16 E=8 K=256 N=256 +silu-glu": {"2": {"backend": "test", "us": 1.0}, "16": {"backend": "test", "us": 8.0}}
    }


def test_an_interrupted_merge_keeps_the_earlier_entries_and_the_finished_cases(env, tmp_path):
    earlier = tmp_path / "t.json"
    done = hal_tune(env, "--vendor", "tunable", "--tokens", "4", "--output", str(earlier))
    assert done.returncode == 0, done.stderr
    done = hal_tune(env, "--vendor", "tunable", "--tokens", "1", "99", "--merge", str(earlier))
    assert done.returncode != 0
    table = json.loads(earlier.read_text())
    assert sorted(table["entries"]["bf16 E=8 K=256 N=256 +silu-glu"], key=int) == ["2", "8"]
    assert sorted(table["entries"]["bf16 E=8 K=128 N=256"]) == ["8"] and len(table["history"]) == 1


def test_a_vendor_table_without_problem_entries_is_tuned_in_one_call(env, tmp_path):
    out = tmp_path / "t.json"
    done = hal_tune(env, "--vendor", "own-format", "--tokens", "1", "8", "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["cases"] == [[256, [1, 8]], [128, [1, 8]]]
