"""The Lighthouse of a ``fed_transport torchft`` federation: ``python -m hf_fedshard.lighthouse --port 29510``.

Start one per job, anywhere every group's rank 0 can reach; it forms the quorum of the groups alive before each
averaging (torchft's `LighthouseServer`; the groups' traffic never goes through it). It prints its address, the
``--fed_lighthouse`` value of every group, and serves until interrupted.

- ``--min_groups``: the smallest quorum an averaging runs with; below it, groups wait (up to their
  ``fed_timeout_s``) and then fail. Groups that start afresh wait for all ``fed_num_groups`` anyway (up to
  ``fed_timeout_s``), so keep it low enough to survive the failures you expect (1 survives all but one).
- ``--heartbeat_timeout_s``: a group whose heartbeats stop this long (a dead launch) is left out of the next
  quorum at once.
- ``--join_timeout_s``: how long a quorum waits for a group that is alive (heartbeating) but does not ask (a hung
  group): keep it below ``fed_timeout_s``, or the others give up first. A group that joins between two
  averagings never forms a quorum of its own while the others are alive: torchft requires more than half of the
  live groups in a quorum, so it waits for the others' next averaging.
"""

from __future__ import annotations

import argparse
import signal
import threading


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_fedshard.lighthouse", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=29510, help="port to listen on (0: any free port)")
    parser.add_argument("--min_groups", type=int, default=1, help="smallest number of groups an averaging runs with")
    parser.add_argument(
        "--join_timeout_s", type=float, default=10.0, help="wait for live groups that have not asked yet"
    )
    parser.add_argument(
        "--heartbeat_timeout_s", type=float, default=5.0, help="a group whose heartbeats stop this long is dead"
    )
    args = parser.parse_args(argv)
    if args.min_groups < 1:
        parser.error(f"--min_groups={args.min_groups}: it must be at least 1.")
    from hf_fedshard.transports.elastic import _import_torchft, advertised_hostname

    _import_torchft()
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{args.port}",
        min_replicas=args.min_groups,
        join_timeout_ms=int(args.join_timeout_s * 1000),
        heartbeat_timeout_ms=int(args.heartbeat_timeout_s * 1000),
    )
    port = server.address().rsplit(":", 1)[-1]
    print(f"hf_fedshard lighthouse: --fed_lighthouse http://{advertised_hostname()}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


if __name__ == "__main__":
    main()
