"""``fed_transport torchft`` with real launches (torchrun + a lighthouse, gloo).

The transport equals the one-job mesh to the bit; a killed group leaves, the others average among themselves
without restarting, and the group, restarted by its launcher, heals and rejoins, reading its own data from the step
it healed at; bad federations and a lost lighthouse end every rank in one line. The in-process half (settings, the
engine's rounds on a fake membership) is tests/unit/test_elastic.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import time

import pytest
import torch

from ..asserts import labelled
from ..launch import finish, lighthouse, start_group, train_groups, train_tiny
from .test_elastic_timings import wait_until_a_worker_stops
from .test_reliability import read_dcp

TINY = ["--num_samples", "128"]
H4_10_STEPS = [*TINY, "--max_steps", "10", "--fed_sync_steps", "4"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="fedavg-fp32"),
        pytest.param(["--fed_outer_optimizer", "nesterov", "--fed_sync_dtype", "int8"], id="nesterov-int8"),
        pytest.param(["--fed_shard_size", "1", "--fed_sync_dtype", "bfloat16"], id="fl-hsdp-bf16"),
        pytest.param(
            ["--fed_sync_fragments", "2", "--fed_sync_overlap", "1", "--fed_outer_optimizer", "nesterov",
             "--fed_sync_dtype", "int8", "--eval_strategy", "steps", "--eval_steps", "3", "--fed_eval_per_group",
             "true"],
            id="fragments-overlap-nesterov-int8-evaluations",
        ),
        pytest.param(
            ["--fed_sync_fragments", "2", "--fed_sync_overlap", "1", "--fed_outer_optimizer", "nesterov",
             "--fed_sync_dtype", "topk", "--fed_sync_density", "0.05", "--fed_sync_bits", "2", "--fed_sync_chunk",
             "64", "--fed_sync_feedback_decay", "0.9"],
            id="fragments-overlap-nesterov-topk",
        ),
    ],
)  # fmt: skip
def test_torchft_equals_the_one_job_mesh_to_the_bit(tmp_path, extra, request):
    """2 groups × 2 ranks, H = 4, 10 steps (the last averaging at the end): the same samples, shards and
    evaluation as one job of 4 ranks with fed_group_size 2 (group G reads slice G of 2); each launch logs its
    own group's loss, whose mean over the groups is the one job's. FL+HSDP (2 replicas × 1 shard per group)
    splits the exchange over the group's replicas."""
    common = [*H4_10_STEPS, *extra]
    with lighthouse(min_groups=2) as address:
        groups = train_groups(2, 2, tmp_path / "ft", common, address)
    if extra:
        mesh = train_tiny(4, tmp_path / "mesh", [*common, "--fed_group_size", "2"])
    else:  # fedavg fp32: the module's one job, which the restart test compares with too
        mesh = request.getfixturevalue("one_job_h4")
    for g in range(2):
        for r in range(2):
            ours, theirs = groups[g][r], mesh[2 * g + r]
            assert ours["seen"] == theirs["seen"], labelled(f"group {g} rank {r}: samples read")
            for name, value in ours["local_params"].items():
                torch.testing.assert_close(
                    value, theirs["local_params"][name], rtol=0, atol=0, msg=labelled(f"group {g} rank {r} {name}")
                )
            assert ours["eval"]["eval_loss"] == theirs["eval"]["eval_loss"]
            evals = [[(h["step"], h["eval_loss"]) for h in run["log_history"] if "eval_loss" in h] for run in (ours,
                     theirs)]  # fmt: skip
            assert evals[0] == evals[1]  # evaluations between averagings: torchft's lend rounds lend the same mean
            assert len(evals[0]) == (5 if "--eval_steps" in common else 1)  # steps 3, 6, 9, the last, and after
            if "--fed_eval_per_group" in common:  # each launch logs its own group's loss, the one job's value
                key, other = f"eval_group{g}_loss", f"eval_group{1 - g}_loss"
                own = [[(h["step"], h[key]) for h in run["log_history"] if key in h] for run in (ours, theirs)]
                assert own[0] and own[0] == own[1]
                assert not any(other in h for h in ours["log_history"])
    group_losses = [[h["loss"] for h in groups[g][0]["log_history"] if "loss" in h] for g in range(2)]
    one_job = [h["loss"] for h in mesh[0]["log_history"] if "loss" in h]  # the world's mean; each launch logs its own
    assert [(a + b) / 2 for a, b in zip(*group_losses, strict=True)] == pytest.approx(one_job, rel=1e-6)


@pytest.mark.timeout(900)
def test_a_killed_group_leaves_and_heals_back_while_the_others_go_on(tmp_path):
    """3 groups × 2 ranks, H = 4, 48 steps (two epochs). Group 1's rank 0 is SIGKILLed as step 6 begins; its
    torchrun ends the group and restarts it. The others never restart: their averaging of step 8 fails, is
    redone by the two of them (the mean of their own two Δ, exactly), and they go on. Group 1 heals from a live
    group right after an averaging, resumes there and reads the samples its ranks read in one job of 3 groups from
    that step on. All three end on one global model."""
    common = [*TINY, "--num_samples", "512", "--max_steps", "48", "--fed_sync_steps", "4", "--step_sleep_s", "0.2",
              "--record_syncs", "true", "--fed_timeout_s", "30"]  # fmt: skip
    marker = tmp_path / "group1-restarted"
    kill = ["--kill_at_step", "6", "--fault_rank", "0", "--fault_group", "1", "--restart_marker", marker]
    hold = ["--hold_at_step", "10", "--hold_until", marker]  # the others keep steps for it, however slow the restart
    with lighthouse(min_groups=1) as address:
        # Fresh interpreters, as a user's launches: the restart's import time decides which averaging the killed group
        # is back for, and the timing these checks were written for is that one.
        launches = [start_group(g, 3, 2, tmp_path, [*common, *(kill if g == 1 else hold)], address,
                                max_restarts=int(g == 1), preloaded=False) for g in range(3)]  # fmt: skip
        results = [finish(launch, 600) for launch in launches]
    for g, result in enumerate(results):
        assert result.returncode == 0, f"group {g}:\n{result.stdout[-6000:]}"
    dumps = [
        [torch.load(tmp_path / f"dump{g}" / f"rank{r}.pt", weights_only=False) for r in range(2)] for g in range(3)
    ]
    healed_at = dumps[1][0]["started_at_step"]
    assert [dumps[g][0]["started_at_step"] for g in (0, 2)] == [0, 0]  # the survivors never restarted
    assert healed_at > 8 and healed_at % 4 == 0
    quorum = {h["step"]: h["fed_groups_in_quorum"] for h in dumps[0][0]["log_history"] if "fed_groups_in_quorum" in h}
    assert quorum[4] == 3 and quorum[9] == 2 and quorum[48] == 3, quorum
    assert dumps[0][0]["log_history"][-3]["fed_heals"] == 1
    for r in range(2):
        deltas = {g: dumps[g][r]["sync_exchanges"][8][0] for g in (0, 2)}
        for g in (0, 2):  # the redone averaging of step 8: the mean over the two groups alive
            for got, d0, d2 in zip(dumps[g][r]["sync_exchanges"][8][1], deltas[0], deltas[2], strict=True):
                torch.testing.assert_close(got, (d0 + d2) / 2, rtol=0, atol=0, msg=labelled(f"group {g} rank {r}"))
        for g in (1, 2):
            for name, value in dumps[g][r]["local_params"].items():
                torch.testing.assert_close(
                    value, dumps[0][r]["local_params"][name], rtol=0, atol=0, msg=labelled(f"group {g} {name}")
                )
    one_job = train_tiny(6, tmp_path / "mesh", [*common[:-4], "--fed_group_size", "2", "--step_sleep_s", "0"])
    for r in range(2):
        per_step = 2  # per_device_train_batch_size
        tail = one_job[2 + r]["seen"][healed_at * per_step :]
        assert dumps[1][r]["seen"] == tail, labelled(f"group 1 rank {r}: samples read after the heal at {healed_at}")


@pytest.mark.timeout(900)
def test_every_setting_at_once_survives_a_killed_group(tmp_path):
    """3 groups × 2 ranks on torchft with overlap, int8, Nesterov and speed-aware rounds, H = 4, 24 steps: group 2
    is slowed (0.4 s more per trained step), so it trains a prefix of each round; group 1's rank 0 is SIGKILLed as
    step 6 begins and its launcher, `python -m hf_fedshard.launch` (a user's command), restarts the group by forking
    its workers again, without their imports; the others run on plain torchrun. The restarted group heals from a
    live group at an apply step. Every group ends on one model (the sha256 of its exported weights) with the same
    averaging count."""
    common = [*TINY, "--num_samples", "256", "--max_steps", "24", "--fed_sync_steps", "4", "--fed_sync_overlap", "1",
              "--fed_sync_dtype", "int8", "--fed_outer_optimizer", "nesterov", "--fed_round_policy", "speed",
              "--step_sleep_s", "0.1", "--slow_group", "2", "--slow_step_s", "0.4",
              "--fed_timeout_s", "30"]  # fmt: skip
    marker = tmp_path / "group1-restarted"
    kill = ["--kill_at_step", "6", "--fault_rank", "0", "--fault_group", "1", "--restart_marker", marker]
    hold = ["--hold_at_step", "10", "--hold_until", marker]
    with lighthouse(min_groups=1) as address:
        launches = [
            start_group(g, 3, 2, tmp_path, [*common, "--export_dir", tmp_path / f"export{g}", *(kill if g == 1 else
                        hold)], address, max_restarts=int(g == 1), preloaded=False, forked=g == 1)
            for g in range(3)
        ]  # fmt: skip
        results = [finish(launch, 600) for launch in launches]
    for g, result in enumerate(results):
        assert result.returncode == 0, f"group {g}:\n{result.stdout[-6000:]}"
    imports = re.findall(r"hf_fedshard: start-up [\d.]+ s to the first trained step: interpreter and imports "
                         r"([\d.]+) s", results[1].stdout)  # fmt: skip
    assert imports == ["0.0", "0.0"], results[1].stdout[-6000:]  # both launches' workers forked after the imports
    dumps = [torch.load(tmp_path / f"dump{g}" / "rank0.pt", weights_only=False) for g in range(3)]
    # healed at an apply step (τ = 1 after H = 4): step 5's, if the forked restart was back before the others' next
    # averaging (the quorum they redo it in), a later one otherwise
    healed = dumps[1]["started_at_step"]
    assert healed >= 5 and healed % 4 == 1 and [dumps[g]["started_at_step"] for g in (0, 2)] == [0, 0], healed
    ends = [next(h for h in d["log_history"] if "train_runtime" in h) for d in dumps]
    assert len({end["fed_syncs"] for end in ends}) == 1, [end["fed_syncs"] for end in ends]
    assert [end["fed_heals"] for end in ends] == [1, 1, 1]  # the federation's heals, as each group saw them
    planned = [h["fed_round_steps"] for h in dumps[2]["log_history"] if "fed_round_steps" in h]
    assert min(planned) < 4, planned  # the slowed group trained a prefix of some round
    exports = [tmp_path / f"export{g}" / "model.safetensors" for g in range(3)]
    digests = [hashlib.sha256(path.read_bytes()).hexdigest() for path in exports]
    assert len(set(digests)) == 1, digests


def end_line(group: int, others: str, timeout_s: int) -> str:
    """The line a group says when its END round (`hf_fedshard.engine.rounds.end_round`) never met ``others``."""
    return (
        f"hf_fedshard: fed_group{group} ended without {others}, which never met it on its final model within "
        f"fed_timeout_s={timeout_s} s"
    )


@pytest.mark.timeout(400)
def test_a_group_late_for_the_final_averaging_heals_within_the_end_round_and_past_it_each_side_says_so(tmp_path):
    """Two federations at once, 3 groups × 1 rank, H = 4, 8 steps, fed_timeout_s 10 s; group 1 stops as step 8
    begins. The others' final averaging times out without it; they commit it and END: they form quorums for
    fed_timeout_s more (I10). Stopped (SIGSTOP, its heartbeats too) and continued 17 s later, group 1 is back within
    that: it meets them, heals to their final model and all three save one model, nobody warns (issue 59: it used
    to average alone and save another model, silently). Asleep 32 s (heartbeating), it is back after they left: it
    ends on a model of its own, and each side names the other in one line."""
    common = [*TINY, "--max_steps", "8", "--fed_sync_steps", "4", "--fed_timeout_s", "10"]
    faults = {
        "near": ["--stop_at_step", "8", "--fault_rank", "0", "--fault_group", "1"],
        "far": ["--sleep_group", "1", "--sleep_at_step", "8", "--sleep_s", "32"],
    }
    runs = {}
    with lighthouse(min_groups=1, join_timeout_s=2) as near, lighthouse(min_groups=1, join_timeout_s=2) as far:
        for name, address in (("near", near), ("far", far)):
            out = tmp_path / name
            runs[name] = [
                start_group(g, 3, 1, out, [*common, *faults[name], "--export_dir", str(out / f"model{g}")], address)
                for g in range(3)
            ]
        stopped = wait_until_a_worker_stops(runs["near"][1], 240)
        time.sleep(17)
        os.kill(stopped, signal.SIGCONT)
        results = {name: [finish(launch, 300) for launch in launches] for name, launches in runs.items()}
    for name, group_results in results.items():
        for g, result in enumerate(group_results):
            assert result.returncode == 0, f"{name} group {g}:\n{result.stdout[-3000:]}"
    models = {
        name: [hashlib.sha256((tmp_path / name / f"model{g}" / "model.safetensors").read_bytes()).hexdigest()
               for g in range(3)]
        for name in results
    }  # fmt: skip
    near_out = [r.stdout for r in results["near"]]
    assert len(set(models["near"])) == 1, models["near"]
    assert not any("never met it" in out for out in near_out), near_out[1][-3000:]
    dumps = [torch.load(tmp_path / "near" / f"dump{g}" / "rank0.pt", weights_only=False) for g in range(3)]
    heals = [next(h for h in d["log_history"] if "train_runtime" in h)["fed_heals"] for d in dumps]
    assert heals[1] == 1, heals  # group 1 took the others' final model in their END round
    far_out = [r.stdout for r in results["far"]]
    assert models["far"][0] == models["far"][2] != models["far"][1], models["far"]
    for g, others in ((0, "fed_group1"), (1, "fed_group0, fed_group2"), (2, "fed_group1")):
        assert far_out[g].count(end_line(g, others, 10)) == 1, far_out[g][-3000:]


FAST = [*TINY, "--max_steps", "8", "--fed_sync_steps", "4", "--fed_timeout_s", "10"]


@pytest.mark.timeout(400)
def test_bad_federations_fail_every_rank_in_one_line_within_the_timeout(tmp_path):
    """Four federations at once (one rank per group, fed_timeout_s 10), each of which must fail on every rank:
    an unreachable lighthouse (2 ranks), a quorum below --min_groups, two launches with one fed_group_id, and
    groups started with different settings."""
    quorum_lost = "got no quorum of the federation within fed_timeout_s=10"
    cases = {  # name: (min_groups or None for no lighthouse, per-group extra arguments, ranks, expected line)
        "unreachable": (None, [[]], 2, "hf_fedshard: fed_lighthouse=http://localhost:9: nothing answers there "
                        "within 2 s"),
        "below_min": (2, [[]], 1, quorum_lost),
        "same_id": (2, [[], ["--fed_group_id", "0"]], 1, "two launches claim fed_group_id=0 (both answer: a second "
                    "launch, or a worker that outlived its killed torchrun"),
        "settings": (2, [[], ["--fed_outer_optimizer", "nesterov"]], 1,
                     "the groups of the federation were started with different settings: fed_outer_optimizer fedavg in "
                     "fed_group0, nesterov in fed_group1"),
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        launches = {}
        for name, (min_groups, per_group, nproc, _) in cases.items():
            address = "http://localhost:9" if min_groups is None else stack.enter_context(lighthouse(min_groups))
            launches[name] = [
                start_group(g, len(per_group), nproc, tmp_path / name, [*FAST, *extra], address)
                for g, extra in enumerate(per_group)
            ]
        outputs = {
            name: [finish(launch, 300) for launch in group_launches] for name, group_launches in launches.items()
        }
    for name, results in outputs.items():
        for g, result in enumerate(results):
            assert result.returncode != 0, f"{name}, group {g} did not fail:\n{result.stdout[-3000:]}"
            assert cases[name][3] in result.stdout, f"{name}, group {g}:\n{result.stdout[-3000:]}"


@pytest.mark.timeout(400)
def test_a_lost_lighthouse_ends_every_group_at_its_next_averaging_with_nothing_half_written(tmp_path):
    """2 groups × 1 rank checkpointing every 4 steps; the lighthouse is killed once checkpoint-4 exists: both
    groups fail at their next averaging with the line naming it, and no partial checkpoint is left."""
    args = [*TINY, "--max_steps", "64", "--fed_sync_steps", "4", "--fed_timeout_s", "10", "--step_sleep_s", "0.3",
            "--save_strategy", "steps", "--save_steps", "4"]  # fmt: skip
    with lighthouse(min_groups=2) as address:
        launches = [start_group(g, 2, 1, tmp_path, args, address) for g in range(2)]
        deadline = time.monotonic() + 240
        while not (tmp_path / "fed_group1" / "checkpoint-4").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    results = [finish(launch, 240) for launch in launches]
    for g, result in enumerate(results):
        assert result.returncode != 0, f"group {g} did not fail:\n{result.stdout[-3000:]}"
        assert "got no quorum of the federation within fed_timeout_s=10" in result.stdout, result.stdout[-3000:]
        leftovers = [p.name for p in (tmp_path / f"fed_group{g}").iterdir() if not p.name.startswith("checkpoint-")]
        assert leftovers == [], leftovers


@pytest.mark.timeout(900)
def test_a_restart_of_every_group_resumes_from_the_newest_step_they_all_have_then_on_another_group_size(
    tmp_path, one_job_h4
):
    """2 groups × 2 ranks checkpoint every 4 steps to step 8; group 1's checkpoint-8 is lost. Restarted with
    fed_auto_resume to step 10, both resume from checkpoint-4 (the newest both have), no group heals, and step 10
    (two averagings after the resume) equals one uninterrupted job to the bit (the module's, which saves nothing).
    Restarted again on 1 rank per group, each group resumes its checkpoint-10 (written in the background right
    after the final
    averaging) resharded, as mesh does: its model and anchor bit for bit, the data after the 40 samples its group
    read."""
    saves = ["--save_strategy", "steps", "--save_steps", "4"]
    out = tmp_path / "ft"
    with lighthouse(min_groups=2) as address:
        train_groups(2, 2, out, [*TINY, "--fed_sync_steps", "4", *saves, "--max_steps", "8"], address)
        shutil.rmtree(out / "fed_group1" / "checkpoint-8")
        background = ["--fed_auto_resume", "true", "--fed_async_checkpoint", "true"]
        resumed = train_groups(2, 2, out, [*H4_10_STEPS, *saves, *background], address)
        again = [*TINY, "--fed_sync_steps", "4", *saves, "--max_steps", "14", "--fed_auto_resume", "true"]
        resized = train_groups(2, 1, out, [*again, "--record_resume", "true"], address)
    mesh = one_job_h4
    for g in range(2):
        for r in range(2):
            assert resumed[g][r]["started_at_step"] == 4
            assert resumed[g][r]["log_history"][-3]["fed_heals"] == 0
            for name, value in resumed[g][r]["local_params"].items():
                torch.testing.assert_close(
                    value, mesh[2 * g + r]["local_params"][name], rtol=0, atol=0, msg=labelled(f"{g}/{r} {name}")
                )
    for g, (run,) in enumerate(resized):
        checkpoint = out / f"fed_group{g}" / "checkpoint-10"
        model = read_dcp(checkpoint / "fed_group0" / "model", tmp_path)["model"]
        anchor = read_dcp(checkpoint / "fed_outer", tmp_path)["anchor"]
        assert run["resumed"]["step"] == 10 and run["log_history"][-3]["fed_heals"] == 0
        for name, value in run["resumed"]["params"].items():
            assert torch.equal(value, model[name]) and torch.equal(run["resumed"]["anchor"][name], anchor[name]), name
        line = re.search(r"hf_fedshard: resuming step 10 of (.*)", run["stdout"]).group(1)
        assert "world batch goes from 4 to 2 samples per step; epoch 0 resumes after its first 40 samples" in line
        startup = re.search(r"hf_fedshard: start-up ([\d.]+) s to the first trained step: (.*)", run["stdout"])
        phases = dict(part.rsplit(" ", 2)[:2] for part in startup.group(2).split(", "))
        assert {"interpreter and imports", "quorum and heal", "state load (checkpoint or peer)", "first step"} <= set(
            phases
        ) and sum(map(float, phases.values())) == pytest.approx(float(startup.group(1)), abs=0.5), startup.group(0)
    for name, value in resized[0][0]["full_params"].items():  # the resized groups end on one global model
        assert torch.equal(value, resized[1][0]["full_params"][name]), name
