"""`python -m pdserve.bench.serve`: the same as `pdserve bench serve`."""

import sys

from pdserve.bench.serve.cli import main

sys.exit(main())
