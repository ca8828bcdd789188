"""The CUDA vendor's expert-parallel dispatcher "deepep" (DeepEP v1.2.1): discovery, declaration and refusals
without a GPU; DeepEP itself on two GPUs where it is built (`@pytest.mark.gpu`).

Discovery is tested in subprocesses with a small fake `deep_ep` package on `sys.path`: it only stands in for
the module's presence and build flags, never for its numerics."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hal import (
    DispatchDtype,
    InvalidInput,
    ProbeResult,
    ReferenceOps,
    ScaleLayout,
    UnsupportedCapability,
    UnsupportedDispatchDtype,
    Vendor,
)
from vendors.cuda.capabilities import cuda_capabilities
from vendors.cuda.deepep import DEEPEP, DeepEp, DeepEpProbe
from vendors.cuda.deepep_limits import BufferSize, check_request, memory_refusal
from tests.support.paths import REPO, release_device_memory

ROOT = REPO

FAKE = '''
"""A stand-in for deep_ep's presence and build flags (no numerics)."""
if {broken!r}:
    raise ImportError("libnvshmem_host.so.3: cannot open shared object file")


class Config:
    def __init__(self, *args):
        pass

    def get_nvl_buffer_size_hint(self, hidden_bytes, ranks):
        return 1024 * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes, ranks):
        if not {nvshmem!r}:
            raise RuntimeError("Assertion failed: NVSHMEM is disable during compilation")
        return 0


class Buffer:
    num_sms = 20

    @staticmethod
    def is_sm90_compiled():
        return {sm90!r}

    @staticmethod
    def get_low_latency_rdma_size_hint(tokens, hidden, ranks, experts):
        return 2 ** 20

    @staticmethod
    def get_dispatch_config(ranks):
        return Config()

    get_combine_config = get_dispatch_config


if {v1!r}:
    for _name in ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine"):
        setattr(Buffer, _name, lambda self, *a, **k: None)
'''


def run_with_fake(tmp_path: Path, code: str, *, fake: dict | None) -> str:
    """Run `code` in a fresh interpreter whose `deep_ep` is the fake (`fake` its flags) or absent (None)."""
    if fake is None:
        prelude = "import sys\nsys.modules['deep_ep'] = None  # absent, whatever this host has\n"
    else:
        package = tmp_path / "site" / "deep_ep"
        package.mkdir(parents=True)
        flags = {"broken": False, "nvshmem": True, "sm90": True, "v1": True, **fake}
        (package / "__init__.py").write_text(FAKE.format(**flags))
        prelude = f"import sys\nsys.path.insert(0, {str(package.parent)!r})\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


DECLARED = """
import json
from vendors.cuda import CudaVendor
vendor = CudaVendor()
out = {}
for model, caps in vendor.declared_models().items():
    out[model] = {"ep": sorted(caps.ep_dispatchers), "low_latency": sorted(caps.ep_low_latency),
                  "absent": dict(caps.ep_dispatchers_absent), "notes": [n for n in caps.notes if "deepep" in n],
                  "problems": caps.consistency_problems()}
print(json.dumps(out))
"""


def test_without_deep_ep_the_dispatcher_is_absent_with_the_reason(tmp_path):
    found = json.loads(run_with_fake(tmp_path, DECLARED, fake=None))
    for model, row in found.items():
        assert row["ep"] == [] and row["low_latency"] == [] and row["problems"] == [], model
        assert "deep_ep is not installed" in row["absent"][DEEPEP] and "docs/deepep.md" in row["absent"][DEEPEP]


def test_importing_the_vendor_never_imports_deep_ep(tmp_path):
    code = "import sys, vendors.cuda, vendors.cuda.deepep, vendors.cuda.capabilities\nprint('deep_ep' in sys.modules)\n"
    assert run_with_fake(tmp_path, code, fake={}).strip() == "False"


def test_a_full_build_declares_both_modes_on_hopper(tmp_path):
    found = json.loads(run_with_fake(tmp_path, DECLARED, fake={}))
    for model in ("H100", "H200", "B200"):
        row = found[model]
        assert row["ep"] == [DEEPEP] and row["low_latency"] == [DEEPEP] and row["absent"] == {}, model
        assert row["problems"] == [] and "fp8" in row["notes"][0] and "7168" in row["notes"][0]
    # an sm90 build on older GPUs: absent, saying why
    assert "sm89" in found["L40S"]["absent"][DEEPEP] and "sm80" in found["A100"]["absent"][DEEPEP]


def test_a_build_without_nvshmem_has_no_low_latency_mode(tmp_path):
    found = json.loads(run_with_fake(tmp_path, DECLARED, fake={"nvshmem": False}))
    assert found["H100"]["ep"] == [DEEPEP] and found["H100"]["low_latency"] == []
    assert "without NVSHMEM" in found["H100"]["notes"][0]


@pytest.mark.parametrize(
    "fake, reason",
    [
        ({"broken": True}, "does not import (ImportError: libnvshmem_host.so.3"),
        ({"v1": False}, "is not DeepEP V1 (its Buffer lacks get_dispatch_layout"),
    ],
)
def test_an_unusable_deep_ep_is_absent_with_the_reason(tmp_path, fake, reason):
    found = json.loads(run_with_fake(tmp_path, DECLARED, fake=fake))
    assert found["H100"]["ep"] == [] and reason in found["H100"]["absent"][DEEPEP]


def test_hal_caps_names_deepep_and_its_reason(tmp_path):
    code = (
        "from hal.cli.app import main\nimport sys\n"
        "sys.exit(main(['caps', '--vendor', 'cuda', '--device-model', 'H100', '--json']))\n"
    )
    absent = json.loads(run_with_fake(tmp_path, code, fake=None))["capabilities"]
    assert absent["ep_dispatchers"] == [] and "not installed" in absent["ep_dispatchers_absent"][DEEPEP]
    table = run_with_fake(tmp_path, code.replace(", '--json'", ""), fake=None)
    assert "deepep absent: deep_ep is not installed" in " ".join(table.split())
    present = json.loads(run_with_fake(tmp_path, code, fake={}))["capabilities"]
    assert present["ep_dispatchers"] == [DEEPEP] and present["ep_low_latency"] == [DEEPEP]


# -- refusals, without a GPU ------------------------------------------------------------------------------

OK = {
    "dtype": DispatchDtype.BF16,
    "hidden_size": 7168,
    "num_experts": 256,
    "world": 2,
    "capacity": None,
    "fp8_built": True,
    "nvshmem_built": True,
}


@pytest.mark.parametrize("dtype", [DispatchDtype.BF16, DispatchDtype.FP8])
@pytest.mark.parametrize("capacity", [None, 128])
def test_what_deepep_serves_passes(dtype, capacity):
    check_request(**{**OK, "dtype": dtype, "capacity": capacity})


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"dtype": DispatchDtype.NVFP4}, UnsupportedDispatchDtype, "deepep carries bf16 and fp8"),
        ({"dtype": DispatchDtype.FP16}, UnsupportedDispatchDtype, "not fp16"),
        ({"dtype": DispatchDtype.FP32}, UnsupportedDispatchDtype, "not fp32"),
        ({"dtype": DispatchDtype.INT8}, UnsupportedDispatchDtype, "not int8"),
        ({"dtype": DispatchDtype.FP8, "fp8_built": False}, UnsupportedDispatchDtype, "sm90 features"),
        ({"dtype": DispatchDtype.FP8, "hidden_size": 7000}, UnsupportedCapability, "multiple of 128"),
        ({"hidden_size": 1004}, UnsupportedCapability, "multiple of 8"),
        ({"hidden_size": 1000}, UnsupportedCapability, "multiple of 32 bytes"),  # 125 16-byte units: a device assert
        ({"hidden_size": 8192 + 16}, UnsupportedCapability, "at most 16368"),
        ({"world": 1}, UnsupportedCapability, "2 or more ranks"),
        ({"world": 3, "num_experts": 255}, UnsupportedCapability, "not 3"),
        ({"num_experts": 255}, InvalidInput, "multiple of the 2 ranks"),
        ({"num_experts": 512}, UnsupportedCapability, "at most 128 experts per rank"),
        ({"world": 16, "nvshmem_built": False}, UnsupportedCapability, "across hosts"),
        ({"capacity": 128, "nvshmem_built": False}, UnsupportedCapability, "built with NVSHMEM"),
        ({"capacity": 128, "hidden_size": 1024}, UnsupportedCapability, "2048, 2560, 4096, 5120, 6144, 7168, 8192"),
        ({"capacity": 1, "world": 2}, InvalidInput, "multiple of 4"),
        ({"capacity": 8, "num_experts": 4096}, UnsupportedCapability, "at most 1024 experts per rank"),
    ],
)
def test_what_deepep_cannot_serve_is_refused_with_the_reason(change, error, words):
    with pytest.raises(error) as raised:
        check_request(**{**OK, **change})
    assert words in str(raised.value)
    if error is UnsupportedDispatchDtype:  # a dtype the vendor carries but deepep does not: a dispatcher's limit too
        assert isinstance(raised.value, UnsupportedCapability)


def test_buffer_sizes_grow_and_refuse_past_free_memory():
    small, large = BufferSize(100, 0, 1), BufferSize(50, 4096, 128)
    union = small.union(large)
    assert union == BufferSize(100, 4096, 128) and union.covers(small) and union.covers(large)
    assert not small.covers(large) and union.total_bytes == 100 + 4096 + 32 * 2**20
    assert memory_refusal("normal", small, free_bytes=small.total_bytes, freed_bytes=0, world=2) is None
    assert memory_refusal("normal", large, free_bytes=0, freed_bytes=large.total_bytes, world=2) is None
    why = memory_refusal("low-latency", BufferSize(0, 70 * 2**30, 128), free_bytes=2**30, freed_bytes=0, world=2)
    assert "70.03 GiB exceeds the free device memory (1.00 GiB" in why and "max_dispatch_tokens_per_rank" in why


def test_deepep_low_latency_refuses_a_per_token_fp8_plan():
    ep = DeepEp(ops=None)
    with pytest.raises(UnsupportedCapability, match="one scale per 128 channels"):
        ep.prepare(
            None, num_experts=256, hidden_size=7168, dtype=DispatchDtype.FP8, capacity=128, layout=ScaleLayout.PER_TOKEN
        )


def test_deepep_needs_a_process_group_and_its_own_handle():
    ep = DeepEp(ops=None)
    with pytest.raises(InvalidInput, match="process_group"):
        ep.prepare(None, num_experts=256, hidden_size=7168, dtype=DispatchDtype.BF16, capacity=None)
    with pytest.raises(InvalidInput, match="handle"):
        ep.combine(torch.ones(2, 8), torch.ones(2, 1), object(), out_dtype=torch.bfloat16)


class _StandIn(Vendor):
    """A CPU platform declaring deepep as the CUDA tables do; its ops must never be reached."""

    name = "deepep-stand-in"

    def __init__(self, probe: DeepEpProbe) -> None:
        super().__init__()
        self._deepep = probe

    def _probe_once(self) -> ProbeResult:
        return ProbeResult.ok("a CPU stand-in declaring deepep")

    def devices(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _detect_capabilities(self):  # type: ignore[no-untyped-def]
        return cuda_capabilities("H100 (stand-in)", (9, 0), deepep=self._deepep)

    def declared_models(self):  # type: ignore[no-untyped-def]
        return {"H100": self._detect_capabilities()}

    def _make_ops(self) -> ReferenceOps:
        class Unreachable(ReferenceOps):
            def prepare_ep(self, name, **kwargs):  # type: ignore[no-untyped-def]
                raise AssertionError("reached the ops")

            ep_dispatch = ep_combine = prepare_ep

        return Unreachable()


#: a process group of one rank that no collective ever runs on (the checks before the ops only read its type)
_GROUP = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)


@pytest.mark.parametrize(
    "low_latency, call, error, words",
    [
        (
            True,
            lambda v: v.prepare_ep(
                DEEPEP, process_group=_GROUP, num_experts=256, hidden_size=7168, dtype="fp8", capacity=0
            ),
            InvalidInput,
            "capacity",
        ),
        (
            False,
            lambda v: v.prepare_ep(
                DEEPEP, process_group=_GROUP, num_experts=256, hidden_size=7168, dtype="fp8", capacity=128
            ),
            UnsupportedCapability,
            "no low-latency mode",
        ),
        (
            True,
            lambda v: v.ep_dispatch(
                torch.ones(9, 256),
                torch.zeros(9, 2, dtype=torch.int64),
                name=DEEPEP,
                dtype="bf16",
                num_experts=8,
                process_group=_GROUP,
                capacity=8,
            ),
            InvalidInput,
            "at most max_dispatch_tokens_per_rank=8",
        ),
        (
            True,
            lambda v: v.prepare_ep(
                "mc2", process_group=_GROUP, num_experts=256, hidden_size=7168, dtype="bf16", capacity=None
            ),
            UnsupportedCapability,
            "declared: deepep",
        ),
    ],
)
def test_hal_refuses_before_the_ops(low_latency, call, error, words):
    vendor = _StandIn(DeepEpProbe(None, "1.2.1", fp8=True, low_latency=low_latency))
    with pytest.raises(error) as raised:
        call(vendor)
    assert words in str(raised.value)


def test_an_absent_deepep_is_refused_with_its_reason():
    vendor = _StandIn(DeepEpProbe("deep_ep is not installed: build it (docs/deepep.md)"))
    with pytest.raises(UnsupportedCapability, match="deep_ep is not installed"):
        vendor.prepare_ep(DEEPEP, process_group=_GROUP, num_experts=256, hidden_size=7168, dtype="bf16", capacity=None)


# -- DeepEP itself, on GPUs ---------------------------------------------------------------------------------


def _deep_ep_importable() -> bool:
    try:
        import deep_ep  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_deepep_ops_on_two_gpus():
    """The ops check of scripts/deepep_check.py (normal and low-latency, bf16 and fp8) on 2 GPUs."""
    if not _deep_ep_importable():
        pytest.skip("deep_ep is not built here (docs/deepep.md)")
    release_device_memory()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "scripts/deepep_check.py",
            "--ops-only",
            "--tokens",
            "128",
            "512",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "FAIL" not in done.stdout and "ERROR" not in done.stdout
