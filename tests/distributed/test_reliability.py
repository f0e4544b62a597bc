"""Multi-process reliability checks on gloo: exact resume, a killed rank, a kill while saving, a silent group,
diverged groups, exports. The runs train the tiny Llama of tests/scripts/train_tiny.py; those that resume use AdamW
and a decaying learning rate, so a resume that lost the moments, the scheduler, the data position or one group's
shards ends elsewhere (checked by breaking each: the final parameters then differ by about 2e-2).
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import LlamaForCausalLM

from hf_fedshard.checkpointing.checkpoint import latest_complete_checkpoint
from hf_fedshard.checkpointing.manifest import checksum_problem, describe_files, read_manifest

from ..asserts import labelled
from ..launch import SCRIPTS, SGD, Background, start_torchrun, torchrun, train_tiny

pytestmark = pytest.mark.timeout(900)

SCRIPT = SCRIPTS / "train_tiny.py"
ADAMW = ["--optim", "adamw_torch", "--learning_rate", "0.01", "--lr_scheduler_type", "linear", "--warmup_steps", "0",
         "--weight_decay", "0.01", "--max_grad_norm", "1.0"]  # fmt: skip
# FL+FSDP, 2 groups × 2 ranks, H=4: checkpoint-2 falls between two averagings, checkpoint-4 on one.
FL_FSDP_RUN = ["--fed_group_size", "2", "--fed_sync_steps", "4", "--max_steps", "6", "--save_strategy", "steps",
               "--save_steps", "2", *ADAMW]  # fmt: skip


def read_dcp(directory: Path, tmp_path: Path) -> dict:
    """A DCP folder as one plain state dict (offline, no process group)."""
    target = tmp_path / ("_".join(directory.parts[-3:]) + ".pt")
    dcp_to_torch_save(directory, target)
    return torch.load(target, weights_only=False)


def assert_same_run(runs: list[dict], reference: list[dict]) -> None:
    """Same final parameters (every rank's shards and the gathered model), eval perplexity and FedAvg counters."""
    for run, ref in zip(runs, reference, strict=True):
        for name, value in ref["local_params"].items():
            torch.testing.assert_close(run["local_params"][name], value, atol=1e-6, rtol=1e-5, msg=labelled(name))
        for name, value in ref["full_params"].items():
            torch.testing.assert_close(run["full_params"][name], value, atol=1e-6, rtol=1e-5, msg=labelled(name))
        assert run["eval"]["eval_perplexity"] == pytest.approx(ref["eval"]["eval_perplexity"], rel=1e-6)
        timing = ("last_sync_seconds", "total_sync_seconds", "total_wait_seconds", "total_barrier_seconds")
        assert {k: v for k, v in run["fed_counters"].items() if k not in timing} == {
            k: v for k, v in ref["fed_counters"].items() if k not in timing
        }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The uninterrupted FL+FSDP run, exporting its final model with save_model."""
    out = tmp_path_factory.mktemp("reference")
    return out, train_tiny(4, out, [*FL_FSDP_RUN, "--export_dir", out / "export"])


def test_each_group_saves_its_own_shards(reference, tmp_path):
    out, runs = reference
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not list(out.glob("tmp-*"))
    layout = json.loads((out / "checkpoint-2" / "fed_layout.json").read_text())
    assert (layout["method"], layout["fed_group_size"], layout["fed_shard_size"]) == ("FL+FSDP", 2, 2)
    assert layout["model"]["model_type"] == "llama"
    between = [read_dcp(out / "checkpoint-2" / f"fed_group{g}" / "model", tmp_path)["model"] for g in (0, 1)]
    on_sync = [read_dcp(out / "checkpoint-4" / f"fed_group{g}" / "model", tmp_path)["model"] for g in (0, 1)]
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(between[0][name], between[1][name])  # groups differ between averagings
    assert all(torch.equal(on_sync[0][k], on_sync[1][k]) for k in on_sync[0])  # and agree right after one
    counters = json.loads((out / "checkpoint-4" / "fed_group1" / "fedavg_rank3.json").read_text())
    assert (counters["syncs"], counters["synced_at"]) == (2, [4])  # step 0's averaging, then step 4's
    assert (layout["samples_per_step"], layout["steps_per_epoch"]) == (8, 8)  # 4 ranks × 2; 64 samples
    outer = read_dcp(out / "checkpoint-4" / "fed_outer", tmp_path)  # by parameter name, any layout reads it
    assert sorted(outer["anchor"]) == sorted(runs[0]["local_params"]) and "momentum" not in outer  # FedAvg: none
    for name, value in outer["anchor"].items():  # right after an averaging, the anchor is the model
        assert torch.equal(value, on_sync[0][name]), name


def test_save_model_exports_the_global_model_in_hf_format(reference):
    out, runs = reference
    model = LlamaForCausalLM.from_pretrained(out / "export")
    exported = dict(model.named_parameters())
    for rank in (0, 2):  # one rank of each group: both hold the global model at the end
        for name, value in runs[rank]["full_params"].items():
            torch.testing.assert_close(exported[name], value, atol=0, rtol=0, msg=labelled(name))


def test_save_model_between_averagings_exports_their_average(tmp_path):
    """2 groups of 1 rank, H=4: save_model at step 3 writes the drifted groups' average; each group keeps its own."""
    args = ["--fed_group_size", "1", "--fed_sync_steps", "4", "--max_steps", "4", "--export_at_step", "3",
            "--export_dir", tmp_path / "export", *ADAMW]  # fmt: skip
    runs = train_tiny(2, tmp_path, args)
    group0, group1 = (run["params_before_export"] for run in runs)
    exported = dict(LlamaForCausalLM.from_pretrained(tmp_path / "export").named_parameters())
    assert any(not torch.equal(group0[name], group1[name]) for name in group0)  # the groups had drifted
    for name, value in group0.items():
        torch.testing.assert_close(exported[name], (value + group1[name]) / 2, atol=1e-7, rtol=1e-6, msg=labelled(name))
    for run in runs:  # the export changed no group's model
        assert all(torch.equal(run["params_after_export"][n], v) for n, v in run["params_before_export"].items())
    assert runs[0]["fed_counters"]["syncs"] == 2  # step 0's averaging, then step 4's: the export is none


def test_killed_rank_restarts_and_resumes_exactly(reference, tmp_path):
    """SIGKILL rank 1 as step 5 begins; torchrun restarts the job, which resumes from checkpoint-4 by itself."""
    _, ref = reference
    runs = train_tiny(
        4, tmp_path, [*FL_FSDP_RUN, "--fed_auto_resume", "true", "--kill_at_step", "5"], 400, max_restarts=1
    )
    assert [run["started_at_step"] for run in runs] == [4] * 4  # resumed, on an averaging step
    assert_same_run(runs, ref)
    stamps = [(h["step"], h["wall_seconds"]) for h in runs[0]["log_history"] if "loss" in h]
    assert [step for step, _ in stamps] == [1, 2, 3, 4, 5, 6]
    seconds = [t for _, t in stamps]
    assert seconds == sorted(seconds)  # the card's clock goes on across the restart


@pytest.mark.parametrize("saves", ["synchronous", "background"])
def test_kill_while_saving_keeps_the_previous_checkpoint(reference, tmp_path, saves):
    """Rank 1 dies after writing its shards of checkpoint-4 (background: in the writing thread, while the others
    train on): no checkpoint-4; the relaunch resumes from 2 and ends as the uninterrupted run. In the background,
    both runs save so: the checkpoints they publish equal the synchronous run's, tensor for tensor, though training
    changed the model while they were written."""
    out, ref = reference
    mode = ["--fed_async_checkpoint", "true"] if saves == "background" else []
    args = ["--output_dir", tmp_path, "--dump_dir", tmp_path / "dump", *SGD, *FL_FSDP_RUN, "--fed_auto_resume", "true"]
    killed = torchrun(4, SCRIPT, [*args, *mode, "--kill_while_saving_step", "4"])
    assert killed.returncode != 0
    assert sorted(p.name for p in tmp_path.glob("*checkpoint-*")) == ["checkpoint-2", "tmp-checkpoint-4"]
    assert latest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    runs = train_tiny(4, tmp_path, [*FL_FSDP_RUN, "--fed_auto_resume", "true", *mode])
    assert [run["started_at_step"] for run in runs] == [2] * 4  # resumed between two averagings
    assert_same_run(runs, ref)
    assert not list(tmp_path.glob("tmp-*"))
    if saves == "background":
        assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (2, 4, 6)]
        for step, part in itertools.product((2, 4, 6), ("fed_group0/model", "fed_group1/optimizer", "fed_outer")):
            ours = read_dcp(tmp_path / f"checkpoint-{step}" / part, tmp_path / "dump")
            theirs = read_dcp(out / f"checkpoint-{step}" / part, tmp_path)
            assert_same_tree(ours, theirs, f"checkpoint-{step}/{part}")
        last = str(tmp_path / "checkpoint-6")
        assert checksum_problem(last, read_manifest(last), read_manifest(last)) is None


def assert_same_tree(ours: object, theirs: object, where: str) -> None:
    """Equal nested state (dicts, lists, tensors bit for bit, plain values)."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and sorted(ours, key=str) == sorted(theirs, key=str), where
        for key, value in theirs.items():
            assert_same_tree(ours[key], value, f"{where}.{key}")
    elif isinstance(theirs, list | tuple):
        assert isinstance(ours, list | tuple) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same_tree(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs), where
    else:
        assert ours == theirs, where


def test_fl_hsdp_resumes_exactly_between_averagings(tmp_path):
    """FL+HSDP, 2 groups × 2 replicas × 2 shards: resume from checkpoint-1 (H=2) with resume_from_checkpoint. The
    reference saves in the background at every step, so each save first waits for the one before."""
    args = ["--fed_group_size", "4", "--fed_shard_size", "2", "--fed_sync_steps", "2", "--max_steps", "3",
            "--save_strategy", "steps", "--save_steps", "1", *ADAMW]  # fmt: skip
    ref = train_tiny(8, tmp_path / "ref", [*args, "--fed_async_checkpoint", "true"], 400)
    assert sorted(p.name for p in (tmp_path / "ref").glob("*checkpoint-*")) == [f"checkpoint-{s}" for s in (1, 2, 3)]
    checkpoint = tmp_path / "ref" / "checkpoint-1"
    runs = train_tiny(8, tmp_path / "resumed", [*args, "--resume_from_checkpoint", checkpoint], 400)
    assert [run["started_at_step"] for run in runs] == [1] * 8
    assert_same_run(runs, ref)


STALLS = {  # name: the fault's arguments (2 groups × 2 ranks); the three launches mostly wait, so they run at once
    "silent": ["--fed_sync_steps", "2", "--max_steps", "4", "--fed_timeout_s", "5", "--sleep_group", "1",
               "--sleep_at_step", "2", "--sleep_s", "600"],
    "stopped": ["--fed_sync_steps", "4", "--max_steps", "8", "--ddp_timeout", "20", "--fed_timeout_s", "10",
                "--stop_at_step", "3", "--fault_rank", "3"],
    "stopped_in_flight": ["--fed_sync_steps", "4", "--fed_sync_overlap", "1", "--max_steps", "8", "--ddp_timeout",
                          "600", "--fed_timeout_s", "10", "--stop_at_step", "5", "--fault_rank", "3",
                          "--logging_steps", "100"],
}  # fmt: skip


@pytest.fixture(scope="module")
def stalls(tmp_path_factory) -> dict[str, Background]:
    """The launches of `STALLS`, started side by side (each test waits for its own)."""
    launches = {}
    for name, fault in STALLS.items():
        out = tmp_path_factory.mktemp(name)
        args = ["--output_dir", out, "--dump_dir", out, *SGD, "--fed_group_size", "2", *fault]
        launches[name] = Background(start_torchrun(4, SCRIPT, args), 400)
    return launches


def test_silent_group_fails_the_others_within_fed_timeout(stalls):
    """Group 1 sleeps 10 minutes before the first averaging: group 0 raises after 5 s and the job ends."""
    result = stalls["silent"].result()
    assert result.returncode != 0
    assert "an exchange across federation groups failed at step 2: another group stopped answering" in result.stdout
    assert "no reply within fed_timeout_s=5 seconds" in result.stdout


def stopped_rank(stdout: str) -> tuple[int, float]:
    """The stopped rank's pid and when it stopped, from its line."""
    found = re.search(r"rank 3 \(pid (\d+)\) stopping at ([\d.]+)", stdout)
    return int(found.group(1)), float(found.group(2))


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stopped_rank_ends_the_job_within_the_timeouts(stalls):
    """SIGSTOP of rank 3 (group 1) at step 3: group 0 fails in the world loss gather of logging after ddp_timeout
    (20 s; fed_timeout_s 10), and torchrun ends the stopped rank.

    Before the world group got ddp_timeout on CPU, group 0 waited PyTorch's 30-minute default there.
    """
    launch = stalls["stopped"]
    result = launch.result()
    assert result.returncode != 0
    pid, stopped = stopped_rank(result.stdout)
    assert launch.ended_at - stopped < max(20, 10) + 60, result.stdout[-3000:]  # the bound the README states
    assert "a collective across ranks failed at step 3: a rank stopped answering (no reply within ddp_timeout=20" in (
        result.stdout
    )
    assert not alive(pid)  # torchrun ended the stopped rank too


def test_stopped_rank_with_an_exchange_in_flight_fails_the_others_within_fed_timeout(stalls):
    """τ = 1, H = 4: rank 3 (group 1) stops as step 5, the apply step, begins. Group 0 fails within fed_timeout_s,
    not the 600 s ddp_timeout: waiting for the exchange of step 4 if rank 3 stopped before its worker sent its part,
    else at step 8's averaging (the apply itself runs no collective across groups). No logging before then: the
    Trainer's loss gather at a log spans the world under ddp_timeout."""
    launch = stalls["stopped_in_flight"]
    result = launch.result()
    assert result.returncode != 0
    pid, stopped = stopped_rank(result.stdout)
    assert launch.ended_at - stopped < 10 + 60, result.stdout[-3000:]
    assert re.search(
        r"an exchange across federation groups failed at step [48]: another group stopped answering \(no reply "
        r"within fed_timeout_s=10 seconds\)",
        result.stdout,
    )
    assert not alive(pid)


def test_diverged_group_restarts_from_the_others_and_all_diverged_stops(tmp_path):
    """A NaN in group 1 after step 3 (healed at the averaging of step 4), then in both groups after step 5.

    Logging every 5 steps, the divergence still gets a log at step 4 (Trainer's logging_nan_inf_filter hides the
    NaN loss itself).
    """
    args = ["--output_dir", tmp_path, "--dump_dir", tmp_path, *SGD, "--fed_group_size", "2", "--fed_sync_steps", "2",
            "--max_steps", "8", "--save_strategy", "steps", "--save_steps", "1", *ADAMW,
            "--nan_at", "3:1", "5:0,1", "--logging_steps", "5"]  # fmt: skip
    result = torchrun(4, SCRIPT, args)
    out = result.stdout
    assert "group(s) [1] had NaN/Inf at step 4: left out of the average" in out
    assert out.count("'fed_diverged_groups': 1") == 2  # logged at step 4 (the divergence's) and 5 (logging_steps)
    assert "checkpoint-3 not written: group(s) [1] hold NaN/Inf" in out
    assert "checkpoint-5 not written: group(s) [0, 1] hold NaN/Inf" in out
    assert result.returncode != 0
    assert "every federation group (2) has NaN/Inf in its model at step 6; training stopped" in out
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]
    assert latest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")
    models = [read_dcp(tmp_path / "checkpoint-4" / f"fed_group{g}" / "model", tmp_path)["model"] for g in (0, 1)]
    for name, value in models[0].items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(models[1][name], value), name  # group 1 restarted from group 0's model
    states = [read_dcp(tmp_path / "checkpoint-4" / f"fed_group{g}" / "optimizer", tmp_path)["optimizer"]["state"]
              for g in (0, 1)]  # fmt: skip
    embed = "model.embed_tokens.weight"
    assert (states[0][embed]["step"].item(), states[1][embed]["step"].item()) == (4, 0)  # group 1's moments reset
    assert not states[1][embed]["exp_avg"].any()


def test_averaging_settings_changed_at_each_resume_take_effect_there(tmp_path):
    """2 groups of 1 rank, H=2, a checkpoint at every averaging; each relaunch resumes with other settings:
    fedavg fp32 (steps 1–2) → nesterov 0.7/0.9 bf16 (3–4) → nesterov 0.5/0.8 fp32 (5–6) → fedavg (7–8).

    Each first averaging after a resume follows the new rule from the checkpoint's anchor and momentum buffer
    (before the fix every run kept the checkpoint's fedavg); the counters keep the whole history for the card.
    """
    base = ["--fed_group_size", "1", "--fed_sync_steps", "2", "--save_strategy", "steps", "--save_steps", "2",
            "--fed_auto_resume", "true", "--record_syncs", "true"]  # fmt: skip
    nesterov = ["--fed_outer_optimizer", "nesterov"]
    stages = [
        (2, []),
        (4, [*nesterov, "--fed_sync_dtype", "bfloat16"]),
        (6, [*nesterov, "--fed_outer_lr", "0.5", "--fed_outer_momentum", "0.8"]),
        (8, []),
    ]
    outputs, dumps = [], []
    for max_steps, settings in stages:
        args = ["--output_dir", tmp_path, "--dump_dir", tmp_path / "dump", *SGD, *base, *settings]
        result = torchrun(2, SCRIPT, [*args, "--max_steps", str(max_steps)])
        assert result.returncode == 0, result.stdout[-6000:]
        outputs.append(result.stdout)
        dumps.append(torch.load(tmp_path / "dump" / "rank0.pt", weights_only=False))
    assert (
        "resuming at step 2 with other averaging settings than the checkpoint's, honoured from this step on: "
        "fed_outer_optimizer fedavg → nesterov, fed_outer_lr 1.0 → 0.7, fed_outer_momentum 0.0 → 0.9, "
        "fed_sync_dtype float32 → bfloat16, the outer momentum starts from zero."
    ) in outputs[1]
    assert "other averaging settings" not in outputs[0]

    names = [n for n in dumps[0]["full_params"]]  # every parameter trains: the anchor's order
    for (step, _), dump, (lr, momentum, kept) in zip(
        stages[1:], dumps[1:], [(0.7, 0.9, False), (0.5, 0.8, True), (1.0, 0.0, False)], strict=True
    ):
        saved = read_dcp(tmp_path / f"checkpoint-{step - 2}" / "fed_outer", tmp_path)  # what this run resumed from
        means = dump["sync_exchanges"][step][1]
        after = dump["sync_params"][step][1]
        for i, name in enumerate(names):
            buffer = saved["momentum"][name] if kept else torch.zeros_like(means[i])
            buffer = momentum * buffer + means[i]
            expected = saved["anchor"][name] - lr * (means[i] + momentum * buffer if momentum else means[i])
            torch.testing.assert_close(after[name], expected, atol=1e-6, rtol=0, msg=labelled(name))
    bf16_means = dumps[1]["sync_exchanges"][4][1]
    assert all(torch.equal(m, m.bfloat16().float()) for m in bf16_means)  # sent in bfloat16 after the resume
    assert not all(torch.equal(m, m.bfloat16().float()) for m in dumps[2]["sync_exchanges"][6][1])  # float32 again
    history = [(e["step"], e["outer_optimizer"], e["outer_lr"], e["outer_momentum"], e["sync_dtype"])
               for e in dumps[3]["fed_counters"]["averaging"]]  # fmt: skip
    assert history == [
        (0, "fedavg", 1.0, 0.0, "float32"),
        (2, "nesterov", 0.7, 0.9, "bfloat16"),
        (4, "nesterov", 0.5, 0.8, "float32"),
        (6, "fedavg", 1.0, 0.0, "float32"),
    ]


def test_federated_checkpoint_fails_one_group_on_every_rank_without_hang(reference, tmp_path):
    """One group of 4 picks it with fed_auto_resume and refuses it on each rank before any collective (Transformers
    said "Can't find a valid checkpoint" before one group checked the layout); the in-process table holds the
    other cases, and tests/test_reshard.py the other layouts that resume it."""
    shutil.copytree(reference[0] / "checkpoint-2", tmp_path / "checkpoint-2")
    args = [*FL_FSDP_RUN, "--fed_group_size", "4", "--fed_auto_resume", "true"]
    result = torchrun(4, SCRIPT, ["--output_dir", tmp_path, "--dump_dir", tmp_path, *SGD, *args], 120)
    assert result.returncode != 0
    message = (
        "was written with fed_group_size=2, fed_shard_size=2 on WORLD_SIZE=4, but this run has fed_group_size=4, "
        "fed_shard_size=4 on WORLD_SIZE=4, and one group (no federation) does not resume a federated checkpoint. "
        "Relaunch on 4 ranks"
    )
    assert result.stdout.count(message) == 4, result.stdout[-3000:]  # one line from every rank


def damage(path: Path, how: str) -> None:
    """Truncate a file to half its size, or flip one byte in its middle (same size: only a checksum sees it)."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)


def shard(checkpoint: Path, group: int, what: str) -> Path:
    return sorted((checkpoint / f"fed_group{group}" / what).glob("*.distcp"))[0]


def test_damaged_checkpoints_are_skipped_together_and_set_aside(reference, tmp_path):
    """checkpoint-6: group 1's model shard and group 0's optimizer shard truncated; checkpoint-4: one flipped byte
    in group 1's model shard (sizes pass, its checksum does not). Under torchrun --max-restarts 1 the first attempt
    skips both, resumes from checkpoint-2 and ends at the uninterrupted run's parameters: no crash loop.
    """
    out, ref = reference
    for step in (2, 4, 6):
        shutil.copytree(out / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
    damage(shard(tmp_path / "checkpoint-6", 1, "model"), "truncate")
    damage(shard(tmp_path / "checkpoint-6", 0, "optimizer"), "truncate")
    damage(shard(tmp_path / "checkpoint-4", 1, "model"), "flip")
    args = ["--output_dir", tmp_path, "--dump_dir", tmp_path / "dump", *SGD, *FL_FSDP_RUN, "--fed_auto_resume", "true"]
    result = torchrun(4, SCRIPT, args, 400, max_restarts=1)
    out_text = result.stdout
    assert result.returncode == 0, out_text[-6000:]
    assert "will restart worker group" not in out_text  # the first attempt resumed
    skipped_6 = re.search(r"skipping \S+checkpoint-6 \((.*)\); renamed to \S+damaged-checkpoint-6", out_text)
    assert re.search(r"rank 0: fed_group0/optimizer/\S+ has [\d,]+ bytes, the manifest says", skipped_6.group(1))
    assert re.search(r"rank 2: fed_group1/model/\S+ has [\d,]+ bytes, the manifest says", skipped_6.group(1))
    skipped_4 = re.search(r"skipping \S+checkpoint-4 \((.*)\); renamed to \S+damaged-checkpoint-4", out_text)
    assert re.search(r"rank [23]: fed_group1/model/\S+ does not match its checksum", skipped_4.group(1))
    runs = [torch.load(tmp_path / "dump" / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert [run["started_at_step"] for run in runs] == [2] * 4
    assert_same_run(runs, ref)
    names = sorted(p.name for p in tmp_path.glob("*checkpoint-*"))
    assert names == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "damaged-checkpoint-4", "damaged-checkpoint-6"]
    for step in (4, 6):  # saved again over the damaged ones' names, with their own manifests
        files = read_manifest(str(tmp_path / f"checkpoint-{step}"))
        assert checksum_problem(str(tmp_path / f"checkpoint-{step}"), files, files) is None


def test_damaged_outer_state_is_verified_like_every_other_file(reference, tmp_path):
    """fed_outer/ is written by group 0 and read by every group: checkpoint-6's second DCP file truncated (sizes,
    seen by every rank), checkpoint-4's first with one flipped byte (checksums, by the rank hashing it). Both are
    named, set aside, and the run resumes from checkpoint-2 on its first attempt, ending at the uninterrupted run's
    parameters.
    """
    out, ref = reference
    for step in (2, 4, 6):
        shutil.copytree(out / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
    damage(tmp_path / "checkpoint-6" / "fed_outer" / "__1_0.distcp", "truncate")
    damage(tmp_path / "checkpoint-4" / "fed_outer" / "__0_0.distcp", "flip")
    args = ["--output_dir", tmp_path, "--dump_dir", tmp_path / "dump", *SGD, *FL_FSDP_RUN, "--fed_auto_resume", "true"]
    result = torchrun(4, SCRIPT, args, 400, max_restarts=1)
    out_text = result.stdout
    assert result.returncode == 0, out_text[-6000:]
    assert "will restart worker group" not in out_text
    skipped_6 = re.search(r"skipping \S+checkpoint-6 \((.*)\); renamed to \S+damaged-checkpoint-6", out_text).group(1)
    for rank in range(4):  # every rank reads the outer state, whichever layout it has
        assert re.search(rf"rank {rank}: fed_outer/__1_0.distcp has [\d,]+ bytes, the manifest says", skipped_6)
    skipped_4 = re.search(r"skipping \S+checkpoint-4 \((.*)\); renamed to \S+damaged-checkpoint-4", out_text).group(1)
    assert re.fullmatch(r"rank \d: fed_outer/__0_0.distcp does not match its checksum \(.*\)", skipped_4)
    runs = [torch.load(tmp_path / "dump" / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert [run["started_at_step"] for run in runs] == [2] * 4
    assert_same_run(runs, ref)


def test_file_written_damaged_fails_every_rank_naming_it(reference, tmp_path):
    """A file that matches its manifest but cannot be read (damaged before the manifest was written): the ranks
    that read it name it, and every rank stops at once with that message, none waiting for ddp_timeout."""
    checkpoint = tmp_path / "checkpoint-4"
    shutil.copytree(reference[0] / "checkpoint-4", checkpoint)
    damage(checkpoint / "fed_outer" / "__1_0.distcp", "truncate")
    files = read_manifest(str(checkpoint))
    files.update(describe_files(str(checkpoint), ["fed_outer/__1_0.distcp"]))
    (checkpoint / "manifest.json").write_text(json.dumps({"files": files}))
    args = [*FL_FSDP_RUN, "--resume_from_checkpoint", checkpoint, "--ddp_timeout", "600"]
    started = time.time()
    result = torchrun(4, SCRIPT, ["--output_dir", tmp_path, "--dump_dir", tmp_path, *SGD, *args], 300)
    assert result.returncode != 0
    assert time.time() - started < 200  # no rank waited for the 600 s ddp_timeout
    ranks = "; ".join(  # DCP fails every rank of a group where one rank could not read its chunk (position 1)
        rf"rank {r}: cannot read \S+/fed_outer \(rank\(s\) \[1\]: RuntimeError: PytorchStreamReader failed [^;]*\)"
        for r in range(4)
    )
    message = re.compile(rf"resuming from {checkpoint} failed \({ranks}\) although its files match manifest.json")
    assert len(message.findall(result.stdout)) == 4, result.stdout[-4000:]  # said by every rank


def test_explicit_checkpoint_that_does_not_verify_is_refused_naming_the_file(reference, tmp_path):
    """A deleted group folder: every rank refuses it with the missing file's name, before training; kept in place."""
    checkpoint = tmp_path / "checkpoint-4"
    shutil.copytree(reference[0] / "checkpoint-4", checkpoint)
    shutil.rmtree(checkpoint / "fed_group1")
    args = [*FL_FSDP_RUN, "--resume_from_checkpoint", checkpoint]
    result = torchrun(4, SCRIPT, ["--output_dir", tmp_path, "--dump_dir", tmp_path, *SGD, *args], 120)
    assert result.returncode != 0
    message = f"resume_from_checkpoint={checkpoint} does not verify: rank 2: fed_group1/"
    assert result.stdout.count(message) == 4, result.stdout[-3000:]
    assert re.search(r"rank 3: fed_group1/\S+ is missing", result.stdout)
    assert checkpoint.is_dir()


def test_load_best_model_at_end_reloads_each_groups_shards(tmp_path):
    """The best checkpoint (here the highest eval loss, step 2) is what the groups hold after training."""
    args = ["--fed_group_size", "2", "--fed_sync_steps", "2", "--max_steps", "4", "--save_strategy", "steps",
            "--save_steps", "2", "--eval_strategy", "steps", "--eval_steps", "2", "--load_best_model_at_end", "true",
            "--metric_for_best_model", "loss", "--greater_is_better", "true", *ADAMW]  # fmt: skip
    runs = train_tiny(4, tmp_path, args)
    evals = [(h["step"], h["eval_loss"]) for h in runs[0]["log_history"] if "eval_loss" in h]
    (_, at_2), (_, at_4) = evals[:2]  # the evaluations during training
    assert [step for step, _ in evals[:2]] == [2, 4] and at_2 > at_4  # step 2 is the best by this metric
    assert runs[0]["eval"]["eval_loss"] == at_2  # the script's final evaluate() sees the best model
    best = read_dcp(tmp_path / "checkpoint-2" / "fed_group1" / "model", tmp_path)["model"]
    last = read_dcp(tmp_path / "checkpoint-4" / "fed_group1" / "model", tmp_path)["model"]
    for rank in runs:
        for name, value in rank["full_params"].items():
            assert torch.equal(value, best[name]), name
    assert any(not torch.equal(best[name], last[name]) for name in best)


@pytest.mark.timeout(200)
def test_gloo_ranks_exit_cleanly_without_destroy_process_group():
    """Trainer scripts never destroy their process groups; the exit hook does, so no rank aborts at exit, and none
    hangs there when a DDP reducer holds the world group while a collective is in flight (every run did before)."""
    for _ in range(2):  # without the hook 8 runs in 10 abort: two clean runs are not luck
        result = torchrun(5, SCRIPTS / "gloo_exit.py", [], timeout_s=60, preloaded=False)  # its own interpreter exit
        assert result.returncode == 0, result.stdout[-3000:]
