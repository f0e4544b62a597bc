"""`hf_fedshard.FederatedAverager`: the engine's averager (`hf_fedshard.engine.averager`), given the world mesh of
one job (``FederatedAverager(model, optimizer, mesh)``, the plain loop's form) or any transport's communicator.

It lives above the engine so that the engine imports no transport: the mesh is turned into the one-job transport's
communicator here, through the transports' registry (``fed_transport mesh``, `hf_fedshard.transports`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh

from hf_fedshard.engine.averager import FederatedAverager as EngineAverager
from hf_fedshard.engine.communicator import FederationCommunicator
from hf_fedshard.engine.options import AveragingOptions
from hf_fedshard.engine.rounds import HealState
from hf_fedshard.launch_guard import watch_launcher
from hf_fedshard.topology import FederationLayout
from hf_fedshard.transports import FederationRequest, OneJob, get_transport
from hf_fedshard.transports.mesh import destroy_gloo_groups_at_exit


class FederatedAverager(EngineAverager):
    """`hf_fedshard.engine.averager.FederatedAverager` (its arguments and docs), whose ``communicator`` defaults to
    the one-job transport over ``mesh`` (`FederationLayout.build_mesh`)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: DeviceMesh | None = None, **options: Any
    ) -> None:
        if options.get("communicator") is None and mesh is not None:
            options["communicator"] = functools.partial(_one_job, mesh)
        super().__init__(model, optimizer, mesh, **options)


def _one_job(mesh: DeviceMesh, options: AveragingOptions) -> FederationCommunicator:
    """The one-job transport's communicator over ``mesh``, once the engine checked ``options``."""
    watch_launcher()  # a worker whose torchrun died ends within a second (hf_fedshard.launch_guard)
    destroy_gloo_groups_at_exit()
    layout = FederationLayout.from_mesh(mesh)
    seconds = default_pg_timeout.total_seconds() if options.timeout_s is None else options.timeout_s
    request = FederationRequest(
        settings=OneJob(), layout=layout, launch=layout, group=torch.distributed.group.WORLD, mesh=mesh,
        options=options, timeout_s=seconds, timeout=f"timeout_s={seconds:g}", heal=HealState(),
    )  # fmt: skip
    return get_transport("mesh").build(request).communicator
