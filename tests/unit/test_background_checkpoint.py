"""`BackgroundCheckpointer`'s phases in one real gloo process: a checkpoint appears only once every rank said it
wrote its shards, holds the state of the moment it was staged, and a failure anywhere publishes nothing and fails
the wait (the multi-rank kill in the middle of a background save: tests/distributed/test_reliability.py)."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hf_fedshard.checkpointing import stall as stall_module
from hf_fedshard.checkpointing.background import RANKS_DIR, BackgroundCheckpointer, CheckpointWriteError, Phase
from hf_fedshard.checkpointing.checkpoint import latest_complete_checkpoint, publish, steps_every_group_has
from hf_fedshard.checkpointing.manifest import (
    describe_files,
    describe_share,
    list_files,
    read_manifest,
    write_manifest_entries,
)
from hf_fedshard.checkpointing.stall import SaveStall

pytestmark = pytest.mark.timeout(60)


def staged_save(
    run: Path, world_size: int = 1, timeout_s: float = 30, fail: Exception | None = None
) -> tuple[BackgroundCheckpointer, dict, Path]:
    """A checkpointer whose DCP writes wait for ``checkpointer.go`` (set it to let them run; ``fail``: they raise
    it then), a model state staged into ``run/tmp-checkpoint-4/model`` and started; returns the checkpointer, the
    live state and the final folder."""
    checkpointer = BackgroundCheckpointer([[0]], world_size, timedelta(seconds=timeout_s), pinned=False)
    checkpointer.go = threading.Event()
    write = checkpointer._write_state

    def held(state: dict, directory: str) -> None:
        assert checkpointer.go.wait(30)
        if fail is not None:
            raise fail
        write(state, directory)

    checkpointer._write_state = held
    staging, final = run / "tmp-checkpoint-4", run / "checkpoint-4"
    staging.mkdir(parents=True)
    (staging / "trainer_state.json").write_text("{}")  # a small file, written by the main thread
    live = {"weight": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(4)}
    checkpointer.write({"model": live}, str(staging / "model"))

    def publisher(files: dict) -> None:
        write_manifest_entries(str(staging), files)
        publish(str(staging), str(final))

    checkpointer.start(str(staging), str(final), publisher)
    return checkpointer, live, final


def test_a_checkpoint_appears_once_written_and_holds_the_state_it_was_staged_with(group_of_one_rank, tmp_path):
    checkpointer, live, final = staged_save(tmp_path)
    live["weight"].add_(100.0)  # training goes on while the write waits
    assert latest_complete_checkpoint(tmp_path) is None and not final.exists()
    checkpointer.go.set()
    waited, published = checkpointer.wait()
    assert published == str(final) and latest_complete_checkpoint(tmp_path) == str(final)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]
    assert sorted(read_manifest(str(final))) == ["model/.metadata", "model/__0_0.distcp", "trainer_state.json"]
    dcp_to_torch_save(final / "model", tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt")["model"]
    assert torch.equal(saved["weight"], torch.arange(6.0).reshape(2, 3)) and saved["step"].item() == 4
    assert checkpointer.waited_s == waited and checkpointer.wait()[1] is None  # nothing in flight any more


def test_the_writer_publishes_only_once_every_rank_wrote_and_hashed_its_share(group_of_one_rank, tmp_path):
    """World of 2 seen from rank 0 (the writer): rank 1's marks are what it waits for, first to hash its share (every
    second file of the listing), then to publish the manifest of both shares: every file's true size and digest."""
    checkpointer, _, final = staged_save(tmp_path, world_size=2)
    checkpointer.go.set()
    staging = tmp_path / "tmp-checkpoint-4"
    marks = staging / RANKS_DIR
    while not (marks / "rank0.written").exists():
        time.sleep(0.01)
    time.sleep(0.3)
    assert checkpointer.current.phase is Phase.WRITTEN and not (marks / "rank0.hashed").exists()
    (marks / "rank1.written").write_text("")
    while not (marks / "rank0.hashed").exists():
        time.sleep(0.01)
    time.sleep(0.3)
    files = list_files(str(staging), skip=RANKS_DIR)
    assert json.loads((marks / "rank0.hashed").read_text()).keys() == set(files[0::2])
    assert checkpointer.current.phase is Phase.HASHED and not final.exists()
    everything = describe_files(str(staging), files)
    (marks / "rank1.hashed").write_text(json.dumps(describe_share(str(staging), 1, 2, skip=RANKS_DIR)))
    assert checkpointer.wait()[1] == str(final)
    assert not (final / RANKS_DIR).exists() and read_manifest(str(final)) == everything


def test_the_host_copies_are_reused_by_the_next_save_and_remade_when_the_state_changes(group_of_one_rank, tmp_path):
    """The second save copies into the first one's memory (no allocation), and holds the state of its own moment; a
    state whose shapes changed gets a copy of its own; staging while a save is in flight is refused."""
    checkpointer, live, _ = staged_save(tmp_path)
    with pytest.raises(RuntimeError, match="checkpoint-4 is still in flight: wait"):
        checkpointer.write({"model": live}, str(tmp_path / "tmp-checkpoint-8" / "model"))
    checkpointer.go.set()
    checkpointer.wait()
    first = checkpointer._copies["model"][1]["model"]["weight"]
    live["weight"].add_(100.0)
    checkpointer.write({"model": live}, str(tmp_path / "tmp-checkpoint-8" / "model"))
    ((staged, _),) = checkpointer._pending
    assert staged["model"]["weight"].data_ptr() == first.data_ptr()
    assert torch.equal(staged["model"]["weight"], torch.arange(6.0).reshape(2, 3) + 100)
    live["weight"].add_(1.0)  # training goes on: the copy keeps the moment it was staged
    assert torch.equal(staged["model"]["weight"], torch.arange(6.0).reshape(2, 3) + 100)
    grown = {"weight": torch.zeros(3, 3), "step": torch.tensor(8)}
    checkpointer.write({"model": grown}, str(tmp_path / "tmp-checkpoint-12" / "model"))
    assert checkpointer._copies["model"][1]["model"]["weight"].shape == (3, 3)


@pytest.mark.parametrize("fault", ["write raises", "another rank failed", "another rank silent"])
def test_a_failed_save_publishes_nothing_and_fails_the_wait_in_one_line(group_of_one_rank, tmp_path, fault):
    raises = OSError("No space left on device") if fault == "write raises" else None
    checkpointer, _, final = staged_save(tmp_path, world_size=1 if raises else 2, timeout_s=1, fail=raises)
    marks = tmp_path / "tmp-checkpoint-4" / RANKS_DIR
    expected = {
        "write raises": "its background write failed: No space left on device.",
        "another rank failed": "its background write failed: a background write failed (rank1: OSError: quota)",
        "another rank silent": "its background write failed: 1 of 2 ranks wrote their shards within 1 s.",
    }[fault]
    if fault == "another rank failed":
        marks.mkdir()
        (marks / "rank1.failed").write_text("OSError: quota")
    checkpointer.go.set()
    with pytest.raises(CheckpointWriteError, match=r"^checkpoint-4 was not published: ") as raised:
        checkpointer.wait()
    assert expected in str(raised.value) and "\n" not in str(raised.value)
    assert not final.exists() and latest_complete_checkpoint(tmp_path) is None
    assert not (tmp_path / "tmp-checkpoint-4").exists()  # the writer removed it: no stale mark for a later save


def test_a_stall_part_excludes_the_parts_timed_inside_it_and_adds_up_repeats(monkeypatch):
    """A save's stall, on a fake clock: the host copies (twice, 0.5 + 0.25 s) inside 8 s of state dicts and small
    files leave those 7.25 s of their own; the total is every part's, once."""
    ticks = iter([0.0, 1.0, 3.0, 4.0, 4.5, 6.0, 6.25, 11.0])
    monkeypatch.setattr(stall_module.time, "perf_counter", lambda: next(ticks))
    stall = SaveStall(8)
    with stall.part("previous write"):
        pass
    with stall.part("state dicts and small files"):
        for _ in range(2):
            with stall.part("host copies"):
                pass
    assert stall.parts == {"previous write": 1.0, "host copies": 0.75, "state dicts and small files": 7.25}
    assert stall.describe() == ("checkpoint-8 stalled training 9.00 s: previous write 1.00 s, host copies 0.75 s, "
                                "state dicts and small files 7.25 s")  # fmt: skip


def test_the_steps_every_group_published_are_none_where_no_folder_is_there_yet(tmp_path):
    """A first run: rank 1 may look before rank 0 made the run's folders (a race that ended a launch with
    FileNotFoundError); groups that share a folder resume at the newest step all of them published."""
    assert steps_every_group_has(str(tmp_path / "out_group0" / "fed_group0")) is None
    for group, steps in ((0, (4, 8)), (1, (4, 8, 12))):
        for step in steps:
            (tmp_path / f"fed_group{group}" / f"checkpoint-{step}").mkdir(parents=True)
            (tmp_path / f"fed_group{group}" / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert steps_every_group_has(str(tmp_path / "fed_group1")) == {4, 8}
