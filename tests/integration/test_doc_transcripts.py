"""The command transcripts in README.md and docs/ are what the commands print now
(`scripts/refresh_transcripts.py` regenerates them; this compares)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "refresh_transcripts.py"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("refresh_transcripts", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_a_transcript_block_is_rewritten_from_its_commands_and_nothing_else_is():
    text = (
        "prose\n<!-- transcript -->\n```text\n$ echo fresh; false\nstale output\n$ echo $?\n0\n\n$ echo two\n```\n"
        "```text\n$ echo untouched\nold\n```\n"
    )
    assert _script().refresh(text) == (
        "prose\n<!-- transcript -->\n```text\n$ echo fresh; false\nfresh\n$ echo $?\n1\n\n$ echo two\ntwo\n```\n"
        "```text\n$ echo untouched\nold\n```\n"
    )


@pytest.mark.slow
def test_the_documents_transcripts_are_current():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=900, cwd=REPO
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
