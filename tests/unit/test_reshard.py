"""Resuming a federated checkpoint on another layout (hf_fedshard.checkpointing.reshard), in process: the data
arithmetic and the outer state held by parameter. The real resumes are tests/distributed/test_reshard.py; the
resharded mean of the models and moments is tests/unit/test_checkpoint_rules.py.

The data arithmetic is pinned end to end in process: `data_position` at the epoch's edges (one new step left, none
left, the record's position rounded up), then what `FedShardTrainer` hands Trainer from it: the batches Trainer
skips in the resumed epoch (the new steps × gradient_accumulation_steps) and the epochs it runs to reach max_steps.
An off-by-one in any of them reads a sample twice or skips a step's samples, which only the torchrun resumes saw.
A live peer's state (a heal at launch) reaches the same hooks from memory, as the run's `ResumeSource`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainerState

from hf_fedshard import FederatedAverager
from hf_fedshard.checkpointing.averaging_state import in_flight_path, write_counters
from hf_fedshard.checkpointing.checkpoint import CheckpointReadError
from hf_fedshard.checkpointing.reshard import DataPosition, data_position
from hf_fedshard.engine.outer import OuterOptimizer, fragments_from_flat
from hf_fedshard.integrations.elastic import trainer_state_now
from hf_fedshard.integrations.resume_source import GroupCheckpoint, LivePeer
from hf_fedshard.integrations.trainer import FedShardTrainer

from ..fake_communicator import run_federation
from ..tiny_federation import build, train_step

SAVED = {"samples_per_step": 8, "steps_per_epoch": 8, "num_groups": 2}  # a record of an earlier layout


@pytest.mark.parametrize(
    ("step", "new_batch", "new_steps_per_epoch", "position"),
    [
        (2, 6, 10, DataPosition(0, 16, 3, 2)),  # 16 read; 3 steps of 6 cover them; 2 samples not read
        (4, 4, 16, DataPosition(0, 32, 8, 0)),  # a whole number of new steps: nothing skipped
        (10, 6, 10, DataPosition(1, 16, 3, 2)),  # epoch 1 (8 steps per epoch then), 2 steps into it
        (7, 16, 4, DataPosition(1, 0, 0, 0)),  # 56 of epoch 0 read: 4 steps of 16 would pass its end
        (7, 8, 8, DataPosition(0, 56, 7, 0)),  # one step of 8 left in the epoch: read in it, not skipped
        (6, 6, 10, DataPosition(0, 48, 8, 0)),  # 48 read: exactly 8 steps of 6, 2 steps left in the epoch
        (8, 6, 10, DataPosition(1, 0, 0, 0)),  # the end of epoch 0: epoch 1 from its beginning
        (17, 6, 10, DataPosition(2, 8, 2, 4)),  # epoch 2, 1 step in: 8 read, 2 steps of 6 cover them
    ],
)
def test_the_data_resumes_after_the_samples_read_rounded_up_to_new_steps(
    step, new_batch, new_steps_per_epoch, position
):
    assert data_position(SAVED, step, new_batch, new_steps_per_epoch) == position


def test_a_recorded_epoch_position_wins_over_the_step():
    """Written after a layout change (3 steps of 6 covered epoch 0's first 16 samples, then 2 more steps): step 4
    says 24 samples, the record 30; resumed on the same layout, 5 steps of 6."""
    saved = {**SAVED, "samples_per_step": 6, "steps_per_epoch": 10, "epoch": 0, "epoch_samples": 30}
    assert data_position(saved, 4, 6, 10) == DataPosition(0, 30, 5, 0)
    assert data_position(saved, 4, 8, 8) == DataPosition(0, 30, 4, 2)  # on batches of 8: 4 steps, 2 not read
    assert data_position({**saved, "epoch_samples": 60}, 10, 8, 8) == DataPosition(1, 0, 0, 0)  # 8 steps: the end


def resuming_trainer(
    record: dict, step: int, gradient_accumulation_steps: int = 1, ignore_data_skip: bool = False
) -> FedShardTrainer:
    """A `FedShardTrainer` with only what its data-position hooks read: its resume source (``fed_resume``), the
    checkpoint of ``record`` (``fed_layout.json``, written after a layout change) at ``step``."""
    trainer = FedShardTrainer.__new__(FedShardTrainer)
    trainer.args = SimpleNamespace(
        gradient_accumulation_steps=gradient_accumulation_steps, should_log=False, ignore_data_skip=ignore_data_skip
    )
    trainer.fed_resume = GroupCheckpoint(f"checkpoint-{step}", record, step, layout=None, group_index=0, rank=0)
    return trainer


@pytest.mark.parametrize(
    ("max_steps", "epochs"),
    [
        (20, 3),  # 7 steps left in epoch 0, then 10 in epoch 1, then 1 in epoch 2
        (9, 1),  # the 7 steps left in epoch 0 reach it
        (10, 2),  # one step more: epoch 1 too
        (19, 2),  # 7 + 10: epoch 1 ends on it
    ],
)
@pytest.mark.parametrize("accumulation", [1, 4])
def test_trainer_skips_the_new_steps_batches_and_runs_the_epochs_that_reach_max_steps(
    monkeypatch, max_steps, epochs, accumulation
):
    """Step 2 of a layout of 8 samples per step, resumed on 6 samples per step, 10 steps per epoch: 16 samples
    read, 3 new steps cover them. Trainer skips 3 × gradient_accumulation_steps batches of epoch 0 (its counts are
    in batches), and runs epochs 0 up to ``epochs`` − 1 to reach ``max_steps`` (Trainer's own values, from the step,
    would be wrong on the new layout: here 99)."""
    trainer = resuming_trainer({**SAVED, "epoch": 0, "epoch_samples": 16}, 2, accumulation)
    batches = 10 * accumulation
    plain = (99, 10, 60, 6 * max_steps, 6, batches, max_steps)  # epochs, steps/epoch, ..., world batch, batches, max
    monkeypatch.setattr(Trainer, "set_initial_training_values", lambda self, args, dataloader: plain)
    monkeypatch.setattr(Trainer, "_init_training_state", lambda self, *args, **kwargs: (99, 99))
    values = trainer.set_initial_training_values(trainer.args, list(range(batches)))
    assert values == (epochs, *plain[1:])
    assert trainer._init_training_state(max_steps, 10, epochs, trainer.fed_resume, None) == (0, 3 * accumulation)


def test_outer_state_by_parameter_is_cut_at_this_averagers_fragments():
    """Anchors and momenta held by parameter (as DCP reads them onto any layout) become each fragment's state, the
    momentum of a parameter without one left out, the param groups this averager's own."""
    anchors = [torch.full((2,), float(i)) for i in range(5)]
    momenta = [torch.ones(2), None, torch.ones(2) * 2, torch.ones(2) * 3, torch.ones(2) * 4]
    optimizers = [OuterOptimizer([torch.zeros(2)] * n, lr=0.7, momentum=0.9) for n in (2, 3)]
    outer = fragments_from_flat({"anchor": anchors, "momentum": momenta}, [(0, 2), (2, 5)], optimizers)
    first, second = outer["fragments"]
    assert [a[0].item() for a in first["anchor"]] == [0, 1] and [a[0].item() for a in second["anchor"]] == [2, 3, 4]
    assert list(first["optimizer"]["state"]) == [0] and list(second["optimizer"]["state"]) == [0, 1, 2]
    assert second["optimizer"]["state"][2]["momentum_buffer"] is momenta[4]
    assert second["optimizer"]["param_groups"][0]["params"] == [0, 1, 2]
    assert second["optimizer"]["param_groups"][0]["lr"] == 0.7
    optimizers[1].load_state_dict(second)
    assert torch.equal(optimizers[1].anchor[2], anchors[4])


def test_an_exchange_in_flight_is_dropped_and_the_next_delta_covers_both_windows():
    """3 groups (H = 4, τ = 1, Nesterov) stop at step 4 with step 4's exchange in flight; 2 groups resume from the
    plain mean of their models and the anchor as the layout change reads it (by parameter, nothing in flight):
    step 5 applies nothing, and step 8's exchange sends Δ = the anchor of step 0 − each group's model."""
    options = {"sync_steps": 4, "sync_overlap": 1, "outer_optimizer": "nesterov"}

    def old_group(comm):
        model, optimizer = build(comm.group)
        averager = FederatedAverager(model, optimizer, communicator=comm, **options)
        for step in range(1, 5):
            train_step(model, optimizer, comm.group, step)
            averager.step()
        state = averager.state_dict()
        assert state["in_flight"] is not None
        return [t.detach().clone() for t in model.parameters()], state

    old = run_federation(3, old_group)
    mean = [sum(ts[i] for ts, _ in old) / 3 for i in range(len(old[0][0]))]
    anchor = [a.clone() for f in old[0][1]["outer"]["fragments"] for a in f["anchor"]]
    resharded = {"counters": old[0][1]["counters"], "in_flight": None, "step": 4,
                 "outer": {"anchor": anchor, "momentum": [None] * len(anchor)}}  # fmt: skip

    def new_group(comm):
        model, optimizer = build(comm.group + 10)
        with torch.no_grad():
            for p, value in zip(model.parameters(), mean, strict=True):
                p.copy_(value)
        averager = FederatedAverager(model, optimizer, communicator=comm, average_initial_weights=False, **options)
        averager.load_state_dict(resharded)
        sent = []
        mean_of = averager.exchange.mean

        def record(tensors, contributors, addresses=None):  # what the exchange sends: each group's Δ
            sent.append([t.clone() for t in tensors])
            return mean_of(tensors, contributors, addresses)

        averager.exchange.mean = record
        changed = []
        for step in range(5, 9):
            train_step(model, optimizer, comm.group, step)
            before = [p.detach().clone() for p in model.parameters()]
            averager.step()
            changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)))
        local = [p.detach().clone() for p in model.parameters()]
        averager.finish()
        return changed, sent[0], local

    for changed, deltas, local in run_federation(2, new_group):
        assert changed == [False, False, False, False]  # step 5 applies nothing; step 8's exchange is in flight
        for delta, a, p in zip(deltas, anchor, local, strict=True):  # Δ taken at step 8 against step 0's anchor
            assert torch.equal(delta, a - p.float())


def test_ignore_data_skip_starts_the_resumed_epoch_from_its_beginning(monkeypatch):
    """As with Trainer: ``--ignore_data_skip`` skips no batch of the resumed epoch (the epoch is still the record's)."""
    trainer = resuming_trainer({**SAVED, "epoch": 0, "epoch_samples": 16}, 2, 4, ignore_data_skip=True)
    plain = (99, 10, 60, 120, 6, 40, 20)
    monkeypatch.setattr(Trainer, "set_initial_training_values", lambda self, args, dataloader: plain)
    monkeypatch.setattr(Trainer, "_init_training_state", lambda self, *args, **kwargs: (99, 0))
    trainer.set_initial_training_values(trainer.args, list(range(40)))
    assert trainer._init_training_state(20, 10, 3, trainer.fed_resume, None) == (0, 0)


def test_a_live_peers_trainer_state_comes_from_memory_and_places_the_data_from_its_step(monkeypatch):
    """A group healing at launch resumes from a live peer's committed trainer state (`LivePeer`), with no folder for
    Trainer to read: step 10 of 4 steps per epoch with 2 accumulation steps is epoch 2 with its first 2 steps'
    4 batches skipped, as Trainer places a checkpoint's step; the state is the peer's but for its callbacks'."""
    trainer = FedShardTrainer.__new__(FedShardTrainer)
    trainer.args = SimpleNamespace(gradient_accumulation_steps=2, should_log=False, ignore_data_skip=False,
                                   local_process_index=0, process_index=0)  # fmt: skip
    trainer.hp_name, trainer._trial = None, None
    peer = TrainerState(global_step=10, log_history=[{"loss": 1.5, "step": 10}], stateful_callbacks={"Cb": {"a": 1}},
                        best_model_checkpoint="/not/here/fed_group0/checkpoint-8")  # fmt: skip
    parts = {"trainer": trainer_state_now(peer), "averager": {}, "scheduler": {}}
    trainer.fed_resume = LivePeer(parts, group_id=1, accumulation=2)
    trainer._data_arithmetic, trainer._resumed_position = {"samples_per_step": 8}, None
    folders = []
    monkeypatch.setattr(Trainer, "_init_training_state", lambda self, *args: folders.append(args[3]) or (0, 0))
    assert trainer._init_training_state(20, 4, 5, trainer.fed_resume, None) == (2, 4)
    assert folders == [None]  # Trainer was given no folder to read
    state = trainer.state
    assert (state.global_step, state.log_history, state.stateful_callbacks) == (10, [{"loss": 1.5, "step": 10}], {})
    assert (state.max_steps, state.num_train_epochs) == (20, 5)
    assert state.best_model_checkpoint is None  # as Trainer: the peer's best is not on this file system
    trainer.fed_resume.release()  # once loaded, only the trainer state stays referenced by Trainer's loop
    assert list(trainer.fed_resume.state) == ["trainer"]


@pytest.mark.parametrize(
    ("epoch", "samples_per_step", "position"),
    [
        (24 / 40, 8, DataPosition(0, 96, 12, 0)),  # 24 of 40 batches read: 12 steps of 2 batches
        (24 / 40, 4, DataPosition(0, 48, 12, 0)),  # a healing group of half the size: the same steps, its samples
        (1.0, 8, DataPosition(1, 0, 0, 0)),  # at the epoch's end: the next epoch from its beginning
        (2 + 38 / 40, 8, DataPosition(2, 152, 19, 0)),  # epoch 2, one step before its end
    ],
)
def test_a_live_peer_places_the_data_by_its_epoch_not_its_step(epoch, samples_per_step, position):
    """The peer's fractional epoch (Trainer's, in batches: the same count on every rank of every group) read back as
    whole steps: after a layout change its step (9 here) no longer says where its epoch is; 40 batches per epoch,
    2 accumulation steps, 20 steps per epoch."""
    peer = LivePeer({"trainer": {"epoch": epoch, "global_step": 9}}, group_id=1, accumulation=2)
    assert peer.data_position(samples_per_step, 20, 40) == position


def test_a_checkpoints_schedule_beside_its_optimizer_must_be_there(tmp_path):
    """An optimizer folder without scheduler.pt is damage (raised, so every rank stops together); a save_only_model
    checkpoint has neither and resumes its schedule afresh."""
    source = GroupCheckpoint(str(tmp_path), None, 4, layout=None, group_index=0, rank=0)
    assert source.scheduler_state() is None
    (tmp_path / "fed_group0" / "optimizer").mkdir(parents=True)
    with pytest.raises(CheckpointReadError, match=r"^cannot read .*scheduler\.pt"):
        source.scheduler_state()


@pytest.mark.parametrize(("synced_at", "in_flight", "committed"), [([96], False, True), ([88], False, False),
                         ([96, 92], False, False), ([96], True, False)])  # fmt: skip
def test_a_checkpoint_written_right_after_a_commit_is_a_heal_source_once_loaded(tmp_path, synced_at, in_flight,
                                                                                committed):  # fmt: skip
    """After a full restart without a shared folder, the group that published step 96's averaging resumes there and
    the others, from 92, heal from it: its checkpoint holds a committed state only where every fragment averaged at
    its step and no exchange was in flight (else the groups behind wait for its next commit)."""
    (tmp_path / "fed_group0").mkdir()
    write_counters(str(tmp_path), 0, 0, {"syncs": 13, "synced_at": synced_at})
    if in_flight:
        torch.save({}, in_flight_path(str(tmp_path), 0, 0))
    source = GroupCheckpoint(str(tmp_path), None, 96, layout=None, group_index=0, rank=0)
    assert (source.averagings, source.committed) == (13, committed)
