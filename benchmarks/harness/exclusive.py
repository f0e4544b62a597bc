"""One benchmark at a time on this machine: every study's ``main`` holds an exclusive lock on a shared file.

Timed studies compare methods run one after the other; a second CPU-heavy job on the same cores would slow some
of them and not others. ``flock`` is released by the kernel when the process exits, so a killed run never leaves
the lock held. Wrap other CPU-heavy jobs (test suites) with ``flock /tmp/hf_fedshard_cpu.lock <command>`` to
queue them behind a running study.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

LOCK = os.environ.get("HF_FEDSHARD_BENCH_LOCK", "/tmp/hf_fedshard_cpu.lock")


@contextlib.contextmanager
def exclusive_cores(what: str) -> Iterator[None]:
    """Hold the machine's benchmark lock for ``what``; say so if another job holds it and we wait."""
    with open(LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{what}: waiting for {LOCK} (another benchmark or test run holds it)", flush=True)
            started = time.time()
            fcntl.flock(lock, fcntl.LOCK_EX)
            print(f"{what}: lock acquired after {time.time() - started:.0f} s", flush=True)
        yield
