"""The transports' registry in process: a transport registered from outside the package (tests/store_transport.py)
parses its settings from ``--fed_transport_options`` and lays out its launch as torchft's does; every bad setting is
refused in one line naming it, before any process group."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os

import pytest
from transformers import HfArgumentParser, TrainingArguments

from hf_fedshard import FedShardTrainingArguments
from hf_fedshard.errors import ConfigError
from hf_fedshard.topology import FederationLayout
from hf_fedshard.transports import TRANSPORTS, GroupLaunch, get_transport, register_transport

STORE = ["--fed_transport", "store"]


@pytest.fixture(autouse=True, scope="module")
def store():
    """tests/store_transport.py registered as ``store`` for this module's tests only (importing it registers it)."""
    module = importlib.import_module("tests.store_transport")
    register_transport("store", module.StoreFederation, settings=module.StoreSettings)  # again, after a removal
    yield module
    TRANSPORTS.pop("store")


def parse(argv: list[str]) -> FedShardTrainingArguments:
    (args,) = HfArgumentParser(FedShardTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--report_to", "none", *argv]
    )
    return args


def options(**values) -> list[str]:
    return ["--fed_transport_options", json.dumps(values)]


def test_a_transport_registered_from_outside_reads_its_options_and_lays_out_a_launch_per_group(
    store, monkeypatch, tmp_path
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)  # no process group for 2 ranks
    args = parse([*STORE, *options(group_id=1, num_groups=3, store="h:1"), "--output_dir", str(tmp_path)])
    assert args.fed_launch == store.StoreSettings(group_id=1, num_groups=3, store="h:1")
    assert args.output_dir == os.path.join(tmp_path, "fed_group1")
    assert (args.fed_layout.world_size, args.fed_layout.num_groups, args.fed_layout.group_size) == (6, 3, 2)
    assert (args.fed_launch_layout.world_size, args.fed_launch_layout.num_groups) == (2, 1)
    assert args.fed_group_index(0) == args.fed_group_index(1) == 1
    assert args.fed_launch.data_first_rank(args.fed_layout) == 2  # what ranks 2, 3 of one job of 6 would read


def test_torchft_flags_and_options_are_one_setting(monkeypatch):
    """torchft's flags parse into its settings; the same names in --fed_transport_options do too."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    by_flags = parse(["--fed_transport", "torchft", "--fed_lighthouse", "http://h:1", "--fed_group_id", "0",
                      "--fed_num_groups", "2"])  # fmt: skip
    by_options = parse(["--fed_transport", "torchft", *options(lighthouse="http://h:1", group_id=0, num_groups=2)])
    assert by_flags.fed_launch == by_options.fed_launch
    assert dataclasses.asdict(by_flags.fed_launch) == {"group_id": 0, "num_groups": 2, "lighthouse": "http://h:1"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*STORE, *options(group_id=0, num_groups=2, store="h:1", port=3)],
         r"^fed_transport store has no setting port \(its settings: group_id, num_groups, store\)"),
        ([*STORE, *options(group_id=0, num_groups=2)],
         r"^fed_transport store needs store \(in --fed_transport_options\): e\.g\. --fed_transport_options"),
        ([*STORE, *options(num_groups=2, store="h:1")], r"^fed_transport store needs fed_group_id: e\.g\."),
        ([*STORE, *options(group_id=5, num_groups=2, store="h:1")], r"^fed_group_id=5 must be in 0 … fed_num_groups"),
        ([*STORE, *options(group_id=0, num_groups=2, store="h:1"), "--fed_lighthouse", "http://h:1"],
         r"^fed_lighthouse belong to fed_transport torchft, not store\. Add --fed_transport torchft, or drop them"),
        (["--fed_transport", "torchft", "--fed_group_id", "0", *options(group_id=1, num_groups=2, lighthouse="h")],
         r"^fed_group_id given both as a flag and in fed_transport_options\. Give each once\.$"),
        ([*STORE, "--fed_transport_options", "{"], r"^fed_transport_options='\{' is not JSON"),
        ([*STORE, "--fed_transport_options", "[1]"], r"^fed_transport_options='\[1\]' is not a JSON object"),
        (["--fed_transport_options", '{"x": 1}'], r"^fed_transport mesh has no setting x \(its settings: none\)"),
        (["--fed_transport", "pigeon"], r"^fed_transport='pigeon' is unknown\. Set --fed_transport to one of mesh, "
                                        r"torchft, store, or register your own"),
    ],
)  # fmt: skip
def test_bad_transport_settings_are_refused_in_one_line(argv, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=message) as caught:
        parse(argv)
    assert "\n" not in str(caught.value)


def test_register_transport_refuses_a_taken_name_and_settings_of_no_launch_kind(store):
    StoreFederation, StoreSettings = store.StoreFederation, store.StoreSettings
    register_transport("store", StoreFederation, settings=StoreSettings)  # the same again: nothing changes
    with pytest.raises(ValueError, match=r"^fed_transport 'store' is already registered"):
        register_transport("store", lambda request: None, settings=StoreSettings)

    @dataclasses.dataclass(frozen=True)
    class Loose:
        store: str

    with pytest.raises(TypeError, match=r"settings must be a dataclass deriving from hf_fedshard\.transports\.OneJob"):
        register_transport("loose", StoreFederation, settings=Loose)
    assert "loose" not in TRANSPORTS and get_transport("store").settings is StoreSettings
    assert issubclass(StoreSettings, GroupLaunch)


def test_torchft_internals_are_checked_in_one_place(monkeypatch):
    """The installed torchft has every private name the transport uses; a release without one is refused in one
    line naming it; no other module reaches a torchft private name."""
    import re
    from pathlib import Path

    from torchft import process_group

    from hf_fedshard.transports import torchft_internals

    torchft_internals.check_torchft_internals()
    monkeypatch.delattr(process_group, "_rendezvous")
    with pytest.raises(
        ConfigError,
        match=r"^this torchft \(torchft-nightly [^)]*\) no longer has torchft\.process_"
        r"group\._rendezvous\(opts, handle_id\), which fed_transport torchft uses",
    ):
        torchft_internals.check_torchft_internals()  # fmt: skip
    package = Path(torchft_internals.__file__).parents[1]
    private = re.compile(r"from torchft[\w.]* import _|manager\._|\._handle_id|\._quorum_id")
    for path in package.rglob("*.py"):
        if path.name != "torchft_internals.py":
            lines = [line for line in path.read_text().splitlines() if private.search(line)]
            assert lines == [], f"{path.name}: {lines}"


def test_a_launch_of_unequal_groups_lays_out_the_listed_federation(monkeypatch):
    """torchft, ``--fed_group_size 2,1``, group 0 on 2 ranks: the federation is the list's, its shard as given (not
    the launch's own shard of 2, which would not divide the group of 1)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)
    args = parse(["--fed_transport", "torchft", *options(lighthouse="h", group_id=0, num_groups=2),
                  "--fed_group_size", "2,1"])  # fmt: skip
    assert args.fed_layout == FederationLayout(3, (2, 1), None)
    assert (args.fed_launch_layout.world_size, args.fed_launch_layout.group_size) == (2, 2)
