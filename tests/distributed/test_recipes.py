"""The recipes users run, end to end: `accelerate launch` with a CPU config, the card, LoRA, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ..launch import REPO, finish, torchrun

RECIPES = REPO / "recipes"
CONFIGS = REPO / "accelerate_configs"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
TINY_RUN = ["--model_size", "micro", "--block_size", "64", "--per_device_train_batch_size", "2",
            "--per_device_eval_batch_size", "4", "--max_eval_samples", "32", "--disable_tqdm", "true",
            "--report_to", "none", "--save_strategy", "no", "--fed_group_size", "2",
            "--fed_sync_steps", "2"]  # fmt: skip


def run(cmd: list, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    try:
        return subprocess.run(list(map(str, cmd)), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        raise TimeoutError(f"{cmd} hung for {timeout_s}s") from err


def accelerate_launch(
    config: str, script: str, args: list, timeout_s: float = 400, launch_args: tuple = ()
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIGS / config, *launch_args,
           RECIPES / script]  # fmt: skip
    result = run([*cmd, *args], timeout_s)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pretrain") / "tiny-fl-fsdp"
    args = ["--output_dir", out, "--max_steps", "6", "--eval_steps", "4", "--logging_steps", "2",
            "--fed_eval_per_group", "true", *TINY_RUN]  # fmt: skip
    accelerate_launch("fl_fsdp_cpu.yaml", "pretrain_clm.py", args)
    return out


@pytest.mark.timeout(600)
def test_pretrain_writes_model_tokenizer_card_and_plot(pretrained):
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results = json.loads((pretrained / "all_results.json").read_text())
    card = ModelCard.load(pretrained / "README.md")
    (result,) = card.data.eval_results
    assert result.metric_type == "perplexity"
    assert result.metric_value == pytest.approx(results["eval_perplexity"], rel=1e-4)
    assert {"hf_fedshard", "fl-fsdp"} <= set(card.data.tags)
    assert "| Federation groups | 2 |" in card.text and "| Inter-group syncs | 4 |" in card.text
    assert "| Time in inter-group averaging (s, rank 0) |" in card.text
    assert "### Training hyperparameters" in card.text and "### Framework versions" in card.text  # Trainer's card
    assert "wall_seconds" not in card.text.lower().replace(" ", "_")
    lines = card.text.splitlines()  # Trainer's guesses corrected: where the model started, the device
    assert "This model was trained from scratch on the shakespeare dataset." in lines
    assert "- distributed_type: multi-CPU" in lines and "More information needed" not in card.text
    assert (pretrained / "training_curves.png").stat().st_size > 10_000
    history = json.loads((pretrained / "trainer_state.json").read_text())["log_history"]
    (mid_eval,) = [h for h in history if "eval_loss" in h and h["step"] == 4]
    assert {"eval_group0_perplexity", "eval_group1_perplexity"} <= set(mid_eval)  # packed datasets.Dataset path
    model = AutoModelForCausalLM.from_pretrained(pretrained)  # one process, no distributed set-up
    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    assert model.config.vocab_size == len(tokenizer)
    assert not [p for p in pretrained.iterdir() if p.name.startswith("checkpoint")]


@pytest.mark.timeout(600)
def test_lora_sends_only_adapter_bytes(pretrained, tmp_path):
    """With the accelerate config's fsdp_cpu_ram_efficient_loading on, as for a big model: rank 0 alone reads the
    weights, the others wrap an empty model with LoRA (test_ram_efficient_loading.py pins the weights themselves)."""
    out = tmp_path / "lora"
    result = accelerate_launch("fl_fsdp_cpu.yaml", "finetune_lora.py",
                               ["--model_name_or_path", pretrained, "--output_dir", out, "--max_steps", "4",
                                "--eval_steps", "4", *TINY_RUN],
                               launch_args=("--fsdp_cpu_ram_efficient_loading", "true"))  # fmt: skip
    results = json.loads((out / "all_results.json").read_text())
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    fed = [h for h in history if "fed_syncs" in h][-1]
    # Every LoRA matrix splits evenly over the 2 shards: rank 0 sends half the adapter, in fp32, per sync.
    assert fed["fed_inter_group_bytes"] / fed["fed_syncs"] == 4 * results["trainable_parameters"] / 2
    assert results["trainable_fraction"] < 0.1
    assert "eval_before_perplexity" in results and "eval_perplexity" in results
    assert "inter-group bytes per averaging" in result.stdout
    assert (out / "adapter_model.safetensors").exists()
    card = (out / "README.md").read_text().splitlines()
    assert f"This model was fine-tuned from the local model `{pretrained}` on the kjv dataset." in card


@pytest.mark.timeout(600)
def test_sft_recipe_with_lora(pretrained, tmp_path):
    out = tmp_path / "sft"
    args = ["--model_name_or_path", pretrained, "--output_dir", out, "--max_steps", "4", "--eval_steps", "4",
            "--max_length", "64", "--use_peft", "true", "--fed_group_size", "2", "--fed_sync_steps", "2",
            "--per_device_train_batch_size", "2", "--max_eval_samples", "16", "--disable_tqdm", "true",
            "--report_to", "none"]  # fmt: skip
    result = accelerate_launch("fl_fsdp_cpu.yaml", "sft_trl.py", args)
    assert "inter-group bytes per rank:" in result.stdout and "(adapter," in result.stdout
    card = (out / "README.md").read_text()
    assert "TRL" in card and "| Federation groups | 2 |" in card
    assert "| Inter-group syncs | 3 |" in card  # steps 0, 2 and 4
    assert f"This model was fine-tuned from the local model `{pretrained}` on the kjv dataset." in card.splitlines()
    assert f'generator = pipeline("text-generation", model="{out}")' in card.splitlines()
    assert "[None]" not in card and 'model="None"' not in card and "licence" not in card
    assert "Slicing a flattened dim" not in result.stderr
    assert result.stderr.count("hf_fedshard: FL+FSDP: WORLD_SIZE(4)") == 1  # the group batch, once, by rank 0


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_accelerate_configs_are_valid(config):
    from accelerate.commands.config.config_args import load_config_from_file

    text = (CONFIGS / config).read_text()
    assert text.startswith("#"), "each config starts with a comment saying when to use it"
    loaded = load_config_from_file(str(CONFIGS / config))
    assert loaded.distributed_type == "FSDP" and loaded.fsdp_config["fsdp_version"] == 2
    assert yaml.safe_load(text)["num_processes"] == (4 if config.endswith("_cpu.yaml") else 8)


HELP = """
import runpy, sys
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    print(f"==== {script}", flush=True)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        print(f"==== exit {exit.code}", flush=True)
"""


def test_help_documents_every_argument():
    """Each recipe's ``--help`` as ``python recipe.py --help`` runs it (one interpreter for the three: its start-up
    is most of the cost), exits 0 and lists the federation and data settings."""
    scripts = ["pretrain_clm.py", "finetune_lora.py", "sft_trl.py"]
    result = run([sys.executable, "-c", HELP, *(RECIPES / s for s in scripts)], 120)
    assert result.returncode == 0, result.stderr
    helps = result.stdout.split("==== ")[1:]
    assert len(helps) == 2 * len(scripts), result.stdout[-3000:]
    for script, text, status in zip(scripts, helps[::2], helps[1::2], strict=True):
        assert text.startswith(str(RECIPES / script)) and status.strip() in ("exit 0", "exit None"), (script, status)
        length = "--max_length" if script == "sft_trl.py" else "--block_size"
        for name in ("--fed_group_size", "--fed_sync_steps", "--dataset_name", length, "--model_size"):
            assert name in text, (script, name)


BAD_INPUT = {  # name: (arguments, the error line's start); one process each, started together
    "dataset": (["--dataset_name", "no_such_dataset_hf_fedshard"],
                "error: --dataset_name=no_such_dataset_hf_fedshard could"),
    "train_file": (["--train_file", "missing.txt"], "error: --train_file/--validation_file missing.txt does not exist"),
    "model_size": (["--model_size", "huge"], "error: argument --model_size/--model-size: invalid choice: 'huge'"),
    "block_size": (["--train_file", "{text}", "--validation_file", "{text}", "--block_size", "512", "--vocab_size",
                    "300"], "error: --block_size=512 is larger than the whole train split"),
}  # fmt: skip


@pytest.fixture(scope="module")
def recipe_errors(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The pre-training recipe on one process with each of `BAD_INPUT` (all at once: most of each is start-up):
    every output folder and result."""
    root = tmp_path_factory.mktemp("bad_input")
    text = root / "short.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 3)
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    started = {}
    for name, (args, _) in BAD_INPUT.items():
        out = root / name / "out"
        cmd = [sys.executable, RECIPES / "pretrain_clm.py", "--output_dir", out, "--report_to", "none",
               *(str(a).format(text=text) for a in args)]  # fmt: skip
        started[name] = out, subprocess.Popen(list(map(str, cmd)), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    return {name: (out, finish(proc, 300)) for name, (out, proc) in started.items()}


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_ends_with_one_clear_line_and_writes_nothing(recipe_errors, name):
    out, result = recipe_errors[name]
    assert result.returncode != 0
    assert not out.exists() or not any(out.iterdir()), "nothing half-written in the output folder"
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert BAD_INPUT[name][1] in last, result.stderr[-3000:]
    if name == "block_size":
        assert "Lower --block_size" in last


def test_a_refused_setting_is_said_once_and_torchrun_reports_one_failure(tmp_path):
    """4 ranks, --fed_group_size 3: rank 0 says the one line, the others leave quietly on torchrun's SIGTERM, so
    its report lists rank 0 alone (it listed all four, each after its own copy of the line)."""
    out = tmp_path / "out"
    result = torchrun(4, RECIPES / "pretrain_clm.py", ["--fed_group_size", "3", "--output_dir", out], timeout_s=180)
    assert result.returncode != 0
    assert result.stdout.count("error: fed_group_size=3 must divide the world size") == 1, result.stdout[-3000:]
    assert "<NO_OTHER_FAILURES>" in result.stdout and "exitcode  : 2" in result.stdout, result.stdout[-3000:]
    assert not out.exists()
