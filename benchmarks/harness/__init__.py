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
- `results_folder` (here): the one naming scheme of the folders under ``benchmarks/results/``.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: the launched ranks' PYTHONPATH
TRAIN_SCRIPT = Path(__file__).with_name("bench_train.py")  # launched by path, so that torchrun can run it
RESULTS = Path(__file__).resolve().parents[1] / "results"


def results_folder(study: str, quick: bool = False, variant: str | None = None) -> Path:
    """Where a study writes by default, one scheme for all: ``benchmarks/results/<study>_<quick|full>[_<variant>]``.

    ``full`` is a study's default run (the only one of a study without ``--quick``), ``quick`` its ``--quick`` run;
    a variant names what a run changes besides (``tiers_full_three_tier``: ``--topology three-tier``).
    """
    return RESULTS / "_".join([study, "quick" if quick else "full", *([variant] if variant else [])])
