"""What the studies in ``benchmarks/`` import; nothing here is run on its own, except by the studies.

- ``methods``: the methods compared (FSDP, HSDP, FL+FSDP, ...) and one run of them on a fresh emulated cluster;
- ``netns``: the emulated two- or three-tier cluster (a network namespace per node, rate-limited links);
- ``bench_train``: the training script each study launches on every rank (by path, under torchrun);
- ``report``: figures, targets and tables from the ranks' records, and the results writers;
- ``exclusive``: the lock that keeps one timed study at a time on this machine;
- ``collective_bytes``: a counter of the bytes handed to collectives that span federation groups;
- ``study``: how a study's ``main`` runs (the lock, a scratch folder, the record of its command, ``--report-only``);
- ``faults``, ``progress``: launches killed and restarted, and what they log as they go (the fault studies);
- ``process_tree``: every launch below a keeper that stops all it started, torchrun's workers and orphans included
  (also when the study is SIGKILLed); the studies and the tests start every launch through it;
- `results_folder` (here): the one naming scheme of the folders under ``benchmarks/results/``;
- `torchrun_command` (here): the command that starts torchrun, the same for every study.
"""

import os
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: the launched ranks' PYTHONPATH
TRAIN_SCRIPT = Path(__file__).with_name("bench_train.py")  # launched by path, so that torchrun can run it
RESULTS = Path(__file__).resolve().parents[1] / "results"
LAUNCHER_ENV = "HF_FEDSHARD_STUDY_TORCHRUN"  # the studies' smoke tests launch through the test suite's launch server


def torchrun_command() -> list[str]:
    """``python -m torch.distributed.run``, or the command in ``$HF_FEDSHARD_STUDY_TORCHRUN`` (torchrun's flags
    follow either way). The tests set it to their launch client (tests/launch_client.py), whose launches are forked
    from a server that imported the libraries once and run in the client's namespaces and cgroup: a study's smoke
    test then spends its seconds on the study, not on each rank's 7 CPU-seconds of imports."""
    return (
        shlex.split(os.environ[LAUNCHER_ENV])
        if os.environ.get(LAUNCHER_ENV)
        else [sys.executable, "-m", "torch.distributed.run"]
    )


def results_folder(study: str, quick: bool = False, variant: str | None = None) -> Path:
    """Where a study writes by default, one scheme for all: ``benchmarks/results/<study>_<quick|full>[_<variant>]``.

    ``full`` is a study's default run (the only one of a study without ``--quick``), ``quick`` its ``--quick`` run;
    a variant names what a run changes besides (``tiers_full_three_tier``: ``--topology three-tier``).
    """
    return RESULTS / "_".join([study, "quick" if quick else "full", *([variant] if variant else [])])
