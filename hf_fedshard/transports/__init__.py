"""Transports: how federation groups reach each other. Each is one module with one factory, registered in
`TRANSPORTS` by its ``fed_transport`` name; the engine imports none of them (it takes the `FederationCommunicator`
a transport builds, and a transport whose groups come and go adds a `Membership`, `hf_fedshard.engine.rounds`).

- ``mesh``: every group in one job, on one world mesh (`hf_fedshard.transports.mesh.mesh_communicator`).
- ``torchft``: every group its own launch, meeting through a torchft Lighthouse; groups die and heal between
  averagings (`hf_fedshard.transports.elastic.ElasticFederation`).
- ``simulated``: launches as threads on a fake clock, with a fake lighthouse, for testing the round protocol under
  any timing (`hf_fedshard.transports.simulated.SimulatedFederation`); not offered to the Trainer.

A fourth transport is one module whose factory returns a `FederationCommunicator` (and, if its groups come and go,
a `Membership` with a `HealState`), plus its line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Transport:
    """One transport: its name (``fed_transport``), its factory (``module:name``, imported on use, so that an
    optional dependency such as torchft is needed only by whoever picks it), whether each group is a launch of its
    own (``fed_group_id``, a lighthouse) rather than a part of one job, and whether the Trainer offers it."""

    name: str
    factory: str
    launch_per_group: bool
    trainer: bool
    summary: str

    def load(self) -> Any:
        module, name = self.factory.split(":")
        return getattr(importlib.import_module(module), name)


_MESH = Transport("mesh", "hf_fedshard.transports.mesh:mesh_communicator", False, True, "every group in one job.")
_TORCHFT = Transport(
    "torchft", "hf_fedshard.transports.elastic:ElasticFederation", True, True,
    "every group its own launch, averaging with the groups alive (a dead group costs the others nothing).",
)  # fmt: skip
_SIMULATED = Transport(
    "simulated", "hf_fedshard.transports.simulated:SimulatedFederation", True, False,
    "launches as threads on a fake clock (tests of the round protocol).",
)  # fmt: skip
TRANSPORTS: dict[str, Transport] = {t.name: t for t in (_MESH, _TORCHFT, _SIMULATED)}
TRAINER_TRANSPORTS = tuple(name for name, t in TRANSPORTS.items() if t.trainer)
