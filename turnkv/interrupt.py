"""Ctrl-C on the command line ends with one line on stderr, even while torch is still importing.

`turnkv.cli.main` answers an interrupt while a command runs. Before it can, the package and the
command's modules import (torch, a few seconds); an interrupt there would end the process with a
traceback. Their import blocks catch it, call `one_line_on_exit` and re-raise it.
"""

from __future__ import annotations

import os
import sys

MESSAGE = "interrupted"


def is_command_line() -> bool:
    """Whether this process is the `turnkv` command: its console script, or `python -m turnkv` (whose
    argv[0] reads "-m" while the package imports)."""
    return os.path.basename(sys.argv[0]) in ("turnkv", "-m", "__main__.py")


def one_line_on_exit(interrupt: KeyboardInterrupt) -> None:
    """On the command line, have the interpreter print MESSAGE instead of a traceback if `interrupt`
    ends the process (it still dies of SIGINT, so the shell sees status 130). Any other uncaught
    exception is shown as before; a library import is left alone."""
    if not is_command_line():
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if value is interrupt:
            print(MESSAGE, file=sys.stderr, flush=True)
        else:
            previous(kind, value, traceback)

    sys.excepthook = hook
