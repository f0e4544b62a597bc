"""The averaging options: the ``fed_*`` settings without their prefix, checked once for every way in.

`FedShardTrainingArguments` (the Trainer) and `FederatedAverager` (a plain loop) build the same `AveragingOptions`,
so bad values get the same one-line error, naming the setting and the fix, before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_fedshard.engine.codec import SYNC_DTYPES
from hf_fedshard.engine.fragments import Schedule
from hf_fedshard.engine.outer import OUTER_OPTIMIZERS, outer_hyperparameters
from hf_fedshard.engine.settings_history import AveragingSettings
from hf_fedshard.engine.speed import ROUND_POLICIES
from hf_fedshard.errors import ConfigError


@dataclass(frozen=True)
class AveragingOptions:
    """How the groups average (see `FedShardArgumentsMixin` for each ``fed_*`` field's meaning and default)."""

    sync_steps: int = 8
    average_optimizer_state: bool = False
    outer_optimizer: str = "fedavg"
    outer_lr: float | None = None
    outer_momentum: float | None = None
    sync_dtype: str = "float32"
    split_exchange: bool = True
    sync_fragments: int = 1
    sync_overlap: int = 0
    outer_state_on_device: bool = False
    timeout_s: float | None = None
    round_policy: str = "steps"
    min_round_steps: int = 1

    def __post_init__(self) -> None:
        if self.sync_steps < 1:
            raise ConfigError(
                f"fed_sync_steps={self.sync_steps}: it must be at least 1. Set --fed_sync_steps to the "
                "number of optimizer steps between averagings (the paper uses 8)."
            )
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(
                f"fed_timeout_s={self.timeout_s}: it must be a positive number of seconds. Set --fed_timeout_s "
                "above the longest expected wait of one group for the others (or leave it unset)."
            )
        self._check_outer_settings()
        self._check_round_policy()

    def _check_outer_settings(self) -> None:
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ConfigError(
                f"fed_outer_optimizer={self.outer_optimizer!r} is unknown. Set --fed_outer_optimizer to one of "
                f"{', '.join(OUTER_OPTIMIZERS)}."
            )
        if self.sync_dtype not in SYNC_DTYPES:
            raise ConfigError(
                f"fed_sync_dtype={self.sync_dtype!r} is unknown. Set --fed_sync_dtype to one of "
                f"{', '.join(SYNC_DTYPES)}."
            )
        if self.outer_optimizer == "fedavg" and (self.outer_lr, self.outer_momentum) != (None, None):
            raise ConfigError(
                "fed_outer_lr/fed_outer_momentum apply to fed_outer_optimizer='nesterov'; fedavg is the plain "
                "average (lr 1, no momentum). Add --fed_outer_optimizer nesterov, or drop them."
            )
        self.schedule.validate()
        if self.schedule.streaming and self.average_optimizer_state:
            raise ConfigError(
                "fed_average_optimizer_state averages the moments in blocking averagings only; drop it, or set "
                "--fed_sync_fragments 1 --fed_sync_overlap 0."
            )
        lr, momentum = self.outer
        if not lr > 0:
            raise ConfigError(f"fed_outer_lr={lr}: it must be positive. Set --fed_outer_lr above 0 (DiLoCo: 0.7).")
        if not 0 <= momentum < 1:
            raise ConfigError(
                f"fed_outer_momentum={momentum}: it must be in [0, 1). Set --fed_outer_momentum to e.g. 0.9."
            )

    def _check_round_policy(self) -> None:
        if self.round_policy not in ROUND_POLICIES:
            raise ConfigError(
                f"fed_round_policy={self.round_policy!r} is unknown. Set --fed_round_policy to one of "
                f"{', '.join(ROUND_POLICIES)}."
            )
        if not 1 <= self.min_round_steps <= self.sync_steps:
            raise ConfigError(
                f"fed_min_round_steps={self.min_round_steps} must be in [1, fed_sync_steps={self.sync_steps}]: the "
                "fewest of a round's steps a slow group trains. Set --fed_min_round_steps within it."
            )
        if self.round_policy == "speed" and self.schedule.streaming:
            raise ConfigError(
                "fed_round_policy speed plans whole rounds, which fed_sync_fragments/fed_sync_overlap cut up: set "
                "--fed_sync_fragments 1 --fed_sync_overlap 0, or --fed_round_policy steps."
            )

    @property
    def speed_aware(self) -> bool:
        """Whether each group trains the steps its speed allows (``fed_round_policy speed``)."""
        return self.round_policy == "speed"

    @property
    def outer(self) -> tuple[float, float]:
        """(lr, momentum) of the outer SGD, defaults filled in: (1, 0) for fedavg."""
        return outer_hyperparameters(self.outer_optimizer, self.outer_lr, self.outer_momentum)

    @property
    def settings(self) -> AveragingSettings:
        """The outer optimizer and wire dtype as the averagings use (and checkpoints record) them."""
        return AveragingSettings(self.outer_optimizer, *self.outer, self.sync_dtype)

    @property
    def schedule(self) -> Schedule:
        """When each fragment of the model averages (`hf_fedshard.engine.fragments`)."""
        return Schedule(self.sync_steps, self.sync_fragments, self.sync_overlap)
