"""How a pdserve process that will not run as configured says so: one line, and an exit code
that tells a supervisor whether starting it again could help.

Owns `Refused` (the exception whose message is that whole line) and the exit codes of a
refusal. The processes raise it at start (a model folder that cannot be served, a node whose
facts the router refuses) and their `main` prints it and exits with `exit_code`; the local
cluster launcher never restarts a child that exited with one of `FINAL_EXIT_CODES`, since the
same command line would be refused again.

Must never: print, log or exit itself; that is each command's `main`.
"""

from __future__ import annotations

EXIT_USAGE = 2  # the command line is wrong as given (a flag's value): argparse's code for usage errors
EXIT_REFUSED = 78  # sysexits' EX_CONFIG: the router refused this node's configuration
FINAL_EXIT_CODES = (EXIT_USAGE, EXIT_REFUSED)


class Refused(Exception):
    """This process will not run as configured. `cli_message()` is the one line its command
    prints; `exit_code` is one of `FINAL_EXIT_CODES`."""

    exit_code = EXIT_USAGE

    def cli_message(self) -> str:
        return str(self)
