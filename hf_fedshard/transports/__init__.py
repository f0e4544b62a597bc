"""Transports: how federation groups reach each other. A transport is one module with one factory, registered by
its ``fed_transport`` name with `register_transport`; the engine imports none of them.

A factory takes a `FederationRequest` (the transport's own settings, the layout, the device mesh, the averaging
options, the loop's heal parts) and returns a `Federation`: the engine's communicator (`FederationCommunicator`, with
a `Membership` if groups come and go), and how this launch joins the others and leaves. A transport's settings are
a dataclass deriving from `OneJob` (every group in one launch) or `GroupLaunch` (a launch per group), whose fields
are its options: the Trainer parses them from its ``fed_*`` flags of the same name and from
``--fed_transport_options`` (JSON), so a transport registered from outside the package needs no change to it.

Built in:

- ``mesh``: every group in one job, on one world mesh (`hf_fedshard.transports.mesh.one_job_federation`).
- ``torchft``: every group its own launch, meeting through a torchft Lighthouse; groups die and heal between
  averagings (`hf_fedshard.transports.elastic.torchft_federation`).

(``simulated``, `hf_fedshard.transports.simulated`, runs launches as threads on a fake clock for the round
protocol's tests; it is not a Trainer transport.) The README's "How it is built" shows a fourth one written outside
the package, tests/store_transport.py, with its test.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hf_fedshard.errors import ConfigError
from hf_fedshard.transports.elastic import TorchftSettings
from hf_fedshard.transports.federation import Federation, FederationRequest
from hf_fedshard.transports.launches import GroupLaunch, OneJob

Factory = Callable[[FederationRequest], Federation]


@dataclass(frozen=True)
class Transport:
    """A registered transport: its ``fed_transport`` name, its factory (a callable, or ``"module:name"`` imported on
    use, so that an optional dependency such as torchft is needed only by whoever picks it), its settings (a
    dataclass deriving from `OneJob` or `GroupLaunch`) and a one-line summary for ``--help``."""

    name: str
    factory: Factory | str
    settings: type[OneJob] | type[GroupLaunch]
    summary: str

    def build(self, request: FederationRequest) -> Federation:
        factory = self.factory
        if isinstance(factory, str):
            module, name = factory.split(":")
            factory = getattr(importlib.import_module(module), name)
        return factory(request)

    def parse_settings(self, options: Mapping[str, Any], flags: frozenset[str] = frozenset()) -> OneJob | GroupLaunch:
        """The transport's settings from ``options`` (its fields by name; ``None``: not given), refusing an unknown or
        a missing one in one line. ``flags``: the names the arguments have a ``fed_*`` flag for (errors name it)."""
        fields = dataclasses.fields(self.settings)
        names = [f.name for f in fields]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(
                f"fed_transport {self.name} has no setting {', '.join(unknown)} (its settings: "
                f"{', '.join(names) or 'none'}). Drop it from --fed_transport_options, or pick the transport it "
                "belongs to."
            )
        required = [f.name for f in fields if f.default is dataclasses.MISSING is f.default_factory]
        missing = [name for name in required if options.get(name) is None]
        if missing:
            named = ", ".join(f"fed_{n}" if n in flags else f"{n} (in --fed_transport_options)" for n in missing)
            example = getattr(self.settings, "example", "") or f"--fed_transport_options '{{\"{missing[0]}\": ...}}'"
            raise ConfigError(f"fed_transport {self.name} needs {named}: e.g. {example}.")
        return self.settings(**{name: value for name, value in options.items() if value is not None})


TRANSPORTS: dict[str, Transport] = {}


def register_transport(
    name: str, factory: Factory | str, *, settings: type[OneJob] | type[GroupLaunch] = OneJob, summary: str = ""
) -> Transport:
    """Offer a transport as ``fed_transport name`` (to the Trainer, TRL and the plain loop alike).

    ``factory(request: FederationRequest) -> Federation`` builds this launch's side of the federation; ``settings``
    is a dataclass deriving from `OneJob` (every group in one launch) or `GroupLaunch` (a launch per group: fields
    ``group_id`` and ``num_groups``, plus the transport's own). Call it before the arguments are parsed (at import of
    the module that defines the transport). Registering a name again with another factory is refused.
    """
    if not (isinstance(settings, type) and issubclass(settings, OneJob | GroupLaunch)):
        raise TypeError(
            f"register_transport({name!r}): settings must be a dataclass deriving from "
            f"hf_fedshard.transports.OneJob or GroupLaunch (a launch per group), got {settings!r}."
        )
    if not dataclasses.is_dataclass(settings):
        raise TypeError(f"register_transport({name!r}): settings {settings.__name__} must be a dataclass.")
    transport = Transport(name, factory, settings, summary)
    known = TRANSPORTS.get(name)
    if known is not None and (known.factory, known.settings) != (factory, settings):
        raise ValueError(f"fed_transport {name!r} is already registered (to {known.factory!r}); pick another name.")
    TRANSPORTS[name] = transport
    return transport


def get_transport(name: str) -> Transport:
    """The transport registered as ``name``, or a one-line error listing those registered."""
    if name not in TRANSPORTS:
        raise ConfigError(
            f"fed_transport={name!r} is unknown. Set --fed_transport to one of {', '.join(TRANSPORTS)}, or register "
            "your own with hf_fedshard.transports.register_transport before the arguments are parsed."
        )
    return TRANSPORTS[name]


def settings_owners(name: str) -> list[str]:
    """The registered transports that have a setting ``name`` (for an error naming where a flag belongs)."""
    return [t.name for t in TRANSPORTS.values() if name in {f.name for f in dataclasses.fields(t.settings)}]


register_transport("mesh", "hf_fedshard.transports.mesh:one_job_federation", summary="every group in one job.")
register_transport(
    "torchft", "hf_fedshard.transports.elastic:torchft_federation", settings=TorchftSettings,
    summary="every group its own launch, averaging with the groups alive (a dead group costs the others nothing).",
)  # fmt: skip

__all__ = [
    "TRANSPORTS",
    "Federation",
    "FederationRequest",
    "GroupLaunch",
    "OneJob",
    "Transport",
    "get_transport",
    "register_transport",
]
