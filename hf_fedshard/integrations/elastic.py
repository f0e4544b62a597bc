"""The Trainer's side of ``fed_transport torchft``: what every group must share, what a joining group is sent, and how
it starts from it.

A group that joins a running federation (a restart, or a new group) heals before its training loop starts: the first
quorum hands it a live peer's state as of that peer's last committed averaging, and the Trainer resumes from it as
from a checkpoint (`hf_fedshard.integrations.resume_source.LivePeer`: global step, learning-rate schedule, data
position, global model, anchors and outer state), except that its inner optimizer starts fresh; nothing touches the
disk. A group that lost a round mid-run takes the same parts through their ``load``. What it is sent is registered
by part (`register_heal_parts`, `hf_fedshard.engine.rounds`), as of the sender's last committed averaging. Between
groups of unequal size the same state travels in parts (`cut_state`), its tensors copied onto the joining group's
own shards.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

from transformers import TrainerState

from hf_fedshard.checkpointing.checkpoint import model_fingerprint
from hf_fedshard.engine.heal import PeerParts, cut
from hf_fedshard.engine.payload import model_state_addresses, model_state_shapes
from hf_fedshard.engine.rounds import HealState
from hf_fedshard.transports.members import fingerprint

if TYPE_CHECKING:
    from hf_fedshard.integrations.trainer import FedShardMixin


def federation_fingerprint(trainer: FedShardMixin) -> str:
    """The settings every group of a torchft federation must share (compared whenever groups meet)."""
    args, layout = trainer.args, trainer.args.fed_launch_layout
    if not args.fed_layout.equal:  # groups of unequal size: every launch names the same list of sizes
        layout = args.fed_layout
    return fingerprint(
        model=model_fingerprint(trainer.model),
        **{  # each setting on its own, so that a refusal names the one that differs; each group its own timeout
            f"fed_{name}": value
            for name, value in dataclasses.asdict(args.fed_averaging_options).items()
            if name != "timeout_s"
        },
        group=(layout.group_size, layout.shard_size),
        group_batch=args.per_device_train_batch_size * layout.group_sizes[0] * args.gradient_accumulation_steps,
        num_groups=args.fed_layout.num_groups,
        seed=args.seed,
        max_steps=args.max_steps,
    )


def register_heal_parts(trainer: FedShardMixin, heal: HealState) -> None:
    """The training loop's parts of what a joining group is sent (the averager registers its own): the trainer
    state (global step, data position) and the learning-rate schedule, each as of the last committed averaging."""
    heal.register("trainer", lambda: trainer_state_now(trainer.state), trainer._check_peer_step)
    heal.register(
        "scheduler",
        lambda: copy.deepcopy(trainer.lr_scheduler.state_dict()),
        lambda state: trainer.lr_scheduler.load_state_dict(state),
    )


def trainer_state_now(state: TrainerState) -> dict:
    """The trainer state's fields, taken at every committed averaging: a shallow copy, with the log history's list
    copied (its entries are not changed once logged), instead of `dataclasses.asdict`'s deep copy, which would copy
    the whole, ever longer, history at every averaging. A heal serializes it when it sends it."""
    fields = {field.name: getattr(state, field.name) for field in dataclasses.fields(state)}
    return {**fields, "log_history": list(state.log_history)}


def cut_state(trainer: FedShardMixin, state: dict) -> PeerParts:
    """A committed state in parts, for a group of another size (`hf_fedshard.engine.heal`): the tensors by address."""
    model = trainer.fed_callback.averager.model
    parts = cut(state["averager"], model_state_shapes(model), model_state_addresses(model))
    return dataclasses.replace(parts, state={**state, "averager": parts.state})
