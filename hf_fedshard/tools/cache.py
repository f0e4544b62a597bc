"""A machine's cache of things built once and reused (prepared data, the converted real model): each folder is
published whole and checked, or not at all.

A folder is written into a staging folder beside it, checked, and renamed into place (`publish`): a crash, a
concurrent run or a writer that silently wrote nothing never leaves a half folder under the final name. A folder
found broken later (a disk that filled, a folder copied in part, a run of an older version) is reported in one line,
moved aside and built again (`build_once`), instead of failing every later run until the user deletes it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hf_fedshard.integrations.file_modes import current_umask

logger = logging.getLogger("hf_fedshard")

Check = Callable[[Path], str | None]  # what is wrong with a folder, or None when it is whole


def cache_home() -> Path:
    """hf_fedshard's cache: ``$HF_FEDSHARD_CACHE`` or ``~/.cache/hf_fedshard`` (a machine's own disk)."""
    return Path(os.environ.get("HF_FEDSHARD_CACHE", Path.home() / ".cache" / "hf_fedshard"))


def publish(folder: Path, write: Callable[[Path], None], check: Check) -> None:
    """Create ``folder`` whole or not at all: ``write`` fills a staging folder beside it, ``check`` must find nothing
    wrong with it, and it is renamed into place. A check that fails raises (naming what is wrong) and leaves nothing."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        write(staging)
        staging.chmod(0o777 & ~current_umask())  # mkdtemp's 0700 would hide the folder from the machine's other users
        problem = check(staging)
        if problem is not None:
            raise RuntimeError(f"hf_fedshard: building {folder.name} wrote an incomplete folder: {problem}")
        staging.rename(folder)
    except OSError:  # another run with the same key published it first: use theirs
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_once(folder: Path, write: Callable[[Path], None], check: Check, what: str) -> None:
    """Make sure ``folder`` holds a whole ``what``: keep it if ``check`` finds nothing wrong, else move a broken one
    aside (one line says where) and publish it anew. Callers hold a lock or run on one process per machine."""
    problem = check(folder) if folder.is_dir() else "missing"
    if problem is None:
        return
    if problem != "missing":
        aside = folder.with_name(f"{folder.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        try:
            folder.rename(aside)
        except FileNotFoundError:  # a concurrent run moved it first
            pass
        else:
            logger.warning(
                "hf_fedshard: the cached %s in %s is broken (%s): moved it to %s and building it again",
                what, folder, problem, aside,
            )  # fmt: skip
    publish(folder, write, check)
