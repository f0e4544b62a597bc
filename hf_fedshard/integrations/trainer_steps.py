"""FSDP2 inside each federation group, and the work of one training step there (the Trainer's side).

`GroupStepsMixin` keeps FSDP on where Accelerate would drop it (CPU), shards over one group instead of the world,
keeps a step's metric gathers inside the group, and skips a step's gradient work on the steps a speed-aware round
leaves untrained. One of the parts `hf_fedshard.integrations.trainer.FedShardMixin` is made of.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from transformers import Trainer
from transformers.trainer_utils import IntervalStrategy

from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.arguments import FedShardArgumentsMixin
from hf_fedshard.integrations.fsdp import check_weights_present, ensure_fsdp, requested_fsdp_plugin, use_federation_mesh
from hf_fedshard.integrations.group_gather import gathers_within_group
from hf_fedshard.transports.mesh import group_process_group


class GroupStepsMixin(Trainer):
    """FSDP2 over each group (on CPU too), and one training step's work inside it."""

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
