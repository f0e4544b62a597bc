"""The averaging engine: what a federation does between groups, for any training loop (it imports torch only).

`FederatedAverager` composes the schedule and fragments (`fragments`), the outer optimizer (`outer`), the
exchange and its codec (`exchange`, `codec`), the control all-reduce (`control`) and the overlap worker
(`overlap`); every collective goes through a `FederationCommunicator` (`communicator`), which a transport provides.
"""

from hf_fedshard.engine.averager import FederatedAverager
from hf_fedshard.engine.communicator import Communicator, FederationCommunicator, ProcessGroupCommunicator
from hf_fedshard.engine.observer import AveragingObserver
from hf_fedshard.engine.options import AveragingOptions
from hf_fedshard.engine.resumable import check_state
from hf_fedshard.engine.settings_history import AveragingSettings, History

__all__ = [
    "AveragingObserver",
    "AveragingOptions",
    "AveragingSettings",
    "Communicator",
    "FederatedAverager",
    "FederationCommunicator",
    "History",
    "ProcessGroupCommunicator",
    "check_state",
]
