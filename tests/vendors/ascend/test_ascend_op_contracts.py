"""The grouped-matmul and routing-op contracts, on the strict versioned emulation.

Each item test fails on the old vendor (through the emulation as it now models torch_npu) and
passes now: 1 (W8A8 scale/output pairing), 2 (`k=` of npu_moe_finalize_routing, explicit
routing defaults), 8 (no int4 x int4 on A2/A3), 9 (no per-call fp32 copy of the whole weight).
The rest checks the versioned emulation itself: argument lists per torch-npu version, and the
leniencies hardware has (short group_list, finalize drop_pad_mode 2/3).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conformance.reference import random_weights
from hal import Groups, ScaleLayout, UnsupportedCapability
from hal.gemm_kinds import GemmKind
from moe import MoELayer
from vendors.ascend.emulation.torch_npu_ops import EmulatedTorchNpu
from vendors.ascend.emulation.vendor import EmulatedAscendVendor
from vendors.ascend.emulation.versions import VERSION_VARIABLE, VERSIONS
from tests.support.paths import REPO

ROOT = REPO
I64, I32, I8, BF16, F16 = torch.int64, torch.int32, torch.int8, torch.bfloat16, torch.float16
MODELLED = ["2.8", "2.13"]


class Spy:
    """Delegates to `inner`, recording `(op, args, kwargs)` of every call."""

    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        target = getattr(self.inner, name)
        if not callable(target):
            return target

        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls.append((name, args, kwargs))
            return target(*args, **kwargs)

        return call


def spied_vendor(soc: str = "Ascend910_9392", version: str = "2.13") -> tuple[EmulatedAscendVendor, Spy]:
    vendor = EmulatedAscendVendor(soc, torch_npu_version=version)
    spy = Spy(vendor.binding.ops)
    object.__setattr__(vendor.binding, "ops", spy)  # the binding is frozen; the ops object is built later
    return vendor, spy


def gemm_operands(vendor, kind: str, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    e, k, n, counts = 4, 32, 48, [3, 0, 5, 2]
    w = torch.randn(e, k, n, generator=g)
    x = torch.randn(sum(counts), k, generator=g).to(BF16)
    groups = Groups.from_counts(torch.tensor(counts, dtype=I64))
    if kind == "bf16":
        return x, vendor.quantize_weight(w, ScaleLayout.NONE, BF16), groups
    if kind == "int8":
        return vendor.quantize(x, "int8"), vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, I8), groups
    return vendor.quantize(x, "fp8"), vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, torch.float8_e4m3fn), groups


# -- W8A8 scale dtype and output dtype are paired ------------------------------------------


def test_the_emulation_rejects_a_float32_scale_with_a_bf16_output():
    npu = EmulatedTorchNpu("Ascend910B3")
    x, w = torch.ones(2, 4, dtype=I8), torch.ones(1, 4, 3, dtype=I8)
    call = dict(per_token_scale=[torch.ones(2)], group_list=torch.tensor([2], dtype=I64), split_item=2, group_type=0)
    with pytest.raises(RuntimeError, match="bfloat16 scale -> bfloat16 output, float32 scale -> float16 output"):
        npu.npu_grouped_matmul([x], [w], scale=[torch.ones(1, 3)], output_dtype=BF16, **call)  # the old call
    with pytest.raises(RuntimeError, match="not a supported combination"):
        npu.npu_grouped_matmul([x], [w], scale=[torch.ones(1, 3, dtype=BF16)], output_dtype=F16, **call)
    assert (
        npu.npu_grouped_matmul([x], [w], scale=[torch.ones(1, 3, dtype=BF16)], output_dtype=BF16, **call)[0].dtype
        == BF16
    )
    assert npu.npu_grouped_matmul([x], [w], scale=[torch.ones(1, 3)], output_dtype=F16, **call)[0].dtype == F16


@pytest.mark.parametrize("out_dtype", [BF16, F16])
def test_the_vendor_passes_a_listed_pairing_and_computes_right(out_dtype):
    vendor, spy = spied_vendor()
    x, w, groups = gemm_operands(vendor, "int8")
    y = vendor.grouped_matmul(x, w, groups, out_dtype=out_dtype)
    (call,) = [c for c in spy.calls if c[0] == "npu_grouped_matmul"]
    scale = call[2].get("scale")
    pairing = (scale[0].dtype if scale else None, call[2]["output_dtype"])
    assert pairing in {(BF16, BF16), (torch.float32, F16), (None, I32)}
    if out_dtype == BF16:  # the int32 accumulator, scaled in fp32 and rounded once (not twice through fp16)
        assert pairing == (None, I32)
    expected = vendor_reference(x, w, groups)
    assert y.dtype == out_dtype and torch.allclose(y.double(), expected, rtol=2**-7, atol=1e-3)


def vendor_reference(x, w, groups) -> torch.Tensor:  # type: ignore[no-untyped-def]
    a = x.data.double() * x.scale.double()[:, None]
    b = w.data.double() * w.scale.double()[:, None, :]
    ids = torch.repeat_interleave(torch.arange(b.shape[0]), groups.counts())
    return torch.einsum("mk,mkn->mn", a, b[ids])


# -- npu_moe_finalize_routing's k, npu_moe_init_routing_v2's defaults -----------------------


def finalize_args(k: int = 2, rows: int = 3):  # type: ignore[no-untyped-def]
    expanded = torch.arange(rows * k * 4, dtype=torch.float32).reshape(rows * k, 4).to(BF16)
    return (expanded, None, None, None, torch.full((rows, k), 0.5, dtype=BF16), torch.arange(rows * k, dtype=I32), None)


@pytest.mark.parametrize("version", ["2.8", "2.10"])
def test_finalize_rejects_k_before_2_13(version):
    npu = EmulatedTorchNpu("Ascend910B3", version)
    with pytest.raises(RuntimeError, match=f"torch_npu {version} schema.*unexpected keyword argument 'k'"):
        npu.npu_moe_finalize_routing(*finalize_args(), drop_pad_mode=0, k=2)  # the old call
    with pytest.raises(RuntimeError, match="torch_npu 2.8 schema|torch_npu 2.10 schema"):
        npu.npu_moe_finalize_routing(*finalize_args(), 0, 2)  # k by position
    assert npu.npu_moe_finalize_routing(*finalize_args(), drop_pad_mode=0).shape == (3, 4)


def test_finalize_takes_k_in_2_13():
    npu = EmulatedTorchNpu("Ascend910B3", "2.13")
    with_k = npu.npu_moe_finalize_routing(*finalize_args(), drop_pad_mode=0, k=2)
    assert torch.equal(with_k, npu.npu_moe_finalize_routing(*finalize_args(), drop_pad_mode=0))


def init_routing(npu, **kwargs):  # type: ignore[no-untyped-def]
    x = torch.arange(32, dtype=torch.float32).reshape(4, 8).to(BF16)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 1]], dtype=I32)
    options = dict(
        expert_num=3, expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, 3], **kwargs
    )
    return npu.npu_moe_init_routing_v2(x, ids, **options)


def test_init_routing_defaults_differ_per_version_so_both_are_passed():
    old, new = EmulatedTorchNpu("Ascend910B3", "2.8"), EmulatedTorchNpu("Ascend910B3", "2.13")
    with pytest.raises(RuntimeError, match="quant_mode: only -1"):  # 2.8 defaults to 0 (static)
        init_routing(old, active_num=8)
    with pytest.raises(RuntimeError, match="active_num must equal NUM_ROWS\\*K = 8 in torch_npu 2.8"):
        init_routing(old, quant_mode=-1)
    init_routing(new)  # 2.13: quant_mode -1 and active_num -1 are the defaults
    explicit = [init_routing(npu, active_num=8, quant_mode=-1) for npu in (old, new)]
    assert all(torch.equal(a, b) for a, b in zip(*explicit))
    with pytest.raises(RuntimeError, match="x_dtype"):
        init_routing(old, active_num=8, quant_mode=-1, x_dtype=None)  # 2.8 has no x_dtype


@pytest.mark.parametrize("version", MODELLED)
def test_the_vendor_never_passes_k_and_passes_routing_options_explicitly(version):
    vendor, spy = spied_vendor(version=version)
    w13, w2 = random_weights(8, 64, 32, seed=7)
    fused = MoELayer.from_float(w13, w2, 2, scheme="w8a8-int8", vendor=vendor)
    assert fused.fused
    g = torch.Generator().manual_seed(2)
    y = fused(torch.randn(24, 64, generator=g).to(BF16), torch.randn(24, 8, generator=g))
    assert torch.isfinite(y).all()
    for name, _, kwargs in spy.calls:
        if name == "npu_moe_finalize_routing":
            assert "k" not in kwargs
        if name == "npu_moe_init_routing_v2":
            assert {"active_num", "quant_mode"} <= set(kwargs)


# -- no int4 x int4 on A2/A3 ----------------------------------------------------------------


@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend910_9392"])
def test_int4_gemm_is_not_declared_and_w4a4_is_refused_clearly(soc):
    vendor = EmulatedAscendVendor(soc)
    assert GemmKind.INT4 not in vendor.capabilities().grouped_matmul
    w13, w2 = random_weights(8, 64, 32, seed=7)
    with pytest.raises(
        UnsupportedCapability, match="the int4 grouped matmul that scheme .w4a4-int4. needs is not declared"
    ):
        MoELayer.from_float(w13, w2, 2, scheme="w4a4-int4", vendor=vendor)


def test_the_emulation_rejects_int4_x_int4():
    with pytest.raises(RuntimeError, match="int4 x int4"):
        EmulatedTorchNpu("Ascend910B3").npu_grouped_matmul(
            [torch.ones(2, 1, dtype=I32)],
            [torch.ones(1, 8, 1, dtype=I32)],
            scale=[torch.ones(1, 8, dtype=BF16)],
            per_token_scale=[torch.ones(2)],
            group_list=torch.tensor([2], dtype=I64),
            split_item=2,
            group_type=0,
            output_dtype=BF16,
        )


# -- no per-call fp32 copy of the whole [E, K, N] weight ------------------------------------


class Allocations(TorchDispatchMode):
    """Records (shape, dtype) of every tensor an aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize("soc, kind", [("Ascend910B3", "bf16"), ("Ascend950PR", "fp8")])
@pytest.mark.parametrize("out_dtype", [BF16, torch.float32])
def test_no_full_weight_fp32_copy_per_call(soc, kind, out_dtype):
    vendor, spy = spied_vendor(soc)
    x, w, groups = gemm_operands(vendor, kind)
    with Allocations() as seen:
        y = vendor.grouped_matmul(x, w, groups, out_dtype=out_dtype)
    assert (tuple(w.data.shape), torch.float32) not in seen.made
    for _, args, _ in (c for c in spy.calls if c[0] == "npu_grouped_matmul"):
        assert args[1][0].dtype == w.data.dtype  # the op gets the weight as stored
    a = x.double() if kind == "bf16" else x.data.double() * x.scale.double()[:, None]
    b = w.data.double() if kind == "bf16" else w.data.double() * w.scale.double()[:, None, :]
    ids = torch.repeat_interleave(torch.arange(b.shape[0]), groups.counts())
    expected = torch.einsum("mk,mkn->mn", a, b[ids])
    assert y.dtype == out_dtype and torch.allclose(y.double(), expected, rtol=2**-7, atol=1e-3)


# -- the versioned emulation ------------------------------------------------------------------------


def test_versions_are_chosen_per_instance_and_refused_when_not_modelled():
    assert VERSIONS[0] == "2.8" and "2.13" in VERSIONS
    assert EmulatedAscendVendor(torch_npu_version="2.8.0").binding.ops.version == "2.8"
    assert EmulatedAscendVendor(environ={VERSION_VARIABLE: "2.10"}).binding.ops.version == "2.10"
    assert EmulatedAscendVendor(environ={}).binding.ops.version == "2.13"
    assert "torch_npu 2.8 " in EmulatedAscendVendor(torch_npu_version="2.8").binding.label
    with pytest.raises(RuntimeError, match="not modelled"):
        EmulatedAscendVendor(torch_npu_version="2.5")


@pytest.mark.parametrize("version", MODELLED)
def test_unknown_keyword_arguments_are_rejected(version):
    npu = EmulatedTorchNpu("Ascend910B3", version)
    with pytest.raises(RuntimeError, match="unexpected keyword argument 'group_size'"):
        npu.npu_grouped_matmul([torch.ones(2, 4)], [torch.ones(1, 4, 3)], group_size=2)
    with pytest.raises(RuntimeError, match="unexpected keyword argument 'dim_size'"):
        npu.npu_swiglu(torch.ones(2, 4), dim_size=1)
    if version == "2.8":
        with pytest.raises(RuntimeError, match="'dst_type_max'"):
            npu.npu_dynamic_quant(torch.ones(2, 8, dtype=BF16), dst_type_max=0.0)
    else:
        npu.npu_dynamic_quant(torch.ones(2, 8, dtype=BF16), dst_type_max=0.0)


@pytest.mark.parametrize("version", MODELLED)
@pytest.mark.parametrize("group_list_type", [0, 1])
def test_a_short_group_list_is_accepted_and_the_rows_past_it_are_undefined(version, group_list_type):
    npu = EmulatedTorchNpu("Ascend910B3", version)
    x, w = torch.ones(6, 4, dtype=BF16), torch.ones(2, 4, 3, dtype=BF16)
    counts = torch.tensor([1, 2], dtype=I64)
    group_list = counts if group_list_type == 1 else counts.cumsum(0)
    (y,) = npu.npu_grouped_matmul(
        [x], [w], group_list=group_list, group_list_type=group_list_type, split_item=2, group_type=0
    )
    assert y.shape == (6, 3) and torch.equal(y[:3].float(), torch.full((3, 3), 4.0)) and y[3:].isnan().all()
    with pytest.raises(RuntimeError, match="x's rows 6"):
        npu.npu_grouped_matmul(
            [x], [w], group_list=group_list * 4, group_list_type=group_list_type, split_item=2, group_type=0
        )


@pytest.mark.parametrize("version", MODELLED)
def test_finalize_accepts_drop_pad_modes_2_and_3(version):
    npu = EmulatedTorchNpu("Ascend910B3", version)
    rows = torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0], [8.0, 8.0]], dtype=BF16)
    scales = torch.tensor([[1.0, 0.5], [1.0, 1.0]], dtype=BF16)
    row_major = torch.tensor([0, 1, 2, -1], dtype=I32)  # token 1's second route was dropped
    out = npu.npu_moe_finalize_routing(rows, None, None, None, scales, row_major, None, 2)
    assert out.float().tolist() == [[2.0, 2.0], [4.0, 4.0]]  # 1 + 0.5*2; 4*1 + nothing
    out3 = npu.npu_moe_finalize_routing(rows.reshape(2, 2, 2), None, None, None, scales, row_major, None, 3)
    assert torch.equal(out, out3)
    with pytest.raises(RuntimeError, match=r"in \[0, 3\] for drop_pad_mode 0"):
        npu.npu_moe_finalize_routing(rows, None, None, None, scales, row_major, None, 0)


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.8"])
def test_hal_conformance_runs_under_an_older_modelled_version(version, tmp_path):
    env = {**os.environ, VERSION_VARIABLE: version}
    done = subprocess.run(
        [sys.executable, "-m", "hal.cli", "conformance", "--vendor", "ascend-emulated", "--report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"torch_npu {version} " in (tmp_path / "conformance.md").read_text()
