"""Multi-process checks of FL+FSDP / FL+HSDP on gloo: real FSDP2 sharding, disjoint data, FedAvg on shards."""

from __future__ import annotations

import pytest
import torch

from ..asserts import labelled
from ..launch import SCRIPTS, torchrun, train_tiny

pytestmark = pytest.mark.timeout(900)

FL_FSDP = ["--fed_group_size", "2"]
FL_HSDP = ["--fed_group_size", "4", "--fed_shard_size", "2"]


# fl_fsdp_h2 (2 groups × 2 ranks, H=2, 4 steps) and ddp_4_ranks (3 steps) are tests/conftest.py's: test_plain_loop.py
# asserts on the same runs.


@pytest.fixture(scope="module")
def exactness_fl_fsdp(tmp_path_factory, ddp_4_ranks):
    """FL+FSDP with H=1 next to DDP (transformers.Trainer on CPU) over the same 4 ranks."""
    fed = train_tiny(4, tmp_path_factory.mktemp("fed"), [*FL_FSDP, "--fed_sync_steps", "1", "--max_steps", "3"])
    return fed, ddp_4_ranks


@pytest.fixture(scope="module")
def exactness_fl_hsdp(tmp_path_factory):
    """FL+HSDP (2 groups × 2 replicas × 2 shards, 2 samples a rank) with H=1 next to DDP on the same global batch
    of 16 samples, over 4 ranks of 4 samples (every sample holds as many tokens: the same mean loss)."""
    steps = ["--max_steps", "2"]
    fed = train_tiny(8, tmp_path_factory.mktemp("fed8"), [*FL_HSDP, "--fed_sync_steps", "1", *steps], 400)
    ddp_args = ["--trainer", "plain", "--use_cpu", "true", "--per_device_train_batch_size", "4", *steps]
    ddp = train_tiny(4, tmp_path_factory.mktemp("ddp4x4"), ddp_args)
    return fed, ddp


def assert_same_params(a: dict, b: dict, atol: float = 2e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-5, msg=labelled(name))


def test_fsdp2_shards_over_the_group_only(fl_fsdp_h2):
    for rank in fl_fsdp_h2:
        assert all(rank["is_dtensor"])
        assert rank["placements"] == ["S(0)"]
        assert rank["mesh_shape"] == [2]


def test_fl_hsdp_is_replicate_shard_inside_the_group(exactness_fl_hsdp):
    fed, _ = exactness_fl_hsdp
    for rank in fed:
        assert all(rank["is_dtensor"])
        assert rank["placements"] == ["R", "S(0)"]
        assert rank["mesh_shape"] == [2, 2]


def test_groups_read_disjoint_slices_of_the_data(fl_fsdp_h2):
    seen = [set(rank["seen"]) for rank in fl_fsdp_h2]
    assert all(len(s) == 8 for s in seen)  # 4 steps × batch 2 per rank
    assert len(set().union(*seen)) == 32  # no sample read twice in the first half epoch


def test_groups_identical_after_each_sync_and_different_between(fl_fsdp_h2):
    for a, b in [(0, 2), (1, 3)]:  # same shard position in group 0 and group 1
        ca, cb = fl_fsdp_h2[a]["checksums"], fl_fsdp_h2[b]["checksums"]
        for step in (2, 4):
            assert ca[step] == cb[step], step
        for step in (1, 3):
            assert ca[step] != cb[step], step
    assert_same_params(fl_fsdp_h2[0]["full_params"], fl_fsdp_h2[2]["full_params"], atol=0)


def test_hsdp_replicas_are_always_identical(exactness_fl_hsdp):
    fed, _ = exactness_fl_hsdp
    # rank = group × 4 + replica × 2 + shard: replicas of a group are ranks r and r + 2
    for group in (0, 4):
        for shard in (0, 1):
            assert fed[group + shard]["checksums"] == fed[group + 2 + shard]["checksums"]


def test_fl_fsdp_with_h1_equals_data_parallel(exactness_fl_fsdp):
    fed, ddp = exactness_fl_fsdp
    assert_same_params(fed[0]["full_params"], ddp[0]["full_params"])
    assert fed[0]["eval"]["eval_loss"] == pytest.approx(ddp[0]["eval"]["eval_loss"], abs=1e-5)


def test_fl_hsdp_with_h1_equals_data_parallel(exactness_fl_hsdp):
    fed, ddp = exactness_fl_hsdp
    assert_same_params(fed[0]["full_params"], ddp[0]["full_params"])


def test_federation_metrics_count_local_shard_bytes(fl_fsdp_h2):
    for rank in fl_fsdp_h2:
        shard_bytes = sum(t.numel() * t.element_size() for t in rank["local_params"].values())
        last = [h for h in rank["log_history"] if "fed_syncs" in h][-1]
        assert last["fed_syncs"] == 3  # the initial weights', then steps 2 and 4
        assert last["fed_inter_group_bytes"] == 3 * shard_bytes
        assert last["fed_sync_seconds"] > 0
        assert last["fed_sync_seconds_total"] > last["fed_sync_seconds"]  # two averagings


def test_perplexity_logged_and_identical_on_every_rank(fl_fsdp_h2):
    import math

    evals = [rank["eval"] for rank in fl_fsdp_h2]
    assert all(e["eval_perplexity"] == pytest.approx(math.exp(e["eval_loss"])) for e in evals)
    assert len({e["eval_perplexity"] for e in evals}) == 1
    train_logs = [h for h in fl_fsdp_h2[0]["log_history"] if "loss" in h]
    assert train_logs and all(h["perplexity"] == pytest.approx(math.exp(h["loss"])) for h in train_logs)


def test_one_group_is_trainer(tmp_path):
    """No federation: FedShardTrainer with FSDP2 (really sharded) follows Trainer's losses step by step."""
    steps = ["--max_steps", "4"]
    fsdp = train_tiny(2, tmp_path / "fsdp", ["--fsdp", "--use_cpu", "true", *steps])
    plain = train_tiny(2, tmp_path / "plain", ["--trainer", "plain", "--use_cpu", "true", *steps])
    assert all(fsdp[0]["is_dtensor"]) and fsdp[0]["mesh_shape"] == [2]
    losses = [[h["loss"] for h in run[0]["log_history"] if "loss" in h] for run in (fsdp, plain)]
    assert len(losses[0]) == 4
    assert losses[0] == pytest.approx(losses[1], abs=1e-4)
    assert not any("fed_syncs" in h for h in fsdp[0]["log_history"])


def test_error_on_every_rank_without_hang(tmp_path):
    """A model with nothing to train fails on all ranks with one clear line, and the job ends. 2 groups × 1 rank:
    the check runs as the trainer is built, before any process group or sharding, alike on every rank."""
    result = torchrun(2, SCRIPTS / "train_tiny.py",
                      ["--output_dir", tmp_path, "--dump_dir", tmp_path, "--fed_group_size", "1", "--freeze_all",
                       "true", "--report_to", "none"], timeout_s=120)  # fmt: skip
    assert result.returncode != 0
    assert "has no parameter with requires_grad=True" in result.stdout
