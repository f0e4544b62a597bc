"""SLURM's commands as a job on one machine sees them, for tests: ``sbatch`` runs the batch script on the first
"node" with the job's variables, ``srun`` starts one task per node with each task's own variables, ``scontrol show
hostnames`` expands the node list. What they keep of SLURM is what a batch script depends on: the batch shell
expands the script's words once, with ``SLURM_NODEID=0``, before srun starts the tasks; each task gets its own
``SLURM_NODEID``, ``SLURM_PROCID`` and ``SLURM_LOCALID``; a task that fails stops the others only under
``--kill-on-bad-exit=1``. The nodes are this host (``FAKE_SLURM_NODES`` of them, default 2).

    tests/fake_slurm/sbatch [--nodes N] SCRIPT [ARGS]    # what a test runs; srun and scontrol come on its PATH

Standard library only. Each task's command line is printed (``srun: task T on node N: ...``) before it starts, and
appended to the file ``$FAKE_SLURM_LOG`` names, if it does.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time


def sbatch(argv: list[str]) -> int:
    nodes = int(os.environ.get("FAKE_SLURM_NODES", "2"))
    if argv[:1] == ["--nodes"]:
        nodes, argv = int(argv[1]), argv[2:]
    names = ",".join(["localhost"] * nodes)
    job = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": names, "SLURM_NNODES": str(nodes)}
    env = {**os.environ, **job, "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}  # the batch shell
    return subprocess.call(["bash", *argv], env=env)


def srun(argv: list[str]) -> int:
    nodes, first, kill_on_bad_exit = int(os.environ["SLURM_NNODES"]), 0, False
    while argv and argv[0].startswith("-"):
        option = argv.pop(0)
        name, _, value = option.partition("=")
        if name in ("--nodes", "-N", "--ntasks", "-n", "--relative", "-r") and not value:
            value = argv.pop(0)
        if name in ("--nodes", "-N"):
            nodes = int(value)
        elif name in ("--relative", "-r"):
            first = int(value)
        elif name == "--kill-on-bad-exit":
            kill_on_bad_exit = value != "0"
    tasks = []
    for task, node in enumerate(range(first, first + nodes)):
        env = {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(task), "SLURM_LOCALID": "0",
               "SLURM_STEP_NUM_NODES": str(nodes)}  # fmt: skip
        said = f"srun: task {task} on node {node}: {shlex.join(argv)}"
        print(said, flush=True)
        if os.environ.get("FAKE_SLURM_LOG"):  # also where a test reads it whatever the tasks print after
            with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
                log.write(said + "\n")
        tasks.append(subprocess.Popen(argv, env=env, start_new_session=True))
    return _wait(tasks, kill_on_bad_exit)


def _wait(tasks: list[subprocess.Popen], kill_on_bad_exit: bool) -> int:
    codes: dict[int, int] = {}
    while len(codes) < len(tasks):
        for i, task in enumerate(tasks):
            if i not in codes and task.poll() is not None:
                codes[i] = task.returncode
                if task.returncode != 0 and kill_on_bad_exit:
                    for other in tasks:
                        if other.poll() is None:
                            os.killpg(other.pid, 9)
        time.sleep(0.1)
    return max(codes.values(), key=abs)


def scontrol(argv: list[str]) -> int:
    if argv[:2] != ["show", "hostnames"] or len(argv) != 3:
        print(f"fake scontrol: only 'show hostnames LIST' (got {argv})", file=sys.stderr)
        return 2
    print("\n".join(argv[2].split(",")))
    return 0


if __name__ == "__main__":
    sys.exit({"sbatch": sbatch, "srun": srun, "scontrol": scontrol}[sys.argv[1]](sys.argv[2:]))
