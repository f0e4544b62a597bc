"""Groups of unequal size under ``fed_transport torchft``: every launch names every group's size
(``--fed_group_size 2,1``). In process: the settings' refusals and the nominal world a launch reads its slice of;
the real launches are tests/distributed/test_elastic_unequal.py.
"""

from __future__ import annotations

import pytest

from hf_fedshard.errors import ConfigError

from .test_elastic import ELASTIC, parse


@pytest.mark.parametrize(
    ("world", "extra", "message"),
    [
        (2, ["--fed_group_size", "2,1", "--fed_group_id", "0", "--fed_num_groups", "3"],
         r"^fed_group_size=2,1 names 2 groups but fed_num_groups=3"),
        (1, ["--fed_group_size", "2,1", "--fed_group_id", "0", "--fed_num_groups", "2"],
         r"^fed_group_size=2,1 gives fed_group0 2 ranks, but this launch has WORLD_SIZE=1"),
        (4, ["--fed_group_size", "4,2,2", "--fed_shard_size", "4", "--fed_group_id", "0", "--fed_num_groups", "3"],
         r"^fed_group_size=4,2,2: fed_shard_size=4 must divide every group's size"),
    ],
)  # fmt: skip
def test_unequal_torchft_settings_are_refused_in_one_line(world, extra, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=message) as caught:
        parse([*ELASTIC, *extra])
    assert "\n" not in str(caught.value)


def test_an_unequal_torchft_group_reads_its_slice_of_the_nominal_world(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse([*ELASTIC, "--fed_group_size", "2,1,2", "--fed_shard_size", "1", "--fed_group_id", "1",
                  "--fed_num_groups", "3", "--output_dir", str(tmp_path)])  # fmt: skip
    nominal, launch = args.fed_layout, args.fed_launch_layout
    assert (nominal.world_size, nominal.group_sizes, nominal.first_rank(2)) == (5, (2, 1, 2), 3)
    assert (launch.world_size, launch.num_groups, launch.replicas) == (1, 1, 1)
    assert nominal.method == "FL+HSDP"
