"""Per-group evaluation: each federation group's own model on the whole eval set, before averaging.

Between two averagings the groups' models drift apart; the global model that `evaluate()` reports is their
average. Evaluating each group as well shows how far they drift and whether averaging helps or hurts (the
paper's per-group curves). A group evaluates over its own ranks only, so no byte crosses the slow tier but
one float per group (none with a launch per group: each launch logs its own group's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import datasets
import torch
from torch.distributed import ProcessGroup, all_reduce, get_rank, get_world_size
from torch.utils.data import Dataset

from hf_fedshard.engine import FederationCommunicator
from hf_fedshard.engine.payload import reshard_units
from hf_fedshard.errors import ConfigError

if TYPE_CHECKING:
    from transformers import Trainer


def rank_batches(num_samples: int, rank: int, world: int, batch_size: int) -> list[list[int]]:
    """This rank's share of ``num_samples`` (every ``world``-th sample) in batches, one list per forward.

    Every rank of a group gets the same number of batches, since FSDP's all-gathers in each forward are
    collectives of the group; a batch with no sample left for this rank is empty (the caller runs a
    throw-away forward for it).
    """
    mine = list(range(rank, num_samples, world))
    num_batches = math.ceil(math.ceil(num_samples / world) / batch_size)
    return [mine[b * batch_size : (b + 1) * batch_size] for b in range(num_batches)]


@torch.no_grad()
def evaluate_each_group(
    trainer: Trainer, group: ProcessGroup | None, federation: FederationCommunicator | None, index: int
) -> dict[str, float]:
    """``eval_group{g}_loss`` of every group's own model (the sample mean, as `eval_loss`), on every rank.

    Each group evaluates over its own ranks (``group``; ``None``: one rank); then each group's first rank puts its
    loss in its slot of a vector summed over ``federation``'s control (every rank, whatever the groups' sizes), so
    every rank logs every group's loss. ``federation`` ``None``: this launch is group ``index`` alone (a launch per
    group, which meets the others only in averagings): it logs its own loss, and each launch logs its own.
    """
    dataset = trainer.eval_dataset
    collator = trainer.data_collator
    # Trainer's own column handling, as in `Trainer._get_dataloader`.
    if isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description="evaluation")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="evaluation")
    rank, world = (get_rank(group), get_world_size(group)) if group is not None else (0, 1)
    model, was_training = trainer.model, trainer.model.training
    model.eval()
    try:
        totals = _loss_totals(trainer, dataset, collator, rank, world)
    finally:
        model.train(was_training)
        reshard_units(model)  # the global model lent next is written into the shards, which the model must use
    device = trainer.args.device
    totals = totals.to(device)
    if group is not None:
        all_reduce(totals, group=group)
    loss = totals[0] / totals[1]
    if federation is None:
        return {f"eval_group{index}_loss": loss.item()}
    losses = torch.zeros(federation.num_groups, dtype=torch.float64, device=device)
    if rank == 0:
        losses[federation.group] = loss
    federation.control.all_reduce_sum(losses)
    return {f"eval_group{g}_loss": value for g, value in enumerate(losses.tolist())}


def _loss_totals(
    trainer: Trainer, dataset: Dataset, collator: Callable[[list], dict], rank: int, world: int
) -> torch.Tensor:
    """(sum of batch losses × samples, samples) over this rank's share of the eval set."""
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in rank_batches(len(dataset), rank, world, trainer.args.per_device_eval_batch_size):
        inputs = trainer._prepare_inputs(collator([dataset[i] for i in batch or [0]]))
        loss, _, _ = trainer.prediction_step(trainer.model, inputs, prediction_loss_only=True)
        if loss is None:  # the same batch keys on every rank: all of them raise here together
            raise ConfigError(
                "fed_eval_per_group needs a loss on the eval set, but the model returned none: give the eval "
                "samples labels (e.g. DataCollatorForLanguageModeling(mlm=False)) or turn --fed_eval_per_group off."
            )
        if batch:
            totals += torch.tensor([loss.item() * len(batch), len(batch)], dtype=torch.float64)
    return totals
