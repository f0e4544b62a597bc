"""Federated checkpoints: save, load, resume on another layout, and the exported global model (the Trainer's side).

`CheckpointMixin` writes each group's own shards into a staging folder renamed once every rank is done, loads a run's
state from its `hf_fedshard.integrations.resume_source.ResumeSource` (a checkpoint of this layout or another, or a
live peer's), and exports the averaged model in the Hugging
Face format. One of the parts of `hf_fedshard.integrations.trainer.FedShardMixin`.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import StateDictType
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from hf_fedshard.checkpointing.averaging_state import save_averaging_state
from hf_fedshard.checkpointing.background import BackgroundCheckpointer
from hf_fedshard.checkpointing.checkpoint import (
    StateWrite,
    atomic_checkpoint,
    dcp_write,
    group_dir,
    publish,
    remove_staging_folders,
    save_group_model,
    save_group_optimizer,
    staging_dir,
    tokenizer_fingerprint,
    write_layout_record,
)
from hf_fedshard.checkpointing.manifest import write_manifest_entries
from hf_fedshard.checkpointing.resume import load_on_every_rank
from hf_fedshard.checkpointing.stall import SaveStall
from hf_fedshard.engine.payload import all_finite, model_state_tensors
from hf_fedshard.integrations.file_modes import follow_umask
from hf_fedshard.integrations.resume_source import ResumeSource, checkpoint_source
from hf_fedshard.startup import LOAD, phase

logger = logging.getLogger(__name__)


class CheckpointMixin(Trainer):
    """Each group's own shards saved and loaded, atomically; the global model exported."""

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        # Trainer's FSDP save runs DCP over the world, where groups would write the same keys, and in place:
        # here each group saves its own shards into a staging folder that is renamed once every rank is done.
        if self.fed_callback is None:
            return super()._save_checkpoint(model, trial)
        step = self.state.global_step
        stall = SaveStall(step)
        if self._checkpointer is not None:
            with stall.part("previous write"):
                self._end_background_save()  # at most one in flight: the previous one is published (or failed) first
        with stall.part("NaN/Inf check"):
            diverged = self._diverged_groups()
        if diverged:
            if self.args.should_log:
                logger.warning(
                    "hf_fedshard: checkpoint-%d not written: group(s) %s hold NaN/Inf (the next averaging restarts "
                    "them from the others); the previous checkpoints stay the latest good ones.",
                    step,
                    diverged,
                )
            return
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        final_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        self._track_best_checkpoint(run_dir, step)
        if self._checkpointer is not None:
            self._save_in_background(final_dir, run_dir, stall)
        else:
            with stall.part("writes and barriers"), atomic_checkpoint(final_dir, self.args.should_save) as staging:
                self._save_federated_state(staging)
            if self.args.push_to_hub:
                self._push_from_checkpoint(final_dir)
            if self.args.should_save:
                self._rotate(run_dir, self.state.best_model_checkpoint)
        self.fed_checkpoint_stalls.append(stall)
        if self.args.should_log:
            logger.info("hf_fedshard: %s", stall.describe())

    def _save_in_background(self, final_dir: str, run_dir: str, stall: SaveStall) -> None:
        """Copy every rank's state to host memory and write the small files now; the DCP writes, the hashing and the
        publication (manifest, rename, rotation) go on in the background (`hf_fedshard.checkpointing.background`).
        No barrier: every rank creates the staging folder (a killed run's were removed at the start)."""
        staging = staging_dir(final_dir)
        os.makedirs(staging, exist_ok=True)
        write = self._checkpointer.write

        def copy(state: dict[str, Any], directory: str, group: Any) -> None:
            with stall.part("host copies"):
                write(state, directory, group)

        with stall.part("state dicts and small files"):
            self._save_federated_state(staging, copy)
        publisher = None  # the writer's: every other rank only writes its shards and hashes its share
        if self.args.should_save:
            publisher = partial(self._publish_checkpoint, staging, final_dir, run_dir, self.state.best_model_checkpoint)
        self._checkpointer.start(staging, final_dir, publisher)

    def _prepare_background_saves(self) -> None:
        """With ``fed_async_checkpoint``, the writer threads' process groups, made before training (every rank at
        once), so that the first save's stall is a save's; the staging folders killed runs left are removed now,
        since a background save has no barrier to remove them behind."""
        if not self.args.fed_async_checkpoint or self.args.save_strategy == SaveStrategy.NO:
            return
        layout = self.args.fed_launch_layout
        ranks = [list(layout.ranks_of(g)) for g in range(layout.num_groups)]
        timeout, pinned = timedelta(seconds=self.args.ddp_timeout), self.args.device.type == "cuda"
        if self.args.should_save:
            remove_staging_folders(self.args.output_dir)
        self._checkpointer = BackgroundCheckpointer(ranks, layout.world_size, timeout, pinned)
        torch.distributed.barrier()  # no rank saves before the removal is done

    def _publish_checkpoint(
        self, staging: str, final_dir: str, run_dir: str, best: str | None, files: dict[str, Any]
    ) -> None:
        """The writer's last part of a background save, once every rank's shards are written and its share of the
        files hashed (``files``: the manifest's entries; in its thread)."""
        write_manifest_entries(staging, files)
        publish(staging, final_dir)
        self._rotate(run_dir, best)

    def _rotate(self, run_dir: str, best: str | None) -> None:
        """Trainer's rotation over the published checkpoints (``checkpoint-N`` names only), keeping ``best``."""
        rotate_checkpoints(run_dir, self.args.save_total_limit, best, use_mtime=True)

    def _end_background_save(self) -> None:
        """Wait for the checkpoint in flight (every rank, at the same step), say the wait, push what was published."""
        if self._checkpointer is None or self._checkpointer.current is None:
            return
        waited, published = self._checkpointer.wait()
        if waited >= 1.0 and self.args.should_log:
            logger.warning(
                "hf_fedshard: waited %.1f s for the previous checkpoint's background write (one in flight at most); "
                "save less often (--save_steps) to train through it.",
                waited,
            )
        if published is not None and self.args.push_to_hub:
            self._push_from_checkpoint(published)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # The last checkpoint is published before Trainer reloads the best one, rotates, or the run ends.
        self._end_background_save()
        return super()._finalize_training(*args, **kwargs)

    def _diverged_groups(self) -> list[int]:
        """The groups holding a NaN/Inf now; with torchft, where groups meet only in averagings, this group alone."""
        if self.args.fed_launch_layout.federated:
            return self.fed_callback.averager.find_diverged_groups()
        flag = torch.tensor(0.0 if all_finite(model_state_tensors(self.model)) else 1.0, device=self.args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return [self.args.fed_launch.group_id] if flag.item() else []

    def _track_best_checkpoint(self, run_dir: str, step: int) -> None:
        """Trainer's bookkeeping of the best checkpoint, for a checkpoint that is published at the end."""
        strategies = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        best_step = self.state.best_global_step
        if self.args.save_strategy in strategies and best_step:
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
            if best_step == step or os.path.exists(best_dir):
                self.state.best_model_checkpoint = best_dir

    def _save_federated_state(self, checkpoint: str, write: StateWrite = dcp_write) -> None:
        """Everything needed to continue exactly, each group's shards in its own ``fed_group{g}`` folder; ``write``
        writes a DCP state now, or copies it for the background (``fed_async_checkpoint``)."""
        group = group_dir(checkpoint, self._group_index)
        save_group_model(self.model, os.path.join(group, "model"), self._group_pg, write)
        if not self.args.save_only_model:
            self._save_group_optimizer(checkpoint, write)
            self._save_scaler(checkpoint)
            self._save_rng_state(checkpoint)
        state = self.fed_callback.averager.state_dict()
        layout = self.args.fed_launch_layout
        rank, group_pg = self.args.process_index, self._group_pg
        save_averaging_state(checkpoint, layout, rank, state, self.model, group_pg, write)
        if self.args.should_save:
            read = {
                **self._data_arithmetic,
                **self._epoch_position(),
                "tokenizer": tokenizer_fingerprint(self.processing_class),
            }
            write_layout_record(checkpoint, layout, self.model, read)
            config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
            if config is not None:
                config.save_pretrained(checkpoint)
            self._save_trainer_state(checkpoint)

    def _save_trainer_state(self, checkpoint: str) -> None:
        """``trainer_state.json`` with the stateful callbacks, as Trainer writes it (the last file of a checkpoint).
        A group healed from a live peer holds none yet (`integrations.resume_source.LivePeer` leaves the peer's out)."""
        for cb in [cb for cb in [*self.callback_handler.callbacks, self.control] if isinstance(cb, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state
        self.state.save_to_json(os.path.join(checkpoint, TRAINER_STATE_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Groups' optimizer moments differ between averagings: each group saves its own, over its own ranks.
        if self.fed_callback is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self._save_group_optimizer(output_dir)

    def _save_group_optimizer(self, output_dir: str, write: StateWrite = dcp_write) -> None:
        """This group's optimizer state over its own ranks (``write``: now, or copied for the background), and the
        scheduler's."""
        directory = os.path.join(group_dir(output_dir, self._group_index), "optimizer")
        save_group_optimizer(self.model, self.optimizer, directory, self._group_pg, write)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: Any, model: nn.Module | None = None) -> None:
        # A federated run loads from its ResumeSource (this group's shards, another layout's resharded, a live
        # peer's); every rank learns of any rank's failure to read.
        if not isinstance(resume_from_checkpoint, ResumeSource):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        source, model = resume_from_checkpoint, model or self.model

        def load() -> None:
            source.load_model(model, self._group_pg)
            self.fed_callback.load_state_dict(source.averaging_state(model, self._group_pg), source.committed)

        with phase(LOAD):
            load_on_every_rank(str(source), load)

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        # Each group reads its own optimizer state from its ResumeSource (a live peer's: none, it starts afresh).
        if not isinstance(checkpoint, ResumeSource):
            return super()._load_optimizer_and_scheduler(checkpoint)

        def load() -> None:
            checkpoint.load_optimizer(self.model, self.optimizer, self._group_pg)
            if (schedule := checkpoint.scheduler_state()) is not None:
                self.lr_scheduler.load_state_dict(schedule)

        with phase(LOAD):
            load_on_every_rank(str(checkpoint), load)
        checkpoint.release()  # Trainer loads nothing more from it that it holds in memory

    def _load_scaler(self, checkpoint: Any) -> None:
        # Trainer reads the scaler's state from a checkpoint's folder; a live peer has none.
        super()._load_scaler(checkpoint.folder if isinstance(checkpoint, ResumeSource) else checkpoint)

    def _load_rng_state(self, checkpoint: Any) -> None:
        # Trainer reads the RNG states from a checkpoint's folder; a live peer has none.
        super()._load_rng_state(checkpoint.folder if isinstance(checkpoint, ResumeSource) else checkpoint)

    def _load_best_model(self) -> None:
        # The best checkpoint holds one copy per group: each group reloads its own (written on another layout: its
        # global model, resharded).
        if self.fed_callback is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        source = checkpoint_source(best, self.args.fed_launch_layout, self._group_index, self.args.process_index)
        source.load_model(self.model, self._group_pg)
        self.fed_callback.averager.adopt_plain_average()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # Export the global model in the Hugging Face format: the groups' plain average between averagings (each
        # group gets its own model back), FSDP2's shards gathered (Trainer writes nothing for SHARDED_STATE_DICT).
        # Federated checkpoints never come here (see _save_checkpoint), so this gathers for exports only.
        if self.fed_callback is None:
            super().save_model(output_dir, _internal_call)
        else:
            self._save_global_model(output_dir, _internal_call)
        if self.args.should_save:  # safetensors writes its files 0600: the weights get the umask's mode like the rest
            follow_umask(output_dir or self.args.output_dir)

    def _save_global_model(self, output_dir: str | None, _internal_call: bool) -> None:
        with self.fed_callback.global_model():
            if self.accelerator.state.fsdp_plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
                return super().save_model(output_dir, _internal_call)
            state_dict = self.accelerator.get_state_dict(self.model)
        self._save(output_dir or self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
