"""Exported weights get the mode the user's umask gives, as every other file of a save does.

safetensors (0.8) writes each file through a private temporary file, so ``model.safetensors`` lands 0600 while
``config.json`` beside it is 0644: a model folder shared with a group, or served as it is, would hide its weights.
"""

from __future__ import annotations

import os
from pathlib import Path


def follow_umask(folder: str | os.PathLike, pattern: str = "*.safetensors") -> None:
    """Give the files of ``folder`` matching ``pattern`` the mode a new file gets under this process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    for path in Path(folder).glob(pattern):
        path.chmod(0o666 & ~umask)
