"""Launch a distributed check script under torchrun (gloo, CPU) with a hard timeout.

A hang fails the test instead of blocking CI: the launcher and every process below it are killed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.harness import LAUNCHER_ENV, process_tree

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
STUDIES = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")  # python -m benchmarks.X

# Settings shared by every check run: deterministic plain SGD, quiet logs, no files but the dumps.
SGD = [
    "--optim", "sgd", "--learning_rate", "0.1", "--lr_scheduler_type", "constant", "--weight_decay", "0",
    "--max_grad_norm", "0", "--warmup_steps", "0", "--per_device_train_batch_size", "2",
    "--per_device_eval_batch_size", "4", "--report_to", "none", "--save_strategy", "no",
    "--logging_steps", "1", "--disable_tqdm", "true", "--seed", "0",
]  # fmt: skip


def start_torchrun(
    nproc: int,
    script: str | Path,
    args: list[str],
    max_restarts: int = 0,
    preloaded: bool = True,
    env: dict[str, str] | None = None,
    forked: bool = False,
) -> subprocess.Popen:
    """Start ``script`` on ``nproc`` local CPU ranks (output piped); `finish` waits for it.

    ``preloaded`` forks the workers from a launcher that imported the libraries once (tests/preloaded_torchrun.py);
    the launcher too is forked, from one server per session (``HF_FEDSHARD_LAUNCH_SERVER=0`` forks it from the
    test process's own fresh interpreter instead). False starts each rank in a fresh interpreter, as plain torchrun
    does (every launch does with ``HF_FEDSHARD_PLAIN_TORCHRUN=1``). ``forked`` launches as a user would with
    ``python -m hf_fedshard.launch`` (its own interpreter, its workers forked from it).

    With ``max_restarts``, torchrun restarts the whole job after a failure; its rendezvous store is then not
    shared with the workers, whose restarted process groups would otherwise read the dead ones' addresses
    (pytorch/pytorch#135712), as docs/fault_tolerance.md tells users to do. ``env`` adds to (or overrides) the
    launch's environment.
    """
    preloaded = preloaded and os.environ.get("HF_FEDSHARD_PLAIN_TORCHRUN") != "1"
    torchrun_args = ["--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", str(script),
                     *map(str, args)]  # fmt: skip
    env = launch_env(**{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1" if max_restarts else "0", **(env or {})})
    if forked:
        cmd = [sys.executable, "-m", "hf_fedshard.launch", *torchrun_args]
    elif preloaded and os.environ.get("HF_FEDSHARD_LAUNCH_SERVER", "1") == "1":
        server, env["HF_FEDSHARD_LAUNCH_PIDS"] = _launch_server()
        cmd = [sys.executable, "-S", str(REPO / "tests" / "launch_client.py"), server, *torchrun_args]
    elif preloaded:
        cmd = [sys.executable, str(REPO / "tests" / "preloaded_torchrun.py"), *torchrun_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args]
    return start(cmd, env)


def start(cmd: list, env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in the repository below a keeper (`process_tree`), its output into a file; `finish` waits.

    A file, not a pipe: several launches run at once and `finish` reads each when it ends; a pipe nobody reads yet
    fills (64 KiB) and blocks the launch in a print (the killed-group elastic test's flake: the restarted group, the
    wordiest, stopped at step 47 until the test had finished reading another group)."""
    output = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read and closed by finish)
    proc = process_tree.popen(cmd, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
    proc.output = output
    return proc


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of every launch: one thread per rank, unbuffered output, this checkout first on the path."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(REPO), **extra}  # fmt: skip


def study_launch_env() -> dict[str, str]:
    """What makes a study (``python -m benchmarks.<study>``) start its torchrun launches through this session's
    launch server (`benchmarks.harness.torchrun_command`): forked after the imports, each in its client's network
    namespace and cgroup; a launch is killed with its client, so the studies' kills and restarts work as under
    torchrun.
    Nothing (plain torchrun) where the suite runs without the server (``HF_FEDSHARD_LAUNCH_SERVER=0``,
    ``HF_FEDSHARD_PLAIN_TORCHRUN=1``)."""
    if os.environ.get("HF_FEDSHARD_LAUNCH_SERVER", "1") != "1" or os.environ.get("HF_FEDSHARD_PLAIN_TORCHRUN") == "1":
        return {}
    server, pids = _launch_server()
    client = f"{shlex.quote(sys.executable)} -S {shlex.quote(str(REPO / 'tests' / 'launch_client.py'))}"
    return {LAUNCHER_ENV: f"{client} {shlex.quote(server)}", "HF_FEDSHARD_LAUNCH_PIDS": pids}


_SERVER: dict = {}  # the session's launch server: "proc", "socket", "pids" (the clients' launcher pids)
SERVER_STARTS_S: list[float] = []  # how long each start took, until the suite's report takes it (to charge no test)


def _launch_server() -> tuple[str, str]:
    """The socket of this session's ``tests/preloaded_torchrun.py --serve`` (started at the first launch, once: the
    libraries are imported once per session), and the folder where each client records its launcher's pid."""
    if "proc" not in _SERVER or _SERVER["proc"].poll() is not None:
        started = time.monotonic()
        folder = tempfile.mkdtemp(prefix="hf_fedshard-launch-")
        socket_path, pids = os.path.join(folder, "server.sock"), os.path.join(folder, "pids")
        os.mkdir(pids)
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "preloaded_torchrun.py"), "--serve", socket_path],
                                cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("tests/preloaded_torchrun.py --serve did not start; its error is above")
        atexit.register(_stop_server, proc, folder)
        _SERVER.update(proc=proc, socket=socket_path, pids=pids)
        SERVER_STARTS_S.append(time.monotonic() - started)
    return _SERVER["socket"], _SERVER["pids"]


def _stop_server(proc: subprocess.Popen, folder: str) -> None:
    proc.kill()
    proc.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)


def finish(proc: subprocess.Popen, timeout_s: float) -> subprocess.CompletedProcess:
    """Wait for a `start_torchrun` launch (or any piped process started in a session of its own); raise
    ``TimeoutError`` (after killing it and every process below it) on a hang."""
    try:
        out, err = _output_at_end(proc, timeout_s)
    except subprocess.TimeoutExpired:
        dump_stacks(proc)
        kill_tree(proc)
        out, _ = _output_at_end(proc, 60)
        raise TimeoutError(f"{proc.args} hung for {timeout_s}s; output and stacks:\n{out[-20000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err or "")


def _output_at_end(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str | None]:
    """(stdout, stderr) once ``proc`` ended: a launch's output file (`start_torchrun`), else its pipes."""
    output = getattr(proc, "output", None)
    if output is None:
        return proc.communicate(timeout=timeout_s)
    proc.wait(timeout=timeout_s)
    output.seek(0)
    text = output.read()
    output.close()
    return text, None


class Background:
    """A launch waited for by a thread of its own from its start, so that launches that mostly wait (for a timeout,
    a stopped peer) run side by side; `result` returns what `finish` would, and ``ended_at`` when it ended."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float) -> None:
        self.ended_at: float | None = None
        self._outcome: subprocess.CompletedProcess | BaseException | None = None
        self._thread = threading.Thread(target=self._wait, args=(proc, timeout_s), daemon=True)
        self._thread.start()

    def _wait(self, proc: subprocess.Popen, timeout_s: float) -> None:
        try:
            self._outcome = finish(proc, timeout_s)
        except BaseException as err:  # re-raised by result(), in the test's thread
            self._outcome = err
        self.ended_at = time.time()

    def result(self) -> subprocess.CompletedProcess:
        self._thread.join()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome


def dump_stacks(proc: subprocess.Popen) -> None:
    """Ask a hung launch's preloaded processes to print every thread's Python stack into its output (SIGUSR1, which
    tests/preloaded_torchrun.py hands to faulthandler; a process without that handler just ends a little early).
    A forked rank's stack starts with its launcher's frames, up to ``run_script``."""
    for pid in launched(proc):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)  # one at a time, so that their stacks do not interleave


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launch and every process below it (its keeper's: torchrun's workers, in sessions of their own, and
    orphans included; also where the launch server forked its launcher)."""
    process_tree.kill_pids([proc.pid], _adopted())


def launched(proc: subprocess.Popen) -> list[int]:
    """Every process a launch started (its torchrun and workers), also where the launch server forked them."""
    return process_tree.descendants(proc.pid, _adopted())


def _adopted() -> dict[int, int]:
    """Each running launch client's launcher (forked by the launch server; the client records its pid)."""
    records = Path(_SERVER["pids"]).iterdir() if "pids" in _SERVER else []
    adopted = {}
    for record in records:
        with contextlib.suppress(OSError, ValueError):
            adopted[int(record.name)] = int(record.read_text())
    return adopted


def torchrun(
    nproc: int,
    script: str | Path,
    args: list[str],
    timeout_s: float = 240,
    max_restarts: int = 0,
    preloaded: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` local CPU ranks; raise ``TimeoutError`` (after killing it) on a hang."""
    return finish(start_torchrun(nproc, script, args, max_restarts, preloaded), timeout_s)


def train_tiny(nproc: int, out_dir: Path, args: list[str], timeout_s: float = 240, max_restarts: int = 0) -> list[dict]:
    """Run tests/scripts/train_tiny.py and load every rank's dump."""
    dump = out_dir / "dump"
    result = torchrun(nproc, SCRIPTS / "train_tiny.py",
                      ["--output_dir", out_dir, "--dump_dir", dump, *SGD, *args], timeout_s, max_restarts)  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:]
    return [torch.load(dump / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@contextlib.contextmanager
def lighthouse(min_groups: int = 1, join_timeout_s: float = 10.0, heartbeat_timeout_s: float = 2.0):
    """A `python -m hf_fedshard.lighthouse` on a free port for the block; yields its ``--fed_lighthouse`` value.

    Its log goes to the file named by ``LIGHTHOUSE_LOG`` (to debug a test), else nowhere."""
    cmd = [sys.executable, "-m", "hf_fedshard.lighthouse", "--port", "0", "--min_groups", str(min_groups),
           "--join_timeout_s", str(join_timeout_s), "--heartbeat_timeout_s", str(heartbeat_timeout_s)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    log = open(os.environ.get("LIGHTHOUSE_LOG", os.devnull), "w")  # noqa: SIM115 (closed below)
    proc = process_tree.popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        assert "--fed_lighthouse" in line, f"the lighthouse did not start: {line!r}"
        yield line.split("--fed_lighthouse", 1)[1].strip()
    finally:
        kill_tree(proc)
        proc.wait(timeout=30)
        log.close()


def train_groups(
    num_groups: int, nproc: int, out_dir: Path, args: list[str], address: str, timeout_s: float = 300
) -> list[list[dict]]:
    """Run tests/scripts/train_tiny.py as ``num_groups`` launches of ``nproc`` ranks (fed_transport torchft);
    every group's ranks' dumps, group by group (each first rank's with its launch's ``stdout``)."""
    launches = [start_group(g, num_groups, nproc, out_dir, args, address) for g in range(num_groups)]
    results = [finish(launch, timeout_s) for launch in launches]
    for result in results:
        assert result.returncode == 0, result.stdout[-6000:]
    dumps = [
        [torch.load(out_dir / f"dump{g}" / f"rank{r}.pt", weights_only=False) for r in range(nproc)]
        for g in range(num_groups)
    ]
    for group, result in zip(dumps, results, strict=True):
        group[0]["stdout"] = result.stdout
    return dumps


def start_group(
    group: int,
    num_groups: int,
    nproc: int,
    out_dir: Path,
    args: list[str],
    address: str,
    max_restarts: int = 0,
    preloaded: bool = True,
    forked: bool = False,
) -> subprocess.Popen:
    """Start group ``group`` of a torchft federation running tests/scripts/train_tiny.py (dumps in ``dump{G}``)."""
    elastic = ["--fed_transport", "torchft", "--fed_lighthouse", address, "--fed_group_id", group,
               "--fed_num_groups", num_groups]  # fmt: skip
    script_args = ["--output_dir", out_dir, "--dump_dir", out_dir / f"dump{group}", *SGD, *elastic, *args]
    return start_torchrun(nproc, SCRIPTS / "train_tiny.py", script_args, max_restarts, preloaded, forked=forked)
