"""`FedAvgCallback`: the Trainer's hooks into `FederatedAverager`, so the training loop stays Transformers' own.

The callback decides nothing about averaging: it builds the engine when training starts (on the sharded model and
its optimizer), tells it of every optimizer step, of an evaluation that follows and of the end, and keeps a
checkpoint's state until the engine exists to take it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import IntervalStrategy

from hf_fedshard.engine import (
    AveragingOptions,
    FederatedAverager,
    FederationCommunicator,
    History,
    check_state,
)


class FedAvgCallback(TrainerCallback):
    """Averages the model across federation groups with a `FederatedAverager` (outer FedAvg or Nesterov on
    pseudo-gradients, blocking or streamed): ``averager`` exists from `on_train_begin` on.

    Args:
        communicator: the cross-group collectives (a transport's `Federation.communicator`, `hf_fedshard.transports`).
        options: the averaging settings (``args.fed_averaging_options``).
        before_eval: called on every rank right before an evaluation that sees the groups differ, while each group
            still holds its own model (per-group evaluation); may be replaced before training starts.
    """

    def __init__(
        self,
        communicator: FederationCommunicator,
        options: AveragingOptions,
        before_eval: Callable[[], None] | None = None,
    ) -> None:
        self.communicator, self.options, self.before_eval = communicator, options, before_eval
        self.averager: FederatedAverager | None = None
        self._resume_state: dict | None = None  # a checkpoint's, until on_train_begin builds the averager
        self._resume_committed = False  # that state is a live group's committed one (a heal at launch)

    def load_state_dict(self, state: dict, committed: bool = False) -> None:
        """Keep a checkpoint's averaging state (`FederatedAverager.state_dict`, ``step`` aside) for the averager;
        ``committed``: it is a live group's committed state (a heal at launch), which becomes this group's own."""
        check_state({**state, "step": 0}, self.options.schedule)
        self._resume_state, self._resume_committed = state, committed

    @property
    def settings_history(self) -> History:
        """What the averagings ran with, step by step (before training: this run's settings)."""
        return self.averager.settings_history if self.averager else [(0, self.options.settings)]

    def metrics(self) -> dict[str, float]:
        """The ``fed_*`` values to log (none before training)."""
        return self.averager.metrics() if self.averager else {}

    @property
    def trains_next_step(self) -> bool:
        """Whether this group trains the step being taken (`FederatedAverager.should_train`; before training: yes)."""
        return self.averager is None or self.averager.should_train

    @contextlib.contextmanager
    def global_model(self, evaluating: bool = False) -> Iterator[None]:
        """`FederatedAverager.global_model`; before training every group holds the model it was given."""
        if self.averager is None:
            yield
            return
        with self.averager.global_model(evaluating):
            yield

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # A fresh run averages the initial weights into the first anchor; a resumed one takes its checkpoint's.
        resuming = state.global_step > 0 or self._resume_state is not None  # a checkpoint or a heal
        self.averager = FederatedAverager(
            model, optimizer, communicator=self.communicator, before_eval=self._before_eval,
            average_initial_weights=not resuming, **asdict(self.options),
        )  # fmt: skip
        if resuming:
            if self._resume_state is None:
                raise RuntimeError(
                    f"hf_fedshard: training resumed at step {state.global_step} without the checkpoint's averaging "
                    "state; resume a federated run with FedShardTrainer.train(resume_from_checkpoint=...)."
                )
            self.averager.load_state_dict({**self._resume_state, "step": state.global_step})
            membership = self.averager.comm.membership
            if self._resume_committed and membership is not None:  # I1: a group joining next may heal from this one
                membership.heal.commit()
        self._resume_state = None

    def _before_eval(self) -> None:
        if self.before_eval is not None:
            self.before_eval()

    def on_step_begin(self, args, state, control, **kwargs):
        self.averager.step_begins()

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        evaluating = control.should_evaluate or _epoch_evaluation_follows(args, state, control)
        self.averager.step(evaluating=evaluating, last=control.should_training_stop)
        if self.averager.step_count != state.global_step:
            raise RuntimeError(
                f"hf_fedshard: the averager counted {self.averager.step_count} steps where the Trainer is at "
                f"{state.global_step}; was step() called outside FedAvgCallback?"
            )
        if self.averager.diverged_at_step == state.global_step:  # Trainer's logging_nan_inf_filter hides NaN losses
            control.should_log = True

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_training_stop:
            self.averager.finish()

    def on_train_end(self, args, state, control, **kwargs):
        self.averager.finish()


def _epoch_evaluation_follows(args: TrainingArguments, state: TrainerState, control: TrainerControl) -> bool:
    """Whether `on_epoch_end` will ask for an evaluation after this step (it decides after `on_step_end`)."""
    epoch_ends = control.should_training_stop or abs(state.epoch - round(state.epoch)) < 1e-9
    return args.eval_strategy == IntervalStrategy.EPOCH and epoch_ends and args.eval_delay <= state.epoch
