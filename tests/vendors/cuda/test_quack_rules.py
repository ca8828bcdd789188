"""quack-kernels as a bf16 runner: where it is found, which calls it takes, how a table entry naming it falls
back, and the offsets and row index its variable-length GEMM is handed (no GPU: quack's `gemm` contract for
`cu_seqlens_m` / `A_idx` is played by a float64 stand-in)."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import json
import logging

import pytest
import torch

from hal import DispatchDtype, GemmKind, InvalidInput, QuantizedWeight
from vendors.cpu import CpuVendor
from vendors.cuda import CudaVendor
from vendors.cuda import quack_runner as qr
from vendors.cuda.tuning import DEEP_GEMM, FORMAT, GROUPED_MM, QUACK, TRITON, Choice, TuningTable, forced_choice


class _VarlenGemm:
    """quack's `gemm(A, B, cu_seqlens_m=, A_idx=, tuned=)` as its interface states it: output row r of group g
    (rows `cu[g]:cu[g+1]`) is `A[A_idx[r]] @ B[g]` (A's own row r without `A_idx`); rows past `cu[-1]` are
    the output's, unwritten."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, a, b, *, cu_seqlens_m, A_idx=None, tuned=True):
        assert cu_seqlens_m.dtype == torch.int32 and cu_seqlens_m.dim() == 1
        assert A_idx is None or A_idx.dtype == torch.int32
        self.calls.append({"tuned": tuned, "offsets": cu_seqlens_m.tolist(), "index": A_idx is not None})
        rows = a.shape[0] if A_idx is None else A_idx.numel()
        out = torch.full((rows, b.shape[2]), float("nan"), dtype=torch.bfloat16)
        source = a.double() if A_idx is None else a.double()[A_idx.long()]
        for g in range(b.shape[0]):
            start, end = int(cu_seqlens_m[g]), int(cu_seqlens_m[g + 1])
            out[start:end] = (source[start:end] @ b[g].double()).to(torch.bfloat16)
        return out


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    picks = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)).topk(top_k, dim=1).indices
    picks = picks.flatten()
    return torch.bincount(picks, minlength=experts), torch.sort(picks, stable=True).indices // top_k


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_quack_grouped_reads_rows_through_the_index_in_groups_of_the_counts_as_float64_does(top_k):
    """128 experts, 1,500 tokens, K 200 and N 136 (multiples of 8, not of 128): the offsets start at 0 and end at
    the rows, int32; the index goes in as int32; the product matches float64 to bf16 rounding."""
    experts, tokens, k, n = 128, 1500, 200, 136
    counts, index = _routing(tokens, experts, top_k, seed=top_k)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, k, generator=g).bfloat16()
    w = (torch.randn(experts, k, n, generator=g) / k**0.5).bfloat16()
    gemm = _VarlenGemm()
    y = qr.quack_grouped(gemm, x, w, counts, index)
    rows = x.double()[index]
    ref = torch.cat([part @ w[e].double() for e, part in enumerate(rows.split(counts.tolist()))])
    assert y.shape == (tokens * top_k, n) and y.dtype == torch.bfloat16
    assert ((y.double() - ref).norm() / ref.norm()).item() < 4e-3
    (call,) = gemm.calls
    assert call == {"tuned": False, "offsets": [0, *counts.cumsum(0).tolist()], "index": True}


def test_quack_grouped_without_an_index_takes_the_rows_in_order_and_skips_an_empty_call():
    experts, k, n = 6, 64, 48
    counts = torch.tensor([0, 5, 0, 0, 9, 2])
    x = torch.randn(16, k).bfloat16()
    w = torch.randn(experts, k, n).bfloat16()
    gemm = _VarlenGemm()
    y = qr.quack_grouped(gemm, x, w, counts, None)
    ref = torch.cat([part @ w[e].double() for e, part in enumerate(x.double().split(counts.tolist()))])
    assert ((y.double() - ref).norm() / ref.norm()).item() < 4e-3
    empty = qr.quack_grouped(gemm, x[:0], w, torch.zeros(experts, dtype=torch.int64), None)
    assert empty.shape == (0, n) and len(gemm.calls) == 1


def _weight(k: int = 64, n: int = 48, dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    return QuantizedWeight(torch.randn(4, k, n).to(dtype))


def test_quack_fits_bf16_rows_and_weights_aligned_to_16_bytes_only():
    x, w = torch.randn(10, 64).bfloat16(), _weight()
    assert qr.quack_fits(x, w, GemmKind.BF16, torch.bfloat16)
    k_major = QuantizedWeight(w.data.transpose(1, 2).contiguous().transpose(1, 2))
    assert qr.quack_fits(x, k_major, GemmKind.BF16, torch.bfloat16)
    assert not qr.quack_fits(x, w, GemmKind.BF16, torch.float32)  # bf16 out only
    assert not qr.quack_fits(x.half(), _weight(dtype=torch.float16), GemmKind.FP16, torch.float16)
    assert not qr.quack_fits(torch.randn(10, 60).bfloat16(), _weight(k=60), GemmKind.BF16, torch.bfloat16)  # K % 8
    assert not qr.quack_fits(x, _weight(n=44), GemmKind.BF16, torch.bfloat16)  # N % 8
    assert qr.quack_fits(torch.randn(10, 72).bfloat16()[:, 8:], w, GemmKind.BF16, torch.bfloat16)  # 144-byte rows
    assert not qr.quack_fits(torch.randn(10, 65).bfloat16()[:, 1:], w, GemmKind.BF16, torch.bfloat16)  # 130-byte rows
    assert not qr.quack_fits(torch.randn(64, 10).bfloat16().T, w, GemmKind.BF16, torch.bfloat16)  # column-major rows
    strided = QuantizedWeight(torch.randn(4, 64, 96).bfloat16()[:, :, ::2])
    assert not qr.quack_fits(x, strided, GemmKind.BF16, torch.bfloat16)
    q = CpuVendor().quantize(torch.randn(10, 128), DispatchDtype.FP8, layout="per-token-group-128")
    assert not qr.quack_fits(q, w, GemmKind.FP8_BLOCK128, torch.bfloat16)


def test_find_quack_says_why_not_before_importing_anything(monkeypatch):
    module, note = qr.find_quack((8, 0))
    assert module is None and "sm80" in note and "sm90" in note
    monkeypatch.setattr(qr.importlib.util, "find_spec", lambda name: None)
    module, note = qr.find_quack((9, 0))
    assert module is None and "not installed" in note and "moe-hal[quack]" in note
    spec = importlib.machinery.ModuleSpec("quack", None)
    monkeypatch.setattr(qr.importlib.util, "find_spec", lambda name: spec)

    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(qr.importlib.metadata, "version", no_distribution)
    module, note = qr.find_quack((9, 0))
    assert module is None and "quack-kernels is not installed" in note
    monkeypatch.setattr(qr.importlib.metadata, "version", lambda name: "0.6.5")
    module, note = qr.find_quack((9, 0))
    assert module is not None and module.version == "0.6.5" and note.startswith("quack-kernels 0.6.5: bf16")


def test_a_quack_build_that_does_not_import_is_a_logged_reason_asked_once(monkeypatch, caplog):
    attempts = []

    def broken(name):
        attempts.append(name)
        raise ImportError("libcute_dsl_runtime.so: cannot open shared object file")

    monkeypatch.setattr(qr.importlib, "import_module", broken)
    quack = qr.Quack("0.6.5")
    with caplog.at_level(logging.WARNING, logger=qr.__name__):
        assert quack.gemm() is None and quack.gemm() is None
    assert attempts == ["quack.gemm_interface"]
    assert "cannot open shared object" in quack.failure and "does not import" in caplog.text


def test_a_table_entry_naming_quack_runs_its_fallback_where_quack_cannot_serve(caplog):
    x, w = torch.randn(10, 64).bfloat16(), _weight()
    fallback = Choice(TRITON, (64, 128, 64, 4, 3, 1))
    choice = Choice(QUACK, fallback=fallback)
    unserved: set = set()
    assert qr.quack_or_fallback(None, None, x, w, GemmKind.BF16, torch.bfloat16, unserved) == (None, None)
    plain = Choice(GROUPED_MM)
    assert qr.quack_or_fallback(None, plain, x, w, GemmKind.BF16, torch.bfloat16, unserved) == (None, plain)
    with caplog.at_level(logging.INFO, logger="vendors.cuda.torch_grouped"):
        got = qr.quack_or_fallback(None, choice, x, w, GemmKind.BF16, torch.bfloat16, unserved)
        again = qr.quack_or_fallback(None, choice, x, w, GemmKind.BF16, torch.bfloat16, unserved)
    assert got == again == (None, fallback)
    records = [r for r in caplog.records if "quack" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO  # not installed: info, once per problem
    assert "running its fallback entry (triton)" in records[0].getMessage()

    found = qr.Quack("0.6.5")
    stand_in = _VarlenGemm()
    found._gemm = stand_in
    gemm, kept = qr.quack_or_fallback(found, choice, x, w, GemmKind.BF16, torch.bfloat16, set())
    assert gemm is stand_in and kept is choice
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vendors.cuda.torch_grouped"):
        gemm, kept = qr.quack_or_fallback(found, choice, x, w, GemmKind.BF16, torch.float32, set())
    assert gemm is None and kept is fallback
    assert [r.levelno for r in caplog.records if "quack" in r.getMessage()] == [logging.WARNING]


def test_tables_keep_quack_entries_with_a_fallback_that_is_always_there(tmp_path):
    entry = Choice(QUACK, us=1371.0, default_us=1551.0, fallback=Choice(GROUPED_MM, us=1551.0))
    table = TuningTable("NVIDIA H200", {"bf16 E=128 K=2048 N=1536 +silu-glu": {131072: entry}}, {"date": "x"})
    path = tmp_path / "t.json"
    table.write(path)
    assert TuningTable.load(path).entries == table.entries
    for bad in (DEEP_GEMM, QUACK):
        data = {
            "format": FORMAT,
            "device": "d",
            "entries": {"k": {"8": {"backend": QUACK, "fallback": {"backend": bad}}}},
        }
        path.write_text(json.dumps(data))
        with pytest.raises(InvalidInput, match="fallback must name a backend that is always there"):
            TuningTable.load(path)
    data = {"format": FORMAT, "device": "d", "entries": {"k": {"8": {"backend": "cute"}}}}
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidInput, match="'quack'"):
        TuningTable.load(path)


def test_a_forced_runner_goes_first_for_its_kinds_with_the_tables_choice_behind_it():
    triton = Choice(TRITON, (64, 128, 64, 4, 3, 1))
    assert forced_choice(None, "bf16", triton) is triton
    assert forced_choice(QUACK, "fp8-block128", triton) is triton  # not a kind quack runs
    assert forced_choice(QUACK, "bf16", None) == Choice(QUACK)
    assert forced_choice(QUACK, "bf16", triton) == Choice(QUACK, fallback=triton)
    assert forced_choice(QUACK, "bf16", Choice(QUACK, fallback=triton)) == Choice(QUACK, fallback=triton)
    assert forced_choice(DEEP_GEMM, "fp8-block128", Choice(DEEP_GEMM)) == Choice(DEEP_GEMM)


@pytest.mark.parametrize(("option", "value"), [("quack", "yes"), ("force_runner", "cute-dsl"), ("force_runner", 1)])
def test_the_cuda_vendor_refuses_bad_runner_options(option, value):
    with pytest.raises(InvalidInput, match=option):
        CudaVendor(**{option: value})


def test_a_quack_call_that_raises_is_remembered_and_its_problem_runs_the_fallback_from_then_on(caplog):
    quack = qr.Quack("0.6.5")
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("cute.compile: no valid tile for this problem")

    quack._gemm = failing
    x, w = torch.randn(12, 64).bfloat16(), _weight()
    counts, choice = torch.tensor([3, 0, 9, 0]), Choice(QUACK, fallback=Choice(GROUPED_MM))
    gemm, kept = qr.quack_or_fallback(quack, choice, x, w, GemmKind.BF16, torch.bfloat16, set())
    assert gemm is failing and kept is choice
    with caplog.at_level(logging.WARNING, logger=qr.__name__):
        assert qr.quack_or_none(quack, gemm, x, w, counts, None) is None
    assert "no valid tile" in caplog.text and len(calls) == 1
    assert qr.quack_or_fallback(quack, choice, x, w, GemmKind.BF16, torch.bfloat16, set()) == (None, choice.fallback)
    other = _weight(k=64, n=96)  # another problem still goes to quack
    assert qr.quack_or_fallback(quack, choice, x, other, GemmKind.BF16, torch.bfloat16, set())[0] is failing
    quack._gemm = _VarlenGemm()
    y = qr.quack_or_none(quack, quack._gemm, x, other, counts, None)
    ref = torch.cat([part @ other.data[e].double() for e, part in enumerate(x.double().split(counts.tolist()))])
    assert ((y.double() - ref).norm() / ref.norm()).item() < 4e-3
