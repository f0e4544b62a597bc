"""The bad-input table of the fault-tolerance settings: each case and the one line it must produce, in-process.

Every check here reads only local files and settings (no collective), so each rank of a job raises the same
error on its own and none waits for the others; `test_reliability` runs the trainer-level ones on 4 ranks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fedshard import FederationLayout, FedShardTrainer, FedShardTrainingArguments, notices
from hf_fedshard.checkpointing.checkpoint import (
    FORMAT_VERSION,
    check_resumable,
    check_tokenizer_matches,
    complete_checkpoints,
    latest_complete_checkpoint,
    set_aside,
    tokenizer_fingerprint,
    write_layout_record,
)
from hf_fedshard.checkpointing.manifest import MANIFEST_NAME, checksum_problem, describe_files, list_files, size_problem
from hf_fedshard.checkpointing.resume import ResumeSettings, resumable_checkpoint
from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.card import divergence_steps


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch):
    """Each test is a run of its own: hf_fedshard's notices are said once per run."""
    monkeypatch.setattr(notices, "_said", set())


def llama(hidden_size: int = 32) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config)


def saved_checkpoint(tmp_path, layout: FederationLayout, model, data: bool = True) -> str:
    """A checkpoint folder holding only the file `check_resumable` reads: the record, with its data arithmetic
    unless ``data`` is false."""
    arithmetic = {"samples_per_step": 8, "steps_per_epoch": 8} if data else {}
    write_layout_record(str(tmp_path), layout, model, arithmetic)
    return str(tmp_path)


def record_format(checkpoint: str, found: object) -> None:
    """Rewrite ``checkpoint``'s ``fed_layout.json`` with format ``found`` (``None``: without one)."""
    path = Path(checkpoint) / "fed_layout.json"
    record = {k: v for k, v in json.loads(path.read_text()).items() if k != "format"}
    path.write_text(json.dumps(record if found is None else {"format": found, **record}))


FL_FSDP_4 = FederationLayout(4, 2)  # 2 groups × 2 shards


@pytest.mark.parametrize(
    ("case", "saved_layout", "saved_hidden", "run_layout", "run_hidden", "message"),
    [
        (
            "another shard size, no data arithmetic recorded",
            FederationLayout(8, 4, 2), 32, FederationLayout(8, 4, 4), 32,
            r"was written with fed_group_size=4, fed_shard_size=2 on WORLD_SIZE=8, but this run has "
            r"fed_group_size=4, fed_shard_size=4 on WORLD_SIZE=8, and it records no data arithmetic "
            r"\(samples_per_step\), which a resume on another layout needs\. "
            r"Relaunch on 8 ranks with --fed_group_size 4 --fed_shard_size 2, or use another output_dir",
        ),
        (
            "another model",
            FL_FSDP_4, 32, FL_FSDP_4, 64,
            r"holds a different model: llama with [\d,]+ parameters \(shapes \w+\), but this run trains llama "
            r"with [\d,]+ \(shapes \w+\)\. Build the model from the checkpoint's config\.json",
        ),
    ],
)  # fmt: skip
def test_resuming_elsewhere_fails_with_one_line(
    tmp_path, case, saved_layout, saved_hidden, run_layout, run_hidden, message
):
    checkpoint = saved_checkpoint(tmp_path, saved_layout, llama(saved_hidden), data=False)
    with pytest.raises(ConfigError, match=rf"^resume_from_checkpoint={checkpoint} {message}") as err:
        check_resumable(checkpoint, run_layout, llama(run_hidden), run_layout.federated)
    assert "\n" not in str(err.value), case


class Vocab:
    """A processing class with a vocabulary, as tokenizers have."""

    def __init__(self, tokens: dict[str, int]) -> None:
        self.tokens = tokens

    def get_vocab(self) -> dict[str, int]:
        return dict(self.tokens)


def test_a_checkpoint_trained_with_another_tokenizer_is_refused(tmp_path):
    """Same size, one token moved: the model's shapes cannot see it, the record does."""
    saved = {"a": 0, "b": 1, "c": 2}
    write_layout_record(str(tmp_path), FL_FSDP_4, llama(), {"tokenizer": tokenizer_fingerprint(Vocab(saved))})
    check_tokenizer_matches(str(tmp_path), tokenizer_fingerprint(Vocab(saved)))
    check_tokenizer_matches(str(tmp_path), None)  # no vocabulary in this run: nothing to compare
    message = (
        rf"^resume_from_checkpoint={tmp_path} was trained with another tokenizer: Vocab with 3 tokens \(vocabulary "
        r"\w+\), but this run has Vocab with 3 \(vocabulary \w+\)\. Load the tokenizer saved with the run"
    )
    with pytest.raises(ConfigError, match=message):
        check_tokenizer_matches(str(tmp_path), tokenizer_fingerprint(Vocab({"a": 0, "c": 1, "b": 2})))


def test_same_layout_and_model_resume(tmp_path):
    checkpoint = saved_checkpoint(tmp_path, FL_FSDP_4, llama())
    assert json.loads((tmp_path / "fed_layout.json").read_text())["format"] == FORMAT_VERSION
    check_resumable(checkpoint, FL_FSDP_4, llama(), federated=True)


@pytest.mark.parametrize("run_layout", [FederationLayout(2, 1), FederationLayout(8, 4, 2), FederationLayout(6, 2)])
def test_a_checkpoint_resumes_on_another_layout(tmp_path, run_layout):
    check_resumable(saved_checkpoint(tmp_path, FL_FSDP_4, llama()), run_layout, llama(), federated=True)


@pytest.mark.parametrize(
    ("found", "recorded"),
    [(None, "no checkpoint format"), (FORMAT_VERSION + 1, f"checkpoint format {FORMAT_VERSION + 1}")],
)
@pytest.mark.parametrize("run_layout", [FL_FSDP_4, FederationLayout(2, 1), FederationLayout(4, 4)])
def test_a_checkpoint_without_a_format_or_of_another_is_refused_in_one_line(tmp_path, found, recorded, run_layout):
    """Before any other field is read, on the same layout, another one, or one group (which refuses it anyway)."""
    checkpoint = saved_checkpoint(tmp_path, FL_FSDP_4, llama())
    record_format(checkpoint, found)
    message = (
        rf"^resume_from_checkpoint={checkpoint} records {recorded} in fed_layout\.json, but this release of "
        rf"hf_fedshard loads format {FORMAT_VERSION} only\. Resume it with the hf_fedshard release that wrote it, "
        r"or start without resume_from_checkpoint\.$"
    )
    with pytest.raises(ConfigError, match=message) as err:
        check_resumable(
            checkpoint, run_layout, llama(64), run_layout.federated
        )  # another model too: the format is checked first
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("manifest", [False, True])
def test_the_resume_refuses_another_format_on_each_rank_before_any_collective(tmp_path, manifest):
    """`resumable_checkpoint` checks every candidate before its first collective: no process group exists here."""
    checkpoint = saved_checkpoint(tmp_path, FL_FSDP_4, llama())
    record_format(checkpoint, None)
    if manifest:
        files = describe_files(checkpoint, list_files(checkpoint))
        (tmp_path / MANIFEST_NAME).write_text(json.dumps({"files": files}))
    run = ResumeSettings(str(tmp_path.parent), auto_resume=False, groups_publish_apart=False, rank=0, writes=True)
    with pytest.raises(ConfigError, match=r"records no checkpoint format in fed_layout\.json, but this release"):
        resumable_checkpoint(checkpoint, run, FL_FSDP_4, llama())


def test_another_layout_still_needs_the_same_model_and_a_federation(tmp_path):
    checkpoint = saved_checkpoint(tmp_path, FL_FSDP_4, llama())
    with pytest.raises(ConfigError, match=r"holds a different model: llama with"):
        check_resumable(checkpoint, FederationLayout(2, 1), llama(64), federated=True)
    one_group = r"on WORLD_SIZE=2, and one group \(no federation\) does not resume a federated checkpoint\. Relaunch"
    with pytest.raises(ConfigError, match=one_group):
        check_resumable(checkpoint, FederationLayout(2, 2), llama(), federated=False)


def test_a_torchft_groups_checkpoint_resumes_on_another_group_size(tmp_path):
    """A launch per group holds one group: its checkpoint (2 ranks) resumes on 1 rank as one of a federation, and
    the same launch without federation refuses it."""
    checkpoint = saved_checkpoint(tmp_path, FederationLayout(2, 2), llama())
    check_resumable(checkpoint, FederationLayout(1, 1), llama(), federated=True)
    with pytest.raises(ConfigError, match=r"one group \(no federation\) does not resume a federated checkpoint"):
        check_resumable(checkpoint, FederationLayout(1, 1), llama(), federated=False)


def test_a_plain_trainer_checkpoint_is_refused(tmp_path):
    (tmp_path / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"has no fed_layout\.json: it was not written by a federated"):
        check_resumable(str(tmp_path), FL_FSDP_4, llama(), federated=True)


def test_latest_complete_checkpoint_skips_partial_ones(tmp_path):
    assert latest_complete_checkpoint(tmp_path / "missing") is None
    for name in ("checkpoint-2", "checkpoint-10", "tmp-checkpoint-12", "checkpoint-11"):
        (tmp_path / name).mkdir()
    for name in ("checkpoint-2", "checkpoint-10", "tmp-checkpoint-12"):
        (tmp_path / name / "trainer_state.json").write_text("{}")
    assert latest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")  # not 11 (no state), not 12


def make_args(tmp_path, **kwargs) -> FedShardTrainingArguments:
    return FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", fed_group_size=2, **kwargs)


@pytest.mark.parametrize(
    ("samples", "batch", "accumulation", "fails"),
    [(7, 2, 1, True), (8, 2, 1, False), (15, 2, 2, True), (16, 2, 2, False)],
)
def test_dataset_smaller_than_the_worlds_first_step(tmp_path, world4_no_setup, samples, batch, accumulation, fails):
    args = make_args(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation)
    if not fails:
        args.check_train_dataset_size(samples)
        return
    world_batch = batch * 4 * accumulation
    with pytest.raises(
        ConfigError,
        match=rf"^train_dataset has {samples} samples, fewer than the world's first optimizer step: "
        rf"per_device_train_batch_size\({batch}\) × WORLD_SIZE\(4\) × gradient_accumulation_steps\({accumulation}\)"
        rf" = {world_batch}\. Use a larger dataset",
    ):
        args.check_train_dataset_size(samples)


@pytest.mark.parametrize("timeout", [0, -5.0])
def test_fed_timeout_must_be_positive(tmp_path, world4_no_setup, timeout):
    with pytest.raises(ConfigError, match=rf"^fed_timeout_s={timeout}: it must be a positive number of seconds"):
        make_args(tmp_path, fed_timeout_s=timeout)


def test_auto_find_batch_size_is_refused_in_a_federation_and_kept_without_one(tmp_path, world4_no_setup):
    with pytest.raises(ConfigError, match=r"^auto_find_batch_size halves the batch of the rank that ran out of memory"):
        make_args(tmp_path, auto_find_batch_size=True)
    one_group = FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", auto_find_batch_size=True)
    assert one_group.auto_find_batch_size and not one_group.fed_layout.federated  # no federation: Trainer's own


@pytest.mark.parametrize(("max_steps", "warns"), [(3, True), (8, False), (-1, False)])
def test_max_steps_below_fed_sync_steps_warns(tmp_path, world4_no_setup, caplog, max_steps, warns):
    with caplog.at_level(logging.WARNING, logger="hf_fedshard"):
        make_args(tmp_path, max_steps=max_steps, fed_sync_steps=8)
    expected = (
        f"max_steps={max_steps} < fed_sync_steps=8: no averaging happens before the final one after step "
        f"{max_steps}. Lower --fed_sync_steps or raise --max_steps."
    )
    assert (expected in caplog.text) == warns


def test_fed_peer_ranks_pair_the_same_position_of_every_group():
    assert FederationLayout(8, 4, 2).fed_peer_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert FederationLayout(6, 2).fed_peer_ranks() == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.parametrize(
    ("group_size", "eval_strategy", "notice"),
    [
        (2, "no", "fed_eval_per_group has no effect without evaluations during training: set --eval_strategy steps"),
        (4, "steps", "fed_eval_per_group has no effect with one federation group"),
        (2, "steps", None),
    ],
)
def test_fed_eval_per_group_without_effect_says_why(
    tmp_path, world4_no_setup, caplog, group_size, eval_strategy, notice
):
    with caplog.at_level(logging.WARNING, logger="hf_fedshard"):
        FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", fed_group_size=group_size,
                                  eval_strategy=eval_strategy, fed_eval_per_group=True)  # fmt: skip
    if notice is None:
        assert "fed_eval_per_group" not in caplog.text
    else:
        assert notice in caplog.text


@pytest.mark.parametrize(("group_size", "says"), [(4, True), (2, False)])
def test_fed_async_checkpoint_with_one_group_says_it_has_no_effect(tmp_path, world4_no_setup, caplog, group_size, says):
    with caplog.at_level(logging.WARNING, logger="hf_fedshard"):
        FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", fed_group_size=group_size,
                                  fed_async_checkpoint=True)  # fmt: skip
    assert ("fed_async_checkpoint has no effect with one federation group" in caplog.text) == says


def test_one_group_refuses_a_federated_checkpoint(tmp_path, monkeypatch):
    """In-process, one rank without fed settings: the same one-line refusal, not Transformers' "Can't find"."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "checkpoint-4").mkdir()
    saved = saved_checkpoint(tmp_path / "checkpoint-4", FL_FSDP_4, llama())
    args = FedShardTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    trainer = FedShardTrainer(model=llama(), args=args, train_dataset=[{"input_ids": [1, 2], "labels": [1, 2]}] * 4)
    message = (
        r"was written with fed_group_size=2, fed_shard_size=2 on WORLD_SIZE=4, but this run has fed_group_size=1, "
        r"fed_shard_size=1 on WORLD_SIZE=1, and one group \(no federation\) does not resume a federated checkpoint\. "
        r"Relaunch on 4 ranks"
    )
    with pytest.raises(ConfigError, match=message):
        trainer.train(resume_from_checkpoint=saved)


def test_manifest_finds_missing_truncated_and_altered_files(tmp_path):
    for name, content in {"a.json": b"{}", "fed_group0/model/__0_0.distcp": b"x" * 100}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    files = describe_files(str(tmp_path), list_files(str(tmp_path)))
    assert list(files) == ["a.json", "fed_group0/model/__0_0.distcp"]
    assert files["fed_group0/model/__0_0.distcp"]["bytes"] == 100
    root = str(tmp_path)
    assert size_problem(root, files, files) is None and checksum_problem(root, files, files) is None
    shard = tmp_path / "fed_group0/model/__0_0.distcp"
    shard.write_bytes(b"x" * 99 + b"y")  # same size, other bytes
    assert size_problem(root, files, files) is None
    assert checksum_problem(root, files, files).startswith("fed_group0/model/__0_0.distcp does not match its checksum")
    shard.write_bytes(b"x" * 50)
    assert size_problem(root, files, files) == "fed_group0/model/__0_0.distcp has 50 bytes, the manifest says 100"
    shard.unlink()
    assert size_problem(root, files, files) == "fed_group0/model/__0_0.distcp is missing"


def test_damaged_checkpoints_are_renamed_aside_out_of_every_listing(tmp_path):
    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert set_aside(str(tmp_path / "checkpoint-4")) == str(tmp_path / "damaged-checkpoint-4")
    (tmp_path / "checkpoint-4").mkdir()  # the same step, saved and damaged again
    assert set_aside(str(tmp_path / "checkpoint-4")) == str(tmp_path / "damaged-checkpoint-4-2")
    assert complete_checkpoints(tmp_path) == [str(tmp_path / "checkpoint-2")]
    assert not list(tmp_path.glob("checkpoint-4*"))  # Trainer's rotation globs checkpoint-*


def test_card_says_when_groups_diverged():
    history = [{"step": 2, "fed_diverged_groups": 0}, {"step": 4, "fed_diverged_groups": 1},
               {"step": 5, "fed_diverged_groups": 1}, {"step": 9, "fed_diverged_groups": 3}]  # fmt: skip
    assert divergence_steps(history) == [4, 9]


def test_notices_are_said_once_and_by_rank_0_only(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_fedshard"):
        for rank in ("1", "0", "0"):
            monkeypatch.setenv("RANK", rank)
            notices.notice("turning on %s on rank %s", "FSDP2", "0" if rank == "0" else "other")
    assert caplog.text.count("hf_fedshard: turning on FSDP2 on rank 0") == 1
    assert "rank other" not in caplog.text


@pytest.mark.parametrize(
    ("samples", "batch", "drop_last", "hint"),
    [
        (24, 8, True, "Lower --per_device_eval_batch_size to 6 or less"),
        (3, 1, True, r"Use at least WORLD_SIZE\(4\) samples"),  # no batch size helps: say so
        (32, 8, True, None),
        (24, 8, False, None),
    ],
)
def test_evaluation_that_drop_last_leaves_without_a_batch(tmp_path, world4_no_setup, samples, batch, drop_last, hint):
    args = make_args(tmp_path, per_device_eval_batch_size=batch, dataloader_drop_last=drop_last)
    if hint is None:
        args.check_eval_dataset_size(samples)
        return
    with pytest.raises(
        ConfigError,
        match=rf"^eval_dataset has {samples} samples, fewer than one batch on every rank: "
        rf"per_device_eval_batch_size\({batch}\) × WORLD_SIZE\(4\) = {batch * 4} with dataloader_drop_last=True, "
        rf".*\. {hint}, or set --dataloader_drop_last false\.$",
    ):
        args.check_eval_dataset_size(samples)


def test_trainer_refuses_an_evaluation_without_a_batch(tmp_path, monkeypatch):
    """One process, 3 eval samples, batches of 4 dropped when short: evaluate() says why instead of no eval_loss."""
    for name in ("WORLD_SIZE", "ACCELERATE_USE_FSDP", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)
    args = FedShardTrainingArguments(
        output_dir=str(tmp_path), report_to="none", per_device_eval_batch_size=4, dataloader_drop_last=True
    )
    samples = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}] * 3
    trainer = FedShardTrainer(model=llama(), args=args, eval_dataset=samples)
    with pytest.raises(ConfigError, match=r"^Evaluation dataset has 3 samples, fewer than one batch on every rank"):
        trainer.evaluate()


def test_enable_jit_checkpoint_is_refused_in_a_federation_and_kept_without_one(tmp_path, world4_no_setup):
    """Each rank's SIGTERM timer fires at its own moment, so its JIT save would start at a step of its own; a
    federated checkpoint is a collective of every rank."""
    with pytest.raises(ConfigError, match=r"^enable_jit_checkpoint saves on the step at which each rank's own") as e:
        make_args(tmp_path, enable_jit_checkpoint=True)
    assert "--fed_async_checkpoint" in str(e.value) and "\n" not in str(e.value)
    one_group = FedShardTrainingArguments(output_dir=str(tmp_path), report_to="none", enable_jit_checkpoint=True)
    assert one_group.enable_jit_checkpoint and not one_group.fed_layout.federated
