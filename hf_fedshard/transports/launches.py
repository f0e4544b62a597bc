"""How a transport's launches cover the federation: one launch for every group (`OneJob`), or a launch per group
(`GroupLaunch`). A transport's settings derive from one of the two, so the Trainer, its arguments, resume and the
data split ask the settings (which groups this launch holds, where it writes, what it reads) instead of branching
on a transport's name.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from hf_fedshard.errors import ConfigError
from hf_fedshard.topology import FederationLayout


@dataclass(frozen=True)
class OneJob:
    """Every group in this launch (one ``torch.distributed`` world): the settings of a transport with nothing else
    to set (``mesh``)."""

    group_id = None  # this launch holds every group
    federated = False  # a federation only if its layout has several groups
    groups_publish_apart = False  # one job publishes every group's checkpoint at once

    def check(self, transport: str, group_size: int | tuple[int, ...] | None, world: int) -> None:
        """Nothing to check: the layout checks the sizes against ``world``."""

    def check_training(self, args: Any) -> None:
        """Nothing to refuse: the groups of one job meet at every collective."""

    def launch_layout(self, group_size: int | tuple[int, ...] | None, shard_size: int | None) -> FederationLayout:
        """This launch's ranks: the whole federation."""
        return FederationLayout.from_env(group_size, shard_size)

    def federation_layout(
        self, launch: FederationLayout, group_size: int | tuple[int, ...] | None, shard_size: int | None
    ) -> FederationLayout:
        """The whole federation: this launch."""
        return launch

    def output_dir(self, output_dir: str | None) -> str | None:
        """Every group of the job writes under one ``output_dir`` (each group's shards in its own folder)."""
        return output_dir

    def group_index(self, layout: FederationLayout, process_index: int) -> int:
        """The group of the rank ``process_index`` of this launch."""
        return layout.group_index(process_index)

    def data_first_rank(self, layout: FederationLayout) -> int | None:
        """The rank whose share of the data this launch's rank 0 reads: ``None``, the launch's own (Accelerate's)."""
        return None


@dataclass(frozen=True)
class GroupLaunch:
    """This launch is one group of ``num_groups`` launches (``torchft``, or a transport registered from outside):
    group ``group_id`` reads slice ``group_id`` of ``num_groups`` of the data and writes under
    ``output_dir/fed_group{group_id}``."""

    group_id: int
    num_groups: int

    federated = True  # one group of a federation of launches, even alone (it checkpoints and heals as one)
    groups_publish_apart = True  # each group its own checkpoints: a full restart resumes at a step every group has

    def check(self, transport: str, group_size: int | tuple[int, ...] | None, world: int) -> None:
        """The group's id against the number of groups, and this launch's ranks against ``fed_group_size``."""
        if self.num_groups < 1 or not 0 <= self.group_id < self.num_groups:
            raise ConfigError(
                f"fed_group_id={self.group_id} must be in 0 … fed_num_groups - 1 (fed_num_groups={self.num_groups}). "
                "Give each launch its own id below --fed_num_groups."
            )
        if isinstance(group_size, tuple):
            self._check_sizes(transport, group_size, world)
        elif group_size not in (None, world):
            raise ConfigError(
                f"fed_group_size={group_size} but this launch has WORLD_SIZE={world}: with fed_transport {transport} "
                "every launch is one group. Drop --fed_group_size (or launch that many ranks per group)."
            )

    def check_training(self, args: Any) -> None:
        """The groups meet only in averagings: what would need them in between is refused (``args``: the Trainer's
        arguments)."""
        schedule, steps = args.fed_schedule, args.eval_steps
        period = schedule.sync_steps // schedule.fragments  # an exchange begins every period steps, in flight τ − 1
        if schedule.overlap > 1 and args.eval_strategy == "steps" and steps:
            step = math.gcd(int(steps), period) if steps >= 1 else 1  # the first evaluation step after a begin
            if step < period and step < schedule.overlap:
                raise ConfigError(
                    f"eval_steps={steps} puts evaluations inside an exchange's flight (steps s + 1 … s + τ − 1 after "
                    f"each begin s, every fed_sync_steps / fed_sync_fragments = {period} steps): with a launch per "
                    "group an evaluation between averagings is a round of the groups alive, which cannot form while "
                    f"an exchange is in flight. Set --eval_steps to a multiple of {period}."
                )
        if args.load_best_model_at_end:
            raise ConfigError(
                "load_best_model_at_end reloads each group's best checkpoint and averages them into one model after "
                "training, outside any averaging, which a launch per group does not do (and a group that healed "
                "later may hold no checkpoint of that step). Turn it off."
            )

    def _check_sizes(self, transport: str, sizes: tuple[int, ...], world: int) -> None:
        """Groups of unequal size: the list names every group's size (each launch reads its data slice and checks
        its peers by it), so it must have ``num_groups`` entries and this launch must be its size."""
        listed = ",".join(map(str, sizes))
        if len(sizes) != self.num_groups:
            raise ConfigError(
                f"fed_group_size={listed} names {len(sizes)} groups but fed_num_groups={self.num_groups}: with "
                f"fed_transport {transport} the list gives every group's size. Give one size per group."
            )
        if sizes[self.group_id] != world:
            raise ConfigError(
                f"fed_group_size={listed} gives fed_group{self.group_id} {sizes[self.group_id]} ranks, but this "
                f"launch has WORLD_SIZE={world}. Launch group {self.group_id} on {sizes[self.group_id]} ranks (or "
                "fix the list)."
            )

    def launch_layout(self, group_size: int | tuple[int, ...] | None, shard_size: int | None) -> FederationLayout:
        """This launch's ranks: one group (of unequal groups, this one's size)."""
        if isinstance(group_size, tuple):
            return FederationLayout.from_env(group_size[self.group_id], shard_size)
        return FederationLayout.from_env(group_size, shard_size)

    def federation_layout(
        self, launch: FederationLayout, group_size: int | tuple[int, ...] | None, shard_size: int | None
    ) -> FederationLayout:
        """The nominal federation of ``num_groups`` launches like this one (or of the listed sizes)."""
        if isinstance(group_size, tuple):  # the list names every group's size; ``shard_size`` as given
            return FederationLayout(sum(group_size), group_size, shard_size)
        return FederationLayout(launch.world_size * self.num_groups, launch.group_size, launch.shard_size)

    def output_dir(self, output_dir: str | None) -> str:
        """Every group writes its own checkpoints, logs and exports: no barrier across groups."""
        return os.path.join(output_dir or "trainer_output", f"fed_group{self.group_id}")

    def group_index(self, layout: FederationLayout, process_index: int) -> int:
        return self.group_id

    def data_first_rank(self, layout: FederationLayout) -> int | None:
        """This launch reads what its ranks would read in one job of the nominal layout."""
        return layout.first_rank(self.group_id)
