"""Expert runners added by a plugin through the `moe.expert_runners` entry-point group.

The plugin is a real distribution on disk; a fresh interpreter builds a layer with the
default registry, so the entry point is found the way pip-installed packages are. A plugin
replacing a runner that serves every vendor needs the registry's opt-in, and `hal caps`
shows the replacement.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

import moe
from hal import InvalidInput
from tests.support.plugin_dist import environment_with, write_distribution

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds

PLUGIN = """
import moe

CALLS = []

def traced(vendor, scheme, weights, dispatched):
    CALLS.append(str(dispatched.format))
    return moe.run_grouped_experts(vendor, scheme, weights, dispatched)

def register(registry):
    registry.register(moe.RunnerKey("standard", "bf16", "unquantized", vendor="cpu"), traced)
"""

BROKEN = """
def register(registry):
    raise RuntimeError("this plugin is broken on purpose")
"""

SCRIPT = """
import json, warnings
import torch
import moe
import runner_plugin

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    registry = moe.RunnerRegistry.with_defaults()
w13, w2 = torch.randn(4, 64, 64) / 8, torch.randn(4, 32, 64) / 6
layer = moe.MoELayer.from_float(w13, w2, 2, vendor="cpu", runners=registry)
layer(torch.randn(5, 64), torch.randn(5, 4))
int8 = moe.MoELayer.from_float(w13, w2, 2, vendor="cpu", scheme="w8a8-int8", runners=registry)
int8(torch.randn(5, 64), torch.randn(5, 4))
print(json.dumps({"calls": runner_plugin.CALLS, "warnings": [str(w.message) for w in caught]}))
"""


def test_a_plugin_runner_is_used_and_a_broken_plugin_is_reported(tmp_path):
    write_distribution(
        tmp_path,
        "runner-plugin",
        {"moe.expert_runners": {"traced": "runner_plugin:register"}},
        {"runner_plugin": PLUGIN},
    )
    write_distribution(
        tmp_path,
        "broken-runner-plugin",
        {"moe.expert_runners": {"broken": "broken_runner:register"}},
        {"broken_runner": BROKEN},
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=environment_with(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["calls"] == ["standard"]  # the plugin's runner served the unquantized layer only
    assert any("'broken'" in w and "broken on purpose" in w for w in result["warnings"])


FAST = """
import moe

def fast(vendor, scheme, weights, dispatched):
    return moe.run_grouped_experts(vendor, scheme, weights, dispatched)

def register(registry):
    registry.register(moe.RunnerKey("standard", "int8", "w8a8-int8", vendor="cpu"), fast)
    registry.register(moe.RunnerKey("standard", "bf16", "unquantized"), fast, replace=True)
"""

REPLACE = """
import json, logging, warnings
import moe, fast_runner

records = []

class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())

logging.getLogger("moe.runners").addHandler(Keep())
out = {"log": records}
for label, allowed in (("default", None), ("opted_in", ["fast"])):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = moe.RunnerRegistry.with_defaults(replace_generic=allowed)
    out[label] = {
        "generic_key": registry.lookup("cpu", "standard", "bf16", "unquantized") is fast_runner.fast,
        "own_key": registry.lookup("cpu", "standard", "int8", "w8a8-int8") is fast_runner.fast,
        "replacements": [[str(r.key), r.by, r.replaced] for r in registry.replacements],
        "warnings": [str(w.message) for w in caught]}
print(json.dumps(out))
"""

GENERIC_KEY = "(format=standard, kernel=bf16, scheme=unquantized, vendor=*)"


def test_replacing_a_generic_runner_needs_an_opt_in_and_is_logged_and_shown_by_hal_caps(tmp_path):
    write_distribution(
        tmp_path, "fast-runner", {"moe.expert_runners": {"fast": "fast_runner:register"}}, {"fast_runner": FAST}
    )
    env = environment_with(tmp_path)
    done = subprocess.run([sys.executable, "-c", REPLACE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    refused = result["default"]  # refused: nothing of the plugin stays registered, and it is reported
    assert not refused["generic_key"] and not refused["own_key"] and refused["replacements"] == []
    assert any(
        "'fast'" in w and "needs an opt-in" in w and "replace_generic=['fast']" in w for w in refused["warnings"]
    ), refused["warnings"]
    allowed = result["opted_in"]
    assert allowed["generic_key"] and allowed["own_key"] and allowed["warnings"] == []
    assert allowed["replacements"] == [[GENERIC_KEY, "fast", "generic"]]
    assert result["log"] == [f"expert runner {GENERIC_KEY}: plugin 'fast' replaced the generic runner"]

    def caps_rows(**extra: str) -> dict[str, str]:
        shown = subprocess.run(
            [sys.executable, "-m", "hal.cli", "caps", "--vendor", "cpu", "--json"],
            env=dict(env, **extra),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert shown.returncode == 0, shown.stderr
        return dict(json.loads(shown.stdout)["sections"]["expert_runners"])

    shown = caps_rows(MOE_RUNNER_REPLACEMENTS="fast")
    assert shown["runner replacements"] == f"{GENERIC_KEY}: plugin 'fast' replaced the generic runner"
    assert "(standard, bf16, unquantized): plugin 'fast'" in shown["expert runners (plugins)"]
    assert "(standard, int8, w8a8-int8) for cpu: plugin 'fast'" in shown["expert runners (plugins)"]
    shown = caps_rows()
    assert shown["runner replacements"] == "none" and "needs an opt-in" in shown["runner plugin failures"]


def test_the_callers_own_replacement_is_recorded_and_logged(caplog):
    registry = moe.RunnerRegistry.with_defaults(plugins=False)
    key = moe.RunnerKey("standard", "bf16", "unquantized")
    assert registry.origin(key) == "generic"
    with caplog.at_level(logging.INFO, logger="moe.runners"):
        registry.register(key, moe.run_grouped_experts, replace=True)
    assert [(r.by, r.replaced) for r in registry.replacements] == [("caller", "generic")]
    assert registry.origin(key) == "caller" and "the caller replaced the generic runner" in caplog.text


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: moe.RunnerRegistry(replace_generic="fast"), "replace_generic"),
        (lambda: moe.RunnerRegistry(replace_generic=[3]), "replace_generic"),
        (lambda: moe.RunnerRegistry.with_defaults(plugins=False, environ=["x"]), "environ"),
        (lambda: moe.RunnerRegistry().origin(moe.RunnerKey("standard", "bf16", "unquantized")), "key"),
    ],
)
def test_bad_registry_arguments_name_the_argument(call, argument):
    with pytest.raises(InvalidInput, match=rf"^{argument}: expected"):
        call()
