"""Two checkpoint rules pinned in process, on real small checkpoints in tmp_path (DCP without a process group).

1. A resume on another layout starts from the mean of the old groups (`hf_fedshard.checkpointing.reshard`): between
   averagings the model is Σ w_g · x_g / Σ w_g over the old groups, in fp32 in group order, with w_g = 1 for groups
   of equal size and w_g = the group's ranks for groups of unequal size; right after an averaging it is group 0's
   model; the AdamW moments are the same weighted mean, their step count kept. The expected values are computed here
   from that rule (weights 2, 1, 1: powers of two, so the rule's fp32 sums are exact to the bit whatever the order
   of rounding), never from the code. tests/distributed/test_reshard.py checks the same with torchrun launches.
2. A resume verifies the size of every file it reads against ``manifest.json`` (`hf_fedshard.checkpointing.resume`),
   the outer state in ``fed_outer/`` included: every group reads it, whoever wrote it. A resized ``fed_outer/`` file
   is refused on every rank with one line naming the file and both sizes.
3. The checksums before a resume: every file a rank reads is hashed, once, by a rank that reads it.
4. The averager's state (counters, anchors, outer momenta) comes back from a checkpoint as it was saved.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from hf_fedshard.checkpointing import resume
from hf_fedshard.checkpointing.averaging_state import (
    ANCHOR,
    MOMENTUM,
    load_averaging_state,
    save_averaging_state,
    save_outer_state,
    write_counters,
)
from hf_fedshard.checkpointing.checkpoint import (
    OUTER_DIR,
    group_dir,
    save_group_model,
    save_group_optimizer,
    write_layout_record,
)
from hf_fedshard.checkpointing.manifest import MANIFEST_NAME, describe_files, list_files
from hf_fedshard.checkpointing.reshard import layout_change, load_global_model, load_mean_optimizer
from hf_fedshard.checkpointing.resume import resumable_checkpoint
from hf_fedshard.errors import ConfigError
from hf_fedshard.topology import FederationLayout

from ..fake_communicator import run_ranks
from ..tiny_federation import Tiny

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process

STEP = 2
DATA = {"samples_per_step": 8, "steps_per_epoch": 8}  # a step's data arithmetic, which a layout change needs


def trained(group: int) -> tuple[Tiny, torch.optim.AdamW]:
    """Group ``group``'s model and AdamW after ``STEP`` steps of its own gradients: every group's values differ."""
    model = Tiny(seed=group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEP):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, 0.1 * (group + 1) * (step + i + 1)) + p.detach()
        optimizer.step()
    with torch.no_grad():
        model.stat.add_(group)
    return model, optimizer


def write_checkpoint(checkpoint: str, layout: FederationLayout, synced_at: int) -> list[tuple[Tiny, torch.optim.AdamW]]:
    """A federated checkpoint of ``layout`` at step ``STEP`` (every group's model and AdamW, the counters of every
    rank, the outer state, the layout record, a manifest); the last averaging at ``synced_at``. Returns the groups'
    models and optimizers."""
    os.makedirs(checkpoint)
    groups = [trained(g) for g in range(layout.num_groups)]
    for g, (model, optimizer) in enumerate(groups):
        save_group_model(model, os.path.join(group_dir(checkpoint, g), "model"), None)
        save_group_optimizer(model, optimizer, os.path.join(group_dir(checkpoint, g), "optimizer"), None)
    for rank in range(layout.world_size):
        write_counters(checkpoint, layout.group_index(rank), rank, {"synced_at": [synced_at]})
    anchor = [p.detach().clone() for p in groups[0][0].parameters()]
    save_outer_state(checkpoint, groups[0][0], {"fragments": [{"anchor": anchor, "optimizer": {"state": {}}}]}, None)
    write_layout_record(checkpoint, layout, groups[0][0], DATA)
    with open(os.path.join(checkpoint, "trainer_state.json"), "w") as f:
        json.dump({"global_step": STEP}, f)
    with open(os.path.join(checkpoint, MANIFEST_NAME), "w") as f:  # as write_manifest records it
        json.dump({"files": describe_files(checkpoint, list_files(checkpoint))}, f)
    return groups


def weighted_mean(tensors: list[torch.Tensor], weights: list[int]) -> torch.Tensor:
    """The rule: Σ w_g · x_g in fp32, in group order, ÷ Σ w_g."""
    total = torch.zeros_like(tensors[0], dtype=torch.float32)
    for w, t in zip(weights, tensors, strict=True):
        total = total + w * t.float()
    return (total / sum(weights)).to(tensors[0].dtype)


# (old layout, its weights written out, the new layout)
LAYOUT_CHANGES = [
    pytest.param(FederationLayout(4, 2), [1, 1], FederationLayout(3, 1), id="2x2-to-3x1"),
    pytest.param(FederationLayout(4, (2, 1, 1)), [2, 1, 1], FederationLayout(2, 1), id="sizes-2,1,1-to-2x1"),
]


@pytest.mark.parametrize(("old", "weights", "new"), LAYOUT_CHANGES)
def test_between_averagings_the_new_groups_start_from_the_weighted_mean_of_the_old(tmp_path, old, weights, new):
    checkpoint = str(tmp_path / "checkpoint-2")
    groups = write_checkpoint(checkpoint, old, synced_at=0)
    change = layout_change(checkpoint, new)
    assert change is not None and change.old_groups == len(weights)

    model = Tiny(seed=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    load_global_model(model, change, None)
    load_mean_optimizer(model, optimizer, change, None)

    saved = [m.state_dict() for m, _ in groups]
    for name, value in model.state_dict().items():  # the parameters and the floating buffer
        want = weighted_mean([s[name] for s in saved], weights)
        assert torch.equal(value, want), name
    moments = [[o.state[p] for p in m.parameters()] for m, o in groups]
    for i, p in enumerate(model.parameters()):
        for moment in ("exp_avg", "exp_avg_sq"):
            per_group = [m[i][moment] for m in moments]
            assert not torch.equal(per_group[0], per_group[1])  # the groups' moments differ: a real mean
            assert torch.equal(optimizer.state[p][moment], weighted_mean(per_group, weights)), (i, moment)
        assert float(optimizer.state[p]["step"]) == STEP


@pytest.mark.parametrize(("old", "weights", "new"), LAYOUT_CHANGES)
def test_right_after_an_averaging_the_new_groups_start_from_group_0s_model(tmp_path, old, weights, new):
    checkpoint = str(tmp_path / "checkpoint-2")
    groups = write_checkpoint(checkpoint, old, synced_at=STEP)
    model = Tiny(seed=10)
    load_global_model(model, layout_change(checkpoint, new), None)
    for name, value in model.state_dict().items():
        assert torch.equal(value, groups[0][0].state_dict()[name]), name


def every_rank_resumes(checkpoint: str, layout: FederationLayout, monkeypatch) -> list[str | None]:
    """`resumable_checkpoint` of ``checkpoint`` on every rank of ``layout`` (a thread each, their gathers met in
    process): each rank's error, or ``None`` where it resumed from ``checkpoint``."""
    ranks = threading.local()
    monkeypatch.setattr(resume, "_gather", lambda found: ranks.comm._meet(found))
    model = Tiny(seed=0)

    def rank_fn(comm):
        ranks.comm = comm
        run = resume.ResumeSettings(os.path.dirname(checkpoint), auto_resume=False, groups_publish_apart=False,
                                    rank=comm.rank(), writes=comm.rank() == 0)  # fmt: skip
        try:
            assert resumable_checkpoint(checkpoint, run, layout, model) == checkpoint
        except ConfigError as err:
            return str(err)
        return None

    return run_ranks(layout.world_size, rank_fn)


@pytest.mark.parametrize("layout", [FederationLayout(4, 2), FederationLayout(3, 1)], ids=["same-layout", "another"])
@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_resized_fed_outer_file_is_refused_on_every_rank_in_one_line(tmp_path, monkeypatch, layout, name):
    """Written on 2 groups × 2 ranks; resumed on the same layout (group 1's ranks read fed_outer/ too) and on 3 × 1
    (every file read by every rank). One byte more in a fed_outer/ file: every rank names it with both sizes."""
    checkpoint = str(tmp_path / "checkpoint-2")
    write_checkpoint(checkpoint, FederationLayout(4, 2), synced_at=STEP)
    assert every_rank_resumes(checkpoint, layout, monkeypatch) == [None] * layout.world_size  # intact: resumed

    path = os.path.join(checkpoint, OUTER_DIR, name)
    recorded = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\0")
    found = f"{OUTER_DIR}/{name} has {recorded + 1:,} bytes, the manifest says {recorded:,}"
    listing = "; ".join(f"rank {r}: {found}" for r in range(layout.world_size))
    line = f"resume_from_checkpoint={checkpoint} does not verify: {listing}. Resume from another checkpoint (or none)."
    assert every_rank_resumes(checkpoint, layout, monkeypatch) == [line] * layout.world_size
    assert "\n" not in line


# 3. Which rank hashes which file at a resume (`resume.checksum_share`): 2 groups × 2 ranks, and groups of 3 and 1.
FILES = ["trainer_state.json", "fed_layout.json", "scheduler.pt", f"{OUTER_DIR}/.metadata", f"{OUTER_DIR}/__0_0.distcp",
         "fed_group0/model/a", "fed_group0/model/b", "fed_group0/optimizer/c",
         "fed_group1/model/a", "fed_group1/model/b", "fed_group1/optimizer/c"]  # fmt: skip
SHARES = [
    pytest.param(FederationLayout(4, 2), False, [
        ["trainer_state.json", f"{OUTER_DIR}/__0_0.distcp", "fed_group0/model/a", "fed_group0/optimizer/c"],
        ["fed_layout.json", "fed_group0/model/b"],
        ["scheduler.pt", "fed_group1/model/a", "fed_group1/optimizer/c"],
        [f"{OUTER_DIR}/.metadata", "fed_group1/model/b"],
    ], id="2x2"),
    pytest.param(FederationLayout(4, (3, 1)), False, [
        ["trainer_state.json", f"{OUTER_DIR}/__0_0.distcp", "fed_group0/model/a"],
        ["fed_layout.json", "fed_group0/model/b"],
        ["scheduler.pt", "fed_group0/optimizer/c"],
        [f"{OUTER_DIR}/.metadata", "fed_group1/model/a", "fed_group1/model/b", "fed_group1/optimizer/c"],
    ], id="sizes-3,1"),
    pytest.param(FederationLayout(3, 1), True, [FILES[0::3], FILES[1::3], FILES[2::3]], id="another-layout"),
]  # fmt: skip


@pytest.mark.parametrize(("layout", "resharded", "shares"), SHARES)
def test_every_file_a_rank_reads_is_hashed_once_by_a_rank_that_reads_it(layout, resharded, shares):
    """A group's own files are hashed by its own ranks (each its position's share), the shared ones across the world;
    on another layout every rank reads every file and the world splits them. Written out here, file by file."""
    got = [resume.checksum_share(FILES, layout, rank, resharded) for rank in range(layout.world_size)]
    assert got == shares
    assert sorted(path for share in got for path in share) == sorted(FILES)  # each once


# 4. The averager's state through a checkpoint, outer momentum included (`averaging_state`), in one process.
def test_the_averaging_state_keeps_the_counters_the_anchors_and_every_outer_momentum(tmp_path):
    model = Tiny(seed=3)
    params = list(model.parameters())
    anchors = [torch.full_like(p, 0.5 + i) for i, p in enumerate(params)]
    momenta = {0: torch.full_like(params[0], -1.25), 2: torch.full_like(params[2], 2.5)}  # none for params 1 and 3
    outer = {"fragments": [
        {"anchor": anchors[:2], "optimizer": {"state": {0: {"momentum_buffer": momenta[0]}}}},
        {"anchor": anchors[2:], "optimizer": {"state": {0: {"momentum_buffer": momenta[2]}}}},
    ]}  # fmt: skip
    counters = {"syncs": 3, "synced_at": [0, 4, 8]}
    layout = FederationLayout(1, 1)
    checkpoint = str(tmp_path / "checkpoint-8")
    save_averaging_state(checkpoint, layout, 0, {"counters": counters, "in_flight": None, "outer": outer}, model, None)
    loaded = load_averaging_state(checkpoint, layout, 0, Tiny(seed=4), None)
    assert loaded["counters"] == counters and loaded["in_flight"] is None
    for i, anchor in enumerate(loaded["outer"][ANCHOR]):
        assert torch.equal(anchor, torch.full_like(params[i], 0.5 + i)), i
    assert [m is None for m in loaded["outer"][MOMENTUM]] == [False, True, False, True]
    assert torch.equal(loaded["outer"][MOMENTUM][0], torch.full_like(params[0], -1.25))
    assert torch.equal(loaded["outer"][MOMENTUM][2], torch.full_like(params[2], 2.5))
