"""What a transport is given and what it gives back: `FederationRequest` → `Federation`.

One signature for every transport, so the Trainer, TRL, resume and the plain loop's `FederatedAverager` build any
of them the same way (`hf_fedshard.transports.Transport.build`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from hf_fedshard.engine.communicator import FederationCommunicator
from hf_fedshard.engine.heal import PeerParts
from hf_fedshard.engine.options import AveragingOptions
from hf_fedshard.engine.rounds import HealState
from hf_fedshard.topology import FederationLayout
from hf_fedshard.transports.launches import GroupLaunch, OneJob


@dataclass(frozen=True)
class FederationRequest:
    """Everything a transport's factory may use to build this launch's side of a federation.

    Attributes:
        settings: the transport's own settings (its registered dataclass), parsed and checked.
        layout: the whole federation (every group, of every launch).
        launch: this launch's ranks (the whole federation in one job; one group of a launch per group).
        group: this launch's process group (its world), ``None`` before `torch.distributed` is up.
        mesh: this launch's world mesh (`FederationLayout.build_mesh`: ``fed``, ``dp_replicate``, ``dp_shard``).
        options: the averaging settings (`AveragingOptions`), checked.
        timeout_s: seconds a cross-group collective, a quorum or a heal may wait.
        timeout: how that limit is named in errors (``fed_timeout_s=30``).
        heal: the parts of this launch's state a joining group is sent, and where a heal's parts are put
            (`hf_fedshard.engine.rounds.HealState`); the loop and the averager register theirs.
        fingerprint: the settings every group must share, for transports whose separate launches meet.
        cut: the committed heal state in parts, for a group of another size (`hf_fedshard.engine.heal`).
    """

    settings: OneJob | GroupLaunch
    layout: FederationLayout
    launch: FederationLayout
    group: ProcessGroup | None
    mesh: DeviceMesh | None
    options: AveragingOptions
    timeout_s: float
    timeout: str
    heal: HealState
    fingerprint: str = ""
    cut: Callable[[dict], PeerParts] | None = None


class Federation(Protocol):
    """This launch's side of a federation, as a transport builds it."""

    communicator: FederationCommunicator
    """The engine's cross-group collectives (with a `Membership` where groups come and go)."""

    def join(self, averagings: int) -> Any:
        """Meet the other groups before training, this launch having committed ``averagings`` (a checkpoint's
        count; 0 afresh). A launch behind the others heals there: its parts land in the request's ``heal``."""

    def shutdown(self) -> None:
        """Leave the federation (at the end of training, or on an error); the others go on."""
