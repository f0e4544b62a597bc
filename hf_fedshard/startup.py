"""Where a launch's time goes before its first trained step: one line from rank 0, phase by phase.

A restarted group is back only once its launch trains again, and that time was one figure. The phases are timed
where hf_fedshard runs them (`phase`), and the rest is told apart by two moments: the process's start (from the
kernel, so that the interpreter's own start counts) and the import of hf_fedshard's arguments module (by then a
script has imported what it needs). The line, said once per process at the end of its first trained step::

    hf_fedshard: start-up 27.4 s to the first trained step: interpreter and imports 9.8 s, arguments and process
    groups 0.6 s, your script (data and model) 3.1 s, trainer set-up 0.9 s, quorum and heal 4.2 s, FSDP set-up 1.0 s,
    state load (checkpoint or peer) 2.7 s, first step 4.8 s, other 0.3 s
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from hf_fedshard.notices import notice

LOAD = "state load (checkpoint or peer)"
PHASES = (
    "interpreter and imports",
    "arguments and process groups",
    "your script (data and model)",
    "trainer set-up",
    "quorum and heal",
    "FSDP set-up",
    LOAD,
    "first step",
)
_seconds: dict[str, float] = {}
_moments: dict[str, float] = {}


def process_start() -> float | None:
    """The wall-clock time this process started (Linux: ``/proc``), or ``None`` where the kernel does not say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def moment(name: str) -> None:
    """Remember when ``name`` first happened: ``imports done`` (hf_fedshard's arguments imported), ``trainer``
    (its construction begins), ``loop`` (Trainer's loop begins), ``train begin`` (its first step is next)."""
    _moments.setdefault(name, time.time())


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the seconds of the block to phase ``name`` (one of `PHASES`), before the first trained step only."""
    start = time.time()
    try:
        yield
    finally:
        if "first step" not in _seconds:
            _seconds[name] = _seconds.get(name, 0.0) + time.time() - start


def first_step_done(started: float | None = None) -> dict[str, float] | None:
    """At the end of the first trained step: the breakdown (``None`` if already said or unknown), said by rank 0."""
    if "first step" in _seconds or "train begin" not in _moments:
        return None
    now, started = time.time(), started if started is not None else process_start()
    if started is None:
        return None
    m = _moments
    _seconds["first step"] = now - m["train begin"]
    if "trainer" in m:
        before_trainer = m["trainer"] - started
        imports = max(0.0, m.get("imports done", started) - started)  # none in a process forked after its imports
        _seconds["interpreter and imports"] = imports
        own = _seconds.get("arguments and process groups", 0.0)
        _seconds["your script (data and model)"] = max(0.0, before_trainer - imports - own)
    if "loop" in m:  # Trainer's loop prepares the model (FSDP) and loads the checkpoint before it begins
        _seconds["FSDP set-up"] = max(0.0, m["train begin"] - m["loop"] - _seconds.get(LOAD, 0.0))
    breakdown = {name: round(_seconds[name], 2) for name in PHASES if name in _seconds}
    breakdown["other"] = round(max(0.0, now - started - sum(_seconds[n] for n in PHASES if n in _seconds)), 2)
    breakdown["total"] = round(now - started, 2)
    notice("start-up %.1f s to the first trained step: %s", breakdown["total"],
           ", ".join(f"{name} {s:.1f} s" for name, s in breakdown.items() if name != "total"))  # fmt: skip
    return breakdown
