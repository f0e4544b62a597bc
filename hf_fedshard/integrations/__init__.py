"""The Hugging Face side: `FedShardTrainer` and its mixin, the Trainer callback, the arguments, the model card."""
