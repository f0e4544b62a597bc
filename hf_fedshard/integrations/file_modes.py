"""Exported weights get the mode the user's umask gives, as every other file of a save does.

safetensors (0.8) writes each file through a private temporary file, so ``model.safetensors`` lands 0600 while
``config.json`` beside it is 0644: a model folder shared with a group, or served as it is, would hide its weights.
Every export of the package (`FedShardMixin.save_model`, the plain-loop recipe) calls `follow_umask` after it.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``): setting it to
    read it back would, for an instant, give files created by other threads (a logger, a writer) the wrong mode."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o077)  # elsewhere: the strictest value while it is read, never a laxer one
    os.umask(umask)
    return umask


def follow_umask(folder: str | os.PathLike, pattern: str = "*.safetensors") -> None:
    """Give the files of ``folder`` matching ``pattern`` the mode a new file gets under this process's umask."""
    mode = 0o666 & ~current_umask()
    for path in Path(folder).glob(pattern):
        path.chmod(mode)
