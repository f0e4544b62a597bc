"""hf_fedshard: FL+FSDP and FL+HSDP (FedAvg across FSDP2 groups) for the Hugging Face Trainer."""

from .arguments import FedShardArgumentsMixin, FedShardTrainingArguments
from .callback import FedAvgCallback
from .mesh import FederatedParallelismConfig, FederationLayout, MeshAxis
from .trainer import FedShardMixin, FedShardTrainer

__all__ = [
    "FedAvgCallback",
    "FedShardArgumentsMixin",
    "FedShardMixin",
    "FedShardTrainer",
    "FedShardTrainingArguments",
    "FederatedParallelismConfig",
    "FederationLayout",
    "MeshAxis",
]
__version__ = "0.1.0"
