"""TRL's supervised fine-tuning under FL+FSDP / FL+HSDP: `FedShardSFTTrainer` and `FedShardSFTConfig`.

Needs TRL (``pip install -e ".[trl]"`` in the clone). The classes compose TRL's with hf_fedshard's mixins, in the order
`FedShardMixin` documents: TRL's overrides run first and reach the federation through ``super()``::

    FedShardSFTTrainer -> SFTTrainer -> _BaseTrainer -> FedShardMixin -> Trainer
    FedShardSFTConfig  -> FedShardArgumentsMixin -> SFTConfig -> ... -> TrainingArguments

So `SFTTrainer.log` adds its metrics, `SFTTrainer._save_checkpoint` writes its card and then the federated
checkpoint is written, and `SFTTrainer.compute_loss` runs inside hf_fedshard's `training_step`, which keeps its
per-step metric gathers inside the group (see `hf_fedshard.integrations.group_gather`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainingArguments

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as err:  # an optional extra: say how to get it
    raise ImportError(
        'hf_fedshard.trl needs TRL, which is not installed. Install it with: pip install -e ".[trl]" (in the clone) '
        "(or pip install trl)."
    ) from err

from hf_fedshard.integrations.arguments import FedShardArgumentsMixin
from hf_fedshard.integrations.trainer import FedShardMixin

# SFTTrainer's per-step training metrics: the groups' values are averaged, except token counts, which add up.
_SUMMED_METRICS = ("num_tokens",)


@dataclass
class FedShardSFTConfig(FedShardArgumentsMixin, SFTConfig):
    """`trl.SFTConfig` plus the federation settings of `FedShardArgumentsMixin` (the `fed_*` fields).

    SFTConfig's own defaults hold (`bf16=True` unless `fp16`: turn it off on CPUs without bf16 support).
    """


class FedShardSFTTrainer(SFTTrainer, FedShardMixin):
    """`trl.SFTTrainer` with FL+FSDP / FL+HSDP: same constructor (model as a Hub id or a model, `peft_config`...).

    With a `peft_config`, only the adapter's parameters are trainable, so only they are averaged across groups.
    SFTTrainer's training metrics (`mean_token_accuracy`, `entropy`, `num_tokens`) are gathered over the group at
    every step and combined over the groups at logging steps only: `num_tokens` (an evaluation's `eval_num_tokens`
    too) counts the world's train tokens, the others are the mean of the groups' values (the world's mean when the
    groups train on equally many tokens).
    """

    def __init__(self, model: Any, args: TrainingArguments | None = None, *pos: Any, **kwargs: Any) -> None:
        # SFTTrainer rebuilds any other arguments as a plain SFTConfig, which would drop the fed_* fields.
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = FedShardSFTConfig(output_dir=f"{name.split('/')[-1]}-SFT")
        elif not isinstance(args, FedShardSFTConfig):
            args = FedShardSFTConfig(**{**args.to_dict(), "hub_token": args.hub_token})
        super().__init__(model, args, *pos, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Combine the groups' metrics once per log (SFTTrainer.log averages them next). An evaluation gathers over
        # the world already, except its num_tokens: the group's count of train tokens, like training's. With torchft
        # the groups meet only in averagings: each group logs its own.
        if self.fed_callback is not None and self.args.fed_launch_layout.federated:
            metrics = self._metrics["train" if self.model.training else "eval"]
            keys = sorted(metrics) if self.model.training else [k for k in _SUMMED_METRICS if k in metrics]
            self._combine_group_metrics(metrics, keys)
        super().log(logs, start_time)

    def _combine_group_metrics(self, metrics: dict[str, list[float]], keys: list[str]) -> None:
        """One all-reduce across groups of ``keys`` (the same on every rank; none: no collective): sums of token
        counts, means of the other per-step values (weighted by the groups' ranks where they are of unequal size)."""
        if not keys:
            return
        comm = self.fed_communicator
        if comm.groups is None:  # equal groups: one rank per group, the plain mean over groups
            flat = torch.tensor([v for k in keys for v in metrics[k]], dtype=torch.float64)
            comm.peers.all_reduce_sum(flat)
            scales = {k: 1 if k in _SUMMED_METRICS else comm.num_groups for k in keys}
        else:  # groups of unequal size: every rank, each group's counts once, the means weighted by ranks (samples)
            ranks = len(comm.groups[comm.group].ranks)
            flat = torch.tensor([v / ranks if k in _SUMMED_METRICS else v for k in keys for v in metrics[k]],
                                dtype=torch.float64)  # fmt: skip
            comm.control.all_reduce_sum(flat)
            world = sum(len(g.ranks) for g in comm.groups)
            scales = {k: 1 if k in _SUMMED_METRICS else world for k in keys}
        values = iter(flat.tolist())
        for key in keys:
            metrics[key] = [next(values) / scales[key] for _ in metrics[key]]

    def create_model_card(self, **kwargs: Any) -> None:
        # SFTTrainer writes TRL's card without calling super(): add hf_fedshard's section to it here.
        super().create_model_card(**self._remember_card_kwargs(kwargs))
        self._extend_model_card()
