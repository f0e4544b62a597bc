"""Distributed check script: `FederatedAverager` in a plain Accelerate loop on train_tiny.py's model and data.

The loop a user writes (the README's example): FSDP2 over each group by hand, SGD, ``averager.step()`` after every
optimizer step, ``averager.finish()``; the data loader prepared by Accelerate with the Trainer's seeded sampler,
so that the tests can compare it with `FedShardTrainer` sample for sample::

    torchrun --nproc_per_node 4 tests/scripts/plain_loop_tiny.py --dump_dir /tmp/x --group_size 2 --sync_steps 2
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, RandomSampler
from transformers import default_data_collator, set_seed

from hf_fedshard import FederatedAverager, FederationLayout
from hf_fedshard.transports.mesh import destroy_gloo_groups_at_exit, fsdp_mesh
from tests.scripts.train_tiny import TokenDataset, full_tensor, tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump_dir", required=True)
    parser.add_argument("--group_size", type=int, required=True)
    parser.add_argument("--sync_steps", type=int, default=2)
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--num_samples", type=int, default=64)
    opts = parser.parse_args()
    destroy_gloo_groups_at_exit()
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = tiny_llama()
    layout = FederationLayout(accelerator.num_processes, opts.group_size)
    mesh = layout.build_mesh("cpu")
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh(mesh))
    fully_shard(model, mesh=fsdp_mesh(mesh))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # tests/launch.py's SGD settings
    averager = FederatedAverager(model, optimizer, mesh, sync_steps=opts.sync_steps)
    set_seed(0)  # the Trainer's seed (--seed 0): its sampler's order
    dataset = TokenDataset(opts.num_samples)
    loader = DataLoader(dataset, batch_size=2, sampler=RandomSampler(dataset), collate_fn=default_data_collator)
    loader = accelerator.prepare(loader)
    seen: list[int] = []
    batches = iter(loader)
    for _ in range(opts.max_steps):
        batch = next(batches)
        seen += batch["input_ids"][:, 0].tolist()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        averager.step()
    averager.finish()
    dump = {
        "seen": seen,
        "full_params": {n: full_tensor(p) for n, p in model.named_parameters()},
        "counters": averager.state_dict()["counters"],
    }
    os.makedirs(opts.dump_dir, exist_ok=True)
    torch.save(dump, os.path.join(opts.dump_dir, f"rank{accelerator.process_index}.pt"))


if __name__ == "__main__":
    main()
