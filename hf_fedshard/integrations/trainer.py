"""`FedShardMixin` (FL+FSDP / FL+HSDP for any `Trainer` subclass) and `FedShardTrainer` = the mixin + `Trainer`.

The training loop is Transformers' own; the mixin only wraps `Trainer` methods, grouped by what they do:
`trainer_steps` (FSDP2 inside each group, one step's work), `trainer_data` (what each group reads, where it
resumes), `trainer_reporting` (evaluation, logs, the card), `trainer_checkpoints` (save, load, export) and
`trainer_federation` (the transport's federation, joined before training). Here: the attributes they share, their
construction and `train`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import Trainer
from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint, has_length

from hf_fedshard.checkpointing.background import BackgroundCheckpointer
from hf_fedshard.checkpointing.checkpoint import (
    check_resumable,
    check_tokenizer_matches,
    latest_complete_checkpoint,
    tokenizer_fingerprint,
)
from hf_fedshard.checkpointing.reshard import DataPosition
from hf_fedshard.checkpointing.resume import ResumeSettings, resumable_checkpoint
from hf_fedshard.checkpointing.stall import SaveStall
from hf_fedshard.engine import FederationCommunicator
from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.arguments import FedShardTrainingArguments
from hf_fedshard.integrations.callback import FedAvgCallback
from hf_fedshard.integrations.card import TrainingClock
from hf_fedshard.integrations.resume_source import ResumeSource, checkpoint_source
from hf_fedshard.integrations.timeouts import explain_stalled_collectives
from hf_fedshard.integrations.trainer_checkpoints import CheckpointMixin
from hf_fedshard.integrations.trainer_data import DataMixin
from hf_fedshard.integrations.trainer_federation import FederationMixin
from hf_fedshard.integrations.trainer_reporting import ReportingMixin
from hf_fedshard.integrations.trainer_steps import GroupStepsMixin
from hf_fedshard.notices import notice
from hf_fedshard.startup import moment, phase
from hf_fedshard.topology import FederationLayout
from hf_fedshard.transports import Federation
from hf_fedshard.transports.mesh import destroy_gloo_groups_at_exit

logger = logging.getLogger(__name__)


class FedShardMixin(FederationMixin, CheckpointMixin, ReportingMixin, DataMixin, GroupStepsMixin, Trainer):
    """The federation behaviour of `FedShardTrainer`, for any `transformers.Trainer` subclass.

    Put it after the subclass, right above `Trainer`, so that the subclass's own overrides run first and reach the
    federation through `super()` (TRL's `log` adds its metrics, its `_save_checkpoint` writes its card, then the
    federated checkpoint is written)::

        class MyTrainer(SFTTrainer, FedShardMixin): ...  # MRO: MyTrainer, SFTTrainer, …, FedShardMixin, parts, Trainer

    The arguments must carry the `fed_*` fields (`FedShardTrainingArguments`, or a config built on
    `FedShardArgumentsMixin`). With one group it is the subclass under FSDP2 (on CPU too, where Accelerate alone
    would fall back to DDP). With several, a `FedAvgCallback` averages the model across groups every
    `fed_sync_steps` optimizer steps.

    Nothing here reads the model or the arguments before `Trainer.__init__` has them: a subclass may resolve a
    Hub id to a model, wrap it with PEFT or rebuild its arguments first.

    Attributes:
        fed_layout: the `FederationLayout` (groups, replicas, shards).
        fed_mesh: the world `DeviceMesh` (`fed`, `dp_replicate`, `dp_shard`), or `None` without federation.
        fed_callback: the `FedAvgCallback`, or `None` with one group.
        fed_communicator: the cross-group collectives (`FederationCommunicator`), or `None` with one group.
        fed_resume: where the run's state comes from, chosen once in `train`
            (`hf_fedshard.integrations.resume_source`: a checkpoint of this layout or another, a live peer's), or
            `None` for a run that starts afresh.

    Checkpoints of a federated run hold every group's own shards, are published atomically and resume exactly
    (see `hf_fedshard.checkpointing.checkpoint` and docs/fault_tolerance.md); `save_model` exports the averaged
    global model in the ordinary Hugging Face format.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        moment("trainer")
        with phase("trainer set-up"):
            self._set_up(*args, **kwargs)

    def _set_up(self, *args: Any, **kwargs: Any) -> None:
        # Only plain attributes before Trainer.__init__: a subclass may not have resolved the model or args yet.
        self.fed_mesh: DeviceMesh | None = None
        self.fed_callback: FedAvgCallback | None = None
        self.fed_communicator: FederationCommunicator | None = None
        self.fed_federation: Federation | None = None
        self.fed_resume: ResumeSource | None = None  # where this run's state comes from (set by train)
        self._card_kwargs: dict[str, Any] = {}
        self._group_eval: tuple[int, dict[str, float]] | None = None  # (step, metrics) of the last group eval
        self._data_arithmetic: dict[str, int] = {}  # samples_per_step, steps_per_epoch: fed_layout.json records them
        self._batches_per_epoch: int | None = None  # Trainer's steps_in_epoch (each rank's batches), if it has one
        self._resumed_position: DataPosition | None = None  # where the data resumes (the record's, not the step's)
        self._last_loss = torch.tensor(math.nan)  # a step this group does not train logs its last trained loss
        self._checkpointer: BackgroundCheckpointer | None = None  # fed_async_checkpoint's writes (made in train)
        self.fed_checkpoint_stalls: list[SaveStall] = []  # where each federated save's stall of training went
        super().__init__(*args, **kwargs)
        if self.args.fed_evaluates_groups and (
            isinstance(self.eval_dataset, dict) or not has_length(self.eval_dataset)
        ):
            raise ConfigError(
                "fed_eval_per_group evaluates each group on one eval_dataset with a length, but got "
                f"{type(self.eval_dataset).__name__}. Pass a single map-style eval_dataset, or turn "
                "--fed_eval_per_group off."
            )
        destroy_gloo_groups_at_exit()
        self.add_callback(TrainingClock())
        if self.fed_layout.federated or self.args.fed_launch.federated:
            self.fed_federation = self._build_federation()
            self.fed_communicator = self.fed_federation.communicator
        if self.fed_communicator is not None:
            before_eval = self._evaluate_each_group if self.args.fed_eval_per_group else None
            self.fed_callback = FedAvgCallback(self.fed_communicator, self.args.fed_averaging_options, before_eval)
            self._add_before_progress(self.fed_callback)

    def _add_before_progress(self, callback: TrainerCallback) -> None:
        """Add ``callback`` ahead of the progress bar's, so that what it says at train begin (the averaging it
        builds) is printed before the bar is drawn, not inside it."""
        callbacks = self.callback_handler.callbacks
        bar = next((i for i, c in enumerate(callbacks) if isinstance(c, ProgressCallback | PrinterCallback)), None)
        callbacks.insert(len(callbacks) if bar is None else bar, callback)

    @property
    def fed_layout(self) -> FederationLayout:
        """The federation layout of this run, from the arguments (the same on every call)."""
        return self.args.fed_layout

    # ---- Fault tolerance: resume, checkpoints, export ----

    def train(
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval=None, **kwargs
    ):
        # Refuse bad input, then choose where the run's state comes from: a checkpoint that verifies (fed_auto_resume,
        # True: the newest one), or a live peer's state if this group joins the federation behind the others.
        if self.args.fed_requested and has_length(self.train_dataset):
            self.args.check_train_dataset_size(len(self.train_dataset))
        if self.args.fed_requested:  # beside Trainer's "Total train batch size" (the world's), at the default level
            notice("%s; %s", self.fed_layout.describe(), self._batch_arithmetic())
        checkpoint = self._verified_checkpoint(resume_from_checkpoint)
        self.fed_resume = None
        if self.fed_callback is not None and checkpoint is not None:
            layout, rank = self.args.fed_launch_layout, self.args.process_index
            self.fed_resume = checkpoint_source(checkpoint, layout, self._group_index, rank)
            self.fed_resume.check(self.args.max_steps)
        if self.fed_federation is not None:
            with phase("quorum and heal"):
                self.fed_resume = self._join_federation(self.fed_resume)
        if self.fed_callback is not None and self._checkpointer is None:  # train() again: the threads' groups stay
            self._prepare_background_saves()
        try:
            with explain_stalled_collectives(lambda: self.state.global_step, self.args.ddp_timeout):
                # a federated run's source reaches Trainer's loop in _inner_training_loop, not as a folder
                output = super().train(
                    checkpoint if self.fed_callback is None else None, trial, ignore_keys_for_eval, **kwargs
                )
        finally:
            if self.fed_federation is not None:
                self.fed_federation.shutdown()
        return output

    def _verified_checkpoint(self, requested: str | bool | None) -> str | None:
        """The checkpoint this run resumes from, checked: of this model, format and tokenizer, and (federated) one
        that verifies against its manifest; ``None`` to start afresh."""
        layout = self.args.fed_launch_layout  # what a checkpoint holds: this job's groups (torchft: its one group)
        auto = requested is None and self.args.fed_auto_resume
        if self.fed_callback is not None:
            run = ResumeSettings(self.args.output_dir, self.args.fed_auto_resume,
                                 self.args.fed_launch.groups_publish_apart, self.args.process_index,
                                 self.args.should_save)  # fmt: skip
            requested = resumable_checkpoint(requested, run, layout, self.model)
        elif auto:
            requested = latest_complete_checkpoint(self.args.output_dir)
        if requested is True:  # Trainer's meaning: the newest checkpoint of output_dir
            requested = get_last_checkpoint(self.args.output_dir)
            if requested is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if not isinstance(requested, str):
            return None
        check_resumable(requested, layout, self.model, self.fed_callback is not None)  # one group: no federated one
        check_tokenizer_matches(requested, tokenizer_fingerprint(self.processing_class))
        if auto and self.args.should_log:
            logger.warning("hf_fedshard: fed_auto_resume: resuming from %s", requested)
        return requested

    def _inner_training_loop(self, *args: Any, **kwargs: Any):
        # Trainer.train reads a resume's trainer_state.json from a folder before this; a live peer sends its own, so
        # a federated run's ResumeSource is handed to the loop here, whose loading hooks take it.
        moment("loop")  # from here to the first step: FSDP's set-up and the state's load (hf_fedshard.startup)
        if self.fed_resume is not None:
            kwargs["resume_from_checkpoint"] = self.fed_resume
        return super()._inner_training_loop(*args, **kwargs)


class FedShardTrainer(FedShardMixin, Trainer):
    """A drop-in `Trainer` that trains with FSDP2 inside federation groups and FedAvg across them.

    Same constructor as `Trainer`; the federation comes from `FedShardTrainingArguments` (see `FedShardMixin`,
    which already derives from `Trainer`: naming `Trainer` here only spells out what the trainer is).
    """

    def __init__(self, model=None, args: FedShardTrainingArguments | None = None, *pos, **kwargs) -> None:
        # Default arguments with the fed_* fields, where Trainer would default to plain TrainingArguments.
        args = FedShardTrainingArguments(output_dir="trainer_output") if args is None else args
        super().__init__(model, args, *pos, **kwargs)
