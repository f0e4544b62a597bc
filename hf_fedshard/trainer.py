"""`FedShardTrainer`: `transformers.Trainer` with FL+FSDP / FL+HSDP; the training loop is Transformers' own."""

from __future__ import annotations

import logging
import math
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from transformers import Trainer

from .arguments import FedShardTrainingArguments
from .callback import FedAvgCallback
from .card import TrainingClock, write_card
from .fsdp import ensure_fsdp, requested_fsdp_plugin, use_federation_mesh, world_data_view
from .mesh import FederationLayout, fed_process_group

logger = logging.getLogger(__name__)


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class FedShardTrainer(Trainer):
    """A drop-in `Trainer` that trains with FSDP2 inside federation groups and FedAvg across them.

    Same constructor as `Trainer`; the federation comes from `FedShardTrainingArguments`. With one group
    it is `Trainer` under FSDP2 (on CPU too, where Accelerate alone would fall back to DDP). With several,
    a `FedAvgCallback` averages the model across groups every `fed_sync_steps` optimizer steps.

    Attributes:
        fed_layout: the `FederationLayout` (groups, replicas, shards).
        fed_mesh: the world `DeviceMesh` (`fed`, `dp_replicate`, `dp_shard`), or `None` without federation.
        fed_callback: the `FedAvgCallback`, or `None` with one group.
    """

    def __init__(self, model=None, args: FedShardTrainingArguments | None = None, *pos, **kwargs) -> None:
        args = FedShardTrainingArguments(output_dir="trainer_output") if args is None else args
        if not isinstance(args, FedShardTrainingArguments):
            raise TypeError(
                f"FedShardTrainer needs FedShardTrainingArguments, got {type(args).__name__}. "
                "Build the arguments with hf_fedshard.FedShardTrainingArguments (same fields, plus fed_*)."
            )
        self.fed_layout: FederationLayout = args.fed_layout
        self.fed_mesh: DeviceMesh | None = None
        self.fed_callback: FedAvgCallback | None = None
        if args.fed_requested and model is not None and not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"{type(model).__name__} has no parameter with requires_grad=True: nothing to train or average. "
                "Unfreeze some parameters (or attach a PEFT adapter) before building the trainer."
            )
        super().__init__(model, args, *pos, **kwargs)
        self.clock = TrainingClock()
        self.add_callback(self.clock)
        self._card_kwargs: dict[str, Any] = {}
        if self.fed_layout.federated:
            self.fed_callback = FedAvgCallback(
                fed_group=fed_process_group(self.fed_mesh),
                num_groups=self.fed_layout.num_groups,
                sync_steps=args.fed_sync_steps,
                average_optimizer_state=args.fed_average_optimizer_state,
            )
            self.add_callback(self.fed_callback)

    def create_accelerator_and_postprocess(self) -> None:
        # Keep FSDP on CPU (Accelerate falls back to DDP there) and shard over one group, not the world.
        super().create_accelerator_and_postprocess()
        plugin = requested_fsdp_plugin(self.args)
        if plugin is None:
            return
        ensure_fsdp(self.accelerator, plugin)
        self.is_fsdp_enabled = True
        if self.args.fed_requested:
            self.fed_mesh = use_federation_mesh(self.accelerator, self.fed_layout)
            if self.args.should_log:
                logger.info("hf_fedshard: %s; %s", self.fed_layout.describe(), self._batch_arithmetic())

    def _batch_arithmetic(self) -> str:
        group_batch = (
            self.args.per_device_train_batch_size * self.fed_layout.group_size * self.args.gradient_accumulation_steps
        )
        return (
            f"group batch = {self.args.per_device_train_batch_size} per device × {self.fed_layout.group_size} "
            f"ranks × {self.args.gradient_accumulation_steps} accumulation = {group_batch} samples per "
            f"optimizer step; the world reads {group_batch * self.fed_layout.num_groups} samples per step"
        )

    def _get_dataloader(self, *args: Any, **kwargs: Any):
        # Accelerate shards batches over the mesh's dp axes (one group); groups must read disjoint data.
        with world_data_view(self.accelerator):
            return super()._get_dataloader(*args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Perplexity beside every loss and the federation counters, for every logger of `report_to`.
        for key in [k for k in logs if k == "loss" or k.endswith("_loss")]:
            logs[key[: -len("loss")] + "perplexity"] = _perplexity(logs[key])
        if self.fed_callback is not None and not any(k.startswith("eval_") for k in logs):
            logs.update(self.fed_callback.metrics())
        super().log(logs, start_time)

    def create_model_card(self, **kwargs: Any) -> None:
        # Trainer's draft card knows nothing of the federation; push_to_hub renders this one too.
        self._card_kwargs.update({k: v for k, v in kwargs.items() if v is not None})
        if self.is_world_process_zero():
            write_card(self, self.clock, **self._card_kwargs)
