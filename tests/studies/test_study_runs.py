"""The benchmark studies end to end, as users run them (``python -m benchmarks.<study>`` from the repository's root),
each at its smallest honest size: every study's --help; as root with iproute2, the tiers benchmark, the time-to-quality,
speed-rounds and goodput studies on a tiny emulated cluster; the elastic demo and the layout-change study on localhost.

The tiers benchmark and the time-to-quality study train on the same tokenized prefix of the text: one data cache for
the session (``data_cache``), prepared by whichever runs first."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import layout_change as lc
from benchmarks.harness.netns import list_namespaces
from benchmarks.harness.process_tree import cmdline, descendants, kill, kill_pids

from ..launch import REPO, STUDIES, study_launch_env

NETNS = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="network namespaces need root")

METHOD_FIELDS = {
    "layout", "tokens_per_s", "window_tokens_per_s", "s_per_step", "speedup_vs_fsdp", "fraction_of_ideal",
    "inter_bytes_per_step", "inter_bytes_per_node", "predicted", "bytes_measured_over_predicted", "averaging",
    "final_eval_perplexity", "eval_at_equal_time", "evals", "train_clock_s", "step_s",
}  # fmt: skip


def user_env() -> dict[str, str]:
    """This process's environment without PYTHONPATH: a study resolves its imports from the repository's root."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run_study(study: str, args: list, timeout_s: float, preloaded: bool = True) -> tuple[subprocess.Popen, str]:
    """``python -m benchmarks.<study> ARGS`` from the repository's root; the finished process (its pid names its
    namespaces) and its output, stderr included. A study still running at ``timeout_s`` is killed with its ranks.
    ``preloaded``: its launches fork from the session's launch server (`study_launch_env`)."""
    env = {**user_env(), **(study_launch_env() if preloaded else {})}
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{study}", *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise TimeoutError(f"benchmarks.{study} ran past {timeout_s} s:\n{proc.communicate()[0][-6000:]}") from None
    return proc, out


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """Tokenized text shared by the studies of this module (its folder names the settings it was made with)."""
    return tmp_path_factory.mktemp("data")


# Every study in one interpreter, as `python -m benchmarks.<study> --help` runs each: its answer and exit status.
HELP = """
import contextlib, io, json, runpy, sys
answers = {}
for study in sys.argv[1:]:
    sys.argv, out, code = [study, "--help"], io.StringIO(), "no exit"
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(f"benchmarks.{study}", run_name="__main__")
    except SystemExit as done:
        code = done.code
    answers[study] = [code, out.getvalue()]
print(json.dumps(answers))
"""


def test_every_study_answers_help():
    """Every study a user runs answers --help as a module from the repository's root, without PYTHONPATH (its imports
    resolve; nothing runs)."""
    proc = subprocess.run([sys.executable, "-c", HELP, *STUDIES], cwd=REPO, env=user_env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(answers) == STUDIES
    for study, (code, text) in answers.items():
        assert code == 0 and "usage:" in text, (study, code, text[-2000:])


@pytest.mark.timeout(900)
@NETNS
def test_tiny_benchmark_writes_every_figure(tmp_path, data_cache):
    out = tmp_path / "out"
    proc, out_text = run_study("tiers", ["--nodes", "2", "--ranks-per-node", "1",
        "--methods", "FSDP", "FL+FSDP", "ideal", "LocalSGD", "--steps", "4", "--sync-steps", "2",
        "--eval-steps", "4", "--model-size", "micro", "--max-train-lines", "3000", "--timeout-s", "240",
        "--out", out, "--work", tmp_path, "--data-cache", data_cache], timeout_s=840)  # fmt: skip
    assert proc.returncode == 0, out_text[-6000:]
    assert not [name for name in list_namespaces() if name.startswith(f"fsb{proc.pid}")]  # this run's, not another's

    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"FSDP", "FL+FSDP", "ideal", "LocalSGD"}
    for name, method in results["methods"].items():
        assert method.keys() >= METHOD_FIELDS, name
        assert method["tokens_per_s"] > 0 and method["final_eval_perplexity"] > 1
        assert len(method["inter_bytes_per_node"]) == 2
    assert results["link"]["goodput_mbit"] > 0
    assert results["machine"]["before"]["loadavg_1_5_15"]
    assert results["methods"]["FSDP"]["speedup_vs_fsdp"] == 1.0
    assert results["methods"]["ideal"]["fraction_of_ideal"] == 1.0
    for name in ("FSDP", "FL+FSDP", "LocalSGD"):  # the cost model predicts the measured inter-node bytes
        assert results["methods"][name]["bytes_measured_over_predicted"] == pytest.approx(1.0, abs=0.15), name
    assert [a["step"] for a in results["methods"]["FL+FSDP"]["averaging"]] == [2, 4]
    assert {t["target"].split()[0] for t in results["targets"]} >= {"FL+FSDP"}
    assert "| FL+FSDP |" in (out / "results.md").read_text()
    for png in ("throughput.png", "perplexity_vs_time.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


BUDGET_S = 3  # the smallest budget past the first evaluation after the start here (eval every H = 2 steps)


@pytest.mark.timeout(600)
@NETNS
def test_time_to_quality_study_runs_on_a_tiny_cluster(tmp_path, data_cache):
    """The study as users run it (2 nodes × 1 rank, micro, a 3 s budget): every rank of a method stops at the
    same step, the first evaluated one past the budget, and the results, table and plot are written."""
    out = tmp_path / "out"
    args = ["--nodes", "2", "--ranks-per-node", "1", "--methods", "FSDP", "FL+FSDP", "--budget-s", BUDGET_S,
            "--model-size", "micro", "--max-train-lines", "3000", "--sync-steps", "2", "--repeats", "1", "--out", out,
            "--work", tmp_path / "work", "--data-cache", data_cache]  # fmt: skip
    proc, out_text = run_study("time_to_quality", args, timeout_s=540)
    assert proc.returncode == 0, out_text[-6000:]
    assert not [name for name in list_namespaces() if name.startswith(f"fsb{proc.pid}")]

    results = json.loads((out / "results.json").read_text())
    for name in ("FSDP", "FL+FSDP"):
        run = results["runs"][0]["methods"][name]
        clocks = [e["train_clock_s"] for e in run["evals"]]
        assert len(run["stop_step_per_rank"]) == 1 and clocks[-2] < BUDGET_S <= clocks[-1], (name, clocks)
        assert run["evals"][-1]["step"] == run["stop_step_per_rank"][0]
        assert run["perplexity_at_budget"] > 1 and run["peak_rss_bytes_max"] > run["memory_added_bytes_max"] > 0
    fsdp = results["summary"]["methods"]["FSDP"]
    assert fsdp["time_to_FSDP"]["reached"] and fsdp["time_to_FSDP"]["reached"][0] <= BUDGET_S
    assert "| FL+FSDP |" in (out / "results.md").read_text()
    assert (out / "perplexity_vs_time.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(600)
@NETNS
def test_speed_rounds_study_slows_one_group_and_compares_both_policies(tmp_path, data_cache):
    """The study's quick mode as users run it, shorter (a 4 s budget, H = 4, cap 6 × B): the all-fast run, then the
    slow group 2× slower under ``steps`` and ``speed``, each group's launch in a cgroup with its quota; every rank of
    a run stops at one step, the slow group is slower for real, passes over steps under ``speed`` only, and every
    namespace and cgroup is removed. H = 4 and the cap leave room for a second round even where the quota slows the
    group far more than 2× (10-30× on this machine one evening, at H = 8 and cap 2.5 × B the runs stopped inside
    the first round, before a speed plan exists).

    About 40 s here, the one study smoke test over 20 s: its comparison needs three real runs on the 4-node
    cluster (the all-fast run sets the target, then ``steps`` and ``speed`` run to it), 4 + 10 + 10 s of training
    clock with each run's set-up and final evaluation. A shorter budget leaves the slow group one round where the
    quota slows it most (above), which fails the test for the machine's sake, not the study's."""
    out = tmp_path / "out"
    args = ["--quick", "--budget-s", 4, "--sync-steps", 4, "--cap-factor", 6, "--max-train-lines", 3000, "--out",
            out, "--work", tmp_path / "work", "--data-cache", data_cache]  # fmt: skip
    proc, out_text = run_study("speed_rounds", args, timeout_s=540)
    assert proc.returncode == 0, out_text[-6000:]
    assert not [name for name in list_namespaces() if name.startswith(f"fsb{proc.pid}")]
    assert not list(Path("/sys/fs/cgroup/cpu").glob(f"fsb{proc.pid}q*"))

    results = json.loads((out / "results.json").read_text())
    runs = results["reps"][0]["runs"]
    assert list(runs) == ["all fast", "2× slower, steps", "2× slower, speed"]
    figures = results["summary"]["runs"]
    for label, run in runs.items():
        assert len(run["stop_step_per_rank"]) == 1, label
        assert all(g["barrier_s"] is not None for g in run["groups"]), label  # every rank records its idle time
        steps = run["stop_step_per_rank"][0]
        slow = run["groups"][3]
        assert (slow["trained_steps"] < steps) == label.endswith("speed"), (label, slow["trained_steps"], steps)
        if label.endswith("speed"):  # the steps each rank recorded as trained, as the library counted them
            assert [g["round_plan"][-1] for g in run["groups"]] == [g["fed_round_steps"] for g in run["groups"]]
        assert run["cores"] == ([0.4] * 4 if label == "all fast" else [0.4, 0.4, 0.4, 0.2])
    for label in ("2× slower, steps", "2× slower, speed"):
        assert figures[label]["slowdown_achieved"]["median"] > 1.2, label  # the quota slows it, for real
        assert runs[label]["throttled_share"][3] > 0.3, label
    assert results["summary"]["target_ppl"]["median"] > 1 and results["summary"]["targets"]
    table = (out / "results.md").read_text()
    assert "| all fast | " in table and "| 2× | " in table
    assert (out / "perplexity_vs_time.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(600)
@NETNS
@pytest.mark.parametrize("path,fault", [("torchft", "full"), ("mesh", "none")])
def test_goodput_study_runs_a_path(tmp_path, path, fault):
    """The study's machinery on a short run (not its timing) of 2 groups × 1 rank: torchft through one full restart
    (every launch and the lighthouse killed at 2.5 s of 6, the groups started again from 3.5 s, 1 s apart, resuming
    from their checkpoints), mesh (one torchrun job of 2 nodes) without faults; every group stopped at one step and
    ended on one model, the figures, table and plot written, every namespace removed.

    About 20 s and 11 s here: a run of 6 s of training is the study's fixed start-up and stop around it, and the
    full restart runs after a run without faults (its goodput's denominator). The mesh job's restart from its
    checkpoint is `test_reliability.py`'s (torchrun restarts the job, ``fed_auto_resume`` resumes it), and the
    study's quick mode runs both paths through every fault."""
    out = tmp_path / "out"
    args = ["--quick", "--groups", "2", "--paths", path, "--run-s", "6", "--intervals-s", "5", "--restart-s", "1",
            "--stagger-s", "1", "--faults", fault, "--out", out, "--work", tmp_path / "work"]  # fmt: skip
    proc, out_text = run_study("goodput", args, timeout_s=540)
    assert proc.returncode == 0, out_text[-6000:]
    assert not [name for name in list_namespaces() if name.startswith(f"fsb{proc.pid}")]
    results = json.loads((out / "results.json").read_text())
    runs = {(r["path"], r["fault"]): r for r in results["reps"][0]["runs"]}
    faults = [None] if fault == "none" else [None, fault]
    assert set(runs) == {(path, f) for f in faults}
    assert runs[(path, None)]["goodput"] == 1.0 and runs[(path, None)]["group_steps"] > 0
    if fault == "full":
        assert [f["group"] for f in runs[(path, "full")]["faults"]] == [-1]
        assert runs[(path, "full")]["goodput"] >= 0  # 0 when the restarted groups commit nothing before the stop
    for f in faults:  # both groups wrote their shards' SHA-256 at the stop step, and they agree
        assert (runs[(path, f)]["groups_ended"], runs[(path, f)]["models_at_end"]) == ([0, 1], 1)
    assert results["hosts"] == "netns" and results["config"]["groups"] == 2
    table = (out / "results.md").read_text()
    assert f"| {path} | none | — | 0 |" in table
    if fault == "full":
        assert f"| {path} | every launch killed, back after 1 s, 1 s apart | 5 s | 1 |" in table
    assert (out / "goodput.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(480)
def test_elastic_demo_tells_its_story(tmp_path):
    """`make elastic-demo`'s script: group 1 is killed, restarted, heals and rejoins; the groups end bit-identical.

    About 17 s here: the demo as users run it, but 3 groups × 1 rank instead of 2, 48 steps instead of 128 and a
    restart after 1 s instead of 5; the restarted group heals about 2.5 s after its kill, and the survivors must not
    finish before it rejoins (the last 36 steps, about 5 s, are the margin). The two-rank groups' heal (every rank's
    shard from its peer) is `test_elastic.py`'s."""
    args = ["--work", tmp_path, "--max-steps", 48, "--restart-after-s", 1, "--ranks-per-group", 1]
    proc, out_text = run_study("elastic_demo", args, timeout_s=460)
    assert proc.returncode == 0, out_text[-9000:]
    assert "group 1 KILLED (SIGKILL to torchrun and its workers" in out_text
    assert re.search(r"group 1 healed from a live group: resumes training at step \d+", out_text)
    assert "averaging at step  48: groups [0 1 2]" in out_text and "OK: group 1 rejoined" in out_text


def _workers_below(pid: int) -> int:
    """The bench_train.py workers below ``pid`` (not their torchrun, not the keepers whose command names them)."""
    lines = [cmdline(p) for p in descendants(pid)]
    return sum(b"bench_train.py" in c and b"torch.distributed.run" not in c and b"process_tree" not in c for c in lines)


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(300)
def test_an_interrupted_study_leaves_nothing_running(tmp_path):
    """The elastic demo (a lighthouse, 3 launches of torchrun with 2 workers each) SIGKILLed once a worker of every
    group runs: none of its own cleanup runs, yet every process it had started is gone within 30 s, since each
    launch's keeper (benchmarks.harness.process_tree) finds its owner gone and stops its tree (before: its lighthouse
    and workers ran on). A Ctrl-C runs the study's cleanup first, and then the same."""
    command = [sys.executable, "-m", "benchmarks.elastic_demo", "--work", str(tmp_path)]
    study = subprocess.Popen(command, cwd=REPO, env=user_env(), stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 200
        while _workers_below(study.pid) < 3 and study.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        started = descendants(study.pid)
        assert _workers_below(study.pid) >= 3, "the demo did not start its groups within 200 s"
        study.kill()
        study.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [cmdline(p)[:120] for p in started if _alive(p)]
    finally:
        kill_pids([study.pid])


@pytest.mark.timeout(900)
def test_layout_change_study_runs_on_localhost(tmp_path):
    """The study as users run it, shrunk (micro, 2 groups × 1 rank, T = 4, S = 2, H = 2): checkpoint-2 resumed on its
    own layout, on 3 × 1 and on FL+HSDP 2 × (2 × 1); every resume starts from the source's global model at S, the
    changed layouts say so in their start-up line, and the results, table and plot are written."""
    out = tmp_path / "out"
    proc, out_text = run_study("layout_change", ["--source", "2x1", "--layouts", "2x1", "3x1", "2x2s1",
        "--model-size", "micro", "--steps", "4", "--save-step", "2", "--sync-steps", "2", "--eval-samples", "12",
        "--max-train-lines", "3000", "--out", out, "--data-cache", tmp_path], timeout_s=840)  # fmt: skip
    assert proc.returncode == 0, out_text[-9000:]
    results = json.loads((out / "results.json").read_text())
    rows = {(r["layout"], r["role"]): r for r in results["summary"]["rows"]}
    at_save = results["summary"]["source_eval_ppl_at_save"]
    for layout in ("2x1", "3x1", "2x2s1"):
        row = rows[(layout, "resume")]
        assert row["eval_ppl_at_resume"] == pytest.approx(at_save, rel=1e-4), layout  # the same global model
        assert row["eval_ppl_final"] is not None and row["world_batch_samples"] == 4 * lc.Layout.parse(layout).world
    assert rows[("2x1", "resume")]["start_line"] is None and rows[("2x1", "resume")]["loss_bump"] == 0
    assert rows[("3x1", "resume")]["start_line"].startswith(
        "hf_fedshard: resuming step 2 of FL+FSDP, 2 groups × 1 ranks on FL+FSDP, 3 groups × 1 ranks"
    )
    assert "the model is group 0's" in rows[("2x2s1", "resume")]["start_line"]
    assert "| 3 × 1 | 3 | 12 | 4 |" in (out / "results.md").read_text()
    assert (out / "layout_change.png").read_bytes()[:4] == b"\x89PNG"
