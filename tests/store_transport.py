"""A transport written outside the package, the worked example of the README's "How it is built": every group its own
launch, meeting at a `TCPStore` that one process hosts (here the test; on a cluster, any host every group reaches).
Importing this module registers it as ``fed_transport store`` through the public `register_transport`; nothing under
``hf_fedshard/`` names it.

Its membership is fixed: `join` waits for every one of ``num_groups`` groups (each names its fingerprint, and a
group whose settings differ is refused); every averaging is a round of `hf_fedshard.engine.rounds` whose vote goes
through the store (`commit`), over the same quorum each time; a dead group stops the others at their next collective,
as in one job. (Torchft's membership forms quorums of the groups alive and heals the ones behind.) Groups of equal
size only.

Use: ``import store_transport`` in the training script, then ``--fed_transport store --fed_transport_options
'{"group_id": 0, "num_groups": 2, "store": "HOST:PORT"}'``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

from hf_fedshard.engine import FederationCommunicator
from hf_fedshard.engine.communicator import GroupThenPeers, Round
from hf_fedshard.errors import ConfigError
from hf_fedshard.transports import FederationRequest, GroupLaunch, register_transport


@dataclass(frozen=True)
class StoreSettings(GroupLaunch):
    """A launch per group (``group_id`` of ``num_groups``), meeting at the TCPStore at ``store`` (``HOST:PORT``)."""

    store: str


class GlooPeers:
    """A `Communicator` over a gloo process group of its own (not torch.distributed's world): this rank's peers, one
    per group, ranked by group id."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size
        self.pg: dist.ProcessGroupGloo | None = None  # set up by `StoreFederation.join`, once the groups agree

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        self.pg.allreduce([tensor], opts).wait()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.pg.alltoall_base(output, input, [], [], AllToAllOptions()).wait()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.pg.allgather([list(output.chunk(self.size()))], [input], AllgatherOptions()).wait()


class StoreFederation:
    """This launch's side: a gloo group per shard position across the groups, set up through the store."""

    def __init__(self, request: FederationRequest) -> None:
        settings: StoreSettings = request.settings
        if not request.layout.equal:
            raise ConfigError("fed_transport store averages groups of equal size only. Drop the fed_group_size list.")
        host, port = settings.store.rsplit(":", 1)
        timeout = timedelta(seconds=request.timeout_s)
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        self.group_id, self.num_groups, self.fingerprint = settings.group_id, settings.num_groups, request.fingerprint
        self.position = dist.get_rank(request.group)  # this rank's place in its group: its peers share it
        self.timeout, self.peers = timeout, GlooPeers(self.group_id, self.num_groups)
        self.heal, self.votes = request.heal, 0
        self.communicator = FederationCommunicator(
            peers=self.peers, control=GroupThenPeers(request.group, self.peers),
            hsdp_replicas=request.launch.replicas, timeout=request.timeout, membership=self,
        )  # fmt: skip

    def join(self, averagings: int) -> None:
        """Every group present, with the same settings and averaging count (their fingerprints through the store);
        then the peers' process group (its set-up is the first collective)."""
        self.store.set(f"member{self.group_id}/{self.position}", json.dumps([self.fingerprint, averagings]))
        keys = [f"member{g}/{self.position}" for g in range(self.num_groups)]
        self.store.wait(keys)
        members = [json.loads(self.store.get(key)) for key in keys]
        differ = [g for g, member in enumerate(members) if member != members[self.group_id]]
        if differ:
            raise ConfigError(
                f"fed_transport store: fed_group{self.group_id} met group(s) {differ} with other settings or another "
                "averaging count. Launch every group with the same settings, from the same checkpoint step."
            )
        peers_store = dist.PrefixStore(f"peers{self.position}", self.store)
        self.peers.pg = dist.ProcessGroupGloo(peers_store, self.peers.rank(), self.peers.size(), self.timeout)

    # ---- Membership (`hf_fedshard.engine.communicator`): a round commits when every group voted for it ----

    def commit(self) -> bool:
        """This rank's collectives succeeded (a failed one raised): vote, and wait for its peers' votes."""
        self.votes += 1
        self.store.set(f"vote{self.votes}/{self.group_id}/{self.position}", "yes")
        keys = [f"vote{self.votes}/{g}/{self.position}" for g in range(self.num_groups)]
        self.store.wait(keys)
        return all(self.store.get(key) == b"yes" for key in keys)

    def next_round(self) -> Round:
        return Round(healed=False, changed=False)  # the same quorum: every group, none behind

    def metrics(self) -> dict[str, float]:
        return {"fed_groups_in_quorum": self.num_groups}

    def dropped_groups(self) -> list[int]:
        return []  # a fixed federation: no group leaves without stopping the others

    def shutdown(self) -> None:
        """The peers' process group ends with the process."""


register_transport(
    "store", StoreFederation, settings=StoreSettings,
    summary="every group its own launch, meeting at a TCPStore (a test's example of a transport from outside).",
)  # fmt: skip
