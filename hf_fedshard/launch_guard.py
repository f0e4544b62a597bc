"""What a worker checks of the launch that started it (torchrun, or ``accelerate launch``, which runs it): the start
and the end of a run are where a federation of launches breaks without a word.

- `watch_launcher`: torchrun starts each worker in a session of its own, so a torchrun that is SIGKILLed (an OOM
  killer, a crashed node agent) leaves its workers running. Under ``fed_transport torchft`` they keep answering for
  the group's ``fed_group_id``, and the group's restarted launch is refused as a second claim of it. A daemon thread
  notices within a second that the process that started this worker is gone, says so in one line and ends the
  worker, so that the restart heals.
- `check_restart_store`: ``torchrun --max-restarts`` shares its rendezvous store with the workers it starts unless
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is in its environment; the workers it restarts then read the dead ones'
  addresses and fail or hang in ``init_process_group`` (pytorch/pytorch#135712). Said once, at the first start,
  from rank 0, with the fix; a restarted worker's failed set-up names the cause.
- `setup_deadline`: the world's process group must be set up within `setup_timeout_s` (default `SETUP_TIMEOUT_S`,
  ``HF_FEDSHARD_SETUP_TIMEOUT_S`` sets it), else the worker says so in one line and ends: a hang there (ranks that
  never come, a stale store) becomes an error instead of a job that waits for half an hour or forever.

Workers of other launchers (no ``TORCHELASTIC_*`` environment: a plain ``python``, srun, mpirun) are left alone by
the first two.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

from hf_fedshard.errors import ConfigError
from hf_fedshard.notices import notice

SETUP_TIMEOUT_S = 300.0  # ranks of one launch start together; 5 minutes covers slow imports on a shared file system
WATCH_INTERVAL_S = 0.5
_watched: dict[str, int] = {}  # the launcher's pid once this process watches it


def under_torchelastic() -> bool:
    """Whether this process is a worker of torchrun's agent (``accelerate launch`` included)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def watch_launcher() -> None:
    """End this worker within a second of its launcher's death (once per process; only under torchrun)."""
    if not under_torchelastic() or _watched:
        return
    _watched["launcher"] = os.getppid()
    threading.Thread(
        target=_watch, args=(_watched["launcher"],), name="hf_fedshard-launcher-watch", daemon=True
    ).start()


def _watch(launcher: int) -> None:
    event = threading.Event()
    while os.getppid() == launcher:
        event.wait(WATCH_INTERVAL_S)
    _end(
        f"the launcher that started this worker (pid {launcher}) is gone; ending this worker so that a restarted "
        "launch can take its place"
    )


def _end(message: str) -> None:
    """Say ``message`` in one line and end the process now: its main thread may be blocked in a collective."""
    print(f"hf_fedshard: rank {os.environ.get('RANK', '0')}: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def check_restart_store() -> None:
    """Warn (rank 0, once) where torchrun would restart workers that read its shared store's stale addresses."""
    if _restarts_share_the_store() and not _restarted():
        notice(
            "torchrun --max-restarts=%s shares its rendezvous store with the workers it restarts, which then read "
            "the dead workers' addresses and fail or hang in init_process_group (pytorch/pytorch#135712). Export "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where you start torchrun.",
            os.environ["TORCHELASTIC_MAX_RESTARTS"],
        )


def _restarts_share_the_store() -> bool:
    """Whether torchrun may restart this worker and shares its rendezvous store with the workers it starts."""
    return (
        under_torchelastic()
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    )


def _restarted() -> bool:
    """Whether torchrun restarted this worker (attempt 1 or later)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def setup_timeout_s() -> float:
    """Seconds the world's process-group set-up may take: ``HF_FEDSHARD_SETUP_TIMEOUT_S``, else `SETUP_TIMEOUT_S`."""
    value = os.environ.get("HF_FEDSHARD_SETUP_TIMEOUT_S")
    try:
        seconds = SETUP_TIMEOUT_S if value is None else float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"HF_FEDSHARD_SETUP_TIMEOUT_S={value!r} must be a number of seconds above 0. Unset it, or "
                          f"set e.g. HF_FEDSHARD_SETUP_TIMEOUT_S={SETUP_TIMEOUT_S:g}.")  # fmt: skip
    return seconds


@contextlib.contextmanager
def setup_deadline() -> Iterator[None]:
    """The world's process-group set-up inside the block: ended in one line past `setup_timeout_s`, and a restarted
    worker's failure explained where the launcher's shared store caused it."""
    seconds = setup_timeout_s()
    timer = threading.Timer(seconds, _end, args=(_stalled_setup(seconds),))
    timer.daemon = True
    timer.start()
    try:
        yield
    except RuntimeError as err:
        if _restarts_share_the_store() and _restarted():
            raise ConfigError(
                "this worker, restarted by torchrun, could not set up the world's process group: torchrun shared "
                "its rendezvous store with it, and it read the dead workers' addresses (pytorch/pytorch#135712). "
                f"Export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where you start torchrun. ({str(err).splitlines()[0]})"
            ) from err
        raise
    finally:
        timer.cancel()


def _stalled_setup(seconds: float) -> str:
    cause = (
        "torchrun restarted it and shared its rendezvous store with it (pytorch/pytorch#135712): export "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where you start torchrun"
        if _restarts_share_the_store() and _restarted()
        else "another rank never started, or started far later: check every rank's log; if they only start slowly, "
        "raise HF_FEDSHARD_SETUP_TIMEOUT_S"
    )
    return f"the world's process group was not set up within {seconds:g} s: {cause}"
