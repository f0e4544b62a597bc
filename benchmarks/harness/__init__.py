"""What the studies in ``benchmarks/`` import; nothing here is run on its own, except by the studies.

- ``methods``: the methods compared (FSDP, HSDP, FL+FSDP, ...) and one run of them on a fresh emulated cluster;
- ``netns``: the emulated two- or three-tier cluster (a network namespace per node, rate-limited links);
- ``bench_train``: the training script each study launches on every rank (by path, under torchrun);
- ``report``: figures, targets and tables from the ranks' records, and the results writers;
- ``exclusive``: the lock that keeps one timed study at a time on this machine;
- ``collective_bytes``: a counter of the bytes handed to collectives that span federation groups.
"""

from pathlib import Path

TRAIN_SCRIPT = Path(__file__).with_name("bench_train.py")  # launched by path, so that torchrun can run it
