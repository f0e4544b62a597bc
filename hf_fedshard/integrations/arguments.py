"""The federation settings (`fed_*`) as a dataclass mixin, and `FedShardTrainingArguments` built from it.

`FedShardArgumentsMixin` adds the `fed_*` fields to any `TrainingArguments` subclass (TRL's configs too); put it
first among the bases so that its `__post_init__` adjusts the settings before the subclass's own runs::

    @dataclass
    class MyConfig(FedShardArgumentsMixin, SFTConfig): ...

`HfArgumentParser` parses the fields like any other.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from transformers import TrainingArguments
from transformers.trainer_utils import IntervalStrategy

from hf_fedshard.engine.fragments import Schedule
from hf_fedshard.engine.options import AveragingOptions
from hf_fedshard.engine.settings_history import AveragingSettings
from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.timeouts import start_world_process_group
from hf_fedshard.launch_guard import check_restart_store, setup_deadline, watch_launcher
from hf_fedshard.notices import notice as _notice
from hf_fedshard.startup import moment, phase
from hf_fedshard.topology import FederationLayout, parse_group_size
from hf_fedshard.transports import TRANSPORTS, GroupLaunch, OneJob, get_transport, settings_owners

moment("imports done")  # a script imports this before it parses its arguments: the start-up line's first phase


def averaging_setting(name: str) -> Any:
    """The field of ``fed_<name>``: `AveragingOptions`' default and help, their one source (its type is written beside
    the field, and tests/unit/test_settings.py checks it is the engine's)."""
    declared = {f.name: f for f in fields(AveragingOptions)}[name]
    return field(default=declared.default, metadata=dict(declared.metadata))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


@dataclass
class FedShardArgumentsMixin:
    """The federation settings of FL+FSDP / FL+HSDP, for any `TrainingArguments` subclass (bases: mixin first).

    Federation layout:
        fed_group_size (`int` or `str`, *optional*): ranks per federation group (contiguous ranks, e.g. one
            node). `None` or the world size means one group: plain FSDP/HSDP, no averaging. A comma-separated
            list (``"4,2,2"``, or a tuple) gives each group its own size, in rank order: groups of unequal size,
            averaged by the samples each trained on (`hf_fedshard.engine.pieces`). With `fed_transport torchft`
            the list names every launch's size (`fed_num_groups` of them; this launch's WORLD_SIZE is entry
            `fed_group_id`).
        fed_shard_size (`int`, *optional*): ranks sharding one model copy inside a group. `None` means the
            group size (FL+FSDP); a divisor of it gives FL+HSDP with `fed_group_size // fed_shard_size`
            replicas per group.

    Averaging, streaming, groups of different speeds (docs/overlap.md, docs/speed_aware_rounds.md):
        fed_sync_steps, fed_average_optimizer_state, fed_outer_optimizer, fed_outer_lr, fed_outer_momentum,
        fed_sync_dtype, fed_sync_density, fed_sync_bits, fed_sync_chunk, fed_sync_feedback_decay,
        fed_split_exchange, fed_sync_fragments, fed_sync_overlap, fed_outer_state_on_device,
        fed_round_policy, fed_min_round_steps, fed_timeout_s: the fields of
        `hf_fedshard.engine.options.AveragingOptions` with the ``fed_`` prefix; their type, default, help and
        meaning are declared there once (a plain loop passes the same settings to `FederatedAverager`), and
        `fed_averaging_options` builds them. ``fed_timeout_s`` unset uses ``ddp_timeout``.

    Evaluation:
        fed_eval_per_group (`bool`, defaults to `False`): at each evaluation during training, first evaluate
            every group's own model (before the evaluation of the groups' average), logged as
            `eval_group{g}_loss` / `eval_group{g}_perplexity` beside the global model's `eval_loss`. Each group
            reads the whole eval set over its own ranks, so an evaluation costs about twice as much.

    Fault tolerance (docs/fault_tolerance.md):
        fed_auto_resume (`bool`, defaults to `False`): `train()` resumes from the newest verifying checkpoint in
            `output_dir` when there is one (and starts afresh otherwise), so that a job restarted by
            `torchrun --max-restarts=N` continues where it stopped. Needs `save_strategy="steps"` or `"epoch"`.
        fed_async_checkpoint (`bool`, defaults to `False`): a checkpoint stops training only while each rank copies
            its shards to host memory; DCP writes them in the background and the checkpoint is published
            (manifest, then the rename to `checkpoint-N`) once every rank's writes are done. One save in flight at
            most: the next waits for it (`hf_fedshard.checkpointing.background`).

    Transport (docs/fault_tolerance.md, "Groups that die and join"):
        fed_transport (`str`, defaults to `"mesh"`): `"mesh"`: every group in one job (one launch, one
            `torch.distributed` world); a failed rank stops the job. `"torchft"`: every group is its own launch
            and averages through torchft with the groups alive (needs `pip install -e '.[elastic]'` in the clone).
        fed_lighthouse (`str`, *optional*): torchft: the Lighthouse's address, `http://HOST:PORT`
            (`python -m hf_fedshard.lighthouse`).
        fed_group_id (`int`, *optional*): torchft: this launch's group, in `0 … fed_num_groups - 1`.
        fed_num_groups (`int`, *optional*): torchft: the nominal number of groups; group G reads slice G of N
            of every epoch (what its ranks would read with `mesh`).
        fed_transport_options (`dict` or JSON `str`, *optional*): the transport's own settings by name, for a
            transport registered with `hf_fedshard.transports.register_transport` (the three above are torchft's,
            and may be given here too).
        With torchft every group writes into `output_dir/fed_group{G}` (checkpoints, logs, the exported model),
        an evaluation between averagings is a round of its own (not inside an exchange's flight), each launch logs
        only its own group's `fed_eval_per_group` loss, and `load_best_model_at_end` is refused (it needs the groups
        outside an averaging).

    Batch arithmetic: one optimizer step of one group sees
    `per_device_train_batch_size × fed_group_size × gradient_accumulation_steps` samples (the *group batch*);
    the world processes `num_groups` such batches per step.

    Defaults that differ from `TrainingArguments` when a federation setting is given:
        - no FSDP configured: FSDP2 is turned on, wrapping the model's `_no_split_modules`;
        - no accelerator present (and FSDP or a fed setting asked for): `use_cpu` is turned on, so that the
          ranks form a gloo process group;
        - several groups: `average_tokens_across_devices` is turned off, since it is an all-gather over the
          whole world (the slow tier) at every step; each rank normalises its loss by its own tokens.
    """

    fed_group_size: int | str | None = field(
        default=None,
        metadata={
            "help": "Ranks per federation group (e.g. GPUs per node), or each group's, e.g. 4,2,2 (groups of "
            "unequal size, in rank order; torchft: every launch's). Default: the world (no federation)."
        },
    )
    fed_shard_size: int | None = field(
        default=None,
        metadata={
            "help": "Ranks sharding one model copy inside a group. Default: the group (FL+FSDP); "
            "a divisor of it gives FL+HSDP."
        },
    )
    fed_sync_steps: int = averaging_setting("sync_steps")
    fed_average_optimizer_state: bool = averaging_setting("average_optimizer_state")
    fed_outer_optimizer: str = averaging_setting("outer_optimizer")
    fed_outer_lr: float | None = averaging_setting("outer_lr")
    fed_outer_momentum: float | None = averaging_setting("outer_momentum")
    fed_sync_dtype: str = averaging_setting("sync_dtype")
    fed_sync_density: float | None = averaging_setting("sync_density")
    fed_sync_bits: int | None = averaging_setting("sync_bits")
    fed_sync_chunk: int | None = averaging_setting("sync_chunk")
    fed_sync_feedback_decay: float | None = averaging_setting("sync_feedback_decay")
    fed_split_exchange: bool = averaging_setting("split_exchange")
    fed_sync_fragments: int = averaging_setting("sync_fragments")
    fed_sync_overlap: int = averaging_setting("sync_overlap")
    fed_outer_state_on_device: bool = averaging_setting("outer_state_on_device")
    fed_round_policy: str = averaging_setting("round_policy")
    fed_min_round_steps: int = averaging_setting("min_round_steps")
    fed_eval_per_group: bool = field(
        default=False,
        metadata={
            "help": "At each evaluation during training, also evaluate every group's own model, beside the groups' "
            "average (eval_group{g}_perplexity; one line per group in the card's plot)."
        },
    )
    fed_timeout_s: float | None = averaging_setting("timeout_s")
    fed_auto_resume: bool = field(
        default=False,
        metadata={
            "help": "Resume from the newest checkpoint in output_dir that verifies, if there is one (for torchrun "
            "--max-restarts): a restarted job continues where it stopped."
        },
    )
    fed_async_checkpoint: bool = field(
        default=False,
        metadata={
            "help": "Write checkpoints in the background: training stops only while each rank copies its shards to "
            "host memory; a checkpoint is published (manifest, rename) once every rank's writes are done."
        },
    )

    fed_transport: str = field(
        default="mesh",
        metadata={
            "help": " ".join(f"{name}: {t.summary}" for name, t in TRANSPORTS.items())
            + " (or one registered with hf_fedshard.transports.register_transport)."
        },
    )
    fed_lighthouse: str | None = field(
        default=None, metadata={"help": "torchft: the Lighthouse's address, http://HOST:PORT."}
    )
    fed_group_id: int | None = field(
        default=None,
        metadata={"help": "torchft: this launch's federation group, 0 … fed_num_groups - 1."},
    )
    fed_num_groups: int | None = field(
        default=None,
        metadata={
            "help": "torchft: the nominal number of groups (group G reads slice G of N of every epoch).",
        },
    )
    fed_transport_options: dict | str | None = field(
        default=None,
        metadata={
            "help": 'The transport\'s own settings as a JSON object, e.g. \'{"store": "host:29600"}\' (for a transport '
            "registered with hf_fedshard.transports.register_transport; its settings dataclass names them)."
        },
    )

    def __post_init__(self) -> None:
        # Adjust FSDP, use_cpu and token averaging before TrainingArguments reads them.
        self.fed_group_size = parse_group_size(self.fed_group_size)
        launch = self.fed_launch  # the transport's settings, checked
        launch.check(self.fed_transport, self.fed_group_size, int(os.environ.get("WORLD_SIZE", "1")))
        self.output_dir = launch.output_dir(self.output_dir)  # a launch per group: each writes its own folder
        options = self.fed_averaging_options  # checks the averaging settings, one line each
        layout = self.fed_layout  # validates the sizes against WORLD_SIZE before any process group exists
        if layout.federated and 0 < self.max_steps < options.sync_steps:
            _notice(
                "max_steps=%d < fed_sync_steps=%d: no averaging happens before the final one after "
                "step %d. Lower --fed_sync_steps or raise --max_steps.",
                self.max_steps,
                self.fed_sync_steps,
                self.max_steps,
            )
        self._note_pace_setters(options.speed_aware and layout.federated)
        if layout.federated and self.auto_find_batch_size:
            raise ConfigError(
                "auto_find_batch_size halves the batch of the rank that ran out of memory, on that rank alone: its "
                "group's other ranks (and the other groups, whose batch is the same setting) would then wait on "
                "collectives it no longer runs. Turn --auto_find_batch_size off and set a "
                "--per_device_train_batch_size that fits."
            )
        if (layout.federated or launch.federated) and self.enable_jit_checkpoint:
            raise ConfigError(
                "enable_jit_checkpoint saves on the step at which each rank's own SIGTERM timer fires, but a federated "
                "checkpoint is a collective of every rank at one step: ranks would enter it at different steps. "
                "Turn --enable_jit_checkpoint off; save often with --save_steps and --fed_async_checkpoint instead "
                "(a checkpoint then costs a copy to host memory), and resume with --fed_auto_resume."
            )
        if self.fed_requested:
            self._check_sharding_backend()
            if not self.fsdp and not _env_flag("ACCELERATE_USE_FSDP"):
                self.fsdp = True
                self.fsdp_config = {**self._fsdp_config_dict(), "version": 2}
                _notice(
                    "%s asked for and no FSDP configured: turning on FSDP2 (model's _no_split_modules)", layout.method
                )
        if self._requested_fsdp_version() and not torch.accelerator.is_available() and not self.use_cpu:
            self.use_cpu = True
            _notice("no accelerator found: FSDP2 runs on the CPU with gloo (use_cpu=True)")
        if layout.federated:
            self.average_tokens_across_devices = False
        super().__post_init__()
        launch.check_training(self)
        if self.fed_async_checkpoint and not (layout.federated or launch.federated):
            _notice("fed_async_checkpoint has no effect with one federation group: Trainer writes its own checkpoints")
        if self.fed_eval_per_group and not self.fed_evaluates_groups:
            _notice(
                "fed_eval_per_group has no effect %s",
                "without evaluations during training: set --eval_strategy steps"
                if layout.federated
                else "with one federation group",
            )

    @cached_property
    def _setup_devices(self) -> torch.device:
        # Transformers' use_cpu set-up leaves ddp_timeout out of the world process group: create it first, within a
        # deadline; and watch the launcher from here on (hf_fedshard.launch_guard).
        with phase("arguments and process groups"):
            check_restart_store()
            watch_launcher()
            with setup_deadline():
                start_world_process_group(self)
                return super()._setup_devices

    @property
    def fed_exchange_timeout_s(self) -> float:
        """Seconds an averaging waits for the other groups: ``fed_timeout_s``, else ``ddp_timeout``."""
        return self.fed_timeout_s if self.fed_timeout_s is not None else self.ddp_timeout

    @property
    def fed_averaging_options(self) -> AveragingOptions:
        """The averaging settings as the engine takes them (`FederatedAverager`'s keywords), checked on construction."""
        return AveragingOptions(**{f.name: getattr(self, f"fed_{f.name}") for f in fields(AveragingOptions)})

    @property
    def fed_averaging_settings(self) -> AveragingSettings:
        """The outer optimizer and wire dtype as the averagings use (and checkpoints record) them."""
        return self.fed_averaging_options.settings

    @property
    def fed_schedule(self) -> Schedule:
        """When each fragment of the model averages (`hf_fedshard.engine.fragments`)."""
        return self.fed_averaging_options.schedule

    @property
    def fed_requested(self) -> bool:
        """True when any federation setting is given (even one group of HSDP through `fed_shard_size`)."""
        return self.fed_group_size is not None or self.fed_shard_size is not None or self.fed_launch.federated

    @cached_property
    def fed_launch(self) -> OneJob | GroupLaunch:
        """The transport's settings (`hf_fedshard.transports`), from its ``fed_*`` flags and
        ``fed_transport_options``: which groups this launch holds, what it reads and where it writes."""
        transport = get_transport(self.fed_transport)
        options = _transport_options(self.fed_transport_options)
        flags = {name: getattr(self, f"fed_{name}") for name in _transport_flags() if hasattr(self, f"fed_{name}")}
        names = {f.name for f in dataclasses.fields(transport.settings)}
        foreign = [f"fed_{name}" for name, value in flags.items() if value is not None and name not in names]
        if foreign:
            owners = " or ".join(dict.fromkeys(o for name in foreign for o in settings_owners(name[len("fed_") :])))
            raise ConfigError(
                f"{', '.join(foreign)} belong to fed_transport {owners}, not {self.fed_transport}. Add "
                f"--fed_transport {owners.split(' or ')[0]}, or drop them."
            )
        given = {name: value for name, value in flags.items() if name in names and value is not None}
        twice = [f"fed_{name}" for name in given if name in options]
        if twice:
            raise ConfigError(f"{', '.join(twice)} given both as a flag and in fed_transport_options. Give each once.")
        return transport.parse_settings({**given, **options}, frozenset(flags))

    @property
    def fed_evaluates_groups(self) -> bool:
        """True when `fed_eval_per_group` has an effect: several groups and evaluations during training."""
        return self.fed_eval_per_group and self.fed_layout.federated and self.eval_strategy != IntervalStrategy.NO

    @property
    def fed_layout(self) -> FederationLayout:
        """The federation layout (needs only the `WORLD_SIZE` environment variable); with a launch per group, the
        nominal one of every launch."""
        return self.fed_launch.federation_layout(self.fed_launch_layout, self.fed_group_size, self.fed_shard_size)

    @property
    def fed_launch_layout(self) -> FederationLayout:
        """This launch's ranks: the whole federation with ``mesh``, one group with a launch per group."""
        return self.fed_launch.launch_layout(self.fed_group_size, self.fed_shard_size)

    def fed_group_index(self, process_index: int) -> int:
        """The federation group of the rank ``process_index`` of this launch."""
        return self.fed_launch.group_index(self.fed_layout, process_index)

    def _note_pace_setters(self, speed_aware: bool) -> None:
        """Under ``fed_round_policy speed`` in one job, Trainer's loss log (an all-gather over the world) is a barrier
        across groups: at every log the faster groups wait for the slowest, which the policy exists to avoid."""
        steps = self.logging_steps if self.logging_strategy == IntervalStrategy.STEPS else 0
        if speed_aware and self.fed_launch_layout.federated and steps and steps % self.fed_sync_steps:
            _notice(
                "fed_round_policy speed: logging_steps=%g is not a multiple of fed_sync_steps=%d, and Trainer's loss "
                "log gathers over every group, so the faster groups wait for the slowest at each log. Set "
                "--logging_steps to a multiple of %d.",
                self.logging_steps, self.fed_sync_steps, self.fed_sync_steps,
            )  # fmt: skip

    def check_train_dataset_size(self, num_samples: int) -> None:
        """Refuse a dataset smaller than the world's first step, which the sampler would pad with repeats.

        Padding would feed some groups copies of other groups' samples in place of data of their own.
        """
        layout = self.fed_layout
        world_batch = self.per_device_train_batch_size * layout.world_size * self.gradient_accumulation_steps
        if num_samples < world_batch:
            raise ConfigError(
                f"train_dataset has {num_samples} samples, fewer than the world's first optimizer step: "
                f"per_device_train_batch_size({self.per_device_train_batch_size}) × WORLD_SIZE({layout.world_size})"
                f" × gradient_accumulation_steps({self.gradient_accumulation_steps}) = {world_batch}. Use a larger "
                "dataset, or lower --per_device_train_batch_size or --gradient_accumulation_steps."
            )

    def check_eval_dataset_size(self, num_samples: int, description: str = "eval_dataset") -> None:
        """Refuse an evaluation that `dataloader_drop_last` would leave without a batch on every rank.

        Each rank reads num_samples ÷ WORLD_SIZE samples; below one batch, Trainer evaluates nothing and logs
        no eval_loss, which surfaces later as a KeyError far from its cause.
        """
        world = self.fed_launch_layout.world_size  # torchft: each group evaluates over its own ranks
        world_batch = self.per_device_eval_batch_size * world
        if self.dataloader_drop_last and num_samples < world_batch:
            fix = (
                f"Lower --per_device_eval_batch_size to {num_samples // world} or less"
                if num_samples >= world
                else f"Use at least WORLD_SIZE({world}) samples"
            )
            raise ConfigError(
                f"{description} has {num_samples} samples, fewer than one batch on every rank: "
                f"per_device_eval_batch_size({self.per_device_eval_batch_size}) × WORLD_SIZE({world}) = {world_batch}"
                " with dataloader_drop_last=True, so it would be read in no batch (no loss, no predictions). "
                f"{fix}, or set --dataloader_drop_last false."
            )

    def _check_sharding_backend(self) -> None:
        """Federation runs on FSDP2 only; say so before `TrainingArguments` sets up any process group."""
        if self.deepspeed or _env_flag("ACCELERATE_USE_DEEPSPEED"):
            raise ConfigError(
                "fed_group_size/fed_shard_size need FSDP2, but DeepSpeed is configured. Remove --deepspeed "
                "(or use an accelerate config with distributed_type: FSDP and fsdp_version: 2)."
            )
        version = self._requested_fsdp_version()
        if version not in (None, 2):
            raise ConfigError(
                f"fed_group_size/fed_shard_size need FSDP2, but fsdp_version={version} is configured. Set "
                "fsdp_version: 2 in the accelerate config (or fsdp_config={'version': 2})."
            )

    def _requested_fsdp_version(self) -> int | None:
        """The FSDP version asked for by the arguments or by `accelerate launch`; `None` if FSDP is off."""
        if self.fsdp:
            config = self._fsdp_config_dict()
            return int(config.get("version", config.get("fsdp_version", 2)))
        if _env_flag("ACCELERATE_USE_FSDP"):
            return int(os.environ.get("FSDP_VERSION", "1"))
        return None

    def _fsdp_config_dict(self) -> dict:
        """``fsdp_config`` as a dict, read as `TrainingArguments` reads it: a dict, a JSON string (the command line's
        ``--fsdp_config '{"cpu_ram_efficient_loading": true}'``) or the path of a JSON file."""
        config = self.fsdp_config or {}
        if isinstance(config, str):
            return json.loads(config) if config.startswith("{") else json.loads(Path(config).read_text())
        return dict(config)


@dataclass
class FedShardTrainingArguments(FedShardArgumentsMixin, TrainingArguments):
    """`TrainingArguments` plus the federation settings of `FedShardArgumentsMixin` (see its fields)."""


def _transport_flags() -> list[str]:
    """The settings of the registered transports that the arguments have a ``fed_*`` flag for (torchft's), in the
    order the transports declare them."""
    names = [f.name for t in TRANSPORTS.values() for f in dataclasses.fields(t.settings)]
    return [name for name in dict.fromkeys(names) if f"fed_{name}" in FedShardArgumentsMixin.__dataclass_fields__]


def _transport_options(options: dict | str | None) -> dict[str, Any]:
    """``fed_transport_options`` as a dict: a dict, or a JSON object (the command line's)."""
    if options is None or isinstance(options, dict):
        return dict(options or {})
    try:
        parsed = json.loads(options)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"fed_transport_options={options!r} is not JSON ({err.msg}). Give a JSON object, e.g. "
            '\'{"store": "host:29600"}\'.'
        ) from err
    if not isinstance(parsed, dict):
        raise ConfigError(f"fed_transport_options={options!r} is not a JSON object. Give one, e.g. '{{\"k\": 1}}'.")
    return parsed
