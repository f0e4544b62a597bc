"""Joining the federation (the Trainer's side): the transport's federation built from the arguments, met before
training, where a group that starts behind the others takes a live peer's state as its resume source
(`hf_fedshard.integrations.resume_source.LivePeer`).

`FederationMixin` reaches a transport only through `hf_fedshard.transports` (its registry and `FederationRequest`).
One of the parts of `hf_fedshard.integrations.trainer.FedShardMixin`.
"""

from __future__ import annotations

import logging

import torch
from transformers import Trainer

from hf_fedshard.engine.rounds import HealState
from hf_fedshard.integrations.arguments import FedShardArgumentsMixin
from hf_fedshard.integrations.elastic import cut_state, federation_fingerprint, register_heal_parts
from hf_fedshard.integrations.resume_source import LivePeer, ResumeSource
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

    def _join_federation(self, source: ResumeSource | None) -> ResumeSource | None:
        """Meet the other groups before training (`Federation.join`): where groups come and go, a group behind the
        others starts from a live peer's committed state instead of ``source`` (a checkpoint, or ``None``: afresh)."""
        self.fed_federation.join(source.averagings if source is not None else 0)
        membership = self.fed_communicator.membership
        peer = membership.heal.take() if membership is not None else {}
        return LivePeer(peer, self.args.fed_launch.group_id, self.args.gradient_accumulation_steps) if peer else source

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
