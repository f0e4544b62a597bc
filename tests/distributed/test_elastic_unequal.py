"""Groups of unequal size under ``fed_transport torchft``, with real launches (torchrun launches of 2 and 1 ranks + a
lighthouse, gloo, real FSDP2): the federation equals the one-job mesh transport with ``--fed_group_size 2,1`` to the
bit (samples, eval loss, final weights), FL+FSDP with fp32 FedAvg and FL+HSDP with Nesterov and int8; a killed
group, restarted by its launcher, heals from a group of another size while that one goes on. The settings'
refusals are tests/unit/test_elastic_unequal.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from ..asserts import labelled
from ..launch import SCRIPTS, SGD, finish, lighthouse, start_torchrun, train_tiny

SIZES = (2, 1)
TINY = ["--num_samples", "128", "--fed_group_size", ",".join(map(str, SIZES))]


def start_unequal_group(
    group: int, out_dir: Path, args: list[str], address: str, max_restarts: int = 0, preloaded: bool = True
) -> subprocess.Popen:
    """Start group ``group`` (``SIZES[group]`` ranks) of a torchft federation running tests/scripts/train_tiny.py."""
    elastic = ["--fed_transport", "torchft", "--fed_lighthouse", address, "--fed_group_id", group,
               "--fed_num_groups", len(SIZES)]  # fmt: skip
    script_args = ["--output_dir", out_dir, "--dump_dir", out_dir / f"dump{group}", *SGD, *elastic, *args]
    return start_torchrun(SIZES[group], SCRIPTS / "train_tiny.py", script_args, max_restarts, preloaded)


def train_unequal_groups(out_dir: Path, args: list[str], address: str) -> list[list[dict]]:
    launches = [start_unequal_group(g, out_dir, args, address) for g in range(len(SIZES))]
    results = [finish(launch, 300) for launch in launches]
    for g, result in enumerate(results):
        assert result.returncode == 0, f"group {g}:\n{result.stdout[-6000:]}"
    return [
        [torch.load(out_dir / f"dump{g}" / f"rank{r}.pt", weights_only=False) for r in range(size)]
        for g, size in enumerate(SIZES)
    ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="fedavg-fp32"),
        pytest.param(["--fed_shard_size", "1", "--fed_outer_optimizer", "nesterov", "--fed_sync_dtype", "int8"],
                     id="fl-hsdp-nesterov-int8"),
    ],
)  # fmt: skip
def test_unequal_torchft_launches_equal_the_one_job_mesh_to_the_bit(tmp_path, extra):
    """Launches of 2 and 1 ranks, H = 4, 10 steps: the same samples, shards, evaluation and final weights as one job
    of 3 ranks with fed_group_size 2,1 (group 0 reads ranks 0-1's slices, group 1 rank 2's)."""
    common = [*TINY, "--max_steps", "10", "--fed_sync_steps", "4", *extra]
    with lighthouse(min_groups=2) as address:
        groups = train_unequal_groups(tmp_path / "ft", common, address)
    mesh = train_tiny(sum(SIZES), tmp_path / "mesh", common)
    offsets = [0, SIZES[0]]
    for g, size in enumerate(SIZES):
        for r in range(size):
            ours, theirs = groups[g][r], mesh[offsets[g] + r]
            assert ours["seen"] == theirs["seen"], labelled(f"group {g} rank {r}: samples read")
            for name, value in ours["local_params"].items():
                torch.testing.assert_close(
                    value, theirs["local_params"][name], rtol=0, atol=0, msg=labelled(f"group {g} rank {r} {name}")
                )
            assert ours["eval"]["eval_loss"] == theirs["eval"]["eval_loss"]
            assert ours["log_history"][-3]["fed_groups_in_quorum"] == 2


def replica_models(dumps: list[dict], shards: int) -> list[dict[str, torch.Tensor]]:
    """Each replica's whole model from a group's ranks' shards (FSDP2's Shard(0); ranks replica-major)."""
    replicas = [dumps[q : q + shards] for q in range(0, len(dumps), shards)]
    return [{name: torch.cat([d["local_params"][name] for d in ranks]) for name in ranks[0]["local_params"]}
            for ranks in replicas]  # fmt: skip


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("killed", "hsdp"),
    [pytest.param(1, False, id="group-of-1-heals-from-2-shards"), pytest.param(0, True, id="hsdp-group-of-2-heals")],
)
def test_a_killed_group_heals_from_a_group_of_another_size_while_the_other_goes_on(tmp_path, killed, hsdp):
    """Launches of 2 and 1 ranks, H = 4, 24 steps, FL+FSDP or FL+HSDP (``hsdp``: the group of 2 holds two replicas of
    one shard). Group ``killed``'s rank 0 is SIGKILLed as step 6 begins; its torchrun restarts it. The other never
    restarts: it redoes the averaging of step 8 alone and goes on. The restarted group heals from it right after an
    averaging (its shards are of another size: the tensors are copied piece by piece), resumes there, reads the
    samples its ranks read in one job of --fed_group_size 2,1 from that step on, and both end on one global model,
    to the bit (Nesterov: the anchors and the outer momentum it took decide the last averaging's values)."""
    survivor = 1 - killed
    common = [*TINY, "--num_samples", "512", "--max_steps", "24", "--fed_sync_steps", "4", "--step_sleep_s", "0.2",
              "--fed_outer_optimizer", "nesterov", "--record_syncs", "true", "--fed_timeout_s", "30",
              *(["--fed_shard_size", "1"] if hsdp else [])]  # fmt: skip
    shards = [1 if hsdp else size for size in SIZES]
    marker = tmp_path / "restarted"
    kill = ["--kill_at_step", "6", "--fault_rank", "0", "--fault_group", str(killed), "--restart_marker", marker]
    hold = ["--hold_at_step", "10", "--hold_until", marker]  # the survivor keeps steps for it, however slow the restart
    with lighthouse(min_groups=1) as address:
        # Fresh interpreters, as a user's launches: the restart's import time decides which averaging the killed group
        # is back for, and the timing these checks were written for is that one.
        launches = [start_unequal_group(g, tmp_path, [*common, *(kill if g == killed else hold)], address,
                                        max_restarts=int(g == killed), preloaded=False)
                    for g in range(len(SIZES))]  # fmt: skip
        results = [finish(launch, 600) for launch in launches]
    for g, result in enumerate(results):
        assert result.returncode == 0, f"group {g}:\n{result.stdout[-6000:]}"
    dumps = [[torch.load(tmp_path / f"dump{g}" / f"rank{r}.pt", weights_only=False) for r in range(size)]
             for g, size in enumerate(SIZES)]  # fmt: skip
    healed_at = dumps[killed][0]["started_at_step"]
    assert dumps[survivor][0]["started_at_step"] == 0  # the survivor never restarted
    assert healed_at > 8 and healed_at % 4 == 0
    log = dumps[survivor][0]["log_history"]
    quorum = {h["step"]: h["fed_groups_in_quorum"] for h in log if "fed_groups_in_quorum" in h}
    assert quorum[4] == 2 and quorum[9] == 1 and quorum[24] == 2, quorum
    assert log[-3]["fed_heals"] == dumps[killed][0]["log_history"][-3]["fed_heals"] == 1
    healed, averaged = dumps[killed][0]["sync_start"], dumps[survivor][0]["sync_params"][healed_at][1]
    final = replica_models(dumps[survivor], shards[survivor])[0]
    for name, value in final.items():  # the model it healed to; the anchors and outer momentum decide the end
        torch.testing.assert_close(healed[name], averaged[name], rtol=0, atol=0, msg=labelled(f"healed {name}"))
        for g in range(len(SIZES)):
            for model in replica_models(dumps[g], shards[g]):
                torch.testing.assert_close(model[name], value, rtol=0, atol=0, msg=labelled(f"group {g} {name}"))
    one_job = train_tiny(sum(SIZES), tmp_path / "mesh", [*common, "--step_sleep_s", "0"])
    first = [0, SIZES[0]][killed]
    for r in range(SIZES[killed]):
        tail = one_job[first + r]["seen"][healed_at * 2 :]  # per_device_train_batch_size 2
        assert dumps[killed][r]["seen"] == tail, labelled(f"group {killed} rank {r}: samples read after {healed_at}")
