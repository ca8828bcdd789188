"""The Ascend vendor on the torch_npu emulation: probe, tables, ops through the binding, the
MoE layer's paths (fused W8A8-INT8, W4A4 after a bf16 dispatch, unquantized), the scoped
DeepEP environment variable, and the rule that nothing in the vendor asks whether it is emulated."""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from conformance.reference import emulated_integer_moe, moe, random_weights, relative_error, softmax_topk
from conformance.tolerances import EMULATED_LAYER_TOLERANCE, FUSED_TOLERANCE, LAYER_TOLERANCE
from hal import DispatchConfig, DispatchDtype, GemmKind, UnsupportedCapability
from moe import MoELayer
from vendors.ascend import AscendVendor
from vendors.ascend.emulation.binding import emulated_binding
from vendors.ascend.emulation.deep_ep import EmulatedDeepEp
from vendors.ascend.emulation.vendor import EmulatedAscendVendor
from vendors.ascend.fused import INT8_DISPATCH_VARIABLE
from tests.support.paths import REPO

ROOT = REPO
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 32, 8, 2


class Recording:
    """Delegates every attribute call to `inner` and records `(name, args, kwargs, result)` in `calls`."""

    def __init__(self, inner: object, calls: list | None = None) -> None:
        self._inner = inner
        self.calls = [] if calls is None else calls

    def __getattr__(self, name: str):
        target = getattr(self._inner, name)

        @functools.wraps(target)  # keeps the signature the vendor inspects (e.g. dispatch's quant_mode)
        def call(*args, **kwargs):
            result = target(*args, **kwargs)
            self.calls.append((name, args, kwargs, result))
            return result

        return call


class RecordingDeepEp(EmulatedDeepEp):
    """The emulated DeepEP port whose buffers record the calls made on them."""

    def __init__(self, npu: object) -> None:
        super().__init__(npu)
        self.calls: list = []

    def Buffer(self, group=None, *args, **kwargs):  # noqa: N802 - the port's name
        return Recording(super().Buffer(group, *args, **kwargs), self.calls)


def recording_vendor(soc: str = "Ascend910_9392") -> tuple[AscendVendor, Recording, RecordingDeepEp]:
    """The real vendor class bound to the emulation, with every torch_npu and DeepEP call recorded."""
    plain = emulated_binding(soc)
    ops = Recording(plain.ops)
    deep_ep = RecordingDeepEp(plain.ops)
    return AscendVendor(dataclasses.replace(plain, ops=ops, deep_ep=deep_ep)), ops, deep_ep


def inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16), torch.randn(tokens, EXPERTS, generator=g))


def layer(vendor, scheme: str, **kwargs) -> MoELayer:
    w13, w2 = random_weights(EXPERTS, HIDDEN, INTERMEDIATE, seed=7)
    return MoELayer.from_float(w13, w2, TOP_K, scheme=scheme, vendor=vendor, **kwargs)


def reference(x: torch.Tensor, logits: torch.Tensor, qmax: int | None = None) -> torch.Tensor:
    w13, w2 = random_weights(EXPERTS, HIDDEN, INTERMEDIATE, seed=7)
    ids, weights = softmax_topk(logits, TOP_K)
    if qmax is None:
        return moe(x, ids, weights, w13, w2)
    return emulated_integer_moe(x, ids, weights, w13, w2, qmax)


# -- probe and tables ------------------------------------------------------------------------------


def test_real_ascend_is_unavailable_here_and_says_why():
    result = AscendVendor().probe()
    assert not result.available
    assert "torch_npu is not installed" in result.reason and "ascend-emulated" in result.reason


def test_hal_vendors_lists_ascend_unavailable_and_the_emulation_available():
    done = subprocess.run(
        [sys.executable, "-m", "hal.cli", "vendors", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    listing = json.loads(done.stdout)
    by_name = {v["name"]: v for v in listing["vendors"]}
    assert not by_name["ascend"]["available"] and "torch_npu" in by_name["ascend"]["detail"]
    assert by_name["ascend-emulated"]["available"] and "EMULATED" in by_name["ascend-emulated"]["detail"]
    assert listing["selected"] != "ascend-emulated"  # the emulation never becomes the default


def test_emulated_a2_table_matches_the_design():
    assert EmulatedAscendVendor().capabilities().device_name.startswith("Ascend910_93")  # the default: an A3
    caps = EmulatedAscendVendor("Ascend910B3").capabilities()
    assert "EMULATED" in caps.device_name and caps.device_name.startswith("Ascend910B3")
    assert caps.dispatch_dtypes == {DispatchDtype.BF16, DispatchDtype.FP16, DispatchDtype.FP32, DispatchDtype.INT8}
    assert caps.fallback_for("fp8") is DispatchDtype.INT8 and caps.fallback_for("nvfp4") is None
    assert caps.fused_deep_moe == frozenset() and caps.collective_backend == "hccl"
    assert {GemmKind.INT8, GemmKind.BF16} <= caps.grouped_matmul
    assert GemmKind.INT4 not in caps.grouped_matmul  # A4W4 is not a documented ND path on A2/A3
    assert GemmKind.FP8_ROWWISE not in caps.grouped_matmul and caps.consistency_problems() == []


def test_fp8_is_declared_only_on_a_generation_that_computes_it():
    a3 = EmulatedAscendVendor("Ascend910_9392").capabilities()
    a5 = EmulatedAscendVendor("Ascend950PR").capabilities()
    assert a3.fallback_for("fp8") is DispatchDtype.INT8 and not a3.supports_fp8_dispatch
    assert a5.supports_fp8_dispatch and GemmKind.FP8_ROWWISE in a5.grouped_matmul
    assert a5.consistency_problems() == []


def test_fp8_quantizes_through_npu_dynamic_quant_on_a5_and_is_refused_on_a2():
    vendor, ops, _ = recording_vendor("Ascend950PR")
    x = torch.randn(4, 32).to(torch.bfloat16)
    q = vendor.quantize(x, "fp8", layout="per-token")
    assert q.data.dtype == torch.float8_e4m3fn
    assert [(c[0], c[2].get("dst_type")) for c in ops.calls] == [("npu_dynamic_quant", torch.float8_e4m3fn)]
    with pytest.raises(UnsupportedCapability, match="falls back to int8"):
        EmulatedAscendVendor().quantize(x, "fp8")


def test_without_deep_ep_no_fused_op_is_declared_and_w8a8_runs_unfused():
    vendor = EmulatedAscendVendor(deep_ep=False)
    caps = vendor.capabilities()
    assert caps.fused_deep_moe == frozenset() and any("deep_ep" in note for note in caps.notes)
    w8a8 = layer(vendor, "w8a8-int8")
    x, logits = inputs(16, seed=1)
    assert not w8a8.fused
    assert relative_error(w8a8(x, logits), reference(x, logits, 127)) <= EMULATED_LAYER_TOLERANCE["w8a8-int8"][1]


# -- the MoE layer's paths -------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [None, 32], ids=["normal", "low-latency"])
def test_w8a8_int8_takes_the_fused_path_and_equals_the_unfused_one(capacity):
    vendor, _, deep_ep = recording_vendor()
    config = DispatchConfig(max_dispatch_tokens_per_rank=capacity)
    fused = layer(vendor, "w8a8-int8", dispatch=config)
    unfused = layer(vendor, "w8a8-int8", dispatch=config, fused=False)
    assert fused.fused and not unfused.fused and fused.plan.resolved is DispatchDtype.INT8
    x, logits = inputs(24, seed=2)
    y = fused(x, logits)
    # hidden 64 is below the one-kernel op's limits (FUSED_DEEP_MOE.md), so both take the port's normal mode;
    # tests/vendors/ascend/test_ascend_fused_contract.py runs the one-kernel op on shapes it takes.
    expected_calls = {"get_dispatch_layout", "dispatch", "combine"}
    assert {c[0] for c in deep_ep.calls} == expected_calls
    deep_ep.calls.clear()
    y_unfused = unfused(x, logits)
    assert deep_ep.calls == []
    assert relative_error(y, y_unfused.double()) <= FUSED_TOLERANCE
    assert relative_error(y, reference(x, logits, 127)) <= EMULATED_LAYER_TOLERANCE["w8a8-int8"][1]


def test_w4a4_is_refused_with_a_clear_error_since_no_int4_gemm_is_declared():
    vendor, _, _ = recording_vendor()
    with pytest.raises(UnsupportedCapability, match="int4 grouped matmul that scheme 'w4a4-int4' needs"):
        layer(vendor, "w4a4-int4")
    with pytest.raises(UnsupportedCapability, match="does not declare the int4 grouped matmul"):
        vendor.quantize_int4(inputs(20, seed=3)[0])


def test_an_unquantized_model_dispatches_bf16():
    vendor, ops, deep_ep = recording_vendor()
    plain = layer(vendor, "unquantized")
    assert plain.plan.resolved is DispatchDtype.BF16 and not plain.fused
    x, logits = inputs(20, seed=4)
    y = plain(x, logits)
    assert [c[1][0][0].dtype for c in ops.calls if c[0] == "npu_grouped_matmul"] == [torch.bfloat16] * 2
    assert not any(c[0] == "npu_dynamic_quant" for c in ops.calls) and deep_ep.calls == []
    assert relative_error(y, reference(x, logits)) <= LAYER_TOLERANCE[("unquantized", "bf16")]


# -- the DeepEP environment variable, scoped per call ----------------------------------------------


def test_the_deep_ep_port_really_follows_the_variable(monkeypatch):
    """The control: set process-wide, the variable decides every normal-mode dispatch."""
    buffer = emulated_binding().deep_ep.Buffer(torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1))
    ids = torch.tensor([[0], [1]])
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 2)
    args = {
        "num_tokens_per_rank": per_rank,
        "is_token_in_rank": in_rank,
        "num_tokens_per_expert": per_expert,
        "topk_idx": ids,
        "topk_weights": torch.ones(2, 1),
    }
    x = torch.randn(2, 16).to(torch.bfloat16)
    monkeypatch.setenv(INT8_DISPATCH_VARIABLE, "1")
    assert isinstance(buffer.dispatch(x, **args)[0], tuple)
    monkeypatch.setenv(INT8_DISPATCH_VARIABLE, "0")
    assert isinstance(buffer.dispatch(x, **args)[0], torch.Tensor)


@pytest.mark.filterwarnings("ignore::hal.HalDeprecationWarning")  # the preset legacy variable, on purpose
@pytest.mark.parametrize("preset", [None, "1"], ids=["unset", "preset-1"])
def test_two_layers_with_different_int8_settings_each_get_their_own(monkeypatch, preset):
    if preset is None:
        monkeypatch.delenv(INT8_DISPATCH_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(INT8_DISPATCH_VARIABLE, preset)
    vendor, _, deep_ep = recording_vendor()
    target = layer(vendor, "w8a8-int8")  # dispatches int8
    draft = layer(vendor, "w8a8-int8", dispatch=DispatchConfig(dtype="bf16"))  # dispatches bf16
    assert target.fused and draft.fused
    assert (target.plan.resolved, draft.plan.resolved) == (DispatchDtype.INT8, DispatchDtype.BF16)
    batches = {"target": inputs(32, seed=5), "draft": inputs(24, seed=6)}  # told apart by their token counts
    models = {"target": target, "draft": draft}
    alone = {name: models[name](*batches[name]) for name in models}
    for name, model in models.items():  # each equals the unfused layer of the same plan
        twin = layer(vendor, "w8a8-int8", dispatch=model.dispatch_config, fused=False)
        assert relative_error(alone[name], twin(*batches[name]).double()) <= FUSED_TOLERANCE, name

    deep_ep.calls.clear()
    results: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            for _ in range(8):
                results[name].append(models[name](*batches[name]))
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    # What the DeepEP port produced for each call, told apart by the batch it carried.
    carried = {(call[1][0].shape[0], isinstance(call[3][0], tuple)) for call in deep_ep.calls if call[0] == "dispatch"}
    assert carried == {(32, True), (24, False)}
    assert sum(call[0] == "dispatch" for call in deep_ep.calls) == 16
    for name in results:
        assert len(results[name]) == 8 and all(torch.equal(y, alone[name]) for y in results[name]), name
    assert os.environ.get(INT8_DISPATCH_VARIABLE) == preset  # restored after every call


# -- one code path ---------------------------------------------------------------------------------


def test_the_vendor_never_asks_whether_it_is_emulated():
    """The vendor's modules name nothing emulated: the binding is the only difference."""
    offenders = []
    for path in sorted((ROOT / "vendors" / "ascend").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, (ast.Name, ast.arg)):
                names = [getattr(node, "id", None) or node.arg]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if "emulat" in n.lower()]
    assert offenders == []


def test_a5_dispatches_fp8_natively_through_the_layer():
    vendor, ops, _ = recording_vendor("Ascend950PR")
    plain = layer(vendor, "unquantized", dispatch=DispatchConfig(dtype="fp8"))
    assert plain.plan.resolved is DispatchDtype.FP8 and plain.plan.fallback is None
    x, logits = inputs(16, seed=8)
    y = plain(x, logits)
    assert [c[2].get("dst_type") for c in ops.calls if c[0] == "npu_dynamic_quant"] == [torch.float8_e4m3fn]
    assert relative_error(y, reference(x, logits)) <= LAYER_TOLERANCE[("unquantized", "fp8")]


# -- the acceptance run ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_conformance_suite_passes_on_the_emulation(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hal.cli", "conformance", "--vendor", "ascend-emulated", "--report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (report,) = json.loads((tmp_path / "conformance.json").read_text())["vendors"]
    assert report["ok"] and report["summary"]["failed"] == 0 and report["summary"]["passed"] > 180
    assert "EMULATED" in report["capabilities"]["device_name"] and "EMULATED" in report["description"]
    rows = {row["capability"]: row for row in report["matrix"]}
    assert (rows["dispatch fp8"]["declared"], rows["dispatch fp8"]["result"]) == ("falls back to int8", "pass")
    assert rows["dispatch nvfp4"]["declared"] == "rejected"
    assert rows["moe layer w8a8-int8"]["declared"] == "supported (fused)"
    for label in ("fused_deep_moe w8a8-int8", "grouped_matmul int8"):
        assert rows[label]["result"] == "pass", label
    for label in ("moe layer w4a4-int4", "grouped_matmul int4"):  # not declared on A2/A3
        assert rows[label]["result"] == "skipped" and rows[label]["failed"] == 0, label
    assert "EMULATED" in (tmp_path / "conformance.md").read_text()
