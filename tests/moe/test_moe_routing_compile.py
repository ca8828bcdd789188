"""Every router traces under torch.compile(fullgraph=True) on CPU (no host synchronisation, no
data-dependent Python control flow) and gives the eager result, for varying token counts.

Each router is traced alone through the quick `aot_eager` backend; inductor (the default backend,
which generates and builds C++ kernels) compiles all of them at once, in one graph."""

from __future__ import annotations

import pytest
import torch

from moe.routing import Routing, SoftmaxTopK
from tests.support.routing_reference import randn_logits
from tests.moe.test_moe_routing_common import CASES, ROUTERS, E


def _compiled(router, backend: str = "aot_eager"):
    torch._dynamo.reset()
    return torch.compile(lambda logits: router(logits), fullgraph=True, dynamic=True, backend=backend)


def _assert_same(compiled: Routing, eager: Routing) -> None:
    assert isinstance(compiled, Routing)
    assert compiled.weights_on_input is eager.weights_on_input
    assert compiled.topk_ids.dtype == torch.int64 and compiled.topk_weights.dtype == torch.float32
    assert torch.equal(compiled.topk_ids, eager.topk_ids)
    torch.testing.assert_close(compiled.topk_weights, eager.topk_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", ROUTERS)
def test_router_compiles_fullgraph_and_equals_eager(make):
    router = make()
    compiled = _compiled(router)
    for tokens, seed in ((7, 1), (33, 2), (130, 3)):
        x = randn_logits(tokens, E, seed=seed)
        _assert_same(compiled(x), router(x))


def test_every_router_compiles_with_inductor_in_one_graph_and_equals_eager():
    routers = [make() for _, make, _, _ in CASES]
    torch._dynamo.reset()
    compiled = torch.compile(lambda logits: [router(logits) for router in routers], fullgraph=True, dynamic=True)
    for tokens, seed in ((9, 5), (257, 6)):
        x = randn_logits(tokens, E, seed=seed)
        for got, router in zip(compiled(x), routers):
            _assert_same(got, router(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_compiled_router_takes_other_logits_dtypes_and_empty_batches(dtype):
    from moe.routing import GroupedSigmoidTopK

    router = GroupedSigmoidTopK(E, 4, num_groups=4, topk_groups=2, correction_bias=torch.linspace(-0.1, 0.1, E))
    compiled = _compiled(router)
    for tokens in (0, 5, 40):
        x = randn_logits(tokens, E, seed=tokens).to(dtype)
        _assert_same(compiled(x), router(x))


class _SyncingRouter(SoftmaxTopK):
    """A faulty router: it asks the host about the data (what the real ones must never do)."""

    def _route(self, logits):
        ids, weights = super()._route(logits)
        if weights.max().item() > 0.5:  # host synchronisation + data-dependent control flow
            weights = weights * 1.0
        return ids, weights


def test_the_compile_check_catches_a_host_synchronising_router():
    router = _SyncingRouter(E, 2)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # UserError / Unsupported, by torch version
        _compiled(router)(randn_logits(8, E, seed=4))
