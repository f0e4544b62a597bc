"""A real SLURM on emulated nodes: the batch scripts of `recipes/slurm/` submitted with ``sbatch``, as on a cluster.

    sudo apt-get install -y slurm-wlm munge          # once (about 2 minutes)
    sudo python -m tests.real_slurm                   # both scripts on 2 nodes × 2 CPU ranks, about 2 minutes

``slurmctld`` and one ``slurmd`` per node, each in a network namespace of its own (`benchmarks.harness.netns.Cluster`,
links unshaped: node 0 is the controller, nodes 1 and 2 the compute nodes) with its host name, as
slurm-wlm 22.05 needs on one machine: ``nsenter`` into the namespace (not ``ip netns exec``, whose fresh ``/sys`` slurmd
refuses), ``unshare --uts`` for the host name, the names in ``/etc/hosts`` for the nodes to resolve each other
(removed at exit with the daemons and the namespaces). Then ``sbatch --wait`` of ``recipes/slurm/pretrain.sbatch``
(FL+FSDP, a group per node) and ``recipes/slurm/pretrain_torchft.sbatch`` (a lighthouse and a job step per group),
with the sizes given through the scripts' variables, as a user would. Each job must exit 0; the first saves the
model one torchrun of 4 ranks saves on one host (to the bit: ``tests/distributed/test_multinode.py`` compares), and
the torchft job's two groups end on one model.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.harness import process_tree
from benchmarks.harness.netns import Cluster, handle_termination

REPO = Path(__file__).resolve().parents[1]
HOSTS = Path("/etc/hosts")
PROGRAMS = ("slurmctld", "slurmd", "munged", "sbatch", "scancel")
GPUS_PER_NODE = 2  # each node's "GPUs" (a generic resource without devices), as the scripts' #SBATCH lines ask
TRAIN = ["--model_size", "micro", "--block_size", "64", "--per_device_train_batch_size", "2", "--max_steps", "4",
         "--max_eval_samples", "8", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none",
         "--disable_tqdm", "true"]  # fmt: skip
FED = ["--fed_group_size", "2", "--fed_sync_steps", "2"]


def missing() -> str | None:
    """Why a real SLURM cannot run here (``None``: it can)."""
    if os.geteuid() != 0:
        return "a real SLURM on emulated nodes needs root"
    absent = [name for name in PROGRAMS if shutil.which(name) is None]
    return f"not installed: {', '.join(absent)} (apt-get install -y slurm-wlm munge)" if absent else None


def slurm_conf(folder: Path, spool: Path, cluster: Cluster, compute: list[int]) -> str:
    """slurm.conf for a controller on node 0 and the ``compute`` nodes, the logs under ``folder``, the state and
    the daemons' sockets under ``spool`` (a short path: a socket's is at most 108 bytes)."""
    nodes = "\n".join(f"NodeName={cluster.namespace(n)} NodeAddr={cluster.address(n)} CPUs=2 RealMemory=4000 "
                      f"Gres=gpu:{GPUS_PER_NODE}" for n in compute)  # fmt: skip
    return f"""ClusterName=fedshard
GresTypes=gpu
SlurmctldHost={cluster.namespace(0)}({cluster.address(0)})
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
StateSaveLocation={spool}/state
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.%n.log
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@contextlib.contextmanager
def named_in_hosts(names: dict[str, str]) -> Iterator[None]:
    """``names`` (host name -> address) in /etc/hosts while the block runs, then the file as it was."""
    before = HOSTS.read_text()
    HOSTS.write_text(before + "".join(f"{address} {name}  # hf_fedshard real_slurm\n" for name, address in
                                      names.items()))  # fmt: skip
    try:
        yield
    finally:
        lines = [line for line in HOSTS.read_text().splitlines(keepends=True) if "# hf_fedshard real_slurm" not in line]
        HOSTS.write_text("".join(lines))


def munge_running() -> bool:
    check = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, text=True)
    return "Success" in check.stdout


def start_munge() -> subprocess.Popen | None:
    """munged, unless one already answers (its folders owned by munge, as the package's service does)."""
    if munge_running():
        return None
    for folder in ("/etc/munge", "/var/run/munge", "/var/lib/munge", "/var/log/munge"):
        os.makedirs(folder, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    command = ["runuser", "-u", "munge", "--", "munged", "--force", "--foreground"]
    proc = process_tree.popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(50):
        if munge_running():
            return proc
        time.sleep(0.1)
    raise RuntimeError("munged did not answer within 5 s")


@contextlib.contextmanager
def real_slurm(folder: Path, nodes: int = 2) -> Iterator[dict[str, str]]:
    """A running SLURM of ``nodes`` compute nodes; yields the environment its clients (sbatch) need."""
    compute = list(range(1, nodes + 1))
    with Cluster(nodes + 1, rate_mbit=None) as cluster:
        names = {cluster.namespace(n): cluster.address(n) for n in range(nodes + 1)}
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "slurm.conf"
        spool = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
        env = {**os.environ, "SLURM_CONF": str(conf)}
        procs: list[subprocess.Popen] = []
        munge = None
        try:
            (spool / "state").mkdir()
            conf.write_text(slurm_conf(folder, spool, cluster, compute))
            (folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
            for index in range(GPUS_PER_NODE):  # slurmd counts GPUs by their device files: null devices stand in
                os.mknod(spool / f"gpu{index}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            (folder / "gres.conf").write_text(f"Name=gpu File={spool}/gpu[0-{GPUS_PER_NODE - 1}]\n")
            munge = start_munge()
            with named_in_hosts(names):
                for n in (0, *compute):
                    daemon = "slurmctld -D" if n == 0 else f"slurmd -D -N {cluster.namespace(n)}"
                    command = ["nsenter", f"--net=/run/netns/{cluster.namespace(n)}", "unshare", "--uts", "sh", "-c",
                               f"hostname {cluster.namespace(n)}; exec {daemon}"]  # fmt: skip
                    with open(folder / f"daemon{n}.out", "w") as out:  # their own logs are beside it
                        procs.append(process_tree.popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
                client = {**env, "HF_FEDSHARD_SLURM_NETNS": cluster.namespace(0)}
                try:
                    wait_until_idle(client, nodes, folder)
                    yield client
                finally:  # a job still running (a timeout, an interrupt) ends with the daemons' process trees
                    subprocess.run(in_controller_net(client, "scancel", "--user", "root"), env=client, timeout=30)
        finally:  # each daemon's keeper stops all below it: slurmstepd and the job's processes included
            process_tree.stop_all([*procs, *([munge] if munge is not None else [])], 5.0)
            shutil.rmtree(spool, ignore_errors=True)


def in_controller_net(env: dict[str, str], *command: str) -> list[str]:
    """A SLURM client command, run in the controller's network (the only one that reaches it)."""
    return ["nsenter", f"--net=/run/netns/{env['HF_FEDSHARD_SLURM_NETNS']}", *command]


def wait_until_idle(env: dict[str, str], nodes: int, folder: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(in_controller_net(env, "sinfo", "-h", "-o", "%T %D"), env=env, capture_output=True,
                             text=True)  # fmt: skip
        if out.stdout.split() == ["idle", str(nodes)]:
            return
        time.sleep(0.5)
    logs = "\n".join(p.read_text()[-1500:] for p in sorted(folder.glob("*.log")))
    raise RuntimeError(
        f"the SLURM nodes were not idle within {timeout_s:.0f} s ({out.stdout!r}{out.stderr!r}):\n{logs}"
    )


def sbatch(env: dict[str, str], script: Path, out: Path, variables: dict[str, str], timeout_s: float = 400) -> str:
    """``sbatch --wait --nodes 2 script`` from the repository, the job's variables exported; its output."""
    log = out / "job.log"
    out.mkdir(parents=True, exist_ok=True)
    command = in_controller_net(env, "sbatch", "--wait", "--no-requeue", "--nodes", "2", "--gpus-per-node",
                                str(GPUS_PER_NODE), "--output", str(log), str(script))  # fmt: skip
    job_env = {**env, "PATH": os.environ["PATH"], "GLOO_SOCKET_IFNAME": "uplink", "OMP_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO), **variables}  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=job_env, capture_output=True, text=True, timeout=timeout_s)
    text = log.read_text() if log.exists() else ""
    if done.returncode != 0:
        raise RuntimeError(f"{script.name}: sbatch exited {done.returncode}: {done.stderr}\n{text[-6000:]}")
    return text


def run_both(folder: Path) -> dict[str, Path]:
    """Both scripts on a real SLURM of 2 nodes × 2 CPU ranks (the torchft one: 1 rank a group); their outputs."""
    slurm = REPO / "recipes" / "slurm"
    outputs = {"pretrain": folder / "pretrain", "torchft": folder / "torchft"}
    with real_slurm(folder / "slurm") as env:
        sbatch(env, slurm / "pretrain.sbatch", outputs["pretrain"], {
            "GPUS_PER_NODE": "2", "MASTER_PORT": "29500", "FED_ARGS": " ".join(FED),
            "TRAIN_ARGS": " ".join([*TRAIN, "--output_dir", str(outputs["pretrain"])])})  # fmt: skip
        sbatch(env, slurm / "pretrain_torchft.sbatch", outputs["torchft"], {
            "GPUS_PER_NODE": "1", "LIGHTHOUSE_PORT": "29510", "FED_ARGS": "--fed_sync_steps 2 --fed_timeout_s 60",
            "TRAIN_ARGS": " ".join([*TRAIN, "--output_dir", str(outputs["torchft"])])})  # fmt: skip
    return outputs


def same_bits(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.real_slurm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.parse_args(argv)
    if (why := missing()) is not None:
        print(f"error: {why}")
        return 2
    start = time.monotonic()
    with handle_termination(), tempfile.TemporaryDirectory(prefix="hf_fedshard-slurm-") as tmp:
        outputs = run_both(Path(tmp))
        models = [outputs["torchft"] / f"fed_group{g}" / "model.safetensors" for g in range(2)]
        one_model = same_bits(*models)
        saved = (outputs["pretrain"] / "model.safetensors").exists()
    print(f"pretrain.sbatch: exit 0, model saved: {saved}; pretrain_torchft.sbatch: exit 0, both groups on one model: "
          f"{one_model}; {time.monotonic() - start:.0f} s")  # fmt: skip
    return 0 if saved and one_model else 1


if __name__ == "__main__":
    sys.exit(main())
