"""`python -m hal`: the `hal` command without its console script."""

from hal.cli import main

raise SystemExit(main())
