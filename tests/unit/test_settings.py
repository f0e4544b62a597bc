"""Each averaging setting is declared once, in `hf_fedshard.engine.options.AveragingOptions` (name, type, default,
help, choices): the Trainer's ``fed_*`` fields, the plain loop's keyword arguments and flags, and the README's settings
table are checked against it here, so a setting added or changed there cannot drift elsewhere."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from typing import get_type_hints

import pytest

from hf_fedshard import FederatedAverager, FedShardTrainingArguments
from hf_fedshard.engine import AveragingOptions
from hf_fedshard.engine.options import averaging_options
from hf_fedshard.engine.outer import NESTEROV_DEFAULTS
from hf_fedshard.engine.sparse import SparseCodec
from hf_fedshard.errors import ConfigError

from ..launch import REPO

SETTINGS = {f.name: f for f in fields(AveragingOptions)}
# The README gives the value a default of None stands for.
README_NONE = {"outer_lr": str(NESTEROV_DEFAULTS["lr"]), "outer_momentum": str(NESTEROV_DEFAULTS["momentum"]),
               "timeout_s": "`ddp_timeout`", "sync_density": str(SparseCodec().density),
               "sync_bits": str(SparseCodec().bits), "sync_chunk": str(SparseCodec().chunk),
               "sync_feedback_decay": "1"}  # fmt: skip


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_trainers_fed_field_is_the_engines_setting(name):
    trainer_fields = {f.name: f for f in fields(FedShardTrainingArguments)}
    ours, engine = trainer_fields[f"fed_{name}"], SETTINGS[name]
    types = get_type_hints(FedShardTrainingArguments)[f"fed_{name}"], get_type_hints(AveragingOptions)[name]
    assert types[0] == types[1] and ours.default == engine.default and ours.default is not MISSING
    assert dict(ours.metadata) == dict(engine.metadata) and engine.metadata["help"]


def test_the_trainer_builds_the_engines_options_from_every_fed_field(world4_no_setup):
    given = {"fed_sync_steps": 6, "fed_sync_dtype": "int8", "fed_timeout_s": 9.5, "fed_outer_optimizer": "nesterov",
             "fed_outer_lr": 0.5, "fed_min_round_steps": 2}  # fmt: skip
    args = FedShardTrainingArguments(output_dir="x", **given)
    expected = {name: getattr(args, f"fed_{name}") for name in SETTINGS}
    assert vars(args.fed_averaging_options) == expected and expected["sync_steps"] == 6


def test_a_plain_loop_takes_every_setting_by_name_and_refuses_others_in_one_line():
    values = {"sync_steps": 4, "sync_dtype": "bfloat16", "round_policy": "speed", "min_round_steps": 2}
    assert averaging_options(values) == AveragingOptions(**values)
    message = (r"^FederatedAverager got 'sync_step', which is not an averaging setting\. The settings are sync_steps, "
               r"average_optimizer_state, outer_optimizer, .*, min_round_steps \(the fed_\* settings without the "
               r"prefix\)\.$")  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        FederatedAverager(None, None, sync_step=4)


def test_the_readme_table_has_every_setting_with_its_default():
    text = (REPO / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(fed_\w+)` \| ([^|]+) \|", text, re.M))
    for name, setting in SETTINGS.items():
        default = setting.default
        shown = (
            README_NONE[name]
            if default is None
            else f"`{default}`"
            if isinstance(default, str | bool)
            else str(default)
        )
        assert rows.get(f"fed_{name}", "").strip() == shown, name


def test_the_plain_loop_recipes_flags_are_the_engines():
    from recipes.pretrain_plain_loop import AVERAGING, make_parser

    parser = make_parser()
    actions = {a.dest: a for a in parser._actions}
    for name in AVERAGING:
        setting = SETTINGS[name]
        assert actions[name].default == setting.default and actions[name].help == setting.metadata["help"]
        assert actions[name].choices == setting.metadata.get("choices")
