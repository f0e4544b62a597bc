"""`FedShardMixin` (FL+FSDP / FL+HSDP for any `Trainer` subclass) and `FedShardTrainer` = the mixin + `Trainer`.

The training loop is Transformers' own; the mixin only wraps `Trainer` methods.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import StateDictType
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState, PrinterCallback, ProgressCallback, TrainerCallback
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    IntervalStrategy,
    SaveStrategy,
    has_length,
    rotate_checkpoints,
)

from hf_fedshard.checkpointing.averaging_state import load_averaging_state, read_counters, save_averaging_state
from hf_fedshard.checkpointing.checkpoint import (
    atomic_checkpoint,
    check_resumable,
    check_tokenizer_matches,
    group_dir,
    latest_complete_checkpoint,
    load_group_model,
    load_group_optimizer,
    read_layout_record,
    reading,
    save_group_model,
    save_group_optimizer,
    tokenizer_fingerprint,
    write_layout_record,
)
from hf_fedshard.checkpointing.reshard import (
    DataPosition,
    LayoutChange,
    checkpoint_step,
    data_position,
    global_model_source,
    layout_change,
    load_global_model,
    load_mean_optimizer,
    load_resharded_averaging_state,
    mean_of_old_groups,
)
from hf_fedshard.checkpointing.resume import ResumeSettings, load_on_every_rank, resumable_checkpoint
from hf_fedshard.engine import FederationCommunicator
from hf_fedshard.engine.payload import all_finite, load_model_state, model_state_tensors
from hf_fedshard.engine.rounds import HealState
from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.arguments import FedShardArgumentsMixin, FedShardTrainingArguments
from hf_fedshard.integrations.callback import FedAvgCallback
from hf_fedshard.integrations.card import CARD_EXTRAS, TrainingClock, clock_hidden, extend_card
from hf_fedshard.integrations.elastic import cut_state, federation_fingerprint, register_heal_parts, resume_folder
from hf_fedshard.integrations.file_modes import follow_umask
from hf_fedshard.integrations.fsdp import (
    check_weights_present,
    ensure_fsdp,
    requested_fsdp_plugin,
    use_federation_mesh,
    world_data_view,
)
from hf_fedshard.integrations.group_eval import evaluate_each_group
from hf_fedshard.integrations.group_gather import gathers_within_group
from hf_fedshard.integrations.timeouts import explain_stalled_collectives
from hf_fedshard.notices import notice
from hf_fedshard.topology import FederationLayout
from hf_fedshard.transports import Federation, FederationRequest, get_transport
from hf_fedshard.transports.mesh import destroy_gloo_groups_at_exit, group_process_group

logger = logging.getLogger(__name__)


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class FedShardMixin(Trainer):
    """The federation behaviour of `FedShardTrainer`, for any `transformers.Trainer` subclass.

    Put it after the subclass, right above `Trainer`, so that the subclass's own overrides run first and reach the
    federation through `super()` (TRL's `log` adds its metrics, its `_save_checkpoint` writes its card, then the
    federated checkpoint is written)::

        class MyTrainer(SFTTrainer, FedShardMixin): ...   # MRO: MyTrainer, SFTTrainer, ..., FedShardMixin, Trainer

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

    Checkpoints of a federated run hold every group's own shards, are published atomically and resume exactly
    (see `hf_fedshard.checkpointing.checkpoint` and docs/fault_tolerance.md); `save_model` exports the averaged
    global model in the ordinary Hugging Face format.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only plain attributes before Trainer.__init__: a subclass may not have resolved the model or args yet.
        self.fed_mesh: DeviceMesh | None = None
        self.fed_callback: FedAvgCallback | None = None
        self.fed_communicator: FederationCommunicator | None = None
        self.fed_federation: Federation | None = None
        self._peer_state: dict | None = None  # a live peer's state this group healed from, until training takes it
        self._card_kwargs: dict[str, Any] = {}
        self._group_eval: tuple[int, dict[str, float]] | None = None  # (step, metrics) of the last group eval
        self._layout_change: LayoutChange | None = None  # the checkpoint being resumed was written on another layout
        self._data_arithmetic: dict[str, int] = {}  # samples_per_step, steps_per_epoch: fed_layout.json records them
        self._batches_per_epoch: int | None = None  # Trainer's steps_in_epoch (each rank's batches), if it has one
        self._resume_record: tuple[dict, int] | None = None  # the resumed checkpoint's fed_layout.json and step
        self._resumed_position: DataPosition | None = None  # where the data resumes (the record's, not the step's)
        self._last_loss = torch.tensor(math.nan)  # a step this group does not train logs its last trained loss
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

    def _check_federation_inputs(self) -> None:
        """Refuse arguments without fed_* fields and a model with nothing to train, on every rank alike."""
        if not isinstance(self.args, FedShardArgumentsMixin):
            raise TypeError(
                f"{type(self).__name__} needs FedShardTrainingArguments (or arguments built on "
                f"FedShardArgumentsMixin), got {type(self.args).__name__}. Build the arguments with "
                "hf_fedshard.FedShardTrainingArguments (same fields, plus fed_*)."
            )
        model = self.model
        if self.args.fed_requested and model is not None and not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(
                f"{type(model).__name__} has no parameter with requires_grad=True: nothing to train or average. "
                "Unfreeze some parameters (or attach a PEFT adapter) before building the trainer."
            )

    def create_accelerator_and_postprocess(self) -> None:
        # Keep FSDP on CPU (Accelerate falls back to DDP there) and shard over one group, not the world.
        # Trainer.__init__ calls this first with self.args and self.model set: check them before any process group.
        self._check_federation_inputs()
        super().create_accelerator_and_postprocess()
        plugin = requested_fsdp_plugin(self.args)
        if self.model is not None:  # None with model_init: its model is built later
            check_weights_present(self.model, plugin, self.accelerator.is_main_process)  # cpu_ram_efficient_loading's
        if plugin is None:
            return
        ensure_fsdp(self.accelerator, plugin)
        self.is_fsdp_enabled = True
        if self.args.fed_requested:
            self.fed_mesh = use_federation_mesh(self.accelerator, self.args.fed_launch_layout)

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

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        # Evaluate the global model (the groups' plain average); each group keeps training its own afterwards.
        if self.fed_callback is None:
            return super().evaluate(*args, **kwargs)
        with self.fed_callback.global_model(evaluating=True):
            return super().evaluate(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Per-step metric gathers in compute_loss (TRL's token accuracy, entropy) stay inside the group.
        if self.fed_callback is None:
            return super().training_step(*args, **kwargs)
        if self._untrained_step:
            return self._last_loss.to(self.args.device, copy=True)
        with gathers_within_group(self.accelerator, self._group_pg if self._group_size > 1 else None):
            loss = super().training_step(*args, **kwargs)
        self._last_loss = loss.detach()
        return loss

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        # Without clipping (max_grad_norm 0) Trainer measures the norm, a collective, only to log it: not on steps
        # that do not log (a step a callback alone chooses to log has no grad_norm), nor on untrained ones.
        if self._untrained_step:
            return None
        if grad_norm is None and not self._logs_after_this_step():
            return None
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        # An untrained step has no gradient to clip (and its group must not enter the norm's collective).
        return None if self._untrained_step else super()._clip_grad_norm(model)

    @property
    def _untrained_step(self) -> bool:
        """Whether this group reads the step being taken without training on it (``fed_round_policy speed``)."""
        return self.fed_callback is not None and not self.fed_callback.trains_next_step

    def _logs_after_this_step(self) -> bool:
        """Whether Trainer's own schedule (`DefaultFlowCallback`) logs the optimizer step now being taken."""
        strategy, step = self.args.logging_strategy, self.state.global_step + 1
        if step == 1 and self.args.logging_first_step:
            return True
        if strategy == IntervalStrategy.STEPS:
            return step % self.state.logging_steps == 0
        return strategy != IntervalStrategy.NO  # by epoch: the epoch's last step is not known here, measure each

    def _evaluate_each_group(self) -> None:
        """Evaluate every group's own model (the averager calls this before the global model is evaluated)."""
        group = self._group_pg if self._group_size > 1 else None
        metrics = evaluate_each_group(self, group, self.fed_communicator.peers)
        self._group_eval = (self.state.global_step, metrics)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Perplexity beside every loss (the groups' own too) and the federation counters, for every logger.
        if "eval_loss" in logs and self._group_eval is not None:
            step, group_metrics = self._group_eval
            self._group_eval = None
            if step == self.state.global_step:  # not an evaluation that a callback cancelled at that step
                logs.update(group_metrics)
        for key in [k for k in logs if k == "loss" or k.endswith("_loss")]:
            logs[key[: -len("loss")] + "perplexity"] = _perplexity(logs[key])
        if self.fed_callback is not None and not any(k.startswith("eval_") for k in logs):
            logs.update(self.fed_callback.metrics())
        super().log(logs, start_time)

    def create_model_card(self, **kwargs: Any) -> None:
        # Trainer's card (hyperparameters, results, versions) plus hf_fedshard's section; push_to_hub calls this too.
        with clock_hidden(self.state):
            super().create_model_card(**self._remember_card_kwargs(kwargs))
        self._extend_model_card()

    def _remember_card_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Keep the card's keywords for later cards (push_to_hub, checkpoints); return those the base card takes."""
        self._card_kwargs.update({k: v for k, v in kwargs.items() if v is not None})
        return {k: v for k, v in self._card_kwargs.items() if k not in CARD_EXTRAS}

    def _extend_model_card(self) -> None:
        """Add hf_fedshard's section to the README.md the base card wrote (main process only)."""
        if self.is_world_process_zero():
            extend_card(self, **self._card_kwargs)

    # ---- Fault tolerance: resume, checkpoints, export ----

    def train(
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval=None, **kwargs
    ):
        # Refuse bad input, then resume from a checkpoint that verifies (fed_auto_resume, True: the newest one).
        if self.args.fed_requested and has_length(self.train_dataset):
            self.args.check_train_dataset_size(len(self.train_dataset))
        if self.args.fed_requested:  # beside Trainer's "Total train batch size" (the world's), at the default level
            notice("%s; %s", self.fed_layout.describe(), self._batch_arithmetic())
        auto = resume_from_checkpoint is None and self.args.fed_auto_resume
        self._layout_change, self._resume_record, self._resumed_position = None, None, None
        layout = self.args.fed_launch_layout  # what a checkpoint holds: this job's groups (torchft: its one group)
        if self.fed_callback is not None:
            run = ResumeSettings(self.args.output_dir, self.args.fed_auto_resume,
                                 self.args.fed_launch.groups_publish_apart, self.args.process_index,
                                 self.args.should_save)  # fmt: skip
            resume_from_checkpoint = resumable_checkpoint(resume_from_checkpoint, run, layout, self.model)
        elif auto:
            resume_from_checkpoint = latest_complete_checkpoint(self.args.output_dir)
        if isinstance(resume_from_checkpoint, str):
            check_resumable(resume_from_checkpoint, layout, self.model)  # one group refuses federated ones
            check_tokenizer_matches(resume_from_checkpoint, tokenizer_fingerprint(self.processing_class))
            if self.fed_callback is not None and (saved := read_layout_record(resume_from_checkpoint)) is not None:
                self._resume_record = (saved, checkpoint_step(resume_from_checkpoint))
                self._layout_change = layout_change(resume_from_checkpoint, layout)
            self._check_layout_change(resume_from_checkpoint)
            if auto and self.args.should_log:
                logger.warning("hf_fedshard: fed_auto_resume: resuming from %s", resume_from_checkpoint)
        if self.fed_federation is not None:
            resume_from_checkpoint = self._join_federation(resume_from_checkpoint)
        try:
            with explain_stalled_collectives(lambda: self.state.global_step, self.args.ddp_timeout):
                output = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        finally:
            if self.fed_federation is not None:
                self.fed_federation.shutdown()
        self._say_groups_apart_at_the_end()
        return output

    # ---- Resuming on another layout ----

    def _check_layout_change(self, checkpoint: str) -> None:
        """Refuse, on every rank alike, a layout change this run cannot honour."""
        change = self._layout_change
        if change is None:
            return
        if self.args.fed_launch.groups_publish_apart:
            raise ConfigError(
                f"resume_from_checkpoint={checkpoint} was written on {change.old_layout()}, but fed_transport "
                f"{self.args.fed_transport} resumes a group's checkpoint only on its own group size. Relaunch the "
                f"group on {change.saved['world_size']} ranks, or resume it with fed_transport mesh."
            )
        if self.args.max_steps <= 0:
            raise ConfigError(
                f"resume_from_checkpoint={checkpoint} was written on {change.old_layout()} and this run is "
                f"{change.new_layout()}: a layout change keeps counting optimizer steps, so it needs --max_steps "
                "(the schedule's length; epochs would change it with the world batch). Pass --max_steps."
            )

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

    # ---- Joining the federation: its transport, and groups that join and leave ----

    def _build_federation(self) -> Federation:
        """This launch's side of the federation, from its transport (`hf_fedshard.transports`); where groups come and
        go, it meets the others when `train` joins the first quorum."""
        heal = HealState()
        register_heal_parts(self, heal)
        args = self.args
        request = FederationRequest(
            settings=args.fed_launch, layout=self.fed_layout, launch=args.fed_launch_layout,
            group=torch.distributed.group.WORLD, mesh=self.fed_mesh, options=args.fed_averaging_options,
            timeout_s=args.fed_exchange_timeout_s, timeout=_timeout_setting(args), heal=heal,
            fingerprint=federation_fingerprint(self), cut=lambda state: cut_state(self, state),
        )  # fmt: skip
        return get_transport(args.fed_transport).build(request)

    def _join_federation(self, checkpoint: str | None) -> str | None:
        """Meet the other groups before training (`Federation.join`): where groups come and go, a group behind the
        others resumes from a live peer's committed state (a temporary folder holds its trainer_state.json), one level
        with them from ``checkpoint`` or afresh."""
        syncs = 0
        if checkpoint is not None and self._layout_change is None:  # the averagings this group's checkpoint holds
            syncs = read_counters(checkpoint, self._group_index, self.args.process_index)["syncs"]
        self.fed_federation.join(int(syncs))
        membership = self.fed_communicator.membership
        self._peer_state = (membership.heal.take() or None) if membership is not None else None
        if self._peer_state is None:
            return checkpoint
        folder = resume_folder(self._peer_state)
        if self.args.should_log:
            logger.warning(
                "hf_fedshard: fed_group%d healed from a live group: resuming at step %d (its last averaging) with the "
                "global model, its anchors and outer state; the inner optimizer starts afresh.",
                self.args.fed_launch.group_id, self._peer_state["trainer"]["global_step"],
            )  # fmt: skip
        return folder

    def _say_groups_apart_at_the_end(self) -> None:
        """torchft: name the groups that the final averaging ran without, though they averaged at the one before
        (they left, or one side came more than fed_timeout_s after the other): the groups may end on other models."""
        dropped = self.fed_federation.dropped_groups() if self.fed_federation is not None else []
        if dropped and self.args.should_log:
            logger.warning(
                "hf_fedshard: fed_group%d's final averaging (step %d) ran without %s, which averaged with it at the "
                "one before: they left, or one side reached it more than fed_timeout_s=%g s after the other. The "
                "groups may end on different models. To wait longer at the end, raise --fed_timeout_s; to never end "
                "apart, start the lighthouse with --min_groups %d (a group that dies then stops the others).",
                self.args.fed_launch.group_id, self.state.global_step, ", ".join(f"fed_group{g}" for g in dropped),
                self.args.fed_exchange_timeout_s, self.fed_layout.num_groups,
            )  # fmt: skip

    def _check_peer_step(self, trainer_state: dict) -> None:
        """A heal during training (this group lost a round the others committed): the peer's state must be of this
        step (`hf_fedshard.engine.rounds` I4); its averager part then loads it."""
        if trainer_state["global_step"] != self.state.global_step:
            raise RuntimeError(
                f"hf_fedshard: fed_group{self.args.fed_launch.group_id} fell behind the federation by more than one "
                f"averaging: at step {self.state.global_step} it was sent a peer's state of step "
                f"{trainer_state['global_step']}. Restarting the group heals it at its first quorum (torchrun "
                "--max-restarts does it)."
            )

    @property
    def _group_pg(self) -> ProcessGroup:
        """The ranks of this rank's federation group: each group checkpoints over its own ranks."""
        return group_process_group(self.fed_mesh)

    @property
    def _group_size(self) -> int:
        """The ranks of this rank's group (groups may differ in size)."""
        return self.args.fed_launch_layout.size_of(self._group_index)

    @property
    def _group_index(self) -> int:
        """This rank's group in this job's checkpoints (torchft: 0, each group writes its own)."""
        return self.args.fed_launch_layout.group_index(self.args.process_index)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        # Trainer's FSDP save runs DCP over the world, where groups would write the same keys, and in place:
        # here each group saves its own shards into a staging folder that is renamed once every rank is done.
        if self.fed_callback is None:
            return super()._save_checkpoint(model, trial)
        step = self.state.global_step
        diverged = self._diverged_groups()
        if diverged:
            if self.args.should_log:
                logger.warning(
                    "hf_fedshard: checkpoint-%d not written: group(s) %s hold NaN/Inf (the next averaging restarts "
                    "them from the others); the previous checkpoints stay the latest good ones.",
                    step,
                    diverged,
                )
            return
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        final_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        self._track_best_checkpoint(run_dir, step)
        with atomic_checkpoint(final_dir, self.args.should_save) as staging:
            self._save_federated_state(staging)
        if self.args.push_to_hub:
            self._push_from_checkpoint(final_dir)
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _diverged_groups(self) -> list[int]:
        """The groups holding a NaN/Inf now; with torchft, where groups meet only in averagings, this group alone."""
        if self.args.fed_launch_layout.federated:
            return self.fed_callback.averager.find_diverged_groups()
        flag = torch.tensor(0.0 if all_finite(model_state_tensors(self.model)) else 1.0, device=self.args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return [self.args.fed_launch.group_id] if flag.item() else []

    def _track_best_checkpoint(self, run_dir: str, step: int) -> None:
        """Trainer's bookkeeping of the best checkpoint, for a checkpoint that is published at the end."""
        strategies = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        best_step = self.state.best_global_step
        if self.args.save_strategy in strategies and best_step:
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
            if best_step == step or os.path.exists(best_dir):
                self.state.best_model_checkpoint = best_dir

    def _save_federated_state(self, checkpoint: str) -> None:
        """Everything needed to continue exactly, each group's shards in its own ``fed_group{g}`` folder."""
        group = group_dir(checkpoint, self._group_index)
        save_group_model(self.model, os.path.join(group, "model"), self._group_pg)
        if not self.args.save_only_model:
            self._save_optimizer_and_scheduler(checkpoint)
            self._save_scaler(checkpoint)
            self._save_rng_state(checkpoint)
        state = self.fed_callback.averager.state_dict()
        layout = self.args.fed_launch_layout
        save_averaging_state(checkpoint, layout, self.args.process_index, state, self.model, self._group_pg)
        if self.args.should_save:
            read = {
                **self._data_arithmetic,
                **self._epoch_position(),
                "tokenizer": tokenizer_fingerprint(self.processing_class),
            }
            write_layout_record(checkpoint, layout, self.model, read)
            config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
            if config is not None:
                config.save_pretrained(checkpoint)
            self._save_trainer_state(checkpoint)

    def _epoch_position(self) -> dict[str, int]:
        """The epoch and the samples read of it (`checkpointing.reshard.data_position` resumes from them), from
        Trainer's fractional epoch: epoch + batches read ÷ batches per epoch."""
        if self._batches_per_epoch is None or self.state.epoch is None:
            return {}
        epoch = math.floor(self.state.epoch + 1e-9)
        batches = round((self.state.epoch - epoch) * self._batches_per_epoch)
        samples = batches * self._data_arithmetic["samples_per_step"] // self.args.gradient_accumulation_steps
        return {"epoch": epoch, "epoch_samples": samples}

    def _save_trainer_state(self, checkpoint: str) -> None:
        """``trainer_state.json`` with the stateful callbacks, as Trainer writes it (the last file of a checkpoint).
        A group healed from a peer holds none yet (`integrations.elastic.resume_folder` leaves the peer's out)."""
        for cb in [cb for cb in [*self.callback_handler.callbacks, self.control] if isinstance(cb, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state
        self.state.save_to_json(os.path.join(checkpoint, TRAINER_STATE_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Groups' optimizer moments differ between averagings: each group saves its own, over its own ranks.
        if self.fed_callback is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        directory = os.path.join(group_dir(output_dir, self._group_index), "optimizer")
        save_group_optimizer(self.model, self.optimizer, directory, self._group_pg)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Each rank reads its own group's shards and FedAvg counters; every rank learns of any rank's failure.
        if self.fed_callback is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self._peer_state is not None:  # a heal: the peer's global model and averaging state, from memory
            load_model_state(model or self.model, self._peer_state["averager"]["model"])
            return self.fed_callback.load_state_dict(self._peer_state["averager"]["averager"])
        load_on_every_rank(resume_from_checkpoint, lambda: self._load_federated_state(resume_from_checkpoint, model))

    def _load_federated_state(self, checkpoint: str, model: nn.Module | None) -> None:
        """This rank's model shards and averaging state (`_save_federated_state`'s), or on another layout the
        checkpoint's global model and averaging state resharded (`hf_fedshard.checkpointing.reshard`)."""
        model = model or self.model
        if self._layout_change is not None:
            load_global_model(model, self._layout_change, self._group_pg)
            state = load_resharded_averaging_state(self._layout_change, model, self._group_pg)
            return self.fed_callback.load_state_dict(state)
        group = group_dir(checkpoint, self._group_index)
        load_group_model(model, os.path.join(group, "model"), self._group_pg)
        layout = self.args.fed_launch_layout
        state = load_averaging_state(checkpoint, layout, self.args.process_index, model, self._group_pg)
        self.fed_callback.load_state_dict(state)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Each group reads its own optimizer state; a save_only_model checkpoint has none, as with Trainer.
        if self.fed_callback is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if self._peer_state is not None:  # a heal: the peer's schedule; the inner optimizer starts afresh
            self.lr_scheduler.load_state_dict(self._peer_state["scheduler"])
            self._peer_state = None
            return
        group = 0 if self._layout_change is not None else self._group_index  # another layout: group 0 is there
        directory = os.path.join(group_dir(checkpoint, group), "optimizer")
        if not os.path.isdir(directory):
            return
        load_on_every_rank(checkpoint, lambda: self._load_group_optimizer_and_scheduler(checkpoint, directory))

    def _load_group_optimizer_and_scheduler(self, checkpoint: str, directory: str) -> None:
        if self._layout_change is not None:
            load_mean_optimizer(self.model, self.optimizer, self._layout_change, self._group_pg)
        else:
            load_group_optimizer(self.model, self.optimizer, directory, self._group_pg)
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        with reading(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_best_model(self) -> None:
        # The best checkpoint holds one copy per group: each group reloads its own.
        if self.fed_callback is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        change = layout_change(best, self.args.fed_launch_layout)  # written before a layout change: its global model
        if change is not None:
            load_global_model(self.model, change, self._group_pg)
        else:
            load_group_model(self.model, os.path.join(group_dir(best, self._group_index), "model"), self._group_pg)
        self.fed_callback.averager.adopt_plain_average()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # Export the global model in the Hugging Face format: the groups' plain average between averagings (each
        # group gets its own model back), FSDP2's shards gathered (Trainer writes nothing for SHARDED_STATE_DICT).
        # Federated checkpoints never come here (see _save_checkpoint), so this gathers for exports only.
        if self.fed_callback is None:
            super().save_model(output_dir, _internal_call)
        else:
            self._save_global_model(output_dir, _internal_call)
        if self.args.should_save:  # safetensors writes its files 0600: the weights get the umask's mode like the rest
            follow_umask(output_dir or self.args.output_dir)

    def _save_global_model(self, output_dir: str | None, _internal_call: bool) -> None:
        with self.fed_callback.global_model():
            if self.accelerator.state.fsdp_plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
                return super().save_model(output_dir, _internal_call)
            state_dict = self.accelerator.get_state_dict(self.model)
        self._save(output_dir or self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


class FedShardTrainer(FedShardMixin, Trainer):
    """A drop-in `Trainer` that trains with FSDP2 inside federation groups and FedAvg across them.

    Same constructor as `Trainer`; the federation comes from `FedShardTrainingArguments` (see `FedShardMixin`,
    which already derives from `Trainer`: naming `Trainer` here only spells out what the trainer is).
    """

    def __init__(self, model=None, args: FedShardTrainingArguments | None = None, *pos, **kwargs) -> None:
        # Default arguments with the fed_* fields, where Trainer would default to plain TrainingArguments.
        args = FedShardTrainingArguments(output_dir="trainer_output") if args is None else args
        super().__init__(model, args, *pos, **kwargs)


def _timeout_setting(args: FedShardArgumentsMixin) -> str:
    """How the limit on a cross-group collective is named in errors."""
    return f"fed_timeout_s={args.fed_timeout_s:g}" if args.fed_timeout_s else "ddp_timeout (fed_timeout_s unset)"
