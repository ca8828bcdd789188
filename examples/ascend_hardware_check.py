"""What only Ascend hardware can confirm: one command for the owner of an A2 / A3 / A5 machine.

    python examples/ascend_hardware_check.py                       # on the NPU (vendor "ascend")
    python examples/ascend_hardware_check.py --vendor ascend-emulated   # the same checks on the emulation

Each check runs a vendor op (or the layer) on the device and compares it with `hal.reference`
on the CPU, printing one line: `PASS`, `FAIL` (with the measured difference) or `SKIP` (with
why). The emulation passes them by construction; on hardware they test what the emulation
could only assume (docs/ascend.md, "Unverified without hardware"). Then run the whole suite:
`hal conformance --vendor ascend` and `hal doctor --vendor ascend`. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

import torch

import hal
import moe
from hal import DispatchConfig, GemmKind, Groups, ScaleLayout, Vendor
from hal.reference import grouped_matmul, quantize, quantize_int4, quantize_weight, unpack_int4

Check = Callable[[Vendor], str]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def int4_packing(vendor: Vendor) -> str:
    """npu_dynamic_quant(dst_type=quint4x2): the bit order of the eight int4 values in an int32."""
    if not vendor.capabilities().supports_gemm(GemmKind.INT4):
        return "SKIP no int4 grouped matmul declared (A4W4 is not declared on A2/A3)"
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got, want = vendor.quantize_int4(x.to(vendor.device)), quantize_int4(x)
    values, ref = unpack_int4(got.data.cpu()), unpack_int4(want.data)
    off = int((values - ref).abs().max())
    return "PASS" if off <= 1 else f"FAIL unpacked values differ by up to {off} steps (bit order?)"


def w8a8_grouped_matmul(vendor: Vendor) -> str:
    """int8 x int8 with per-token and per-channel scales: the scale / output dtype pairing the vendor uses."""
    if not vendor.capabilities().supports_gemm(GemmKind.INT8):
        return "SKIP no int8 grouped matmul declared"
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 17, 9])
    x = quantize(torch.randn(31, 320, generator=g), "int8")
    w = quantize_weight(torch.randn(4, 320, 200, generator=g) / 18, ScaleLayout.PER_CHANNEL, torch.int8)
    want = grouped_matmul(x, w, Groups.from_counts(counts), out_dtype=torch.bfloat16)
    dev = vendor.device
    got = vendor.grouped_matmul(
        hal.QuantizedTensor(x.data.to(dev), x.dtype, x.layout, x.scale.to(dev)),
        hal.QuantizedWeight(w.data.to(dev), w.layout, w.scale.to(dev)),
        Groups.from_counts(counts.to(dev)),
        out_dtype=torch.bfloat16,
    )
    err = _relative(got, want)
    return "PASS" if got.dtype == torch.bfloat16 and err < 1e-2 else f"FAIL {got.dtype}, relative error {err:.3g}"


def fp32_grouped_matmul(vendor: Vendor) -> str:
    """The fp32 grouped matmul really computes in fp32 (no reduced-precision mode)."""
    if not vendor.capabilities().supports_gemm(GemmKind.FP32):
        return "SKIP no fp32 grouped matmul declared"
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([7, 3, 0, 12])
    x, w = torch.randn(22, 512, generator=g), torch.randn(4, 512, 300, generator=g) / 22
    want = grouped_matmul(x, hal.QuantizedWeight(w), Groups.from_counts(counts), out_dtype=torch.float32)
    dev = vendor.device
    got = vendor.grouped_matmul(x.to(dev), hal.QuantizedWeight(w.to(dev)), Groups.from_counts(counts.to(dev)))
    err = _relative(got, want)
    return "PASS" if err < 1e-5 else f"FAIL relative error {err:.3g} (a reduced-precision fp32 mode?)"


def fused_deep_moe(vendor: Vendor) -> str:
    """The port's fused op (NZ weights, w13 tile permutation, w2 layout, its dispatch and combine)
    against the unfused layer on the same weights."""
    if "w8a8-int8" not in vendor.capabilities().fused_deep_moe:
        return "SKIP fused_deep_moe not declared on this SoC (A3 and A5 only)"
    g = torch.Generator().manual_seed(4)
    e, h, i, k = 16, 1024, 1024, 4
    w13, w2 = torch.randn(e, h, 2 * i, generator=g) / 32, torch.randn(e, i, h, generator=g) / 32
    x = torch.randn(96, h, generator=g).to(torch.bfloat16)
    logits = torch.randn(96, e, generator=g)
    outs = []
    for fused in (True, False):
        layer = moe.MoELayer.from_float(
            w13,
            w2,
            k,
            scheme="w8a8-int8",
            vendor=vendor,
            fused=fused,
            dispatch=DispatchConfig(dtype="int8"),
            environ={},
        )
        outs.append(layer(x.to(vendor.device), logits.to(vendor.device)).cpu())
    err = _relative(outs[0], outs[1].double())
    return "PASS" if err < 2e-2 else f"FAIL fused vs unfused relative difference {err:.3g}"


def layer_schemes(vendor: Vendor) -> str:
    """Every scheme the vendor runs, through the layer, against the layer on the CPU reference."""
    cpu, results = hal.get_vendor("cpu"), []
    g = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(8, 256, 2 * 192, generator=g) / 16, torch.randn(8, 192, 256, generator=g) / 14
    x, logits = torch.randn(40, 256, generator=g).to(torch.bfloat16), torch.randn(40, 8, generator=g)
    for scheme in ("unquantized", "w8a8-int8"):
        if not vendor.capabilities().supports_gemm(moe.make_scheme(scheme).gemm_kind()):
            continue
        on = moe.MoELayer.from_float(
            w13,
            w2,
            2,
            scheme=scheme,
            vendor=vendor,
            environ={},
            fused=False,
            dispatch=DispatchConfig(dtype="int8" if scheme != "unquantized" else "bf16"),
        )
        ref = moe.MoELayer.from_float(
            w13,
            w2,
            2,
            scheme=scheme,
            vendor=cpu,
            environ={},
            dispatch=DispatchConfig(dtype="int8" if scheme != "unquantized" else "bf16"),
        )
        results.append((scheme, _relative(on(x.to(vendor.device), logits.to(vendor.device)), ref(x, logits).double())))
    bad = [f"{s} {e:.3g}" for s, e in results if e > 2e-2]
    return "PASS" if not bad else "FAIL " + ", ".join(bad)


CHECKS: dict[str, Check] = {
    "int4 packing bit order": int4_packing,
    "w8a8 grouped matmul": w8a8_grouped_matmul,
    "fp32 grouped matmul": fp32_grouped_matmul,
    "fused_deep_moe vs unfused": fused_deep_moe,
    "layer vs the CPU reference": layer_schemes,
}


def main(argv: list[str] | None = None) -> int:
    """Run every check on the vendor; print one line per check; 1 if any fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vendor", default="ascend", help="hal vendor (default: ascend)")
    args = parser.parse_args(argv)
    try:
        vendor = hal.get_vendor(args.vendor)
    except hal.HalError as exc:  # no NPU here (or no CANN): say so and how to try the emulation
        sys.stderr.write(f"{exc}\nthese checks need an Ascend NPU; off one, try: --vendor ascend-emulated\n")
        return 1
    print(f"vendor {vendor.name} on {vendor.capabilities().device_name}")
    print(f"running {len(CHECKS)} checks against hal.reference, one line each")
    failed = 0
    for name, check in CHECKS.items():
        try:
            line = check(vendor)
        except Exception as exc:  # a raising op is a failed check, reported and not fatal
            line = f"FAIL {type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        failed += line.startswith("FAIL")
        print(f"{name:<28} {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
