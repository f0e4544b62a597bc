"""Each rank's peak host memory while a pretrained model is loaded and sharded, with and without Accelerate's
``cpu_ram_efficient_loading``, under FL+FSDP (2 groups × 2 ranks, gloo, this machine's CPUs).

Every rank builds the model as recipes/pretrain_clm.py does (`build_model`: under the setting, ranks other than 0
build it empty and read no weights), hands it to `FedShardTrainer`, and reads its peak RSS (``VmHWM``) as training
begins, right after Accelerate prepared the model (sharded it, and under the setting broadcast rank 0's weights);
nothing is trained. The setting is given as torchrun users give it: ``fsdp_config={"cpu_ram_efficient_loading":
True}``. Two configurations of SmolLM2-135M-Instruct (134.5 M parameters, ``--model_name_or_path
smollm2-135m-instruct``):

- ``fp32``: the converted fp32 folder, no mixed precision (the CPU accelerate configs);
- ``bf16``: a bf16 copy of it (the dtype big checkpoints ship in) with ``--bf16`` mixed precision (the GPU configs'
  setting), where Accelerate upcasts the parameters to fp32 master weights before sharding them.

Each repetition runs every configuration off, then on, so a drift in the machine's load hits both alike; every
figure is the median over repetitions with its range. The peak RSS counts the pages of the mmap'd weights file a
rank touched: they are page cache, shared by the ranks of a machine, so the sum over ranks overstates the host's
total by up to a file per rank (results.json also holds each rank's RSS split into anonymous and file pages after
preparing).

    python -m benchmarks.loading_memory            # 2 repetitions: 8 launches of 4 ranks, about 6 minutes
    python -m benchmarks.loading_memory --quick    # a saved tiny Llama, 1 repetition (the harness, not figures)
    python -m benchmarks.loading_memory --report-only benchmarks/results/loading_memory_full/results.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.harness import REPO, process_tree
from benchmarks.harness.report import median_range, run_record_lines, spread, table_head
from benchmarks.harness.study import Study, add_folder_options, new_parser, rewrite
from hf_fedshard.tools.models import SMOLLM2, llama_config, smollm2_folder

SETTINGS = ("off", "on")
RANKS = 4  # 2 groups × 2 ranks
STATUS_FIELDS = {"VmHWM": "peak_mib", "VmRSS": "rss_mib", "RssAnon": "anon_mib", "RssFile": "file_mib"}


def memory_mib() -> dict[str, float]:
    """This process's peak and current RSS, and the current RSS's anonymous and file-backed parts, in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[key].split()[0]) / 1024 for key, name in STATUS_FIELDS.items()}  # kB → MiB


def worker(argv: list[str]) -> None:
    """On each rank (under torchrun): build the model as the recipes do, prepare it in `FedShardTrainer`, record."""
    import torch
    from transformers import TrainerCallback

    from hf_fedshard import FedShardTrainer, FedShardTrainingArguments
    from hf_fedshard.integrations.fsdp import loads_weights
    from hf_fedshard.tools.models import build_model

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--setting", choices=SETTINGS, required=True)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    opts = p.parse_args(argv)

    class Prepared(Exception):
        """Raised as training begins: the model is prepared, nothing more is measured."""

    class StopWhenPrepared(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            raise Prepared

    ram_efficient = {"cpu_ram_efficient_loading": True} if opts.setting == "on" else {}
    args = FedShardTrainingArguments(
        output_dir=str(opts.out / "trainer"), fed_group_size=2, fsdp_config=ram_efficient or None, bf16=opts.bf16,
        max_steps=1, per_device_train_batch_size=1, report_to="none", save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    start = memory_mib()  # the process group and the libraries, before any model
    clock = time.perf_counter()
    model = build_model("micro", 0, 0, opts.model, empty=not loads_weights(args))
    on_meta = all(p.is_meta for p in model.parameters())
    loaded = memory_mib()
    tokens = [{"input_ids": torch.zeros(8, dtype=torch.long), "labels": torch.zeros(8, dtype=torch.long)}] * 8
    trainer = FedShardTrainer(model=model, args=args, train_dataset=tokens)
    trainer.callback_handler.callbacks.insert(0, StopWhenPrepared())  # before the first averaging
    with contextlib.suppress(Prepared):
        trainer.train()
    record = {
        "rank": args.process_index,
        "on_meta_before_prepare": on_meta,
        "load_and_prepare_s": round(time.perf_counter() - clock, 2),
        "start": start,
        "loaded": loaded,
        "prepared": memory_mib(),
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"rank{args.process_index}.json").write_text(json.dumps(record))


def launch(model: Path, setting: str, bf16: bool, out: Path, timeout_s: float) -> list[dict]:
    """One measurement: `worker` on 4 local ranks (torchrun); every rank's record."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", __file__,
           "--worker", "--model", str(model), "--setting", setting, "--out", str(out),
           *(["--bf16"] if bf16 else [])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    result = process_tree.run(cmd, timeout_s, env=env, capture_output=True, text=True)
    if result.returncode:
        log = result.stdout[-3000:] + result.stderr[-3000:]
        raise RuntimeError(f"cpu_ram_efficient_loading {setting}, bf16={bf16}: exit {result.returncode}\n{log}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def tiny_llama(out: Path) -> Path:
    """The ``micro`` preset with tied embeddings, saved: ``--quick``'s model."""
    from transformers import AutoModelForCausalLM

    config = llama_config("micro", vocab_size=128, max_position_embeddings=16)
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def bf16_copy(folder: Path, out: Path) -> Path:
    """``folder``'s model saved in bf16, as big checkpoints ship."""
    import torch
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(out)
    return out


def summarize(runs: list[dict]) -> dict:
    """Per configuration and setting: each rank's peak RSS and the ranks' sum over the repetitions (median, range)."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        for setting in SETTINGS:
            records = [r["ranks"] for r in runs if (r["config"], r["setting"]) == (config, setting)]
            peaks = [[round(rank["prepared"]["peak_mib"]) for rank in ranks] for ranks in records]  # whole MiB
            out[f"{config} {setting}"] = {
                "peak_mib": [spread([p[r] for p in peaks]) for r in range(RANKS)],
                "sum_peak_mib": spread([sum(p) for p in peaks]),
                "start_mib": spread([ranks[r]["start"]["peak_mib"] for ranks in records for r in range(RANKS)]),
                "on_meta_before_prepare": [rank["on_meta_before_prepare"] for rank in records[0]],
                "load_and_prepare_s": spread([ranks[0]["load_and_prepare_s"] for ranks in records]),
            }  # fmt: skip
    return out


CAPTION = """Peak RSS (MiB, ``VmHWM``) of each rank right after Accelerate prepared the model, FL+FSDP 2 groups × 2
ranks on gloo, {model}; median (min–max) over {repeats} interleaved repetitions. "off": every rank reads the weights;
"on" (cpu_ram_efficient_loading): rank 0 alone, ranks 1–3 build the model empty and receive rank 0's broadcast. Before
any model a rank's peak is {start} MiB (the interpreter, the libraries and the process group)."""


def markdown(results: dict) -> str:
    summary = results["summary"]
    start = f"{spread([s['start_mib']['median'] for s in summary.values()])['median']:.0f}"
    columns = ["configuration", "cpu_ram_efficient_loading", *(f"rank {r}" for r in range(RANKS)), "sum of ranks",
               "rank 0 load + prepare (s)"]  # fmt: skip
    caption = CAPTION.format(**results["config"], repeats=results["repeats"], start=start)
    lines = table_head(caption, columns, "ll" + "r" * 6)
    for name, row in summary.items():
        config, setting = name.split()
        cells = [median_range(s, ".0f") for s in row["peak_mib"]]
        cells += [median_range(row["sum_peak_mib"], ".0f"), median_range(row["load_and_prepare_s"], ".1f")]
        lines.append(f"| {config} | {setting} | " + " | ".join(cells) + " |")
    empty = {name: [r for r, meta in enumerate(row["on_meta_before_prepare"]) if meta] for name, row in summary.items()}
    lines += [
        "",
        "Ranks whose model was empty (on the meta device) before preparing: "
        + "; ".join(f"{name}: {', '.join(map(str, ranks)) or 'none'}" for name, ranks in empty.items())
        + ".",
    ]
    lines += run_record_lines(results)
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="A saved tiny Llama (tied embeddings), 1 repetition.")
    p.add_argument("--repeats", type=int, help="Repetitions (default 2; 1 with --quick).")
    p.add_argument("--timeout-s", type=float, default=600.0, help="Limit per launch.")
    add_folder_options(p, "loading_memory", work="the converted models and the ranks' records", report_only="tables")
    return p


def main(argv: list[str] | None = None) -> int:
    study = Study("loading_memory", make_parser(), argv)
    args = study.args
    if args.report_only:
        return rewrite(args.report_only, lambda r: summarize(r["runs"]), markdown)
    repeats = args.repeats or (1 if args.quick else 2)
    runs = []
    with study.running() as work:
        if args.quick:
            model, name = tiny_llama(work / "micro"), "Llama `micro` (tied embeddings)"
        else:
            model, name = smollm2_folder(), f"`{SMOLLM2}` (134.5 M parameters, tied embeddings)"
        configs = {"fp32": (model, False), "bf16": (bf16_copy(model, work / "bf16"), True)}
        for rep in range(repeats):
            for config, (folder, bf16) in configs.items():
                for setting in SETTINGS:
                    print(f"repetition {rep + 1}/{repeats}: {config}, cpu_ram_efficient_loading {setting}", flush=True)
                    out = work / f"r{rep}" / config / setting
                    ranks = launch(folder, setting, bf16, out, args.timeout_s)
                    runs.append({"repetition": rep, "config": config, "setting": setting, "ranks": ranks})
    results = {"config": {"model": name}, "repeats": repeats, "summary": summarize(runs), "runs": runs}
    return study.finish(results, markdown)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker([a for a in sys.argv[1:] if a != "--worker"])
    else:
        raise SystemExit(main())
