"""The one exception type for settings a user can get wrong, so scripts can print it as one line."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is wrong; the message names it, its value and the fix."""


def exit_on_config_error(main: Callable[[], T]) -> T:
    """Run a script's ``main``; a `ConfigError` ends it with one ``error:`` line and exit status 2."""
    try:
        return main()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
