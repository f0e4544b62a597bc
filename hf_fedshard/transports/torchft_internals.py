"""Every name of torchft that is not its public API, in one place, and the check that they are still there.

The torchft transport needs three things torchft does not export: the id of the Manager's current quorum (to tell a
new quorum from the last one), and, for groups of unequal size, the rendezvous of the Manager's process group (its
store and this rank's place) and the handle id that keys it. `check_torchft_internals` runs before a launch reaches
the lighthouse (and in the unit tests), so a torchft release that renames them fails at once, in one line naming
the name, instead of mid-run.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

from hf_fedshard.errors import ConfigError

_NEEDED = (
    "torchft.process_group._rendezvous(opts, handle_id)",
    "torchft.process_group.ProcessGroup._handle_id()",
    "torchft.Manager._quorum_id",
)


def check_torchft_internals() -> None:
    """Refuse, in one line, a torchft whose private names this transport uses have changed."""
    import torchft
    from torchft import process_group

    missing = []
    rendezvous = getattr(process_group, "_rendezvous", None)
    if rendezvous is None or list(inspect.signature(rendezvous).parameters) != ["opts", "handle_id"]:
        missing.append(_NEEDED[0])
    if not all(callable(getattr(base, "_handle_id", None)) for base in _process_group_bases(torchft)):
        missing.append(_NEEDED[1])
    if "self._quorum_id" not in inspect.getsource(torchft.Manager):
        missing.append(_NEEDED[2])
    if missing:
        raise ConfigError(
            f"this torchft ({_version()}) no longer has {', '.join(missing)}, which fed_transport torchft uses. "
            "Install the torchft the package pins: pip install -e '.[elastic]' in the clone."
        )


def quorum_id(manager: Any) -> int | None:
    """The id of the Manager's current quorum: it changes when a group leaves or joins."""
    return manager._quorum_id


def recording_process_group(base: type, timeout: timedelta) -> Any:
    """torchft's process group ``base`` (gloo or NCCL) that also rendezvouses where a group of the quorum has no rank
    at this rank's position (torchft hands such ranks an empty handle), and records its rendezvous (the quorum's
    store and this rank's place in it) as ``rendezvous`` (`hf_fedshard.transports.quorum_world`)."""
    from torchft.process_group import _rendezvous

    class RecordingProcessGroup(base):
        rendezvous: Any = None

        def reconfigure(self, opts: Any) -> Any:
            opts.handles = [handle for handle in opts.handles if handle]  # groups smaller than this position
            self.rendezvous = _rendezvous(opts, self._handle_id())
            return super().reconfigure(opts)

    return RecordingProcessGroup(timeout=timeout)


def _process_group_bases(torchft: Any) -> list[type]:
    return [torchft.ProcessGroupGloo, torchft.ProcessGroupNCCL]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torchft-nightly", "torchft"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "of unknown version"
