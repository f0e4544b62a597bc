"""hf_fedshard's own notices: said once per run, by rank 0, visible at the default log level.

Settings hf_fedshard changed for the user and the figures of the federation (the group batch beside Trainer's
world batch) go through :func:`notice`: a message is logged at WARNING (the level Python and Transformers show by
default) by the process of ``RANK`` 0 only, and only the first time it is said in the process, however many times
the arguments are rebuilt (TRL rebuilds them from ``to_dict()``). Errors are raised on every rank, not noticed.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("hf_fedshard")
_said: set[str] = set()


def notice(message: str, *args: object) -> None:
    """Log ``"hf_fedshard: " + message % args`` once per process, on rank 0 only."""
    text = "hf_fedshard: " + (message % args if args else message)
    if os.environ.get("RANK", "0") != "0" or text in _said:
        return
    _said.add(text)
    logger.warning(text)
