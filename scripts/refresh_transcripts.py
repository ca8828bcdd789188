"""Rewrite the command transcripts in README.md and docs/*.md from what the commands print now.

A transcript is a fenced block right after the marker line `<!-- transcript -->`; its lines that start
with `$ ` are the commands (run in order by one bash in the repository root, stderr folded into stdout,
so `echo $?` sees the previous command), and every other line is their output, replaced on each run.
Only cheap, deterministic commands belong in transcripts (declared tables, plans, refusals); figures of
expensive or timed runs are stated in the prose without numbers that change from run to run.

    python scripts/refresh_transcripts.py           # rewrite the files
    python scripts/refresh_transcripts.py --check   # exit 1 and show the difference if any is stale
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER = "<!-- transcript -->"
_BLOCK = re.compile(r"^<!-- transcript -->\n```(\w*)\n(.*?)^```$", re.S | re.M)
_SEPARATOR = "@@transcript-command@@"


def documents() -> list[Path]:
    """The files that may hold transcripts."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def run(commands: list[str]) -> list[str]:
    """The output of each command, run in order by one bash in the repository root."""
    # `(exit $s)` hands each command the previous one's status (for `echo $?`); the braces end a trailing comment
    script = "s=0\n" + "".join(
        f"echo {_SEPARATOR}\n(exit $s)\n{{ {command[2:]}\n}} 2>&1\ns=$?\n" for command in commands
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}  # no setting of the caller's
    env.update(COLUMNS="120", NO_COLOR="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    parts = done.stdout.split(_SEPARATOR + "\n")[1:]
    if len(parts) != len(commands):
        raise SystemExit(f"transcript commands ended early ({done.stderr.strip()}): {commands}")
    return [part.rstrip("\n") for part in parts]


def refresh(text: str) -> str:
    """`text` with every transcript block regenerated."""

    def block(match: re.Match[str]) -> str:
        commands = [line for line in match.group(2).splitlines() if line.startswith("$ ")]
        original = match.group(2).splitlines()
        spaced = {line for before, line in zip([""] + original, original) if line.startswith("$ ") and not before}
        lines: list[str] = []
        for command, output in zip(commands, run(commands)):
            lines += [""] if lines and command in spaced else []  # keep the block's blank lines between commands
            lines += [command, *(line.rstrip() for line in output.splitlines())]
        return f"{MARKER}\n```{match.group(1)}\n" + "\n".join(lines) + "\n```"

    return _BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    """Rewrite, or with `--check` compare; exit status 1 when a transcript is stale."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a transcript is stale")
    args = parser.parse_args(argv)
    stale = 0
    for path in documents():
        text = path.read_text(encoding="utf-8")
        if MARKER not in text:
            continue
        fresh = refresh(text)
        if fresh == text:
            continue
        stale += 1
        name = str(path.relative_to(REPO))
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), fresh.splitlines(True), name, name))
        else:
            path.write_text(fresh, encoding="utf-8")
            print(f"refreshed {name}")
    if args.check and stale:
        print(f"{stale} file(s) with stale transcripts: python scripts/refresh_transcripts.py rewrites them")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
