"""Every example runs as written with its extra installed, and without it says which extra to install
(the extra's absence simulated in a subprocess that blocks its import)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.paths import REPO

EXAMPLES = REPO / "examples"

#: example -> (module of its extra, the extra's name)
NEEDS = {
    "serve_checkpoint.py": ("safetensors", "checkpoint"),
    "transformers_tiny_model.py": ("transformers", "transformers"),
}


def _run(example: str, *args: str, blocked: str | None = None) -> subprocess.CompletedProcess:
    """Run `examples/<example>` as `python examples/<example>` does, with `blocked` unimportable."""
    code = (
        "import runpy, sys\n"
        f"sys.modules.update({{{blocked!r}: None}} if {blocked!r} != 'None' else {{}})\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        f"sys.argv = [{example!r}, *{list(args)!r}]\n"
        f"runpy.run_path({str(EXAMPLES / example)!r}, run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.mark.parametrize("example", NEEDS)
def test_without_its_extra_an_example_names_the_extra(example):
    module, extra = NEEDS[example]
    done = _run(example, blocked=module)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert (
        done.stderr.strip().splitlines() == [done.stderr.strip().splitlines()[0]]
        and f"pip install 'moe-hal[{extra}]'" in done.stderr
    )
    assert module in done.stderr and not done.stdout


def test_the_ascend_check_without_an_npu_says_so_without_a_traceback():
    done = _run("ascend_hardware_check.py")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "unavailable" in done.stderr and "--vendor ascend-emulated" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "args", "says"),
    [
        ("transformers_tiny_model.py", (), "restored 2 original blocks"),
        ("linear_experts_to_layer.py", (), "layer vs the experts called one by one"),
        ("serve_checkpoint.py", (), "relative error against the float64 MoE"),
        ("ascend_hardware_check.py", ("--vendor", "ascend-emulated"), "layer vs the CPU reference   PASS"),
    ],
)
def test_an_example_runs_as_written(example, args, says):
    done = _run(example, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert says in done.stdout and "Traceback" not in done.stderr


@pytest.mark.slow
def test_the_transformers_page_snippet_runs_as_written():
    text = (REPO / "docs" / "transformers.md").read_text()
    snippet = text.split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run(
        [sys.executable, "-c", snippet + "\nprint(out.shape)"], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch.Size([1, 20])" in done.stdout
