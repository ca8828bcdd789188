"""Tuned grouped-GEMM configurations per device: the tables `hal tune` writes and the vendor reads.

A table belongs to one device model (its CUDA device name). For each grouped-GEMM problem
(`kind E=experts K=.. N=..`, with ` +silu-glu` where the call applies the experts'
activation) it maps a row count M (tokens x top-k) to the fastest measured choice: a Triton
tile configuration, or `torch._grouped_mm` (bf16 on sm90+); for a problem with the
activation, the Triton kernel with the activation in its epilogue (`triton`; `block_n`
counts the output columns of each half) or without it, the activation then a separate pass
(`triton-then-activation`, `torch-grouped-mm`). A first projection's Triton choice may also say
how it reads the dispatch's rows (`gather`: gathered into a copy first, or read through the row
index inside the GEMM); without it the vendor's built-in rule decides. A
call takes the entry of its problem whose M is nearest on a log scale, if its M lies within
`REACH` times the problem's tuned rows (below the smallest / above the largest); a problem
the table does not hold, or a call outside that reach, takes the built-in defaults. (On the
H100, entries taken 8-32x beyond the largest tuned M made the layer 6-10 % slower than the
built-in choice, whose backend changes with the rows; taken 4x beyond, 4-5 % slower on both
the H100 and the H200, measured 2026-11-23: `git log -p -- docs/performance.md`.) Tables ship in this package
(`vendors/cuda/tuning_tables/<device>.json`, found by device name) or are passed to
`CudaVendor(tuning=...)`.

This module imports neither Triton nor CUDA: `hal caps` reads tables on any machine.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hal import InvalidInput

#: The `format` field every table carries.
FORMAT = "moe-hal cuda grouped-gemm tuning v1"
#: Where the packaged tables live.
PACKAGED = Path(__file__).with_name("tuning_tables")
#: How far (a factor of rows) beyond its tuned rows a problem's entries are used.
REACH = 2
#: The backend names a choice may take (`TRITON_THEN_ACTIVATION` only for a problem with an activation;
#: `DEEP_GEMM` only for fp8 block-128, where DeepGEMM is installed; `QUACK` only for bf16, where quack-kernels is).
TRITON, GROUPED_MM, TRITON_THEN_ACTIVATION = "triton", "torch-grouped-mm", "triton-then-activation"
DEEP_GEMM, QUACK = "deep-gemm", "quack"
#: The optional libraries' backends: a choice of one records the fastest other candidate as its `fallback`.
OPTIONAL = (DEEP_GEMM, QUACK)
#: The GEMM kinds each optional backend runs (what `CudaVendor(force_runner=...)` sends to it).
FORCEABLE = {QUACK: ("bf16",), DEEP_GEMM: ("fp8-block128",)}
_TILED = (TRITON, TRITON_THEN_ACTIVATION)


def device_slug(device_name: str) -> str:
    """The file stem of a device's table: `NVIDIA H100 80GB HBM3` -> `nvidia-h100-80gb-hbm3`."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def problem_key(kind: str, experts: int, k: int, n: int, activation: str | None = None) -> str:
    """The key of one grouped-GEMM problem: `bf16 E=128 K=2048 N=1536` (`... +silu-glu` with the activation)."""
    return f"{kind} E={experts} K={k} N={n}" + (f" +{activation}" if activation else "")


@dataclass(frozen=True)
class Choice:
    """The fastest measured way to run one problem at one row count."""

    backend: str
    tiles: tuple[int, ...] | None = None  #: `TileConfig.as_list()` for the Triton backend
    us: float | None = None  #: its median time when tuned
    default_us: float | None = None  #: the built-in choice's median time in the same run
    #: A first projection's Triton choice: its rows gathered first (True) or read through the index (False);
    #: None: the vendor's built-in rule (`vendors.cuda.ops.gather_in_gemm`).
    gather: bool | None = None
    #: An optional library's choice (`deep-gemm`, `quack`): its stand-in where the library cannot run (absent, or
    #: the call's operands): the choice it replaced in the table (None: the built-in rules).
    fallback: Choice | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON table."""
        out: dict[str, Any] = {"backend": self.backend}
        if self.tiles is not None:
            out["tiles"] = list(self.tiles)
        if self.us is not None:
            out["us"] = round(self.us, 2)
        if self.default_us is not None:
            out["default_us"] = round(self.default_us, 2)
        if self.gather is not None:
            out["gather"] = self.gather
        if self.fallback is not None:
            out["fallback"] = self.fallback.as_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Choice:
        """A choice read from a table, checked (`InvalidInput` naming `where`)."""
        backend = data.get("backend") if isinstance(data, Mapping) else None
        tiles = data.get("tiles") if isinstance(data, Mapping) else None
        if backend in _TILED:
            if not (
                isinstance(tiles, list)
                and len(tiles) in (5, 6, 7, 8)
                and all(isinstance(v, int) for v in tiles)
                and all(v > 0 for v in tiles[:5])
                and (len(tiles) < 7 or tiles[6] > 0)
                and (len(tiles) < 8 or tiles[7] in (0, 1))
            ):
                raise InvalidInput(
                    f"{where}: expected tiles [block_m, block_n, block_k, warps, stages, n_fastest"
                    f"(, group_m(, tma))], got {tiles!r}"
                )
            gather = data.get("gather")
            if gather is not None and not isinstance(gather, bool):
                raise InvalidInput(
                    f"{where}: expected 'gather' true or false (rows gathered first, or read "
                    f"through the row index), got {gather!r}"
                )
            return cls(backend, tuple(tiles), data.get("us"), data.get("default_us"), gather)
        if backend == GROUPED_MM:
            return cls(backend, None, data.get("us"), data.get("default_us"))
        if backend in OPTIONAL:
            fallback = data.get("fallback")
            if fallback is not None:
                fallback = cls.from_dict(fallback, f"{where} fallback")
                if fallback.backend in OPTIONAL:
                    raise InvalidInput(
                        f"{where}: a {backend} choice's fallback must name a backend that is always there "
                        f"({TRITON!r}, {TRITON_THEN_ACTIVATION!r} or {GROUPED_MM!r}), got {fallback.backend!r}"
                    )
            return cls(backend, None, data.get("us"), data.get("default_us"), None, fallback)
        raise InvalidInput(
            f"{where}: expected backend {TRITON!r}, {TRITON_THEN_ACTIVATION!r}, {GROUPED_MM!r}, {DEEP_GEMM!r} or "
            f"{QUACK!r}, got {backend!r}"
        )


def forced_choice(forced: str | None, kind: str, choice: Choice | None) -> Choice | None:
    """`choice` (a table's, or None) with the `forced` optional backend put first for the kinds it runs
    (`FORCEABLE`): the table's choice becomes its fallback (an optional backend's own fallback, if it names one)."""
    if forced is None or kind not in FORCEABLE.get(forced, ()):
        return choice
    if choice is not None and choice.backend in OPTIONAL:
        choice = choice.fallback
    return Choice(forced, fallback=choice)


@dataclass
class TuningTable:
    """One device's tuned choices: problem key -> {rows M -> Choice}."""

    device: str
    entries: dict[str, dict[int, Choice]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  #: torch / Triton versions, date
    source: str = "measured in this process"  #: where it was read from

    def lookup(
        self, kind: str, experts: int, k: int, n: int, rows: int, activation: str | None = None
    ) -> Choice | None:
        """The choice for a call: its problem's entry whose M is nearest to `rows` (log scale), or None
        (the problem is not in the table, or `rows` lies more than `REACH` times outside its tuned rows)."""
        by_rows = self.entries.get(problem_key(kind, experts, k, n, activation))
        if not by_rows or not (min(by_rows) <= REACH * rows and rows <= REACH * max(by_rows)):
            return None
        target = math.log2(max(rows, 1))
        return by_rows[min(by_rows, key=lambda m: (abs(math.log2(m) - target), m))]

    def lookup_activated(self, kind: str, experts: int, k: int, n: int, rows: int, activation: str) -> Choice | None:
        """The choice for a call that applies `activation`: its `+activation` entry, else the plain product's
        entry run as tables tuned before such entries ran it (a Triton entry becomes `triton-then-activation`;
        `torch-grouped-mm` is followed by the activation pass anyway), else None."""
        choice = self.lookup(kind, experts, k, n, rows, activation)
        if choice is not None:
            return choice
        choice = self.lookup(kind, experts, k, n, rows)
        if choice is not None and choice.backend == TRITON:
            return Choice(TRITON_THEN_ACTIVATION, choice.tiles, choice.us, choice.default_us)
        return choice

    def describe(self) -> str:
        """One line for `hal caps`: where the table is from and what it holds."""
        tuned = ", ".join(f"{k}={v}" for k, v in self.meta.items() if k in ("date", "torch", "triton"))
        count = sum(len(v) for v in self.entries.values())
        return (
            f"tuned table for {self.device} ({self.source}; {len(self.entries)} problems, {count} entries"
            + (f"; tuned with {tuned}" if tuned else "")
            + ")"
        )

    def as_dict(self) -> dict[str, Any]:
        """The JSON form `load` reads."""
        return {
            "format": FORMAT,
            "device": self.device,
            **self.meta,
            "entries": {
                key: {str(m): c.as_dict() for m, c in sorted(by_rows.items())}
                for key, by_rows in sorted(self.entries.items())
            },
        }

    def write(self, path: Path) -> None:
        """Write the table as JSON."""
        path.write_text(json.dumps(self.as_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path | str) -> TuningTable:
        """A table from its JSON file; `InvalidInput` naming the file for anything malformed."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"tuning table {str(path)!r}: cannot be read as JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("device"), str):
            raise InvalidInput(
                f"tuning table {str(path)!r}: expected a JSON object with format {FORMAT!r} and a device name"
            )
        entries: dict[str, dict[int, Choice]] = {}
        raw = data.get("entries")
        if not isinstance(raw, dict):
            raise InvalidInput(f"tuning table {str(path)!r}: expected an 'entries' object")
        for key, by_rows in raw.items():
            if not isinstance(by_rows, dict) or not all(str(m).isdigit() and int(m) > 0 for m in by_rows):
                raise InvalidInput(f"tuning table {str(path)!r}: entry {key!r} must map positive row counts to choices")
            entries[key] = {
                int(m): Choice.from_dict(c, f"tuning table {path.name} {key} M={m}") for m, c in by_rows.items()
            }
        meta = {k: v for k, v in data.items() if k not in ("format", "device", "entries")}
        return cls(data["device"], entries, meta, source=str(path))

    @classmethod
    def packaged(cls, device_name: str) -> TuningTable | None:
        """The table shipped in this package for `device_name`, if there is one."""
        path = PACKAGED / f"{device_slug(device_name)}.json"
        return cls.load(path) if path.is_file() else None


def packaged_devices() -> list[str]:
    """The device slugs this package ships tables for."""
    return sorted(p.stem for p in PACKAGED.glob("*.json"))
