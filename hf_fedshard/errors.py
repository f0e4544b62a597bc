"""The one exception type for settings a user can get wrong, so scripts can print it as one line."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

RANK_0_GRACE_S = 30.0  # how long another rank leaves rank 0 to report the error they both raised before any collective


class ConfigError(ValueError):
    """A setting is wrong; the message names it, its value and the fix."""


def exit_on_config_error(main: Callable[[], T]) -> T:
    """Run a script's ``main``; a `ConfigError` ends it with one ``error:`` line and exit status 2.

    Under a launcher the line is said once: a refusal is raised on every rank alike (before the process group exists
    every rank parsed the same command line; after it, a check reads the same files and settings before any
    collective), so rank 0 says it and the launcher stops the others (see `_leave_to_rank_0`). Saying it on every
    rank printed one line per rank, and the first rank to exit had torchrun stop the others, rank 0 included,
    possibly before they had printed theirs.
    """
    try:
        return main()
    except ConfigError as err:
        if _rank() != 0:
            _leave_to_rank_0()
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _leave_to_rank_0() -> None:
    """Wait for the launcher to stop this rank once rank 0 has failed, and then exit 0 without a word.

    torchrun (and `accelerate launch`, which runs it) lists in its failure report every rank that ended on an
    error or a signal: a quiet exit 0 on its SIGTERM leaves rank 0's error the only one there. Exiting 2 at once
    instead races rank 0: the first rank to fail makes torchrun SIGTERM the rest, rank 0 included, possibly before
    it has printed the line (seen here: rank 2 failed first and rank 0 ended on the signal). Should rank 0 not
    fail (an error of this rank alone, e.g. a file missing on its node), this rank says its error itself after
    `RANK_0_GRACE_S`.

    The exit is ``os._exit``: under ``python -m hf_fedshard.launch`` a worker is torchrun's ``--run-path`` function,
    whose ``record`` wrapper turns ``SystemExit(0)`` into a return value; the worker then waited for the launcher to
    read it, which a launcher stopping its workers never does, until SIGKILL 30 s later (every refused launch took
    30 s more than under torchrun). Nothing here is left to flush or clean up.
    """
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    time.sleep(RANK_0_GRACE_S)
