"""hf_fedshard with TRL's SFTTrainer on 4 gloo ranks: FedShardSFTTrainer next to SFTTrainer
(tests/scripts/train_sft.py), the metric gathers inside a group, and LoRA through SFTTrainer's peft_config. The
composition checks (base order, overrides that still run, the ImportError without TRL) are tests/unit/test_trl.py."""

from __future__ import annotations

import pytest
import torch

from ..asserts import labelled
from ..launch import SCRIPTS, SGD, torchrun

pytest.importorskip("trl")

SFT_SGD = [*SGD, "--bf16", "false"]  # SFTConfig turns bf16 on by default; DDP equality needs fp32 everywhere


def run_sft(nproc: int, out, args: list[str], timeout_s: float = 300) -> list[dict]:
    dump = out / "dump"
    result = torchrun(nproc, SCRIPTS / "train_sft.py",
                      ["--output_dir", out, "--dump_dir", dump, *SFT_SGD, *args], timeout_s)  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:]
    return [torch.load(dump / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.fixture(scope="module")
def sft_exactness(tmp_path_factory):
    """FedShardSFTTrainer (2 groups × 2 ranks, H=1) next to SFTTrainer under DDP on the same 4 ranks."""
    steps = ["--max_steps", "3"]
    fed = run_sft(4, tmp_path_factory.mktemp("sft_fed"), ["--fed_group_size", "2", "--fed_sync_steps", "1", *steps])
    ddp = run_sft(4, tmp_path_factory.mktemp("sft_ddp"), ["--trainer", "plain", "--use_cpu", "true", *steps])
    return fed, ddp


@pytest.fixture(scope="module")
def sft_lora(tmp_path_factory):
    """LoRA through SFTTrainer's peft_config: 2 groups × 2 ranks, H=4, logs every 4 steps, a checkpoint at step 4."""
    out = tmp_path_factory.mktemp("sft_lora")
    args = ["--use_peft", "true", "--fed_group_size", "2", "--fed_sync_steps", "4", "--max_steps", "4",
            "--logging_steps", "4", "--save_strategy", "steps", "--save_steps", "4"]  # fmt: skip
    return out, run_sft(4, out, args)


@pytest.mark.timeout(900)
def test_fed_sft_with_h1_equals_sft_trainer_under_ddp(sft_exactness):
    fed, ddp = sft_exactness
    assert fed[0]["mro"][:2] == ["FedShardSFTTrainer", "SFTTrainer"]
    assert fed[0]["full_params"].keys() == ddp[0]["full_params"].keys()
    for name, value in fed[0]["full_params"].items():
        torch.testing.assert_close(value, ddp[0]["full_params"][name], atol=1e-5, rtol=1e-5, msg=labelled(name))
    assert fed[0]["eval"]["eval_loss"] == pytest.approx(ddp[0]["eval"]["eval_loss"], abs=1e-5)
    for run in (fed, ddp):  # SFTTrainer's own log still runs, and counts the world's tokens
        logs = [h for h in run[0]["log_history"] if "loss" in h]
        assert [h["num_tokens"] for h in logs] == [4 * 2 * 16 * h["step"] for h in logs]
        assert all(0 <= h["mean_token_accuracy"] <= 1 for h in logs)
        assert [rank["eval"]["eval_num_tokens"] for rank in run] == [4 * 2 * 16 * 3] * 4  # and the evaluation's


@pytest.mark.timeout(900)
def test_sft_metric_gathers_stay_inside_the_group(sft_exactness, sft_lora):
    _, ddp = sft_exactness
    _, lora = sft_lora
    # Stock SFTTrainer gathers its metrics over the world at every step...
    assert all(ddp[0]["cross_group_bytes"].get(step, 0) > 0 for step in (1, 2, 3))
    # ...FedShardSFTTrainer over the group: nothing crosses groups between averagings and logs (H = logging = 4).
    for rank in lora:
        assert [rank["cross_group_bytes"].get(step, 0) for step in (1, 2, 3)] == [0, 0, 0]
        assert rank["cross_group_bytes"][4] > 0
        # Step 0: the initial weights' plain mean. Step 4, the last: the averaging's control all-reduce and its
        # exchange, the control all-reduce that publishes its norms at the end, TRL's metrics at the log; the
        # divergence check before the checkpoint needs none right after an averaging. Steps 1-3: none.
        assert rank["engine_calls"] == {0: 1, 4: 4}


@pytest.mark.timeout(900)
def test_lora_through_sft_averages_only_the_adapter(sft_lora):
    out, lora = sft_lora
    for rank in lora:
        assert rank["trainable"] and all("lora_" in name for name in rank["trainable"])
        adapter_bytes = sum(rank["local_params"][n].numel() * 4 for n in rank["trainable"])
        (last,) = [h for h in rank["log_history"] if "fed_syncs" in h][-1:]
        assert last["fed_inter_group_bytes"] == last["fed_syncs"] * adapter_bytes
        for name, value in rank["full_params"].items():  # the frozen base model never moved
            if name not in rank["trainable"]:
                base = name.replace("base_model.model.", "").replace(".base_layer", "")
                torch.testing.assert_close(value, rank["initial_params"][base], atol=0, rtol=0, msg=labelled(name))
    for a, b in [(0, 2), (1, 3)]:  # groups hold the same adapter after the final averaging
        for name in lora[a]["trainable"]:
            torch.testing.assert_close(
                lora[a]["local_params"][name],
                lora[b]["local_params"][name],
                atol=0,
                rtol=0,
                msg=labelled(f"{name}, ranks {a} and {b}"),
            )
    card = (out / "README.md").read_text()  # SFTTrainer's checkpoint-time card, with hf_fedshard's section
    assert (out / "checkpoint-4").is_dir()
    assert "TRL" in card and "## Training with hf_fedshard" in card and "| Federation groups | 2 |" in card
