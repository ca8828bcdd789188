"""The fused W8A8-INT8 path against the Ascend DeepEP PORT's contract.

Each test fails on the vendor as it was (CUDA-DeepEP model: re-routing on `recv_topk_idx`,
weights applied before combine, `Buffer(None)`, ND weights, the fused op on A2 and outside
its limits, `os.environ` written around dispatch, -1 / out-of-range ids) through the strict
emulation (`vendors/ascend/emulation/deep_ep.py`), and passes now.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import pytest
import torch

from conformance.reference import emulated_integer_moe, random_weights, relative_error, softmax_topk
from conformance.tolerances import EMULATED_LAYER_TOLERANCE, FUSED_TOLERANCE
from hal import DispatchConfig, DispatchDtype, InvalidInput, UnsupportedCapability
from moe import MoELayer
from vendors.ascend import AscendVendor
from vendors.ascend.emulation.binding import emulated_binding
from vendors.ascend.emulation.deep_ep import EmulatedDeepEp
from vendors.ascend.emulation.vendor import EmulatedAscendVendor
from vendors.ascend.fused import fused_kernel_problems, permute_tiles

A3, A2, A5 = "Ascend910_9392", "Ascend910B3", "Ascend950PR"
SMALL = (8, 64, 32)  # experts, hidden, intermediate: below the one-kernel op's limits
KERNEL = (4, 512, 512)  # hidden 512, 2I = 1024: the smallest shapes the one-kernel op takes
TOP_K = 2


class Recorder:
    """Wraps an object; records `(name, args, kwargs, result)` of every method call (signatures kept)."""

    def __init__(self, inner: object, calls: list) -> None:
        self._inner, self.calls = inner, calls

    def __getattr__(self, name: str):
        target = getattr(self._inner, name)
        if not callable(target):
            return target

        @functools.wraps(target)
        def call(*args, **kwargs):
            result = target(*args, **kwargs)
            self.calls.append((name, args, kwargs, result))
            return result

        return call


def vendor_on(soc: str = A3, port_version: str = "quant-mode") -> tuple[AscendVendor, list, list]:
    """The real vendor class on the emulation; torch_npu calls and port (Buffer) calls recorded."""
    plain = emulated_binding(soc)
    npu_calls: list = []
    port_calls: list = []
    port = EmulatedDeepEp(plain.ops, port_version)

    class RecordingPort:
        def Buffer(self, group, *args, **kwargs):  # noqa: N802 - the port's name
            port_calls.append(("Buffer", (group,), kwargs, None))
            return Recorder(port.Buffer(group, *args, **kwargs), port_calls)

    binding = dataclasses.replace(plain, ops=Recorder(plain.ops, npu_calls), deep_ep=RecordingPort())
    return AscendVendor(binding), npu_calls, port_calls


def build(vendor, shape=SMALL, **kwargs) -> MoELayer:
    experts, hidden, intermediate = shape
    w13, w2 = random_weights(experts, hidden, intermediate, seed=7)
    return MoELayer.from_float(w13, w2, TOP_K, scheme="w8a8-int8", vendor=vendor, environ={}, **kwargs)


def batch(tokens: int, shape=SMALL, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, shape[1], generator=g).to(torch.bfloat16), torch.randn(tokens, shape[0], generator=g)


def integer_reference(x, logits, shape=SMALL) -> torch.Tensor:
    w13, w2 = random_weights(*shape, seed=7)
    ids, weights = softmax_topk(logits, TOP_K)
    return emulated_integer_moe(x, ids, weights, w13, w2, 127)


def one_rank_group():
    return torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1)


# -- the port's dispatch returns per-pair rows grouped by expert; recv_topk_* unfilled ------


def test_normal_mode_computes_on_the_grouped_rows_and_counts_never_the_unfilled_topk():
    vendor, npu_calls, port_calls = vendor_on()
    fused, unfused = build(vendor), build(vendor, fused=False)
    x, logits = batch(24)
    y = fused(x, logits)
    (dispatch,) = [c for c in port_calls if c[0] == "dispatch"]
    recv_x, recv_idx, recv_weights, counts = dispatch[3][:4]
    assert recv_x[0].shape[0] == 24 * TOP_K == sum(counts)  # one row per (token, expert) pair
    assert recv_idx.max() > 2**30 and recv_weights.isnan().all()  # what a reader of them would get
    assert not any(c[0] == "npu_moe_init_routing_v2" for c in npu_calls)  # no re-routing
    gemms = [c[2] for c in npu_calls if c[0] == "npu_grouped_matmul"]
    assert len(gemms) == 2 and all(g["group_list_type"] == 1 and g["group_list"].tolist() == counts for g in gemms)
    assert relative_error(y, unfused(x, logits).double()) <= FUSED_TOLERANCE
    assert relative_error(y, integer_reference(x, logits)) <= EMULATED_LAYER_TOLERANCE["w8a8-int8"][1]


# -- combine applies the routing weights (once) ---------------------------------------------


def test_the_port_combine_weights_the_rows_and_the_vendor_does_not_weight_before_it():
    buffer = EmulatedDeepEp(emulated_binding(A3).ops).Buffer(one_rank_group())
    ids, weights = torch.tensor([[0, 1], [1, 0]]), torch.tensor([[0.25, 0.5], [0.125, 1.0]])
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 2)
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    recv, *_, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=ids,
        topk_weights=weights,
        quant_mode="bf16",
    )
    out, _, _ = buffer.combine(recv, handle)  # identical expert outputs: x * sum_k w (the port's own test)
    assert torch.equal(out[:, 0].float(), torch.tensor([0.75, 1.125]))
    vendor, _, port_calls = vendor_on()
    layer = build(vendor)
    x, logits = batch(16, seed=3)
    layer(x, logits)
    combined_rows = next(c[1][0] for c in port_calls if c[0] == "combine")
    experts_alone = build(vendor, fused=False)  # unweighted per-pair outputs would differ by the weights
    assert combined_rows.shape[0] == 16 * TOP_K
    assert relative_error(layer(x, logits), experts_alone(x, logits).double()) <= FUSED_TOLERANCE


# -- Buffer(None) fails on the port; the vendor passes a real group -------------------------


def test_buffer_none_fails_like_the_port_and_the_vendor_passes_a_group(monkeypatch):
    with pytest.raises(AttributeError, match="rank"):
        EmulatedDeepEp(emulated_binding(A3).ops).Buffer(None)
    vendor, _, port_calls = vendor_on()
    build(vendor)(*batch(4))
    (group,) = [c[1][0] for c in port_calls if c[0] == "Buffer"]
    assert group is not None and (group.rank(), group.size()) == (0, 1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    vendor2, _, _ = vendor_on()
    layer = build(vendor2)
    with pytest.raises(InvalidInput, match="process_group"):
        layer(*batch(4))


# -- NZ, tile-permuted w13 (and scale), w2 [E, H, I], prepared once -------------------------


def test_the_fused_kernel_rejects_nd_weights():
    npu = emulated_binding(A3).ops
    buffer = EmulatedDeepEp(npu).Buffer(one_rank_group())
    e, h, i = KERNEL
    x = torch.randn(4, h).to(torch.bfloat16)
    ids, weights = torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5)
    w13, w2 = torch.ones(e, h, 2 * i, dtype=torch.int8), torch.ones(e, h, i, dtype=torch.int8)
    scales = torch.ones(e, 2 * i), torch.ones(e, h)
    with pytest.raises(RuntimeError, match="FRACTAL_NZ"):
        buffer.fused_deep_moe(x, ids, weights, w13, scales[0], w2, scales[1], 8, e)
    with pytest.raises(RuntimeError, match=r"gmm2_weight must be int8 \[4, 512, 512\]"):  # hal's [E, I, H]: wrong
        buffer.fused_deep_moe(
            x,
            ids,
            weights,
            npu.npu_format_cast(w13, 29),
            scales[0],
            npu.npu_format_cast(w2.transpose(1, 2)[:, :, :256], 29),
            scales[1],
            8,
            e,
        )


def test_the_one_kernel_op_runs_on_prepared_weights_made_once_and_equals_the_unfused_path():
    vendor, npu_calls, port_calls = vendor_on()
    config = DispatchConfig(max_dispatch_tokens_per_rank=16)
    fused, unfused = build(vendor, KERNEL, dispatch=config), build(vendor, KERNEL, dispatch=config, fused=False)
    assert sum(c[0] == "npu_format_cast" for c in npu_calls) == 2  # prepared at load, before any forward
    x, logits = batch(12, KERNEL, seed=4)
    ys = [fused(x, logits) for _ in range(3)]
    calls = [c for c in port_calls if c[0] == "fused_deep_moe"]
    assert len(calls) == 3 and sum(c[0] == "npu_format_cast" for c in npu_calls) == 2  # once, not per call
    w13_nz, w13_scale, w2_nz = calls[0][1][3], calls[0][1][4], calls[0][1][5]
    stored = fused.experts.weights
    assert vendor.binding.ops.get_npu_format(w13_nz) == 29 and vendor.binding.ops.get_npu_format(w2_nz) == 29
    assert torch.equal(w13_nz, permute_tiles(stored.w13.data)) and torch.equal(w2_nz, stored.w2.data.transpose(1, 2))
    assert torch.equal(w13_scale, permute_tiles(stored.w13.scale)) and not torch.equal(w13_nz, stored.w13.data)
    assert all(torch.equal(y, ys[0]) for y in ys)
    assert relative_error(ys[0], unfused(x, logits).double()) <= FUSED_TOLERANCE
    fused.load_state_dict(build(vendor, KERNEL).state_dict())  # new weights: prepared again, at load
    assert sum(c[0] == "npu_format_cast" for c in npu_calls) == 4
    fused(x, logits)
    assert sum(c[0] == "npu_format_cast" for c in npu_calls) == 4


# -- per generation, with the documented limits ---------------------------------------------


def test_the_fused_op_is_declared_on_a3_and_a5_only_and_refused_on_a2():
    assert EmulatedAscendVendor(A2).capabilities().fused_deep_moe == frozenset()
    assert EmulatedAscendVendor(A3).capabilities().fused_deep_moe == {"w8a8-int8"}
    assert EmulatedAscendVendor(A5).capabilities().fused_deep_moe == {"w8a8-int8"}
    a2, _, _ = vendor_on(A2)
    assert not build(a2).fused
    with pytest.raises(UnsupportedCapability, match="fused_deep_moe"):
        build(a2, fused=True)
    buffer = EmulatedDeepEp(emulated_binding(A2).ops).Buffer(one_rank_group())
    with pytest.raises(RuntimeError, match="not built for A2"):
        buffer.fused_deep_moe(
            torch.zeros(1, 512, dtype=torch.bfloat16),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.ones(1, 1),
            *(torch.zeros(1),) * 4,
            1,
            1,
        )


@pytest.mark.parametrize(
    "shape, tokens, capacity, reason",
    [(SMALL, 8, 16, "hidden 64 outside 512..7168"), (KERNEL, 260, 300, "tokens 260 outside 1..256")],
)
def test_outside_the_kernel_limits_the_layer_takes_the_ports_normal_mode(shape, tokens, capacity, reason):
    e, h, i = shape
    assert reason in "; ".join(fused_kernel_problems("A3", tokens, h, 2 * i, TOP_K, e, capacity))
    vendor, _, port_calls = vendor_on()
    layer = build(vendor, shape, dispatch=DispatchConfig(max_dispatch_tokens_per_rank=capacity))
    assert layer.fused
    x, logits = batch(tokens, shape, seed=5)
    y = layer(x, logits)
    assert "fused_deep_moe" not in {c[0] for c in port_calls} and "dispatch" in {c[0] for c in port_calls}
    assert relative_error(y, integer_reference(x, logits, shape)) <= EMULATED_LAYER_TOLERANCE["w8a8-int8"][1]


def test_limit_table():
    assert fused_kernel_problems("A2", 8, 512, 1024, 2, 8, 8) == ["the fused kernel is built for A3 and A5, not A2"]
    assert fused_kernel_problems("A3", 8, 512, 1024, 12, 512, 8) == []
    assert len(fused_kernel_problems("A3", 8, 7169, 6272, 13, 513, 4)) == 5
    assert fused_kernel_problems("A5", 8, 512, 1536, 2, 8, 8) == ["2I 1536 not a multiple of 1024"]


# -- no process environment write; builds elsewhere never see a fused forward's setting ---


@pytest.mark.parametrize("port_version", ["quant-mode", "variable-only"])
def test_concurrent_builds_never_change_plan_while_fused_forwards_run(monkeypatch, port_version):
    monkeypatch.delenv("DEEP_NORMAL_MODE_USE_INT8_QUANT", raising=False)
    monkeypatch.delenv("HAL_DISPATCH_DTYPE", raising=False)
    vendor, _, port_calls = vendor_on(port_version=port_version)
    serving = build(vendor)  # int8 dispatch, normal mode
    x, logits = batch(16, seed=6)
    expected = serving(x, logits)
    w13, w2 = random_weights(*SMALL, seed=7)
    stop, errors, plans = threading.Event(), [], []

    def serve() -> None:
        try:
            while not stop.is_set():
                assert torch.equal(serving(x, logits), expected)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def builder(count: int) -> None:
        try:
            for _ in range(count):  # the process environment (default `environ`) is read at every build
                plans.append(MoELayer.from_float(w13, w2, TOP_K, scheme="unquantized", vendor=vendor).plan.resolved)
        except BaseException as exc:
            errors.append(exc)

    servers = [threading.Thread(target=serve) for _ in range(2)]
    builders = [threading.Thread(target=builder, args=(80,)) for _ in range(4)]
    for thread in servers + builders:
        thread.start()
    for thread in builders:
        thread.join()
    stop.set()
    for thread in servers:
        thread.join()
    assert errors == [] and len(plans) == 320
    assert plans.count(DispatchDtype.BF16) == 320  # 0 plan changes
    dispatches = [c for c in port_calls if c[0] == "dispatch"]
    assert len(dispatches) > 1
    if port_version == "quant-mode":  # int8 on the wire, asked for by argument
        assert all(c[2]["quant_mode"] == "int8" and isinstance(c[3][0], tuple) for c in dispatches)
    else:  # no argument: bf16 on the wire, quantized after the dispatch
        assert all("quant_mode" not in c[2] and isinstance(c[3][0], torch.Tensor) for c in dispatches)


# -- -1 and out-of-range expert ids --------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, SMALL[0]])
def test_invalid_expert_ids_are_refused_clearly(bad):
    vendor, _, port_calls = vendor_on()
    layer = build(vendor)
    x, _ = batch(4)
    ids = torch.tensor([[0, 1], [2, bad], [3, 4], [5, 6]])
    w = layer.experts.weights
    with pytest.raises(InvalidInput, match=r"topk_ids: expected expert ids in \[0, 8\)"):
        vendor.fused_deep_moe(x, ids, torch.full((4, 2), 0.5), w.w13, w.w2, scheme="w8a8-int8")
    assert not any(c[0] == "dispatch" for c in port_calls)


def test_the_port_kernel_skips_minus_one_and_rejects_out_of_range_ids():
    """The port's documented semantics (buffer.py: "-1 indices are supported (meaning no expert
    selected)"), modelled by the emulation; the vendor never sends them."""
    npu = emulated_binding(A3).ops
    buffer = EmulatedDeepEp(npu).Buffer(one_rank_group())
    e, h, i = KERNEL
    g = torch.Generator().manual_seed(0)
    w13 = npu.npu_format_cast(torch.randint(-8, 8, (e, h, 2 * i), generator=g, dtype=torch.int8), 29)
    w2 = npu.npu_format_cast(torch.randint(-8, 8, (e, h, i), generator=g, dtype=torch.int8), 29)
    s13, s2 = torch.full((e, 2 * i), 1e-3), torch.full((e, h), 1e-3)
    x = torch.randn(2, h, generator=g).to(torch.bfloat16)
    weights = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    with_drop, _ = buffer.fused_deep_moe(x, torch.tensor([[0, -1], [1, 2]]), weights, w13, s13, w2, s2, 4, e)
    alone, _ = buffer.fused_deep_moe(x[:1], torch.tensor([[0, 0]]), torch.tensor([[0.5, 0.0]]), w13, s13, w2, s2, 4, e)
    assert torch.equal(with_drop[0], alone[0])
    with pytest.raises(RuntimeError, match="expert ids must lie in"):
        buffer.fused_deep_moe(x, torch.tensor([[0, e], [1, 2]]), weights, w13, s13, w2, s2, 4, e)


# -- a fused result of the wrong form --------------------------------------------------------


@pytest.mark.parametrize("fault", ["short", "integer"])
def test_a_fused_result_of_the_wrong_form_is_the_vendors_fault(fault):
    from hal import VendorFault

    vendor, _, _ = vendor_on()
    layer = build(vendor)
    x, _ = batch(4)
    ids = torch.tensor([[0, 1], [2, 3], [3, 4], [5, 6]])
    w = layer.experts.weights
    fused = vendor.ops.fused_deep_moe
    if fault == "short":  # a faulty port: one token's row lost
        vendor.ops.fused_deep_moe = lambda *a, **k: fused(*a, **k)[:-1]
    else:  # rows returned as integers
        vendor.ops.fused_deep_moe = lambda *a, **k: fused(*a, **k).to(torch.int32)
    with pytest.raises(
        VendorFault, match=r"fused_deep_moe returned torch.(bfloat16 \(3|int32 \(4), .*expected a float tensor \(4, "
    ):
        vendor.fused_deep_moe(x, ids, torch.full((4, 2), 0.5), w.w13, w.w2, scheme="w8a8-int8")
