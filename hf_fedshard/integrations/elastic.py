"""The Trainer's side of ``fed_transport torchft``: what every group must share, what a joining group is sent, and
how it starts from it.

A group that joins a running federation (a restart, or a new group) heals before its training loop starts: the
first quorum hands it a live peer's state right after an averaging, and the Trainer resumes from it as from a
checkpoint (global step, learning-rate schedule, data position, global model, anchors and outer state), except that
its inner optimizer starts fresh: only the trainer state, ``trainer_state.json``, touches the disk, in a temporary
folder of its own. Between groups of unequal size the same state travels in parts (`peer_parts`, `peer_state_of`),
its tensors copied onto the joining group's own shards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import TYPE_CHECKING

from transformers.trainer import TRAINER_STATE_NAME

from hf_fedshard.checkpointing.checkpoint import model_fingerprint
from hf_fedshard.engine.heal import PeerParts, cut, mend
from hf_fedshard.engine.payload import model_state_addresses, model_state_shapes
from hf_fedshard.transports.elastic import fingerprint

if TYPE_CHECKING:
    from hf_fedshard.integrations.trainer import FedShardMixin

NOT_READY = "not_ready"


def federation_fingerprint(trainer: FedShardMixin) -> str:
    """The settings every group of a torchft federation must share (compared whenever groups meet)."""
    args, layout = trainer.args, trainer.args.fed_launch_layout
    if not args.fed_layout.equal:  # groups of unequal size: every launch names the same list of sizes
        layout = args.fed_layout
    return fingerprint(
        model=model_fingerprint(trainer.model),
        averaging=dataclasses.replace(args.fed_averaging_options, timeout_s=None),  # each group its own timeout
        group=(layout.group_size, layout.shard_size),
        group_batch=args.per_device_train_batch_size * layout.group_sizes[0] * args.gradient_accumulation_steps,
        num_groups=args.fed_num_groups,
        seed=args.seed,
        max_steps=args.max_steps,
    )


def peer_state(trainer: FedShardMixin) -> dict:
    """What this group sends a joining one, right after an averaging (its main thread waits meanwhile)."""
    callback = trainer.fed_callback
    if callback is None or callback.averager is None:
        return {NOT_READY: True}
    return {
        "averager": callback.averager.peer_state(),
        "trainer": dataclasses.asdict(trainer.state),
        "scheduler": trainer.lr_scheduler.state_dict(),
    }


def peer_parts(trainer: FedShardMixin) -> PeerParts:
    """`peer_state` in parts, for a group of another size (`hf_fedshard.engine.heal`): the tensors by address."""
    state = peer_state(trainer)
    if state.get(NOT_READY):
        return PeerParts(state, [], [])
    model = trainer.fed_callback.averager.model
    parts = cut(state["averager"], model_state_shapes(model), model_state_addresses(model))
    return dataclasses.replace(parts, state={**state, "averager": parts.state})


def peer_state_of(parts: PeerParts) -> dict:
    """`peer_parts`' output, received on this rank's own shards, as `peer_state` (the same heal from then on)."""
    if not parts.specs:
        return parts.state
    return {**parts.state, "averager": mend(dataclasses.replace(parts, state=parts.state["averager"]))}


def resume_folder(state: dict) -> str:
    """A temporary folder with the peer's ``trainer_state.json``, for Trainer's resume (global step, data skip)."""
    folder = tempfile.mkdtemp(prefix="hf_fedshard-heal-")
    trainer_state = {**state["trainer"], "stateful_callbacks": {}}
    with open(os.path.join(folder, TRAINER_STATE_NAME), "w") as f:
        json.dump(trainer_state, f)
    return folder
