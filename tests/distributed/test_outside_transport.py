"""A transport written outside the package (tests/store_transport.py: a launch per group, meeting at a TCPStore this
test hosts), registered through `hf_fedshard.transports.register_transport` by the training script: the Trainer
runs it end to end, every averaging a round voted through the store by its own membership, with no file under
hf_fedshard/ naming it, and its two groups end where one job of the same two groups (the mesh) ends, to the bit."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ..asserts import labelled
from ..launch import SCRIPTS, SGD, finish, start_torchrun


@pytest.mark.timeout(400)
def test_a_transport_registered_from_outside_trains_two_groups_as_one_job_does(tmp_path, one_job_h4):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    launches = []
    for g in range(2):
        options = json.dumps({"group_id": g, "num_groups": 2, "store": f"127.0.0.1:{store.port}"})
        args = ["--output_dir", tmp_path, "--dump_dir", tmp_path / f"dump{g}", *SGD, "--num_samples", "128",
                "--max_steps", "10", "--fed_sync_steps", "4", "--transport_module", "tests.store_transport",
                "--fed_transport", "store", "--fed_transport_options", options]  # fmt: skip
        launches.append(start_torchrun(2, SCRIPTS / "train_tiny.py", args))
    results = [finish(launch, 300) for launch in launches]
    for g, result in enumerate(results):
        assert result.returncode == 0, f"group {g}:\n{result.stdout[-6000:]}"
    for g in range(2):
        assert (tmp_path / f"fed_group{g}").is_dir(), "a launch per group writes under output_dir/fed_group{G}"
        for r in range(2):
            ours = torch.load(tmp_path / f"dump{g}" / f"rank{r}.pt", weights_only=False)
            theirs = one_job_h4[2 * g + r]
            assert ours["seen"] == theirs["seen"], labelled(f"group {g} rank {r}: samples read")
            for name, value in ours["local_params"].items():
                torch.testing.assert_close(
                    value, theirs["local_params"][name], rtol=0, atol=0, msg=labelled(f"group {g} rank {r} {name}")
                )
            syncs = [h["fed_syncs"] for h in ours["log_history"] if "fed_syncs" in h]
            assert syncs[-1] == 4, syncs  # the initial weights', steps 4 and 8, and the end (10)
            quorum = [h["fed_groups_in_quorum"] for h in ours["log_history"] if "fed_groups_in_quorum" in h]
            assert quorum and set(quorum) == {2}, quorum  # its membership's metrics reach the logs
