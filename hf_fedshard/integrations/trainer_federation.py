"""Joining the federation (the Trainer's side): the transport's federation built from the arguments, met before
training, and the heal of a group that starts behind the others.

`FederationMixin` reaches a transport only through `hf_fedshard.transports` (its registry and `FederationRequest`).
One of the parts of `hf_fedshard.integrations.trainer.FedShardMixin`.
"""

from __future__ import annotations

import logging

import torch
from transformers import Trainer

from hf_fedshard.checkpointing.averaging_state import read_counters
from hf_fedshard.engine.rounds import HealState
from hf_fedshard.integrations.arguments import FedShardArgumentsMixin
from hf_fedshard.integrations.elastic import cut_state, federation_fingerprint, register_heal_parts, resume_folder
from hf_fedshard.transports import Federation, FederationRequest, get_transport

logger = logging.getLogger(__name__)


def _timeout_setting(args: FedShardArgumentsMixin) -> str:
    """How the limit on a cross-group collective is named in errors."""
    return f"fed_timeout_s={args.fed_timeout_s:g}" if args.fed_timeout_s else "ddp_timeout (fed_timeout_s unset)"


class FederationMixin(Trainer):
    """The transport's federation of this launch, built in `__init__` and met in `train` (a heal at the start)."""

    def _build_federation(self) -> Federation:
        """This launch's side of the federation, from its transport (`hf_fedshard.transports`); where groups come and
        go, it meets the others when `train` joins the first quorum."""
        heal = HealState()
        register_heal_parts(self, heal)
        args = self.args
        request = FederationRequest(
            settings=args.fed_launch, layout=self.fed_layout, launch=args.fed_launch_layout,
            group=torch.distributed.group.WORLD, mesh=self.fed_mesh, options=args.fed_averaging_options,
            timeout_s=args.fed_exchange_timeout_s, timeout=_timeout_setting(args), heal=heal,
            fingerprint=federation_fingerprint(self), cut=lambda state: cut_state(self, state),
        )  # fmt: skip
        return get_transport(args.fed_transport).build(request)

    def _join_federation(self, checkpoint: str | None) -> str | None:
        """Meet the other groups before training (`Federation.join`): where groups come and go, a group behind the
        others resumes from a live peer's committed state (a temporary folder holds its trainer_state.json), one level
        with them from ``checkpoint`` or afresh."""
        syncs = 0
        if checkpoint is not None and self._layout_change is None:  # the averagings this group's checkpoint holds
            syncs = read_counters(checkpoint, self._group_index, self.args.process_index)["syncs"]
        self.fed_federation.join(int(syncs))
        membership = self.fed_communicator.membership
        self._peer_state = (membership.heal.take() or None) if membership is not None else None
        if self._peer_state is None:
            return checkpoint
        folder = resume_folder(self._peer_state)
        if self.args.should_log:
            logger.warning(
                "hf_fedshard: fed_group%d healed from a live group: resuming at step %d (its last averaging) with the "
                "global model, its anchors and outer state; the inner optimizer starts afresh.",
                self.args.fed_launch.group_id, self._peer_state["trainer"]["global_step"],
            )  # fmt: skip
        return folder

    def _check_peer_step(self, trainer_state: dict) -> None:
        """A heal during training (this group lost a round the others committed): the peer's state must be of this
        step (`hf_fedshard.engine.rounds` I4); its averager part then loads it."""
        if trainer_state["global_step"] != self.state.global_step:
            raise RuntimeError(
                f"hf_fedshard: fed_group{self.args.fed_launch.group_id} fell behind the federation by more than one "
                f"averaging: at step {self.state.global_step} it was sent a peer's state of step "
                f"{trainer_state['global_step']}. Restarting the group heals it at its first quorum (torchrun "
                "--max-restarts does it)."
            )
