"""Merging a fresh `hal tune` table into an earlier one of the same device (`hal tune --merge`).

Tuning is slow and done in pieces (one device lease for the small batches, another for the
largest); a merge keeps what was tuned before. Tables are the vendor's own JSON, but every
table `hal tune` writes has a `device`, a `format` and `entries` (problem -> row count ->
choice): those are what a merge relies on. Entries tuned now replace the earlier ones of the
same problem and row count; all others are kept. The earlier table's provenance (date,
versions, note, and its own history) is kept under `history`, and its other fields (notes on
entries the merge keeps) stay at the top level unless the fresh table sets them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hal import InvalidInput

#: Top-level fields of a table that describe how it was tuned (kept in the history of a merge).
PROVENANCE = ("date", "torch", "triton", "reps", "timing", "note")
#: The fields a merge builds itself; every other field of the earlier table is kept.
_STRUCTURE = ("device", "format", "entries", "history")


def read_table(path: Path) -> dict[str, Any]:
    """The table in `path`, checked to be mergeable (`InvalidInput` naming the file otherwise)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"--merge: {str(path)!r} cannot be read as a JSON tuning table ({exc})") from None
    if not (
        isinstance(data, dict)
        and isinstance(data.get("device"), str)
        and isinstance(data.get("format"), str)
        and isinstance(data.get("entries"), dict)
        and all(isinstance(rows, dict) for rows in data["entries"].values())
    ):
        raise InvalidInput(
            f"--merge: {str(path)!r} is not a tuning table (expected a JSON object with 'device', "
            "'format' and 'entries' of problem -> row count -> choice)"
        )
    return data


def check_device(earlier: Mapping[str, Any], device_name: str, path: Path) -> None:
    """Refuse to merge a table tuned on another device model (before any tuning time is spent)."""
    if earlier["device"] != device_name:
        raise InvalidInput(
            f"--merge: {str(path)!r} was tuned on {earlier['device']!r}; this device is "
            f"{device_name!r} (tables are per device model)"
        )


def merge_tables(earlier: Mapping[str, Any], fresh: Mapping[str, Any]) -> dict[str, Any]:
    """`fresh` with the entries of `earlier` it did not tune again, and `earlier`'s provenance in `history`.

    Raises `InvalidInput` when the two tables differ in device or format.
    """
    for field in ("device", "format"):
        if earlier.get(field) != fresh.get(field):
            raise InvalidInput(
                f"--merge: the earlier table's {field} is {earlier.get(field)!r}, the new one's "
                f"{fresh.get(field)!r}; they cannot be merged"
            )
    entries: dict[str, dict[str, Any]] = {}
    for key in sorted(set(earlier["entries"]) | set(fresh.get("entries", {}))):
        rows = {**earlier["entries"].get(key, {}), **fresh.get("entries", {}).get(key, {})}
        entries[key] = dict(sorted(rows.items(), key=lambda item: int(item[0])))
    earlier_run = {k: earlier[k] for k in PROVENANCE if k in earlier}
    history = [*earlier.get("history", []), earlier_run]
    # other fields (e.g. notes on entries the merge keeps) stay where the fresh table does not set them
    kept = {k: v for k, v in earlier.items() if k not in (*_STRUCTURE, *PROVENANCE) and k not in fresh}
    top = {k: v for k, v in fresh.items() if k != "entries"}
    return {**top, **kept, "history": history, "entries": entries}


def has_entries(table: object) -> bool:
    """Whether `table` has the `entries` (problem -> row count -> choice) that joins and merges rely on."""
    return (
        isinstance(table, Mapping)
        and isinstance(table.get("entries"), Mapping)
        and all(isinstance(rows, Mapping) for rows in table["entries"].values())
    )


def join_runs(table: Mapping[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    """`table` with the entries of `part` added: two pieces of one run (`hal tune` tunes one case per call).
    `table`'s provenance is kept. Raises `InvalidInput` when the pieces differ in device or format, or are not
    tables with entries."""
    for piece in (table, part):
        if not has_entries(piece):
            raise InvalidInput(
                "hal tune: the vendor's table has no 'entries' (problem -> row count -> choice), so the "
                "cases of a run cannot be joined"
            )
    for field in ("device", "format"):
        if table.get(field) != part.get(field):
            raise InvalidInput(
                f"hal tune: one case's table has {field} {part.get(field)!r}, an earlier one's {table.get(field)!r}"
            )
    entries = {key: dict(rows) for key, rows in table["entries"].items()}
    for key, rows in part["entries"].items():
        entries[key] = dict(sorted({**entries.get(key, {}), **rows}.items(), key=lambda item: int(item[0])))
    return {**table, "entries": entries}
