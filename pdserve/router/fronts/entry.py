"""`pdserve router`'s process: the server, with transformers loaded blind to torch.

The router tokenizes and reads a config; it runs no model. Yet transformers imports torch
whenever torch is installed: about 3 s of CPU at every router start and restart on a 2-core
machine, half of the router's start. transformers decides once, and caches, whether torch can be
found. So this process hides torch while transformers first loads (`sys.modules["torch"] = None`:
`find_spec` then says absent and an import fails) and shows it again at once: transformers stays
as on a machine without torch (tokenizers and configs only, which is all the router asks of it),
and a library that does need torch later (xgrammar, on the first structured-output request)
imports it then.

Only this process entry does it: a router run in a process that also runs models (the tests'
in-process router, the planner) must leave transformers its torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# transformers' one advisory line when it finds no torch: true for it here, misleading in the log.
_QUIET = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault(_QUIET, "1")
    with _torch_hidden():
        from pdserve.router.fronts import server  # transformers' tokenizer and config modules load here
    return server.main(argv)


@contextmanager
def _torch_hidden() -> Iterator[None]:
    if "torch" in sys.modules:  # already imported: nothing to save
        yield
        return
    sys.modules["torch"] = None
    try:
        yield
    finally:
        del sys.modules["torch"]
