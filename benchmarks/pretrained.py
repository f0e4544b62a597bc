"""The paper's perplexity claim on a real pretrained model: FL+FSDP against FSDP at equal tokens, SmolLM2-135M.

quality.py trains a `tiny` Llama from scratch; this study starts from SmolLM2-135M-Instruct (134,515,008 parameters,
offline: ``--model_name_or_path smollm2-135m-instruct``, hf_fedshard/tools/models.py) and continues its pre-training on
the offline Shakespeare corpus with the model's own tokenizer, through recipes/pretrain_clm.py launched by torchrun
(2 processes, gloo, CPU), once per method and seed:

- FL+FSDP: 2 federation groups × 1 rank (``--fed_group_size 1``), FedAvg every H = 4 steps (quality.py's H; the
  cluster studies' default is 8);
- FSDP: one group of both ranks (``--fed_group_size 2``: plain FSDP2 over the world);
- base: the model before any training, evaluated by the recipe itself after zero steps
  (``--max_steps 0 --num_train_epochs 0``), on the same eval set, once;
- on request (``--methods``), FL+FSDP topk 1%: FL+FSDP with the sparse payload (``--fed_sync_dtype topk``, 1% of
  each chunk of 4096 values, 2 bits, plain error feedback), against FL+FSDP's fp32 FedAvg at the same seed, with
  the inter-group bytes rank 0 sent per averaging (its ``fed_inter_group_bytes`` and ``fed_syncs``, step 0's plain
  mean left out).

Both methods share every hyperparameter (per-device batch, AdamW at a constant learning rate, clipping, seed, hence
data order), so they read the same tokens per step: 2 ranks × batch × block size. FL+FSDP's groups step on half of
FSDP's batch each and average their models every H steps. Eval perplexity on the first blocks of the held-out plays
after the last step (a multiple of H, so the groups end on one model); median (min–max) over seeds. Each run must
really shard (Accelerate turns FSDP into DDP on CPU unless hf_fedshard forces it): the set-up its model card names is
checked, and each rank's peak resident memory shows what it held. Beside the measurement, the cost model's projected
speedups (hf_fedshard.tools.cost) for SmolLM2-135M's shape on the paper's 512-GPU setting, next to Llama 3.1 8B's.

    python -m benchmarks.pretrained --quick     # 8 steps, seed 0, 32 eval blocks
    python -m benchmarks.pretrained             # 24 steps, seeds 0 1, 128 eval blocks of 64 tokens (~20 min)
    python -m benchmarks.pretrained --methods FL+FSDP "FL+FSDP topk 1%" --out benchmarks/results/pretrained_full_topk

The full mode's 24 steps, not 32: a short run here took 9–11 s per step while another job shared the 2 cores, so 32
steps × 4 runs projected to about 25 minutes, past the 20 set for this study. The recorded run then found the cores
quieter (5–6 s per step, 632 s in all), where ``--steps 32`` would have taken about 13 minutes.

Results (JSON, Markdown, PNG) go to ``--out`` (default benchmarks/results/pretrained_<quick|full>/);
``--report-only results.json`` rewrites the tables and the plot of a finished run without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.harness import REPO, process_tree
from benchmarks.harness.methods import busy_cpu_s, machine_load, others_cpu
from benchmarks.harness.report import bytes_per_averaging, median_range, run_record_lines, save_figure, spread
from benchmarks.harness.study import Study, new_parser, rewrite, validated
from hf_fedshard.tools.cost import leonardo_setting, llama_parameters, paper_setting, speedups
from hf_fedshard.tools.models import SMOLLM2

RECIPE = REPO / "recipes" / "pretrain_clm.py"
PROCESSES = 2  # FL+FSDP: 2 groups × 1 rank; FSDP: 1 group × 2 ranks
METHODS = ("FSDP", "FL+FSDP")
TOPK = "FL+FSDP topk 1%"
PAYLOAD = {TOPK: ["--fed_sync_dtype", "topk", "--fed_sync_density", "0.01", "--fed_sync_bits", "2"]}
CHOICES = (*METHODS, TOPK)
GROUP_SIZE = {"base": PROCESSES, "FSDP": PROCESSES, "FL+FSDP": 1, TOPK: 1}
# The set-up each run's model card must name (hf_fedshard.integrations.card.setup_description): "FSDP2 over 2 ranks",
# not "data parallel (DDP) over 2 ranks, no FSDP", Accelerate's silent fallback on CPU.
SETUP = {
    "base": f"FSDP2 over {PROCESSES} ranks",
    "FSDP": f"FSDP2 over {PROCESSES} ranks",
    "FL+FSDP": "FL+FSDP",
    TOPK: "FL+FSDP",
}
# SmolLM2-135M's shape (its config.json): tied embeddings, so the embedding shares the [final norm, head] unit.
SMOLLM2_SHAPE = dict(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, vocab=49_152, tied=True)
SMOLLM2_PARAMETERS = 134_515_008
NO_WORSE = 1.05  # "FL+FSDP eval ppl at equal tokens ≤ 1.05× FSDP": the tiers benchmark's target (report.targets)


@dataclass
class PretrainedConfig:
    """What every run shares; only the layout differs between FSDP and FL+FSDP."""

    seeds: tuple[int, ...] = (0, 1)
    methods: tuple[str, ...] = METHODS
    steps: int = 24
    sync_steps: int = 4  # H, FL+FSDP's
    block_size: int = 64
    batch_size: int = 4  # per device: 2 ranks × 4 × 64 = 512 tokens per step for both methods
    learning_rate: float = 1e-4  # AdamW, constant, no warm-up: continued pre-training, not from scratch
    max_grad_norm: float = 1.0
    eval_samples: int = 128  # blocks of block_size tokens from the start of the held-out plays
    eval_batch_size: int = 16  # per device
    timeout_s: float = 1200.0

    @property
    def tokens_per_step(self) -> int:
        """World tokens per optimizer step, the same for both methods."""
        return PROCESSES * self.batch_size * self.block_size

    def validate(self) -> None:
        if not self.seeds:
            raise ValueError("--seeds is empty: give at least one seed (the full mode runs 0 1).")
        if self.steps < self.sync_steps or self.steps % self.sync_steps:
            raise ValueError(
                f"--steps={self.steps} must be a positive multiple of H = --sync-steps {self.sync_steps}, so that "
                "FL+FSDP's last step averages and its groups are evaluated on one model."
            )
        if self.eval_samples < 1 or self.eval_samples % (PROCESSES * self.eval_batch_size):
            raise ValueError(
                f"--eval-samples={self.eval_samples} must be a positive multiple of {PROCESSES} ranks × the per-device "
                f"eval batch {self.eval_batch_size}, so that every run reads the whole eval set in full batches."
            )


def run_args(cfg: PretrainedConfig, method: str, seed: int) -> list[str]:
    """recipes/pretrain_clm.py's arguments of one run (``method``: base, FSDP or FL+FSDP), less the output folder."""
    steps = ["--max_steps", "0", "--num_train_epochs", "0"] if method == "base" else ["--max_steps", str(cfg.steps)]
    fed = ["--fed_sync_steps", str(cfg.sync_steps), *PAYLOAD.get(method, [])] if GROUP_SIZE[method] == 1 else []
    return [
        "--model_name_or_path", SMOLLM2, "--dataset_name", "shakespeare", "--block_size", str(cfg.block_size),
        "--per_device_train_batch_size", str(cfg.batch_size), "--per_device_eval_batch_size",
        str(cfg.eval_batch_size), "--max_eval_samples", str(cfg.eval_samples), *steps,
        "--learning_rate", str(cfg.learning_rate), "--lr_scheduler_type", "constant", "--warmup_steps", "0",
        "--weight_decay", "0", "--max_grad_norm", str(cfg.max_grad_norm), "--seed", str(seed),
        "--eval_strategy", "no", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
        "--disable_tqdm", "true", "--average_tokens_across_devices", "false", "--dataloader_drop_last", "true",
        "--fed_group_size", str(GROUP_SIZE[method]), *fed,
    ]  # fmt: skip


def rank_peaks(launcher: int) -> dict[int, int]:
    """Peak resident memory (``VmHWM``, bytes) so far of each rank of the launch ``launcher``, by its ``RANK``."""
    peaks = {}
    for pid in process_tree.descendants(launcher):
        with contextlib.suppress(OSError, ValueError, StopIteration):
            if RECIPE.name.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = int(next(e for e in env if e.startswith(b"RANK="))[5:])
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            peaks[rank] = 1024 * int(next(line for line in status if line.startswith("VmHWM:")).split()[1])
    return peaks


def launch(cmd: list[str], env: dict[str, str], timeout_s: float, log: Path) -> tuple[int, dict[int, int]]:
    """Run a torchrun launch to its end (killed with its ranks past ``timeout_s``), its output into ``log``; its exit
    status and each rank's peak resident memory, read every second while it runs."""
    peaks: dict[int, int] = {}
    with log.open("w") as out:
        proc = process_tree.popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(1.0):
                for rank, peak in rank_peaks(proc.pid).items():
                    peaks[rank] = max(peak, peaks.get(rank, 0))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process_tree.stop(proc)
        finally:
            stop.set()
            sampler.join()
    return proc.returncode, peaks


def card_setup(card: Path) -> str:
    """The set-up the run's model card names in its table (``| Method | FSDP2 over 2 ranks |``)."""
    row = next((line for line in card.read_text().splitlines() if line.startswith("| Method |")), "| Method | ? |")
    return row.split("|")[2].strip()


def run_one(cfg: PretrainedConfig, method: str, seed: int, work: Path) -> dict:
    """One launch of the recipe; its eval perplexity, time per step, the set-up it ran and each rank's peak memory.

    Raises if the run failed or its model card names another set-up than the method's (FSDP silently turned DDP)."""
    run_dir = work / f"{method.replace('+', '_').replace(' ', '_').replace('%', 'pc')}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={PROCESSES}",
           str(RECIPE), "--output_dir", str(run_dir / "out"), *run_args(cfg, method, seed)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    load_before, cpu, start = os.getloadavg(), busy_cpu_s(), time.monotonic()
    code, peaks = launch(cmd, env, cfg.timeout_s, run_dir / "log.txt")
    wall_s = time.monotonic() - start
    log = (run_dir / "log.txt").read_text()
    if code:
        raise RuntimeError(f"{method} seed {seed} failed (exit {code}; log {run_dir / 'log.txt'}):\n{log[-4000:]}")
    out = run_dir / "out"
    metrics = json.loads((out / "all_results.json").read_text())
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    setup = card_setup(out / "README.md")
    if not setup.startswith(SETUP[method]):
        raise RuntimeError(f"{method} seed {seed} ran as {setup!r}, not {SETUP[method]!r}: it did not shard as asked.")
    (out / "model.safetensors").unlink(missing_ok=True)  # 538 MB per run, of no use to the study
    layout = next((line for line in log.splitlines() if "WORLD_SIZE(" in line), "")
    steps = cfg.steps if method != "base" else 0
    print(f"  {method:<8} seed {seed}: eval ppl {math.exp(metrics['eval_loss']):.2f} ({wall_s:.0f} s)", flush=True)
    return {
        "method": method, "seed": seed, "steps": steps, "tokens": steps * cfg.tokens_per_step,
        "eval_loss": metrics["eval_loss"], "eval_perplexity": math.exp(metrics["eval_loss"]),
        "train_runtime_s": metrics["train_runtime"], "s_per_step": metrics["train_runtime"] / steps if steps else None,
        "eval_runtime_s": metrics["eval_runtime"], "wall_s": round(wall_s, 1),
        "train_losses": [h["loss"] for h in history if "loss" in h],
        "bytes_per_averaging": bytes_per_averaging(history),
        "setup": setup, "layout_line": layout.removeprefix("hf_fedshard: "),
        "peak_rss_bytes_per_rank": [peaks[r] for r in sorted(peaks)],
        "load_1_5_15_before": [round(x, 2) for x in load_before], **others_cpu(cpu, wall_s),
    }  # fmt: skip


def summarize(results: dict) -> dict:
    """Per method, median and range over seeds; FL+FSDP ÷ FSDP per seed (same seed, same tokens) and the verdict."""
    runs = results["runs"]
    base = next(r for r in runs if r["method"] == "base")["eval_perplexity"]
    rows = []
    for method in ("base", *results["config"].get("methods", METHODS)):
        mine = [r for r in runs if r["method"] == method]
        rows.append({
            "method": method, "setup": mine[0]["setup"], "seeds": [r["seed"] for r in mine],
            "eval_perplexity": spread([r["eval_perplexity"] for r in mine]),
            "per_seed": [r["eval_perplexity"] for r in mine],
            "vs_base": spread([r["eval_perplexity"] / base for r in mine]),
            "s_per_step": spread([r["s_per_step"] for r in mine]) if method != "base" else None,
            "peak_rss_bytes": spread([p for r in mine for p in r["peak_rss_bytes_per_rank"]]),
            "batch_samples": GROUP_SIZE[method] * results["config"]["batch_size"] if method != "base" else None,
            "bytes_per_averaging": mine[0].get("bytes_per_averaging"),
        })  # fmt: skip
    ratios = paired(runs, "FL+FSDP", "FSDP")
    return {"base_perplexity": base, "rows": rows, "fl_over_fsdp": ratios, "verdict": verdict(ratios),
            "topk_over_fp32": paired(runs, TOPK, "FL+FSDP")}  # fmt: skip


def paired(runs: list[dict], method: str, reference: str) -> list[float]:
    """``method``'s eval perplexity ÷ ``reference``'s, per seed both ran (same seed, same tokens)."""
    ref = {r["seed"]: r["eval_perplexity"] for r in runs if r["method"] == reference}
    return [r["eval_perplexity"] / ref[r["seed"]] for r in runs if r["method"] == method and r["seed"] in ref]


def verdict(ratios: list[float]) -> str:
    """The paper's claim against FL+FSDP ÷ FSDP eval perplexity (one ratio per seed): lower for every seed, and no
    worse than `NO_WORSE` × FSDP's for any."""
    if not ratios:
        return "not measured"
    if all(r < 1 for r in ratios):
        lower = "reproduced, lower than FSDP's for every seed"
    elif all(r >= 1 for r in ratios):
        lower = "not reproduced, not lower than FSDP's for any seed"
    else:
        lower = "not settled, lower than FSDP's for some seeds and not for others"
    no_worse = "met" if max(ratios) <= NO_WORSE else "missed"
    return f"lower perplexity: {lower}; no worse (≤ {NO_WORSE:g}× FSDP's for every seed): {no_worse}"


def projection() -> list[dict]:
    """The cost model's speedups (serial model) on the paper's 512-GPU setting, on two tiers (`paper_setting`) and on
    Leonardo's three (`leonardo_setting`, FedAvg in bf16), for Llama 3.1 8B (the tool's default) and SmolLM2-135M."""
    params, once = llama_parameters(**SMOLLM2_SHAPE)
    if params != SMOLLM2_PARAMETERS:
        raise ValueError(f"SmolLM2-135M's shape gives {params:,} parameters, not {SMOLLM2_PARAMETERS:,}.")
    rows = []
    for tiers, make in (("two tiers", paper_setting), ("three tiers (Leonardo)", leonardo_setting)):
        setting = make()
        # Tied embeddings: the blocks and one unit of [embedding, final norm, head] (Llama 3.1 8B: blocks + 2).
        smollm2 = replace(setting.model, params=params, once_params=once, units=SMOLLM2_SHAPE["layers"] + 1)
        for name, model in (("Llama 3.1 8B", setting.model), ("SmolLM2-135M", smollm2)):
            costs = replace(setting, model=model).costs()
            serial = speedups(costs)
            rows.append({
                "model": name, "tiers": tiers, "params": model.params, "world_size": setting.world_size,
                "nodes": setting.world_size // setting.ranks_per_node, "ranks_per_node": setting.ranks_per_node,
                "sync_steps": setting.sync_steps, "compute_s": costs["FSDP"].compute_s,
                "fsdp_comm_s": costs["FSDP"].comm_s, "fl_fsdp_over_fsdp": serial["FL+FSDP"],
                "fl_hsdp_over_hsdp": speedups(costs, "HSDP")["FL+HSDP"], "fl_hsdp_over_fsdp": serial["FL+HSDP"],
            })  # fmt: skip
    return rows


def _mb(nbytes: float) -> float:
    return nbytes / 1e6


def markdown(results: dict) -> str:
    cfg, summary = results["config"], results["summary"]
    tokens = cfg["steps"] * PROCESSES * cfg["batch_size"] * cfg["block_size"]
    lines = [
        f"SmolLM2-135M-Instruct ({SMOLLM2_PARAMETERS:,} parameters, fp32) continues pre-training on Shakespeare "
        f"through recipes/pretrain_clm.py, torchrun with {PROCESSES} processes (gloo, CPU): {cfg['steps']} optimizer "
        f"steps of {PROCESSES} ranks × {cfg['batch_size']} × {cfg['block_size']} tokens ({tokens:,} tokens per run), "
        f"AdamW at a constant {cfg['learning_rate']:g}, clipping {cfg['max_grad_norm']:g}, no weight decay; FL+FSDP: "
        f"{PROCESSES} groups × 1 rank, FedAvg every {cfg['sync_steps']} steps{_others(cfg)}. Eval "
        f"perplexity on the first {cfg['eval_samples']} blocks of the held-out plays "
        f"({cfg['eval_samples'] * cfg['block_size']:,} tokens) after the last step: median (min–max) over seeds "
        f"{', '.join(map(str, cfg['seeds']))}; base: the model before training, same eval set. s/step: the trainer's "
        "train_runtime ÷ steps. Peak RSS: each rank's peak resident memory, median (min–max) over ranks and seeds.",
        "",
        "| method | set-up (its model card) | batch per update (samples) | eval ppl | per seed | ÷ base | s/step | "
        "peak RSS per rank (MB) | inter-group bytes per averaging per rank |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in summary["rows"]:
        batch = "—" if row["batch_samples"] is None else str(row["batch_samples"])
        per_seed = ", ".join(f"{p:.2f}" for p in row["per_seed"]) if row["method"] != "base" else "—"
        lines.append(
            f"| {row['method']} | {row['setup']} | {batch} | {median_range(row['eval_perplexity'])} | {per_seed} | "
            f"{median_range(row['vs_base'], '.3f')} | {median_range(row['s_per_step'], '.1f')} | "
            f"{median_range(row['peak_rss_bytes'], '.0f', 1e-6)} | {_bytes_cell(row.get('bytes_per_averaging'))} |"
        )
    seeds = ", ".join(map(str, cfg["seeds"]))
    for name, ratios, after in (
        ("FL+FSDP ÷ FSDP", summary["fl_over_fsdp"], f"The paper's claim at equal tokens: **{summary['verdict']}**."),
        (f"{TOPK} ÷ FL+FSDP (fp32)", summary.get("topk_over_fp32", []), "The sparse payload's cost at equal tokens."),
    ):
        if ratios:
            median = f" (median {statistics.median(ratios):.4f})" if len(ratios) > 1 else ""
            lines += ["", f"{name} eval perplexity, same seed (seeds {seeds}): {', '.join(f'{r:.4f}' for r in ratios)}"
                      f"{median}. {after}"]  # fmt: skip
    lines += [
        "",
        "Cost model (`hf_fedshard.tools.cost`, serial model, not a measurement): projected speedup on the paper's "
        "setting, 512 A100 = 128 nodes × 4, H = 8, 2 × 2048 tokens per GPU per step, MFU 0.4; two tiers: 200 Gb/s "
        "per node; three tiers: Leonardo's cells of 8 nodes (assumed), FedAvg in bf16.",
        "",
        "| model | parameters | network | compute s/step | FSDP comm s/step | FL+FSDP ÷ FSDP | FL+HSDP ÷ HSDP | "
        "FL+HSDP ÷ FSDP |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p in results["projection"]:
        lines.append(
            f"| {p['model']} | {p['params']:,} | {p['tiers']} | {p['compute_s']:.3f} | {p['fsdp_comm_s']:.3f} | "
            f"{p['fl_fsdp_over_fsdp']:.2f}× | {p['fl_hsdp_over_hsdp']:.2f}× | {p['fl_hsdp_over_fsdp']:.2f}× |"
        )
    machine = results["machine"]
    load = machine["before"]["loadavg_1_5_15"]
    lines += [
        "",
        f"Machine: {machine['before']['cpus']} CPUs, load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
        "(1 / 5 / 15 min) before the study; per run (method seed: 1-minute load before it, cores other processes "
        "kept busy during it): "
        + "; ".join(
            f"{r['method']} {r['seed']}: {r['load_1_5_15_before'][0]:.2f}, {r['other_processes_cores']:.2f}"
            for r in results["runs"]
        )
        + ".",
    ]
    lines += run_record_lines(results)
    return "\n".join(lines)


def _others(cfg: dict) -> str:
    """The description of the runs beside FL+FSDP's fp32 FedAvg: FSDP's layout, the sparse payload's settings."""
    methods = cfg.get("methods", METHODS)
    return (f"; FSDP: one FSDP2 group of {PROCESSES} ranks" if "FSDP" in methods else "") + (
        f"; {TOPK}: the same with {' '.join(PAYLOAD[TOPK])} (chunks of 4,096 values, plain error feedback)"
        if TOPK in methods else "")  # fmt: skip


def _bytes_cell(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def plot(results: dict, out: Path) -> Path:
    """Eval perplexity per method and seed (the base model's in the title), and the logged training loss per step."""
    import matplotlib

    matplotlib.use("Agg")  # as report.new_axes, with two panels
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    methods = list(results["config"].get("methods", METHODS))
    by_seed = {(r["method"], r["seed"]): r["eval_perplexity"] for r in results["runs"]}
    for i, seed in enumerate(results["config"]["seeds"]):  # solid, dotted: the seeds, as on the right
        values = [by_seed[(m, seed)] for m in methods]
        left.plot(range(len(methods)), values, "-" if i == 0 else ":", color="black", label=f"seed {seed}")
        left.scatter(range(len(methods)), values, color=[f"C{x}" for x in range(len(methods))], zorder=3)
    left.set_xticks(range(len(methods)), methods, fontsize=7)
    left.set_xlim(-0.4, len(methods) - 0.6)
    left.set_ylabel("eval perplexity after the last step")
    base = results["summary"]["base_perplexity"]
    left.set_title(f"Each seed (same tokens for every method); base model {base:.2f}", fontsize=9)
    left.legend(fontsize=8)
    for run in results["runs"]:
        if run["method"] in methods:
            color = f"C{methods.index(run['method'])}"
            style = "-" if run["seed"] == results["config"]["seeds"][0] else ":"  # colours: the methods
            label, losses = f"{run['method']} seed {run['seed']}", run["train_losses"]
            right.plot(range(1, len(losses) + 1), losses, style, color=color, label=label)
    right.set_xlabel("optimizer step")
    right.set_ylabel("training loss as logged")
    right.set_title(f"{results['config']['tokens_per_step']} world tokens per step, every method", fontsize=9)
    right.legend(fontsize=7)
    return save_figure(fig, out / "perplexity.png")


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="8 steps, seed 0, 32 eval blocks.")
    p.add_argument("--seeds", type=int, nargs="+", help="Seeds (default 0 1; quick 0).")
    p.add_argument("--methods", nargs="+", choices=CHOICES, help=f"Default: {' '.join(METHODS)}.")
    p.add_argument("--steps", type=int, help="Optimizer steps per run, a multiple of H (default 24; quick 8).")
    p.add_argument("--sync-steps", type=int, default=4, help="H: FL+FSDP's steps between two averagings.")
    p.add_argument("--batch-size", type=int, default=4, help="Per-device batch, blocks of 64 tokens.")
    p.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW's, constant, both methods.")
    p.add_argument("--eval-samples", type=int, help="Eval blocks from the held-out plays (default 128; quick 32).")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="Bound on each run.")
    p.add_argument("--out", type=Path, help="Results folder (default benchmarks/results/pretrained_<quick|full>).")
    p.add_argument("--work", type=Path, help="Keep every run's log and output here (default: a temporary folder).")
    p.add_argument("--report-only", type=Path, help="Rewrite the tables and plot of this results.json; run nothing.")
    return p


def config_from_args(args: argparse.Namespace) -> PretrainedConfig:
    quick = args.quick
    return validated(
        PretrainedConfig(
            seeds=tuple(args.seeds or ((0,) if quick else (0, 1))),
            methods=tuple(args.methods or METHODS),
            steps=args.steps or (8 if quick else 24),
            sync_steps=args.sync_steps,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            eval_samples=args.eval_samples or (32 if quick else 128),
            timeout_s=args.timeout_s,
        )
    )


def main(argv: list[str] | None = None) -> int:
    study = Study("pretrained", make_parser(), argv)
    if study.args.report_only:
        return rewrite(study.args.report_only, summarize, markdown, plot)
    cfg = config_from_args(study.args)
    projected = projection()
    with study.running() as work:
        before = machine_load()
        runs = [run_one(cfg, "base", cfg.seeds[0], work)]
        runs += [run_one(cfg, method, seed, work) for seed in cfg.seeds for method in cfg.methods]
    results = {"config": {**asdict(cfg), "tokens_per_step": cfg.tokens_per_step}, "runs": runs,
               "projection": projected, "machine": {"before": before}}  # fmt: skip
    results["summary"] = summarize(results)
    return study.finish(results, markdown, plot)


if __name__ == "__main__":
    raise SystemExit(main())
