"""Checkpoint manifests: every file of a published checkpoint with its size and SHA-256.

A federated checkpoint is complete only if every file its ``manifest.json`` lists is present with the recorded
size and checksum. The manifest is written last, inside the staging folder, so every published ``checkpoint-N/``
holds one. Sizes are cheap to verify (a ``stat`` per file); checksums need the bytes, so a resume verifies them
only for the checkpoint it is about to load, each rank hashing its share of the files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

MANIFEST_NAME = "manifest.json"
_CHUNK_BYTES = 4 * 2**20


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def list_files(root: str, skip: str | None = None) -> list[str]:
    """Every file under ``root`` (but the manifest, and those in its folder ``skip``), as sorted ``/``-separated
    relative paths."""
    paths = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
            if path != MANIFEST_NAME and (skip is None or not path.startswith(skip + "/")):
                paths.append(path)
    return sorted(paths)


def describe_files(root: str, paths: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{path: {"bytes": size, "sha256": digest}}`` for the given files under ``root``."""
    described = {}
    for path in paths:
        full = os.path.join(root, path)
        described[path] = {"bytes": os.path.getsize(full), "sha256": sha256_of(full)}
    return described


def write_manifest(checkpoint: str, is_writer: bool) -> None:
    """Record every file of ``checkpoint``; a collective over the world, called once all ranks wrote their files.

    Rank 0 lists the files, every rank hashes a share of them, ``is_writer`` writes the manifest.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    listing = [list_files(checkpoint) if rank == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    parts: list[dict[str, dict[str, Any]] | None] = [None] * world
    dist.all_gather_object(parts, describe_files(checkpoint, listing[0][rank::world]))
    if is_writer:
        write_manifest_entries(checkpoint, {path: entry for part in parts for path, entry in part.items()})


def describe_share(checkpoint: str, rank: int, world: int, skip: str | None = None) -> dict[str, dict[str, Any]]:
    """Rank ``rank``'s share of ``checkpoint``'s files described (every ``world``-th of the sorted listing), once no
    file changes any more: how a background save's ranks spread the hashing without a collective."""
    return describe_files(checkpoint, list_files(checkpoint, skip)[rank::world])


def write_manifest_entries(checkpoint: str, files: dict[str, dict[str, Any]]) -> None:
    """The manifest of ``checkpoint`` from its files' entries, described by the ranks (`write_manifest`'s shares, or
    each background thread's `describe_share`)."""
    with open(os.path.join(checkpoint, MANIFEST_NAME), "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)


def read_manifest(checkpoint: str) -> dict[str, dict[str, Any]] | None:
    """The manifest's files, ``None`` when the checkpoint has no manifest; ``ValueError`` when it is unreadable."""
    path = os.path.join(checkpoint, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{MANIFEST_NAME} is unreadable ({err})") from None


def size_problem(checkpoint: str, files: dict[str, dict[str, Any]], paths: Iterable[str]) -> str | None:
    """The first of ``paths`` that is missing or not of its recorded size, said in words; ``None`` if all are."""
    for path in paths:
        full = os.path.join(checkpoint, path)
        if not os.path.isfile(full):
            return f"{path} is missing"
        size, recorded = os.path.getsize(full), files[path]["bytes"]
        if size != recorded:
            return f"{path} has {size:,} bytes, the manifest says {recorded:,}"
    return None


def checksum_problem(checkpoint: str, files: dict[str, dict[str, Any]], paths: Iterable[str]) -> str | None:
    """The first of ``paths`` whose content does not match its recorded SHA-256 (or cannot be read)."""
    for path in paths:
        try:
            digest = sha256_of(os.path.join(checkpoint, path))
        except OSError as err:
            return f"{path} cannot be read ({err})"
        recorded = files[path]["sha256"]
        if digest != recorded:
            return f"{path} does not match its checksum (sha256 {digest[:12]}…, the manifest says {recorded[:12]}…)"
    return None
