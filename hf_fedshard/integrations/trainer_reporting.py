"""Evaluation, logs and the model card of a federated run (the Trainer's side).

`ReportingMixin` evaluates the global model (and each group's own, with ``fed_eval_per_group``), logs perplexity
beside every loss with the federation's counters and extends the model card. One of the parts of
`hf_fedshard.integrations.trainer.FedShardMixin`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import Trainer

from hf_fedshard.integrations.card import CARD_EXTRAS, clock_hidden, extend_card
from hf_fedshard.integrations.group_eval import evaluate_each_group

logger = logging.getLogger(__name__)


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class ReportingMixin(Trainer):
    """Evaluations of the global model (and each group's), logs with perplexity and counters, the card."""

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        # Evaluate the global model (the groups' plain average); each group keeps training its own afterwards.
        if self.fed_callback is None:
            return super().evaluate(*args, **kwargs)
        with self.fed_callback.global_model(evaluating=True):
            return super().evaluate(*args, **kwargs)

    def _evaluate_each_group(self) -> None:
        """Evaluate every group's own model (the averager calls this before the global model is evaluated)."""
        group = self._group_pg if self._group_size > 1 else None
        apart = self.args.fed_launch.groups_publish_apart  # a launch per group: no collective outside averagings
        index = self.args.fed_group_index(self.args.process_index)
        metrics = evaluate_each_group(self, group, None if apart else self.fed_communicator, index)
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
