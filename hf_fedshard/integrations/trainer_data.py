"""What each group reads, and where it resumes reading (the Trainer's side).

`DataMixin` gives each group its slice of every epoch (a launch per group reads what its ranks would read in one
job), records a step's data arithmetic for the checkpoint's ``fed_layout.json``, and after a layout change resumes
from the samples read rather than the step. One of the parts of `hf_fedshard.integrations.trainer.FedShardMixin`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import has_length

from hf_fedshard.checkpointing.reshard import data_position, global_model_source, mean_of_old_groups
from hf_fedshard.integrations.fsdp import world_data_view

logger = logging.getLogger(__name__)


class DataMixin(Trainer):
    """Each group's slice of the data, and where a resume reads on."""

    def _batch_arithmetic(self) -> str:
        layout, batch = self.fed_layout, self.args.per_device_train_batch_size
        accumulation, sizes = self.args.gradient_accumulation_steps, self.fed_layout.distinct_sizes  # each size's
        ranks, batches = "/".join(map(str, sizes)), "/".join(str(batch * size * accumulation) for size in sizes)
        return (
            f"group batch = {batch} per device × {ranks} ranks × {accumulation} accumulation = {batches} samples per "
            f"optimizer step; the world reads {batch * layout.world_size * accumulation} samples per step"
        )

    def _get_dataloader(self, dataset: Any, description: str, *args: Any, **kwargs: Any):
        # Accelerate shards batches over the mesh's dp axes (one group); groups must read disjoint data.
        # a launch per group reads what its ranks would read in one job of the nominal layout
        first_rank = self.args.fed_launch.data_first_rank(self.fed_layout) if kwargs.get("is_training") else None
        with world_data_view(self.accelerator, first_rank, self.fed_layout.world_size):
            dataloader = super()._get_dataloader(dataset, description, *args, **kwargs)
        # An evaluation without a batch would log no eval_loss; its length is the same on every rank.
        if not kwargs.get("is_training") and has_length(dataset) and len(dataloader) == 0:
            self.args.check_eval_dataset_size(len(dataset), f"{description} dataset")
        return dataloader

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        # Record a step's data arithmetic for fed_layout.json; resume where the record says the data was (after a
        # layout change the step no longer tells the epoch), with enough epochs to reach max_steps.
        values = super().set_initial_training_values(args, dataloader)
        _, steps_per_epoch, _, _, total_batch, batches_per_epoch, max_steps = values
        self._data_arithmetic = {"samples_per_step": int(total_batch), "steps_per_epoch": int(steps_per_epoch)}
        self._batches_per_epoch = batches_per_epoch if has_length(dataloader) else None
        record = self._resume_record
        if record is None or self._batches_per_epoch is None:
            return values
        saved, step = record
        if "epoch_samples" not in saved and self._layout_change is None:
            return values  # a run that never changed layout: Trainer's own arithmetic holds
        position = data_position(saved, step, int(total_batch), int(steps_per_epoch))
        self._resumed_position = position
        left_in_epoch = steps_per_epoch - position.steps
        more = math.ceil(max(0, max_steps - step - left_in_epoch) / steps_per_epoch)
        return (position.epoch + 1 + more, *values[1:])

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        # On another layout the data position follows the samples read, not the step (checkpointing.reshard).
        epochs_trained, steps_trained = super()._init_training_state(*args, **kwargs)
        change, position = self._layout_change, self._resumed_position
        if position is None:
            return epochs_trained, steps_trained
        if change is not None and self.args.should_log:
            logger.warning(
                "hf_fedshard: resuming step %d of %s on %s: the model is %s; the anchor and outer momentum are the "
                "checkpoint's, resharded; the inner optimizer's moments are %s, resharded; "
                "an exchange in flight (if any) is dropped; the world batch goes from %d to %d samples per step; %s.",
                change.step, change.old_layout(), change.new_layout(), global_model_source(change),
                mean_of_old_groups(change),
                change.saved["samples_per_step"], self._data_arithmetic["samples_per_step"], position.describe(),
            )  # fmt: skip
        if self.args.ignore_data_skip:  # as Trainer: the resumed epoch starts from its beginning
            return position.epoch, 0
        return position.epoch, position.steps * self.args.gradient_accumulation_steps

    def _epoch_position(self) -> dict[str, int]:
        """The epoch and the samples read of it (`checkpointing.reshard.data_position` resumes from them), from
        Trainer's fractional epoch: epoch + batches read ÷ batches per epoch."""
        if self._batches_per_epoch is None or self.state.epoch is None:
            return {}
        epoch = math.floor(self.state.epoch + 1e-9)
        batches = round((self.state.epoch - epoch) * self._batches_per_epoch)
        samples = batches * self._data_arithmetic["samples_per_step"] // self.args.gradient_accumulation_steps
        return {"epoch": epoch, "epoch_samples": samples}
