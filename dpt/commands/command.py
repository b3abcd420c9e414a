"""How dpt's tools end (`dpt-predict`, `dpt-generate`, `dpt-tokenizer`, `dpt-shards`): bad input
and failures as one line on stderr with exit code 1, never a traceback; Ctrl-C with 130; a closed
pipe (`dpt-generate ... | head`) quietly."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from dpt.errors import DptError, one_line


def run_command(body: Callable[[], None], also: tuple[type[BaseException], ...] = ()) -> None:
    """Run a command's body; `also`: errors of other kinds it reports as one line too (the
    shard writer's OSErrors)."""
    try:
        body()
    except (DptError, *also) as error:
        print(f"Error: {one_line(error)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # the reader has what it wanted
        _silence_stdout()
        sys.exit(1)


def _silence_stdout() -> None:
    # Python flushes stdout at exit, which would raise again into the closed pipe.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
