"""The client of ``tests/preloaded_torchrun.py --serve``: one launch, as ``python tests/preloaded_torchrun.py ARGS``.

    python tests/launch_client.py SOCKET torchrun-args…

Standard library only (it starts in milliseconds). It hands the server its argv, environment, folder and its
stdin/stdout/stderr, prints nothing of its own, writes the launcher's pid to ``$HF_FEDSHARD_LAUNCH_PIDS/<its pid>``
(so that tests.launch.kill_tree finds the launch below it; removed when it ends), and exits with the launcher's
exit status.
"""

import json
import os
import signal
import socket
import struct
import sys


def main(path: str, argv: list[str]) -> int:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # tests.launch.dump_stacks asks the processes below for stacks
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(body))], [0, 1, 2])
    conn.sendall(body)
    reader = conn.makefile("r")
    record = os.path.join(os.environ["HF_FEDSHARD_LAUNCH_PIDS"], str(os.getpid()))
    with open(record, "w") as out:
        out.write(reader.readline().strip())
    status = reader.readline().strip()
    os.remove(record)  # the pid is free again once the launcher ended
    if not status:
        print(f"tests/launch_client.py: the launch server at {path} went away", file=sys.stderr)
        return 1
    code = int(status)
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
