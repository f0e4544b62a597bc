"""What each group reads, and where it resumes reading (the Trainer's side).

`DataMixin` gives each group its slice of every epoch (a launch per group reads what its ranks would read in one
job), records a step's data arithmetic for the checkpoint's ``fed_layout.json``, and resumes where the run's source
places the data (after a layout change: the samples read rather than the step). One of the parts of
`hf_fedshard.integrations.trainer.FedShardMixin`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import has_length

from hf_fedshard.integrations.fsdp import world_data_view
from hf_fedshard.integrations.resume_source import ResumeSource

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
        # Record a step's data arithmetic for fed_layout.json; resume where the run's source says the data was (after
        # a layout change the step no longer tells the epoch), with enough epochs to reach max_steps.
        values = super().set_initial_training_values(args, dataloader)
        _, steps_per_epoch, _, _, total_batch, batches_per_epoch, max_steps = values
        self._data_arithmetic = {"samples_per_step": int(total_batch), "steps_per_epoch": int(steps_per_epoch)}
        self._batches_per_epoch = batches_per_epoch if has_length(dataloader) else None
        source, self._resumed_position = self.fed_resume, None
        if source is None or self._batches_per_epoch is None:
            return values
        position = source.data_position(int(total_batch), int(steps_per_epoch), int(self._batches_per_epoch))
        if position is None:
            return values
        self._resumed_position = position
        left_in_epoch = steps_per_epoch - position.steps
        more = math.ceil(max(0, max_steps - source.step - left_in_epoch) / steps_per_epoch)
        return (position.epoch + 1 + more, *values[1:])

    def _init_training_state(
        self, max_steps: int, steps_per_epoch: int, num_train_epochs: int, resume_from_checkpoint: Any, trial: Any
    ) -> tuple[int, int]:
        # A federated run starts from its ResumeSource: Trainer reads a checkpoint's trainer_state.json from its
        # folder, a live peer sends its own; the data position is the source's where it places it.
        source = resume_from_checkpoint if isinstance(resume_from_checkpoint, ResumeSource) else None
        folder = resume_from_checkpoint if source is None else source.folder
        epochs_trained, steps_trained = super()._init_training_state(
            max_steps, steps_per_epoch, num_train_epochs, folder, trial
        )
        if source is None:
            return epochs_trained, steps_trained
        if (state := source.trainer_state()) is not None:  # Trainer's own arithmetic, on the sent state
            self.state = state
            self.state.init_training_references(self, max_steps, num_train_epochs, trial)
            epochs_trained, steps = divmod(state.global_step, steps_per_epoch)
            steps_trained = 0 if self.args.ignore_data_skip else steps * self.args.gradient_accumulation_steps
        position = self._resumed_position
        line = source.start_line(position, self._data_arithmetic["samples_per_step"]) if self.args.should_log else None
        if line is not None:
            logger.warning(line)
        if position is None:
            return epochs_trained, steps_trained
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
