"""The one exception type for settings a user can get wrong, so scripts can print it as one line."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is wrong; the message names it, its value and the fix."""


def exit_on_config_error(main: Callable[[], T]) -> T:
    """Run a script's ``main``; a `ConfigError` ends it with exit status 2 and one ``error:`` line, printed by the
    first rank only (every rank reads the same settings, so every rank refuses alike; the launcher then adds its own
    summary of the failed ranks)."""
    try:
        return main()
    except ConfigError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
