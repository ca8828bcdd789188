"""Expert runners added by a plugin through the `moe.expert_runners` entry-point group.

The plugin is a real distribution on disk; a fresh interpreter builds a layer with the
default registry, so the entry point is found the way pip-installed packages are.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.plugin_dist import environment_with, write_distribution

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
    write_distribution(tmp_path, "runner-plugin", {"moe.expert_runners": {"traced": "runner_plugin:register"}},
                       {"runner_plugin": PLUGIN})
    write_distribution(tmp_path, "broken-runner-plugin", {"moe.expert_runners": {"broken": "broken_runner:register"}},
                       {"broken_runner": BROKEN})
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=environment_with(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["calls"] == ["standard"]  # the plugin's runner served the unquantized layer only
    assert any("'broken'" in w and "broken on purpose" in w for w in result["warnings"])
