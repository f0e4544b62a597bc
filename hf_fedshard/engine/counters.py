"""What the averagings of a run have cost and found, for the logs (``fed_*``) and the checkpoints."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Counters:
    """This rank's counts (byte counts differ by shard); a checkpoint keeps them so a resumed run logs the same."""

    syncs: int = 0
    inter_group_bytes: int = 0
    last_sync_seconds: float = 0.0
    total_sync_seconds: float = 0.0
    last_wait_seconds: float = 0.0
    total_wait_seconds: float = 0.0
    diverged_groups: int = 0
    delta_norm: float = 0.0
    group_drift: float = 0.0
    total_barrier_seconds: float = 0.0  # in the averagings' control all-reduce: the wait for the slowest group
    round_steps: int = 0  # a speed-aware round's: the steps this group trained in the last round

    def count(self, blocked_s: float, waited_s: float) -> None:
        """One more averaging, which held the training loop ``blocked_s`` (``waited_s`` of it on the network)."""
        self.last_sync_seconds, self.last_wait_seconds = blocked_s, waited_s
        self.total_sync_seconds += blocked_s
        self.syncs += 1

    def metrics(self) -> dict[str, float]:
        return {
            "fed_syncs": self.syncs,
            "fed_inter_group_bytes": self.inter_group_bytes,
            "fed_sync_seconds": round(self.last_sync_seconds, 6),
            "fed_sync_seconds_total": round(self.total_sync_seconds, 6),
            "fed_sync_wait_seconds_total": round(self.total_wait_seconds, 6),
            "fed_diverged_groups": self.diverged_groups,
            "fed_delta_norm": self.delta_norm,
            "fed_group_drift": self.group_drift,
            "fed_barrier_seconds_total": round(self.total_barrier_seconds, 6),
            **({"fed_round_steps": self.round_steps} if self.round_steps else {}),
        }

    def state_dict(self) -> dict[str, float]:
        state = asdict(self)
        del state["last_wait_seconds"]  # the last averaging's, logged already
        return state

    def load_state_dict(self, state: dict[str, float]) -> None:
        for name, value in state.items():
            if name in self.__dataclass_fields__:
                setattr(self, name, type(getattr(self, name))(value))
