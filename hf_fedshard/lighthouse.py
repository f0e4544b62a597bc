"""The Lighthouse of a ``fed_transport torchft`` federation: ``python -m hf_fedshard.lighthouse --port 29510``.

Start one per job, anywhere every group's rank 0 can reach; it forms the quorum of the groups alive before each
averaging (torchft's `LighthouseServer`; the groups' traffic never goes through it). It prints its address, the
``--fed_lighthouse`` value of every group, and serves until interrupted.

- ``--min_groups``: the smallest quorum an averaging runs with; groups wait (up to their ``fed_timeout_s``) for
  more. Set it to the number of groups to start them together; below it, a federation survives failures.
- ``--join_timeout_s``: how long a quorum waits for a group that is alive but has not asked yet. A joining group
  asks between two averagings of the others, so it must exceed one averaging interval (H steps); a dead group
  is dropped as soon as its heartbeats stop (``--heartbeat_timeout_s``), whatever this is.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_fedshard.lighthouse", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=29510, help="port to listen on (0: any free port)")
    parser.add_argument("--min_groups", type=int, default=1, help="smallest number of groups an averaging runs with")
    parser.add_argument(
        "--join_timeout_s", type=float, default=600.0, help="wait for live groups that have not asked yet"
    )
    parser.add_argument(
        "--heartbeat_timeout_s", type=float, default=5.0, help="a group whose heartbeats stop this long is dead"
    )
    args = parser.parse_args(argv)
    if args.min_groups < 1:
        parser.error(f"--min_groups={args.min_groups}: it must be at least 1.")
    from hf_fedshard.transports.elastic import _import_torchft

    _import_torchft()
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{args.port}",
        min_replicas=args.min_groups,
        join_timeout_ms=int(args.join_timeout_s * 1000),
        heartbeat_timeout_ms=int(args.heartbeat_timeout_s * 1000),
    )
    port = server.address().rsplit(":", 1)[-1]
    print(f"hf_fedshard lighthouse: --fed_lighthouse http://{socket.gethostname()}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


if __name__ == "__main__":
    main()
