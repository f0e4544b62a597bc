"""Which checkpoint a federated run resumes from: the newest that verifies, agreed by every rank.

Every rank checks the sizes of the files it will read (the checkpoint's top-level files, the outer state in
``fed_outer/`` whoever wrote it, and its group's folder; on another layout every group's) in every candidate; one
collective tells all
ranks which candidates passed everywhere. The newest of those is then checksummed, each rank hashing its share of
the files (every file some rank reads is hashed by one rank), and one more collective agrees on the result:
a mismatch on any rank makes all ranks move on to the next candidate, together. Candidates with verified damage
are renamed aside (`set_aside`), so a restarted job never tries them again; a checkpoint without a manifest cannot
be verified and is skipped but left in place. An explicit path that does not verify is refused. A candidate of
another format or model (`check_resumable`) is bad input, not damage: every rank refuses it before the first
collective.

Loading the chosen checkpoint (`load_on_every_rank`) ends with one more collective: a file that verified yet cannot
be read (written damaged) is named by the rank that read it, and every rank stops with that message together.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from hf_fedshard.checkpointing.checkpoint import (
    OUTER_DIR,
    CheckpointReadError,
    check_resumable,
    complete_checkpoints,
    group_dir,
    read_layout_record,
    set_aside,
    steps_every_group_has,
)
from hf_fedshard.checkpointing.manifest import MANIFEST_NAME, checksum_problem, read_manifest, size_problem
from hf_fedshard.checkpointing.reshard import changes_layout
from hf_fedshard.errors import ConfigError
from hf_fedshard.topology import FederationLayout

logger = logging.getLogger(__name__)

Problems = dict[int, str]  # rank -> what that rank found wrong with one checkpoint


@dataclass(frozen=True)
class ResumeSettings:
    """What the resume reads of a run's settings (the Trainer's arguments give them; `FedShardMixin.train`)."""

    output_dir: str  # where the run's checkpoints are
    auto_resume: bool  # fed_auto_resume: without an explicit checkpoint, resume from the newest that verifies
    groups_publish_apart: bool  # a launch per group (torchft): only the steps every group has are candidates
    rank: int  # this rank, in its launch
    writes: bool  # this rank renames damaged checkpoints aside (one per launch)


def resumable_checkpoint(
    requested: str | bool | None, run: ResumeSettings, layout: FederationLayout, model: nn.Module
) -> str | bool | None:
    """What ``train()`` resumes from: ``requested`` verified, or for ``True``/``fed_auto_resume`` the newest
    checkpoint of ``output_dir`` that verifies (``None``: start afresh). A collective when there is a candidate.

    Raises `ConfigError` (on every rank) for a checkpoint of another layout or model, an explicit path that does
    not verify, or when no candidate of ``output_dir`` verifies.
    """
    if requested is None and not run.auto_resume:
        return None
    explicit = isinstance(requested, str)
    candidates = [requested] if explicit else complete_checkpoints(run.output_dir)
    common = steps_every_group_has(run.output_dir) if run.groups_publish_apart and not explicit else None
    if common is not None:  # a launch per group: a restart of every group resumes from the newest step they all have
        candidates = [c for c in candidates if int(c.rsplit("-", 1)[-1]) in common]
    if not candidates:
        return requested
    rank = run.rank
    sizes = _gather([_size_problem(c, layout, model, rank) for c in candidates])
    skipped: list[tuple[str, Problems]] = []
    chosen = None
    for index, checkpoint in enumerate(candidates):
        problems = {r: found[index] for r, found in enumerate(sizes) if found[index]}
        if not problems:
            checksums = _gather(_checksum_problem(checkpoint, layout, rank))
            problems = {r: found for r, found in enumerate(checksums) if found}
        if not problems:
            chosen = checkpoint
            break
        skipped.append((checkpoint, problems))
    if explicit and skipped:
        raise ConfigError(f"resume_from_checkpoint={requested} does not verify: {_describe(skipped[0][1])}. "
                          "Resume from another checkpoint (or none).")  # fmt: skip
    _set_aside_damaged(skipped, run.writes)
    if chosen is None:
        listing = "; ".join(f"{os.path.basename(c)}: {_describe(p)}" for c, p in skipped)
        raise ConfigError(
            f"no checkpoint of {run.output_dir} verifies ({listing}). Damaged ones were renamed "
            "damaged-checkpoint-N; start afresh in another output_dir, or repair and rename one back."
        )
    return chosen


def load_on_every_rank(checkpoint: str, load: Callable[[], None]) -> None:
    """Run this rank's part of loading ``checkpoint``, then agree over the world whether every rank succeeded.

    A rank that fails would otherwise leave the others waiting in their next collective for ``ddp_timeout`` and
    blaming it; here each failing rank names its file and every rank raises the same error at once.
    """
    problem = None
    try:
        load()
    except CheckpointReadError as err:
        problem = str(err)
    problems = {rank: found for rank, found in enumerate(_gather(problem)) if found}
    if problems:
        raise RuntimeError(
            f"hf_fedshard: resuming from {checkpoint} failed ({_describe(problems)}) although its files match "
            "manifest.json: it was written damaged. Rename it aside (e.g. damaged-checkpoint-N) and resume from an "
            "earlier checkpoint."
        )


def _gather(found: object) -> list:
    """Every rank's ``found``, in rank order (one collective over the world)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    return everyone


def _shared_files(files: list[str] | dict) -> list[str]:
    """Files that ranks of every group read: the top-level ones and the outer state (group 0 writes it)."""
    return [path for path in files if "/" not in path or path.startswith(OUTER_DIR + "/")]


def _files_read_by(files: list[str] | dict, layout: FederationLayout, rank: int, resharded: bool) -> list[str]:
    """The files ``rank`` reads at resume, shared ones first: the top-level files, the outer state and its group's
    folder; on another layout (``resharded``) every group's folder (the global model and the mean of the moments)."""
    shared = _shared_files(files)
    if resharded:
        return shared + [path for path in files if path not in shared]
    group = os.path.basename(group_dir("", layout.group_index(rank))) + "/"
    return shared + [path for path in files if path.startswith(group)]


def _size_problem(checkpoint: str, layout: FederationLayout, model: nn.Module, rank: int) -> str | None:
    """What is wrong with ``checkpoint`` for this rank (sizes), ``None`` if nothing; `ConfigError` for bad input."""
    try:
        files = read_manifest(checkpoint)
    except ValueError as err:
        return str(err)
    if files is None:
        check_resumable(
            checkpoint, layout, model, federated=True
        )  # refuses what no federated run wrote, or another format
        return f"{MANIFEST_NAME} is missing"
    top_level = [path for path in files if "/" not in path]
    problem = size_problem(checkpoint, files, top_level)
    if problem is None:
        check_resumable(checkpoint, layout, model, federated=True)  # another model is bad input, not damage
        resharded = changes_layout(read_layout_record(checkpoint), layout)
        problem = size_problem(checkpoint, files, _files_read_by(files, layout, rank, resharded))
    return problem


def _checksum_problem(checkpoint: str, layout: FederationLayout, rank: int) -> str | None:
    """Hash this rank's share (`checksum_share`) of ``checkpoint``'s files against its manifest."""
    files = read_manifest(checkpoint)
    resharded = changes_layout(read_layout_record(checkpoint), layout)
    return checksum_problem(checkpoint, files, checksum_share(list(files), layout, rank, resharded))


def checksum_share(files: list[str], layout: FederationLayout, rank: int, resharded: bool) -> list[str]:
    """The files ``rank`` hashes: the shared files (top level, outer state) split among the world, its group's files
    among the group; on another layout (``resharded``: every rank reads every file) all of them split over the world.
    Every file a rank reads is hashed by one rank of those that read it, so a damaged one is seen before loading."""
    if resharded:
        return files[rank :: layout.world_size]
    shared = _shared_files(files)
    own = [path for path in _files_read_by(files, layout, rank, False) if path not in shared]
    group_size = layout.size_of(layout.group_index(rank))
    return shared[rank :: layout.world_size] + own[layout.position(rank) :: group_size]


def _describe(problems: Problems) -> str:
    return "; ".join(f"rank {rank}: {problem}" for rank, problem in sorted(problems.items()))


def _set_aside_damaged(skipped: list[tuple[str, Problems]], is_writer: bool) -> None:
    """Say what was skipped and why; rename aside those with verified damage (those with a manifest)."""
    if not is_writer:
        return
    for checkpoint, problems in skipped:
        damaged = os.path.isfile(os.path.join(checkpoint, MANIFEST_NAME))
        target = set_aside(checkpoint) if damaged else None
        renamed = f"; renamed to {target}" if target else ""
        logger.warning("hf_fedshard: skipping %s (%s)%s", checkpoint, _describe(problems), renamed)
