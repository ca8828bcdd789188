"""`python -m conformance.ep`: one rank of the expert-parallel section (see `conformance.ep.run`)."""

import sys

from conformance.ep.run import main

sys.exit(main())
