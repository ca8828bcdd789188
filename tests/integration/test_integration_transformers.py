"""The transformers drop-in: models whose MoE blocks run through `moe.MoELayer` equal transformers' own.

Small random-weight models of each family (`tests/support/transformers_models.py`, no download),
fp32, CPU vendor. Full-model logits must agree within `max|diff| <= 1e-5 * max|logits|`
(fp32 rounding of a different summation order; the layer dispatches fp32 models in fp32),
and greedy generation of 20 tokens must be identical. A bf16 model is held to transformers'
own bf16 accuracy against the fp32 model.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds

pytest.importorskip("transformers")

import hal  # noqa: E402
import moe  # noqa: E402
import moe.integrations.transformers as moe_hf  # noqa: E402
from tests.support.transformers_models import CONFIGS, HIDDEN, VOCAB, build_model  # noqa: E402

FAMILIES = sorted(CONFIGS)
#: max |logits - transformers' logits| over max |transformers' logits|, fp32
FP32_RTOL = 1e-5
#: a bf16 model's mean error against the fp32 model, over transformers' own bf16 model's
BF16_MEAN_RATIO = 1.5


@pytest.fixture(scope="module")
def cpu() -> hal.Vendor:
    return hal.get_vendor("cpu")


def _prompt(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _moe_blocks(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    _, architecture = moe_hf.architecture_of(model)
    return {name: module for name, module in model.named_modules() if architecture.matches(module)}


@pytest.mark.parametrize("family", FAMILIES)
def test_full_model_logits_equal_transformers(family, cpu):
    model = build_model(family)
    ids = _prompt()
    want = _logits(model, ids)
    names = moe_hf.replace_moe_blocks(model, vendor=cpu)
    assert names and all(isinstance(model.get_submodule(n), moe_hf.MoEBlock) for n in names)
    for name in names:
        layer = model.get_submodule(name).moe
        assert isinstance(layer.scheme, moe.Unquantized) and layer.scheme.dtype == torch.float32
        assert str(layer.plan.resolved) == "fp32"
    got = _logits(model, ids)
    assert _relative(got, want) <= FP32_RTOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_of_20_tokens_is_identical(family, cpu):
    model = build_model(family)
    ids = _prompt()
    want = model.generate(ids, do_sample=False, max_new_tokens=20)
    moe_hf.replace_moe_blocks(model, vendor=cpu)
    got = model.generate(ids, do_sample=False, max_new_tokens=20)
    assert want.shape == (2, ids.shape[1] + 20)
    assert torch.equal(got, want)


@pytest.mark.parametrize("record", [False, True], ids=["linear-logits", "hf-router-logits"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_block_returns_what_the_transformers_block_returns(family, record, cpu):
    model = build_model(family)
    originals = _moe_blocks(model)
    moe_hf.replace_moe_blocks(model, vendor=cpu, record_router_logits=record)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(3))
    for name, original in originals.items():
        with torch.no_grad():
            want, got = original(x), model.get_submodule(name)(x)
        assert type(got) is type(want)
        pairs = list(zip(got, want, strict=True)) if isinstance(want, tuple) else [(got, want)]
        for got_part, want_part in pairs:
            assert got_part.shape == want_part.shape and got_part.dtype == want_part.dtype
            assert _relative(got_part, want_part) <= FP32_RTOL


@pytest.mark.parametrize("bad", ["wide", "scalar", "list"])
def test_a_block_refuses_hidden_states_of_another_width_by_name(bad, cpu):
    model = build_model(FAMILIES[0])
    (name,) = list(_moe_blocks(model))[:1]
    moe_hf.replace_moe_blocks(model, vendor=cpu)
    block = model.get_submodule(name)
    given = {"wide": torch.randn(2, 5, HIDDEN + 1), "scalar": torch.tensor(1.0), "list": [[0.0] * HIDDEN]}[bad]
    with pytest.raises(hal.InvalidInput, match=rf"^hidden_states: expected a tensor \[\.\.\., {HIDDEN}\]"):
        block(given)


@pytest.mark.parametrize("flag", ["keep_original", "record_router_logits"])
def test_switches_that_are_not_bools_are_refused_and_replace_nothing(flag, cpu):
    model = build_model(FAMILIES[0])
    before = _moe_blocks(model)
    with pytest.raises(hal.InvalidInput, match=rf"^{flag}: expected True or False, got 'no'"):
        moe_hf.replace_moe_blocks(model, vendor=cpu, **{flag: "no"})
    assert _moe_blocks(model) == before


@pytest.mark.parametrize("family", FAMILIES)
def test_restore_puts_back_the_original_modules(family, cpu):
    model = build_model(family)
    ids = _prompt()
    want = _logits(model, ids)
    originals = _moe_blocks(model)
    replaced = moe_hf.replace_moe_blocks(model, vendor=cpu)
    assert sorted(replaced) == sorted(originals)
    assert sorted(moe_hf.restore_moe_blocks(model)) == sorted(originals)
    assert all(model.get_submodule(name) is block for name, block in originals.items())
    assert not any(isinstance(m, moe_hf.MoEBlock) for m in model.modules())
    assert torch.equal(_logits(model, ids), want)


@pytest.mark.parametrize(
    ("family", "dense"), [("deepseek_v3", "model.layers.0.mlp"), ("qwen3_moe", "model.layers.0.mlp")]
)
def test_dense_layers_are_left_alone(family, dense, cpu):
    model = build_model(family)
    mlp = model.get_submodule(dense)
    names = moe_hf.replace_moe_blocks(model, vendor=cpu)
    assert dense not in names and model.get_submodule(dense) is mlp


def test_an_unknown_architecture_is_refused_clearly(cpu):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        hal.InvalidInput,
        match=r"model: expected a model type with an MoE adapter .*qwen3_moe.*"
        r"got 'llama'",
    ):
        moe_hf.replace_moe_blocks(model, vendor=cpu)
    with pytest.raises(hal.InvalidInput, match="model: expected a transformers model"):
        moe_hf.replace_moe_blocks(torch.nn.Linear(2, 2), vendor=cpu)


def test_an_entry_of_architectures_overrides_the_table(cpu):
    model = build_model("mixtral")
    entry = moe_hf.Architecture(("NoSuchBlock",), moe_hf.softmax_topk(renormalize=True))
    with pytest.raises(hal.InvalidInput, match="MoE blocks of class NoSuchBlock .* got none"):
        moe_hf.replace_moe_blocks(model, vendor=cpu, architectures={"mixtral": entry})


def test_layer_options_pass_through_and_block_derived_ones_are_refused(cpu):
    model = build_model("mixtral")
    with pytest.raises(hal.InvalidInput, match=r"activation, router: expected nothing: the architecture entry"):
        moe_hf.replace_moe_blocks(model, vendor=cpu, router=None, activation="gelu-glu")
    names = moe_hf.replace_moe_blocks(model, vendor=cpu, fused=False)
    assert all(model.get_submodule(n).moe.fused is False for n in names)


def test_replacing_twice_is_refused_and_one_way_swaps_cannot_be_restored(cpu):
    model = build_model("mixtral")
    moe_hf.replace_moe_blocks(model, vendor=cpu, keep_original=False)
    with pytest.raises(hal.InvalidInput, match="already replaced"):
        moe_hf.replace_moe_blocks(model, vendor=cpu)
    with pytest.raises(hal.InvalidInput, match=r"original blocks of model\.layers\.0\.mlp.*keep_original=False"):
        moe_hf.restore_moe_blocks(model)
    assert all(isinstance(model.get_submodule(f"model.layers.{i}.mlp"), moe_hf.MoEBlock) for i in range(2))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_recorded_router_logits_and_aux_loss_equal_transformers(family, cpu):
    model = build_model(family)
    ids = _prompt()
    with torch.no_grad():
        want = model(ids, output_router_logits=True)
    moe_hf.replace_moe_blocks(model, vendor=cpu, record_router_logits=True)
    with torch.no_grad():
        got = model(ids, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == 2
    assert torch.equal(got.router_logits[0], want.router_logits[0])  # the first block sees the same input
    assert _relative(got.router_logits[1], want.router_logits[1]) <= FP32_RTOL
    assert torch.allclose(got.aux_loss, want.aux_loss, rtol=1e-5, atol=0)
    assert _relative(got.logits, want.logits) <= FP32_RTOL


def test_a_scheme_per_block_and_a_quantized_scheme(cpu):
    model = build_model("qwen3_moe")
    ids = _prompt()
    want = _logits(model, ids)
    asked: list[str] = []

    def scheme(name: str) -> str:
        asked.append(name)
        return "w8a8-int8"

    names = moe_hf.replace_moe_blocks(model, vendor=cpu, scheme=scheme)
    assert asked == names
    assert all(model.get_submodule(n).moe.scheme.traits.name == "w8a8-int8" for n in names)
    assert _relative(_logits(model, ids), want) <= 0.1  # int8 weights and activations: close, not equal


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_bf16_model_runs_in_bf16_as_accurately_as_transformers(family, cpu):
    ids = _prompt()
    exact = _logits(build_model(family), ids).double()
    model = build_model(family, dtype=torch.bfloat16)
    theirs = _logits(model, ids).double()
    names = moe_hf.replace_moe_blocks(model, vendor=cpu)
    assert all(model.get_submodule(n).moe.scheme.dtype == torch.bfloat16 for n in names)
    assert all(str(model.get_submodule(n).moe.plan.resolved) == "bf16" for n in names)
    ours = _logits(model, ids)
    assert ours.dtype == torch.bfloat16
    # bf16 rounding flips some routing choices, so both differ from the fp32 model; on average alike
    assert (ours.double() - exact).abs().mean() <= BF16_MEAN_RATIO * (theirs - exact).abs().mean()


def test_per_expert_modules_read_like_the_fused_layout():
    gen = torch.Generator().manual_seed(5)
    experts, hidden, inter = 3, 8, 5
    mlps = torch.nn.ModuleList()
    for _ in range(experts):
        mlp = torch.nn.Module()
        mlp.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        mlp.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        mlp.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            linear.weight.data = torch.randn(linear.weight.shape, generator=gen)
        mlps.append(mlp)
    read = moe_hf.read_experts(mlps, moe_hf.ExpertLayout.PER_EXPERT)
    fused = torch.nn.Module()
    fused.gate_up_proj = torch.nn.Parameter(
        torch.stack([torch.cat((m.gate_proj.weight, m.up_proj.weight)) for m in mlps])
    )
    fused.down_proj = torch.nn.Parameter(torch.stack([m.down_proj.weight for m in mlps]))
    want = moe_hf.read_experts(fused, moe_hf.ExpertLayout.FUSED_OUT_IN)
    assert read.w13.shape == (experts, hidden, 2 * inter) and read.w2.shape == (experts, inter, hidden)
    assert torch.equal(read.w13, want.w13) and torch.equal(read.w2, want.w2)


def test_gpt_oss_interleaved_columns_are_split_into_gate_then_up():
    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4))
    module.gate_up_proj_bias = torch.nn.Parameter(torch.tensor([[0.0, 1, 2, 3], [4, 5, 6, 7]]))
    module.down_proj = torch.nn.Parameter(torch.zeros(2, 2, 3))
    module.down_proj_bias = torch.nn.Parameter(torch.ones(2, 3))
    read = moe_hf.read_experts(module, moe_hf.ExpertLayout.FUSED_IN_OUT_INTERLEAVED)
    assert torch.equal(read.w13[0, 0], torch.tensor([0.0, 2, 1, 3]))
    assert torch.equal(read.w13_bias, torch.tensor([[0.0, 2, 1, 3], [4, 6, 5, 7]]))
    assert torch.equal(read.w2_bias, torch.ones(2, 3))


def test_a_wrongly_laid_out_experts_tensor_names_the_tensors():
    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 6, 8))
    module.down_proj = torch.nn.Parameter(torch.zeros(2, 8, 3))
    with pytest.raises(hal.InvalidInput, match=r"experts\.gate_up_proj, experts\.down_proj: expected .*fused-in-out"):
        moe_hf.read_experts(module, moe_hf.ExpertLayout.FUSED_IN_OUT)


def test_an_unknown_hidden_act_is_refused():
    class Config:
        hidden_act = "mish"

    with pytest.raises(hal.InvalidInput, match="config.hidden_act: expected one of .*silu.*got 'mish'"):
        moe_hf.glu_of(Config())


def test_moe_does_not_import_the_integration_or_transformers():
    code = "import sys, moe; assert 'moe.integrations' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_compiled_model_traces_through_the_drop_in_without_graph_breaks(family, cpu):
    model = build_model(family)
    ids = _prompt()
    moe_hf.replace_moe_blocks(model, vendor=cpu)
    want = _logits(model, ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    assert torch.equal(_logits(compiled, ids), want)
