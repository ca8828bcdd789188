"""Where the repository and the test support files are."""

from pathlib import Path

#: The support folder (helpers and the worker scripts that tests launch).
SUPPORT = Path(__file__).resolve().parent
#: The repository root.
REPO = SUPPORT.parent.parent
