"""The averaging options: the ``fed_*`` settings without their prefix, declared once and checked once for every way in.

Each field here is the one source of its setting's name, type, default and help: `FedShardTrainingArguments` (the
Trainer) derives its ``fed_<name>`` fields from them, `FederatedAverager` (a plain loop) takes them as keyword
arguments, and tests/unit/test_settings.py checks both and the README's settings table against them. Both ways build
the same `AveragingOptions`, so bad values get the same one-line error, naming the setting and the fix, before any
collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hf_fedshard.engine.codec import SYNC_DTYPES
from hf_fedshard.engine.fragments import Schedule
from hf_fedshard.engine.outer import NESTEROV_DEFAULTS, OUTER_OPTIMIZERS, outer_hyperparameters
from hf_fedshard.engine.settings_history import AveragingSettings
from hf_fedshard.engine.sparse import SPARSE, SparseCodec
from hf_fedshard.engine.speed import ROUND_POLICIES
from hf_fedshard.errors import ConfigError


def _setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A setting's field: its default, and its help (the command line's, through `HfArgumentParser`)."""
    return field(default=default, metadata={"help": help, **({"choices": list(choices)} if choices else {})})


@dataclass(frozen=True)
class AveragingOptions:
    """How the groups average; each field is the setting ``fed_<field>`` of `FedShardTrainingArguments`.

    Averaging:
        sync_steps: H, optimizer steps between two averagings (the paper's 8).
        average_optimizer_state: also average the optimizer's moments; off in the paper, and it doubles or
            triples the inter-group bytes with Adam.
        outer_optimizer: how an averaging moves the global model with the groups' mean pseudo-gradient
            Δ = anchor − local. ``"fedavg"``: SGD with lr 1 (the plain average of the models); ``"nesterov"``: SGD
            with Nesterov momentum (DiLoCo).
        outer_lr: the nesterov outer learning rate (``None``: 0.7). Not for fedavg.
        outer_momentum: the nesterov outer momentum, in [0, 1) (``None``: 0.9).
        sync_dtype: the dtype of Δ between groups: ``"float32"``, ``"bfloat16"`` (half the bytes), ``"int8"`` (a
            quarter, plus one fp32 scale per 256 values) or ``"topk"`` (sparse and low-bit, below); the sum is always
            accumulated in fp32 and every group decodes the same bytes.
        sync_density, sync_bits, sync_chunk: ``sync_dtype="topk"`` only (`hf_fedshard.engine.sparse`): in each chunk
            of ``sync_chunk`` values of a rank's shard, the ``sync_density`` fraction of largest values is sent, in
            ``sync_bits`` bits with one fp32 scale per chunk, with their indices (``None``: 0.01, 2 and 4096).
        sync_feedback_decay: ``"topk"`` only: β, what is not sent is kept and β times it is added to the next
            averaging's Δ (`hf_fedshard.engine.feedback`); 1 loses nothing (``None``: 1).
        split_exchange: FL+HSDP only: each of the Q replicas of a group sends 1/Q of its shard between groups and
            the group all-gathers the rest, so the slow tier carries the payload once per group instead of Q times
            (same result).

    Streaming and overlap (docs/overlap.md):
        sync_fragments: F, fragments of whole FSDP units (balanced by bytes), each with its own anchor and outer
            momentum; fragment f averages on the steps ≡ (f + 1)·H/F (mod H), so the inter-group link carries 1/F
            of the model every H/F steps. Must divide ``sync_steps``.
        sync_overlap: τ, steps an exchange runs behind training before it is applied (new anchor + the local
            progress made meanwhile). 0 blocks; must be below H/F.
        outer_state_on_device: keep the anchors and outer momentum of CUDA shards on the GPU; by default they live
            in pinned CPU memory.

    Groups of different speeds (docs/speed_aware_rounds.md):
        round_policy: ``"steps"``: every group trains all H steps of a round, and the faster groups wait for the
            slowest at every averaging. ``"speed"``: each group trains as many of the round's H steps as its
            measured speed allows (the fastest all H, a group half as fast H/2) and reads past the rest of the
            round's batches untrained, so the groups reach the averaging together; the mean of Δ is weighted by the
            samples each group trained. ``max_steps``, the LR schedule, evaluations, checkpoints and the data
            position keep counting the federation's steps.
        min_round_steps: with ``"speed"``, the fewest of a round's steps a group trains.

    Fault tolerance (docs/fault_tolerance.md):
        timeout_s: seconds an averaging waits for the other groups before it fails with an error naming this
            setting. ``None``: the Trainer's ``ddp_timeout`` (30 minutes by default), which bounds every other
            collective across groups, on CPU too; in a plain loop, PyTorch's default process-group timeout.
    """

    sync_steps: int = _setting(8, "H: optimizer steps between two averagings of the model across groups.")
    average_optimizer_state: bool = _setting(
        False, "Also average the optimizer's moments across groups (more inter-group bytes)."
    )
    outer_optimizer: str = _setting(
        "fedavg",
        "Outer optimizer of the averagings, on the groups' mean pseudo-gradient: fedavg (plain average) or nesterov "
        "(DiLoCo).",
        tuple(OUTER_OPTIMIZERS),
    )
    outer_lr: float | None = _setting(None, f"Outer learning rate of nesterov (default {NESTEROV_DEFAULTS['lr']}).")
    outer_momentum: float | None = _setting(
        None, f"Outer momentum of nesterov, in [0, 1) (default {NESTEROV_DEFAULTS['momentum']})."
    )
    sync_dtype: str = _setting(
        "float32",
        "Dtype of the pseudo-gradient between groups: float32, bfloat16 (1/2 the bytes), int8 (about 1/4) or topk "
        "(the largest values of each chunk, low-bit, with error feedback); summed in fp32.",
        tuple(SYNC_DTYPES),
    )
    sync_density: float | None = _setting(
        None, "fed_sync_dtype topk: the fraction of each chunk's values sent, in (0, 1] (default 0.01)."
    )
    sync_bits: int | None = _setting(None, "fed_sync_dtype topk: bits per value sent: 2, 4 or 8 (default 2).")
    sync_chunk: int | None = _setting(
        None, "fed_sync_dtype topk: values per chunk; each chunk sends its largest values (default 4096)."
    )
    sync_feedback_decay: float | None = _setting(
        None,
        "fed_sync_dtype topk: β in [0, 1]; β times what was not sent is added to the next averaging (default 1).",
    )
    split_exchange: bool = _setting(
        True, "FL+HSDP: each replica sends 1/Q of the shard between groups (Q times fewer bytes)."
    )
    sync_fragments: int = _setting(
        1,
        "F: averaging streams F fragments of whole FSDP units, fragment f on the steps ≡ (f+1)·H/F (mod H); must "
        "divide fed_sync_steps.",
    )
    sync_overlap: int = _setting(
        0,
        "τ: an exchange runs behind τ more training steps before it is applied (keeping their progress); 0 blocks. "
        "Must be below fed_sync_steps / fed_sync_fragments.",
    )
    outer_state_on_device: bool = _setting(
        False, "Keep CUDA anchors and outer momentum on the GPU (default: pinned CPU memory)."
    )
    timeout_s: float | None = _setting(
        None,
        "Seconds an averaging waits for the other groups before failing with an error. Default: the world's "
        "ddp_timeout.",
    )
    round_policy: str = _setting(
        "steps",
        "steps: every group trains all fed_sync_steps of a round (the others wait for the slowest); speed: each "
        "group trains as many as its measured speed allows, so they arrive together.",
        tuple(ROUND_POLICIES),
    )
    min_round_steps: int = _setting(1, "fed_round_policy speed: the fewest of a round's steps a slow group trains.")

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
        self._check_sparse_settings()
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
        lr, momentum = self.outer
        if not lr > 0:
            raise ConfigError(f"fed_outer_lr={lr}: it must be positive. Set --fed_outer_lr above 0 (DiLoCo: 0.7).")
        if not 0 <= momentum < 1:
            raise ConfigError(
                f"fed_outer_momentum={momentum}: it must be in [0, 1). Set --fed_outer_momentum to e.g. 0.9."
            )

    def _check_sparse_settings(self) -> None:
        given = [f"fed_{name}" for name in _SPARSE_SETTINGS if getattr(self, name) is not None]
        if given and self.sync_dtype != SPARSE:
            raise ConfigError(
                f"{', '.join(given)} set the sparse payload, but fed_sync_dtype={self.sync_dtype!r}. Add "
                f"--fed_sync_dtype {SPARSE}, or drop them."
            )
        if self.sparse is None:  # building the codec checks density, bits and chunk
            return
        if not 0 <= self.feedback_decay <= 1:
            raise ConfigError(
                f"fed_sync_feedback_decay={self.feedback_decay}: it must be in [0, 1]. Set --fed_sync_feedback_decay "
                "to 1 (plain error feedback) or e.g. 0.95."
            )
        if self.round_policy == "speed":
            raise ConfigError(
                "fed_sync_dtype topk keeps each group's unsent Δ for later rounds, which fed_round_policy speed would "
                "weight by a later round's steps: set --fed_round_policy steps, or another --fed_sync_dtype."
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
        if self.round_policy == "speed" and self.sync_fragments > 1:
            raise ConfigError(
                "fed_round_policy speed plans whole rounds, which fed_sync_fragments cuts up: set "
                "--fed_sync_fragments 1, or --fed_round_policy steps."
            )
        if self.round_policy == "speed" and self.min_round_steps < self.sync_overlap:
            raise ConfigError(
                f"fed_min_round_steps={self.min_round_steps} is below fed_sync_overlap={self.sync_overlap}: a round's "
                "plan is agreed at its apply, τ steps into the round, so its first τ steps must be trained under any "
                f"plan. Set --fed_min_round_steps {self.sync_overlap} or more."
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
    def sparse(self) -> SparseCodec | None:
        """The sparse payload's codec (``sync_dtype="topk"``), defaults filled in; ``None`` for a dense payload."""
        if self.sync_dtype != SPARSE:
            return None
        defaults = SparseCodec()
        return SparseCodec(
            defaults.density if self.sync_density is None else self.sync_density,
            defaults.bits if self.sync_bits is None else self.sync_bits,
            defaults.chunk if self.sync_chunk is None else self.sync_chunk,
        )

    @property
    def feedback_decay(self) -> float:
        """β of the sparse payload's error feedback, default filled in."""
        return 1.0 if self.sync_feedback_decay is None else self.sync_feedback_decay

    @property
    def schedule(self) -> Schedule:
        """When each fragment of the model averages (`hf_fedshard.engine.fragments`)."""
        return Schedule(self.sync_steps, self.sync_fragments, self.sync_overlap)


_SPARSE_SETTINGS = ("sync_density", "sync_bits", "sync_chunk", "sync_feedback_decay")


def averaging_options(settings: dict[str, Any]) -> AveragingOptions:
    """`AveragingOptions` of keyword ``settings`` (a plain loop's), refusing a name it does not know in one line."""
    known = [f.name for f in fields(AveragingOptions)]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ConfigError(
            f"FederatedAverager got {', '.join(map(repr, unknown))}, which is not an averaging setting. The settings "
            f"are {', '.join(known)} (the fed_* settings without the prefix)."
        )
    return AveragingOptions(**settings)
