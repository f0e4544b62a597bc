"""In-process checks of the federation settings: layout arithmetic, every error message, `--help`."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
from transformers import HfArgumentParser

from hf_fedshard import FederatedParallelismConfig, FederationLayout, FedShardTrainingArguments
from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.arguments import FedShardArgumentsMixin
from hf_fedshard.integrations.fsdp import parallelism_config
from hf_fedshard.topology import launcher_needed

from ..launch import REPO


@pytest.mark.parametrize(
    ("world", "group", "shard", "shape", "method"),
    [
        (4, None, None, (1, 1, 4), "FSDP"),
        (4, 4, 2, (1, 2, 2), "HSDP"),
        (4, 2, None, (2, 1, 2), "FL+FSDP"),
        (8, 4, 2, (2, 2, 2), "FL+HSDP"),
        (2, 1, None, (2, 1, 1), "FL+FSDP"),
        (512, 32, 4, (16, 8, 4), "FL+HSDP"),
    ],
)
def test_layout_shapes(world, group, shard, shape, method):
    layout = FederationLayout(world, group, shard)
    assert layout.shape == shape
    assert layout.method == method
    assert layout.federated == (shape[0] > 1)
    assert layout.describe().startswith(f"{method}: WORLD_SIZE({world}) = groups({shape[0]})")


def test_group_index_is_contiguous_blocks():
    layout = FederationLayout(8, 4, 2)
    assert [layout.group_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_parallelism_config_counts_the_groups():
    config = parallelism_config(FederationLayout(8, 4, 2))
    assert isinstance(config, FederatedParallelismConfig)
    assert (config.fed_size, config.dp_replicate_size, config.dp_shard_size) == (2, 2, 2)
    assert config.total_size == 8
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard"]  # real axes: slicing them does not warn
    assert parallelism_config(FederationLayout(4, 2)).fsdp_dim_names == ["dp_shard"]


@pytest.mark.parametrize(
    ("world", "group", "shard", "message"),
    [
        (6, 4, None, r"fed_group_size=4 must divide the world size: WORLD_SIZE\(6\) % fed_group_size\(4\) = 2"),
        (4, 8, None, r"fed_group_size=8 must divide the world size"),
        (4, 0, None, r"fed_group_size=0 must divide the world size"),
        (8, 4, 3, r"fed_shard_size=3 must divide the group size: fed_group_size\(4\) % fed_shard_size\(3\)"),
        (8, 4, 0, r"fed_shard_size=0 must divide the group size"),
    ],
)
def test_layout_errors_name_the_setting_and_the_fix(world, group, shard, message):
    with pytest.raises(ValueError, match=message) as err:
        FederationLayout(world, group, shard)
    assert "Set --fed_" in str(err.value)


def test_groups_of_unequal_size_have_their_own_shards_replicas_and_ranks():
    layout = FederationLayout(8, (4, 2, 2), 2)
    assert (layout.num_groups, layout.group_sizes, layout.method) == (3, (4, 2, 2), "FL+HSDP")
    assert [layout.replicas_of(g) for g in range(3)] == [2, 1, 1]
    assert [layout.group_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [layout.position(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 0, 1]
    assert layout.ranks_of(2) == (6, 7)
    assert (
        layout.describe()
        == "FL+HSDP, groups of unequal size: WORLD_SIZE(8) = 2×2 + 1×2 + 1×2 (replicas × shards per group)"
    )
    fsdp = FederationLayout(8, (4, 2, 2))
    assert ([fsdp.shard_of(g) for g in range(3)], fsdp.method) == ([4, 2, 2], "FL+FSDP")
    config = parallelism_config(fsdp, rank=5)
    assert (config.dp_replicate_size, config.dp_shard_size, config.total_size) == (1, 2, 8)
    assert config.layout == fsdp
    assert FederationLayout(8, (2, 2, 2, 2)) == FederationLayout(8, 2)  # equal sizes are the equal layout


@pytest.mark.parametrize(
    ("sizes", "shard", "message"),
    [
        ("4,2,1", None, r"fed_group_size=4,2,1 sums to 7 ranks, but WORLD_SIZE=8: .* Give sizes that add up to 8"),
        ("4,0,4", None, r"fed_group_size=4,0,4: every group needs at least one rank. Drop the empty group"),
        ("4,2,2", 4, r"fed_group_size=4,2,2: fed_shard_size=4 must divide every group's size .* Pick a common"),
        ("4,x", None, r"fed_group_size='4,x' is not a size or a comma-separated list of sizes: e.g. --fed_group"),
        ("4,2,2", 0, r"fed_group_size=4,2,2: fed_shard_size=0 must divide every group's size"),
        ("4,2,2", -1, r"fed_group_size=4,2,2: fed_shard_size=-1 must divide every group's size"),
    ],
)
def test_unequal_group_sizes_are_refused_in_one_line(tmp_path, monkeypatch, sizes, shard, message):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=message):
        parse(tmp_path, "--fed_group_size", sizes, *([] if shard is None else ["--fed_shard_size", str(shard)]))


def test_unequal_group_sizes_parse_from_the_command_line_and_torchft_checks_its_launch_size(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _group_sizes_of(tmp_path, "1") == 1
    with pytest.raises(ValueError, match=r"^fed_group_size=4,2,2 gives fed_group0 4 ranks, but this launch has"):
        parse(tmp_path, "--fed_group_size", "4,2,2", "--fed_transport", "torchft", "--fed_lighthouse",
              "http://h:1", "--fed_group_id", "0", "--fed_num_groups", "3")  # fmt: skip


def _group_sizes_of(tmp_path, value: str):
    return parse(tmp_path, "--fed_group_size", value).fed_group_size


def parse(tmp_path, *argv: str) -> FedShardTrainingArguments:
    parser = HfArgumentParser(FedShardTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--report_to", "none", *argv])
    return args


@pytest.fixture
def world4(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)


def make_args(tmp_path, **kwargs) -> FedShardTrainingArguments:
    return FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs)


def test_sync_steps_must_be_positive(tmp_path, world4):
    with pytest.raises(ValueError, match=r"fed_sync_steps=0: it must be at least 1. Set --fed_sync_steps"):
        make_args(tmp_path, fed_group_size=2, fed_sync_steps=0)


def test_world_not_divisible_fails_in_arguments(tmp_path, world4):
    with pytest.raises(ValueError, match=r"WORLD_SIZE\(4\) % fed_group_size\(3\) = 1"):
        make_args(tmp_path, fed_group_size=3)


def test_deepspeed_is_refused(tmp_path, world4, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match=r"need FSDP2, but DeepSpeed is configured"):
        make_args(tmp_path, fed_group_size=2)


def test_fsdp1_is_refused(tmp_path, world4):
    with pytest.raises(ValueError, match=r"need FSDP2, but fsdp_version=1 is configured"):
        make_args(tmp_path, fed_group_size=2, fsdp=True, fsdp_config={"version": 1})


def test_fsdp1_from_accelerate_launch_is_refused(tmp_path, world4, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match=r"fsdp_version=1 is configured. Set fsdp_version: 2"):
        make_args(tmp_path, fed_group_size=2)


@pytest.fixture
def world1(monkeypatch):
    """A one-process world: `TrainingArguments` sets up its devices without waiting for other ranks."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)


def test_federation_setting_turns_fsdp2_on(tmp_path, world1):
    args = make_args(tmp_path, fed_shard_size=1)
    assert args.fsdp_plugin_args["fsdp_version"] == 2
    assert args.use_cpu  # no accelerator on the test machine


def test_several_groups_keep_token_counts_local(tmp_path, world4, monkeypatch):
    # Stop before TrainingArguments sets up 4 ranks: the fields are final when its __post_init__ starts.
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)
    args = make_args(tmp_path, fed_group_size=2)
    assert args.average_tokens_across_devices is False
    assert args.fsdp is True and args.fsdp_config == {"version": 2}


@pytest.mark.parametrize("form", ["json", "file"])
def test_fsdp_config_from_the_command_line_keeps_its_keys_when_fsdp2_is_turned_on(tmp_path, world4, monkeypatch, form):
    """torchrun users turn Accelerate's switches on with --fsdp_config (a JSON string or file) and a fed setting alone:
    the config is read, not merged as a string (it raised "'str' object is not a mapping")."""
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)
    config = '{"cpu_ram_efficient_loading": true}'
    if form == "file":
        (tmp_path / "fsdp.json").write_text(config)
        config = str(tmp_path / "fsdp.json")
    args = parse(tmp_path, "--fed_group_size", "2", "--fsdp_config", config)
    assert args.fsdp is True and args.fsdp_config == {"cpu_ram_efficient_loading": True, "version": 2}


def test_no_federation_leaves_training_arguments_alone(tmp_path, world1):
    from transformers import TrainingArguments

    args = make_args(tmp_path)
    plain = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert not args.fed_requested
    assert args.fsdp_plugin_args is None and not args.use_cpu
    assert args.average_tokens_across_devices == plain.average_tokens_across_devices


def test_fields_parse_from_the_command_line(world1):
    (args,) = HfArgumentParser(FedShardTrainingArguments).parse_args_into_dataclasses(
        [
            "--output_dir",
            "x",
            "--report_to",
            "none",
            "--fed_group_size",
            "1",
            "--fed_sync_steps",
            "4",
            "--fed_average_optimizer_state",
            "true",
        ]
    )
    assert (args.fed_group_size, args.fed_shard_size, args.fed_sync_steps) == (1, None, 4)
    assert args.fed_average_optimizer_state is True


def test_trainer_refuses_plain_training_arguments(tmp_path, world1):
    from transformers import TrainingArguments

    from hf_fedshard import FedShardTrainer

    with pytest.raises(TypeError, match="needs FedShardTrainingArguments"):
        FedShardTrainer(args=TrainingArguments(output_dir=str(tmp_path), report_to="none"))


def test_help_documents_every_fed_setting():
    code = "from transformers import HfArgumentParser; from hf_fedshard import FedShardTrainingArguments as A; "
    code += "HfArgumentParser(A).parse_args(['--help'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    names = ("--fed_group_size", "--fed_shard_size", "--fed_sync_steps", "--fed_average_optimizer_state",
             "--fed_timeout_s", "--fed_auto_resume")  # fmt: skip
    for name in names:
        assert name in out
    assert "H: optimizer steps between two averagings" in out
    assert "Resume from the newest checkpoint in output_dir that verifies" in " ".join(out.split())


def test_the_readme_counts_the_fed_settings_and_its_table_lists_each():
    """The README's introduction counts the ``fed_*`` settings and its settings table has a row for each."""
    names = [f.name for f in dataclasses.fields(FedShardArgumentsMixin) if f.name.startswith("fed_")]
    readme = (REPO / "README.md").read_text()
    assert re.search(r"\((\d+) `fed_\*` settings", readme).group(1) == str(len(names))
    rows = set(re.findall(r"^\| `(fed_\w+)` \|", readme, flags=re.M))
    assert rows == set(names), set(names) ^ rows


def test_groups_of_several_ranks_in_a_process_started_without_a_launcher_say_to_use_one(monkeypatch):
    """``python recipes/pretrain_clm.py --fed_group_size 2`` (no WORLD_SIZE): the fix is the launcher, not the size."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    parser = HfArgumentParser(FedShardTrainingArguments)
    with pytest.raises(ConfigError, match=r"^fed_group_size=2 needs several processes, .*accelerate launch") as err:
        parser.parse_args_into_dataclasses(["--output_dir", "unused", "--report_to", "none", "--fed_group_size", "2"])
    assert "\n" not in str(err.value)
    (one,) = parser.parse_args_into_dataclasses(["--output_dir", "unused", "--report_to", "none"])
    assert one.fed_layout.world_size == 1  # a plain run without fed_* settings still runs on one process


@pytest.mark.parametrize(
    ("group", "shard", "setting", "processes"),
    [(2, None, "fed_group_size=2", 4), ((2, 1), None, "fed_group_size=2,1", 3), (None, 2, "fed_shard_size=2", 2)],
)
def test_the_launcher_line_names_the_setting_as_typed_and_a_process_count_that_fits(
    monkeypatch, group, shard, setting, processes
):
    """Two groups of fed_group_size, the listed groups, or one group of fed_shard_size: a count that launches."""
    monkeypatch.setattr("sys.argv", ["recipes/pretrain_clm.py", "--fed_group_size", "2"])
    assert launcher_needed(group, shard) == (
        f"{setting} needs several processes, but this one was started without a launcher (no WORLD_SIZE): run "
        f"`accelerate launch --num_processes {processes} recipes/pretrain_clm.py ...` or "
        f"`torchrun --nproc_per_node {processes} recipes/pretrain_clm.py ...`, not plain `python`."
    )
    assert launcher_needed(1, None) is None and launcher_needed(None, 1) is None and launcher_needed(0, None) is None
