"""A vendor's op implementations: chosen once, visible in `hal caps` / `hal vendors --json`, and called only
with arguments hal has checked against the vendor's device and table."""

from __future__ import annotations

import threading

import pytest
import torch

from hal import (
    OP_NAMES,
    Capabilities,
    DispatchDtype,
    GemmKind,
    Groups,
    HalError,
    InvalidInput,
    KernelLimits,
    ProbeResult,
    ReferenceOps,
    ScaleLayout,
    UnsupportedCapability,
    Vendor,
    VendorOps,
)
from hal.cli import main
from vendors.ascend.emulation.vendor import EmulatedAscendVendor
from vendors.cpu import CpuVendor

TABLE = Capabilities(
    device_name="platform-only",
    dispatch_dtypes={"bf16", "int8"},
    grouped_matmul={GemmKind.BF16, GemmKind.INT8},
    limits=KernelLimits(max_groups=4),
)


class PlatformOnly(Vendor):
    """A third-party vendor that writes only its platform: every op is the reference."""

    name = "platform-only"

    def _probe_once(self) -> ProbeResult:
        return ProbeResult.ok("here")

    def devices(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _detect_capabilities(self) -> Capabilities:
        return TABLE

    def declared_models(self):  # type: ignore[no-untyped-def]
        return {"x": TABLE}


class Untouchable(VendorOps):
    """Ops that refuse to be called: any call that reaches them was not stopped by hal's checks."""

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        if name in OP_NAMES:
            raise RuntimeError(f"{name} reached the ops with arguments hal should have refused")
        return super().__getattribute__(name)

    quantize = dequantize = quantize_weight = quantize_int4 = grouped_matmul = swiglu = None  # type: ignore[assignment]
    sort_by_expert = weighted_combine = fused_deep_moe = None  # type: ignore[assignment]


class Guarded(PlatformOnly):
    name = "guarded"

    def _make_ops(self) -> VendorOps:
        return Untouchable()


def test_ops_are_built_once_and_never_replaced():
    vendor = CpuVendor()
    built = []
    threads = [threading.Thread(target=lambda: built.append(vendor.ops)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(ops is built[0] for ops in built) and vendor.ops is built[0]
    assert type(vendor.ops) is ReferenceOps


def test_ops_wait_for_availability():
    class Absent(PlatformOnly):
        name = "absent"

        def _probe_once(self) -> ProbeResult:
            return ProbeResult.unavailable("no device here")

    with pytest.raises(HalError, match="no device here"):
        _ = Absent().ops


def test_a_platform_only_vendor_computes_with_the_reference():
    vendor = PlatformOnly()
    assert all(not s.native for s in vendor.op_sources())
    x = torch.randn(6, 64).to(torch.bfloat16)
    q = vendor.quantize(x, "int8")
    assert q.dtype is DispatchDtype.INT8 and q.layout is ScaleLayout.PER_TOKEN
    w = vendor.quantize_weight(torch.randn(2, 64, 32) / 8, ScaleLayout.PER_CHANNEL, torch.int8)
    y = vendor.grouped_matmul(q, w, Groups.from_counts(torch.tensor([4, 2])))
    assert y.shape == (6, 32) and y.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda v: v.quantize(torch.ones(2, 8), "fp8"), "fp8"),  # not carried, no declared kind consumes it
        (lambda v: v.quantize(torch.ones(2, 8), "auto"), "dtype"),
        (lambda v: v.quantize(torch.ones(2, 8, dtype=torch.int32), "int8"), "x"),
        (lambda v: v.quantize(torch.ones(2, 8, device="meta"), "int8"), "x"),
        (lambda v: v.quantize(torch.ones(2, 8), "bf16", layout="per-token"), "layout"),
        (lambda v: v.quantize(torch.ones(2, 8), "int8", global_scale=torch.ones(1)), "global_scale"),
        (lambda v: v.dequantize(torch.ones(2, 8)), "q"),
        (lambda v: v.quantize_int4(torch.ones(2, 8)), "int4"),
        (lambda v: v.quantize_weight(torch.ones(8, 4), ScaleLayout.NONE), "weight"),
        (lambda v: v.quantize_weight(torch.ones(2, 8, 4), ScaleLayout.PER_TOKEN), "layout"),
        (lambda v: v.quantize_weight(torch.ones(2, 8, 4), ScaleLayout.PER_CHANNEL, torch.float16), "dtype"),
        (
            lambda v: v.grouped_matmul(
                torch.ones(3, 8).to(torch.float16),
                PlatformOnly().quantize_weight(torch.ones(2, 8, 4), ScaleLayout.NONE, torch.float16),
                Groups.from_counts(torch.tensor([1, 2])),
            ),
            "fp16",
        ),
        (
            lambda v: v.grouped_matmul(
                torch.ones(3, 8).to(torch.bfloat16),
                PlatformOnly().quantize_weight(torch.ones(5, 8, 4), ScaleLayout.NONE, torch.bfloat16),
                Groups.from_counts(torch.tensor([1, 2, 0, 0, 0])),
            ),
            "max_groups",
        ),
        (lambda v: v.swiglu(torch.ones(2, 7)), "x"),
        (lambda v: v.sort_by_expert(torch.ones(2, 2), 4), "topk_ids"),
        (lambda v: v.sort_by_expert(torch.ones(2, 2, dtype=torch.int64), 0), "num_experts"),
        (lambda v: v.weighted_combine(torch.ones(5, 8), None, torch.ones(2, 2), torch.float32), "rows"),
        (lambda v: v.weighted_combine(torch.ones(4, 8), None, torch.ones(2, 2), torch.int8), "out_dtype"),
        (
            lambda v: v.fused_deep_moe(
                torch.ones(2, 8), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), None, None, scheme="w8a8-int8"
            ),
            "w8a8-int8",
        ),  # type: ignore[arg-type]
    ],
)
def test_bad_calls_are_refused_before_they_reach_the_ops(call, argument):
    """The vendor's ops raise on any call: each bad call must be refused by hal first, naming what is wrong."""
    with pytest.raises((InvalidInput, UnsupportedCapability)) as raised:
        call(Guarded())
    assert argument in str(raised.value)


def test_op_sources_tell_native_ops_from_the_reference():
    sources = {s.op: s for s in EmulatedAscendVendor().op_sources()}
    assert set(sources) == set(OP_NAMES)
    native = {op for op, s in sources.items() if s.native}
    assert native == {
        "quantize",
        "quantize_int4",
        "grouped_matmul",
        "swiglu",
        "fused_deep_moe",
        "prepare_fused",
        "prepare_ep",
        "ep_dispatch",
        "ep_combine",
    }
    assert "npu_grouped_matmul" in sources["grouped_matmul"].detail
    assert sources["dequantize"].detail == "hal.reference"


def test_a_vendor_class_redefining_an_op_method_is_refused_with_the_methods_named():
    with pytest.raises(TypeError, match=r"redefines hal.Vendor's op method\(s\) grouped_matmul, swiglu:.*_make_ops"):

        class Patched(CpuVendor):
            def swiglu(self, x):  # type: ignore[no-untyped-def]
                return super().swiglu(x)

            def grouped_matmul(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                return super().grouped_matmul(*args, **kwargs)

    class Middle(CpuVendor):
        pass

    with pytest.raises(TypeError, match=r"op method\(s\) ep_dispatch, tune"):

        class Below(Middle):
            tune = ep_dispatch = staticmethod(lambda *a, **k: None)


def test_ops_implemented_in_a_reference_ops_subclass_are_the_vendors_own():
    class PatchedOps(ReferenceOps):
        def swiglu(self, x):  # type: ignore[no-untyped-def]
            return super().swiglu(x)

    class Patched(CpuVendor):
        def _make_ops(self):  # type: ignore[no-untyped-def]
            return PatchedOps()

    sources = {s.op: s for s in Patched().op_sources()}
    assert sources["swiglu"].native and not sources["quantize"].native


def test_caps_and_vendors_show_the_ops(capsys):
    import json

    assert main(["caps", "--vendor", "ascend-emulated", "--json"]) == 0
    ops = {row["op"]: row for row in json.loads(capsys.readouterr().out)["ops"]}
    assert ops["grouped_matmul"]["native"] and not ops["sort_by_expert"]["native"]
    assert main(["caps", "--vendor", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "ops (native) │ none" in out and "ops (hal.reference) │ quantize, dequantize" in out
    assert main(["vendors", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["vendors"]}
    assert rows["cpu"]["ops"]["grouped_matmul"] == "reference"
    assert rows["ascend-emulated"]["ops"]["swiglu"] == "native"
    assert rows["ascend"]["ops"] is None  # unavailable: no ops are built


def test_op_names_list_every_op_of_the_interface():
    """`hal caps` reports the source of each name in OP_NAMES: an op added to VendorOps without a name there
    would go unreported. `tune` searches kernel configurations and `sources` reports; neither computes."""
    methods = {name for name, value in vars(VendorOps).items() if callable(value) and not name.startswith("_")}
    assert methods - {"tune", "sources"} == set(OP_NAMES)
