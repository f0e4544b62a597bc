"""The benchmarks' training script: one method of a study, on every rank of the emulated cluster (or localhost).

Launched by harness/methods.py in each node's namespace (one launcher per node), e.g. FL+FSDP on 2 nodes × 2 ranks:

    ip netns exec fsb<pid>n<i> torchrun --nnodes 2 --nproc_per_node 2 --node_rank <i> --master_addr 10.213.0.1 \
        --master_port 29500 benchmarks/harness/bench_train.py --data_dir D --record_dir R --output_dir O \
        --fed_group_size 2 --fed_sync_steps 8 ...

Every method runs `FedShardTrainer` on the same packed data, model, per-device batch and hyperparameters; only
the parallelism differs: FSDP (``--fsdp``), HSDP (``--fed_shard_size``), FL+FSDP and FL+HSDP (``--fed_*``), the
ideal (FL+FSDP whose `FedAvgCallback` is removed: groups never average), and Accelerate's `LocalSGD` (DDP with
gradient sync off and a whole-world parameter average every ``--local_sgd_steps`` steps).

`StepRecorder` stamps every optimizer step (start, end, after the FedAvg callback) and reads the node's uplink
byte counters at both ends on the node's first rank (and, on a three-tier cluster, its rack's trunk counters on
the first rank of the rack's first node), so that evaluations and logging are left out of the step times and of
the bytes. Each rank also records its resident memory before the model is built and its peak (``VmHWM``): their
difference is what the model, its gradients, optimizer state and training added. Each rank writes
``rank<R>.json`` into ``--record_dir``. With ``--budget_s``, `BudgetStop` ends training at the first evaluation
whose training clock has reached the budget, at the same step on every rank, and ``--eval_offset_steps`` moves
the evaluations past an overlapped exchange's apply (benchmarks/time_to_quality.py). With ``--progress_log``,
`ProgressLog` appends each event as it happens (benchmarks/goodput.py kills launches mid-run). Each step's record says
whether this rank trained it (``trained``: false for a step a speed-aware round passes over); with ``--target_loss``,
`TargetStop` ends training at the first evaluation at or below that loss once ``--target_tokens`` trained tokens are
reached, and ``--start_gate`` holds every rank before its first step until the study lets it go
(benchmarks/speed_rounds.py: each group's CPU quota is set in between).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.local_sgd import LocalSGD
from datasets import disable_progress_bars, load_from_disk
from transformers import (
    AutoTokenizer,
    DefaultFlowCallback,
    HfArgumentParser,
    TrainerCallback,
    default_data_collator,
    set_seed,
)

from benchmarks.harness.netns import RACK_NETNS_ENV, TRUNK, UPLINK
from benchmarks.harness.progress import ProgressLog
from hf_fedshard import FedShardTrainer, FedShardTrainingArguments
from hf_fedshard.tools.models import PRESETS, build_model

UPLINK_STATS = Path(f"/sys/class/net/{UPLINK}/statistics")


@dataclass
class BenchArguments:
    data_dir: str = field(metadata={"help": "Packed blocks and tokenizer written by methods.prepare_data."})
    record_dir: str = field(metadata={"help": "Folder for each rank's rank<R>.json."})
    model_size: str = field(default="tiny", metadata={"help": "Llama preset.", "choices": list(PRESETS)})
    no_averaging: bool = field(default=False, metadata={"help": "The ideal: drop the FedAvgCallback."})
    local_sgd_steps: int = field(default=0, metadata={"help": "> 0: Accelerate's LocalSGD with this H (DDP)."})
    eval_offset_steps: int = field(
        default=0,
        metadata={"help": "Evaluate (and log) at steps ≡ this (mod eval_steps) instead of at multiples of it; an "
                  "overlapped exchange (fed_sync_overlap τ) is applied at τ steps past its start, so evaluating there "
                  "keeps it out of the evaluation, which would otherwise wait for it outside the training clock."},
    )  # fmt: skip
    budget_s: float = field(
        default=0.0,
        metadata={"help": "> 0: stop at the first evaluation whose training clock (evaluations excluded) has reached "
                  "this many seconds on any rank; max_steps stays a cap."},
    )  # fmt: skip
    progress_log: str = field(
        default="",
        metadata={"help": "Append this launch's begin, averaging, checkpoint and end events to this file as they "
                  "happen (harness/progress.py), for the studies that kill launches mid-run."},
    )  # fmt: skip
    stop_file: str = field(
        default="",
        metadata={"help": "With --progress_log: stop at the first averaging step at or past the step this file holds "
                  "once it exists (the fault studies end every group of a run at one step)."},
    )  # fmt: skip
    target_loss: float = field(
        default=0.0,
        metadata={"help": "> 0: stop at the first evaluation whose eval loss (the largest over ranks) is at or below "
                  "this and at which --target_tokens trained tokens are reached; --budget_s stays a cap."},
    )  # fmt: skip
    target_tokens: int = field(
        default=0,
        metadata={"help": "With --target_loss: the trained tokens, summed over every rank, the run must also reach "
                  "(a step a speed-aware round passes over trains none)."},
    )  # fmt: skip
    start_gate: str = field(
        default="",
        metadata={"help": "A folder: when training begins each rank writes ready<R> there and waits for the file go "
                  "before its first step and its training clock (benchmarks/speed_rounds.py sets each group's CPU "
                  "quota in between, so start-up runs unthrottled)."},
    )  # fmt: skip


def uplink_bytes() -> dict[str, int]:
    """This node's inter-node counters; empty outside the emulated cluster (no uplink)."""
    if not UPLINK_STATS.is_dir():
        return {}
    return {name: int((UPLINK_STATS / name).read_text()) for name in ("tx_bytes", "rx_bytes")}


def rack_bytes(namespace: str) -> dict[str, int]:
    """The rack trunk's counters, read in the rack switch's namespace (no rank runs there): ``rack_tx_bytes``..."""
    stats = f"/sys/class/net/{TRUNK}/statistics"
    cmd = ["ip", "netns", "exec", namespace, "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]
    tx, rx = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout.split()
    return {"rack_tx_bytes": int(tx), "rack_rx_bytes": int(rx)}


def memory_kib(field_name: str) -> int:
    """A line of /proc/self/status in KiB: ``VmRSS`` (resident now) or ``VmHWM`` (peak resident)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1])
    raise KeyError(field_name)


class StepRecorder(TrainerCallback):
    """Wall-clock and byte counters of each optimizer step; added last, so it runs after the averaging callback.

    A step's bytes run from the end of the previous step (or the end of the evaluation in between) to its own
    end, so data loading is in and evaluations are out. Before an evaluation (and after the last step) the
    counters are read once the uplink has gone quiet: a collective returns when its data has arrived, while the
    last bytes it sent may still sit in the socket and qdisc queues. The clock is read before that wait.
    """

    def __init__(
        self, read_counters: bool, rack_namespace: str | None = None, trains: Callable[[], bool] | None = None
    ) -> None:
        self.read_counters = read_counters
        self.rack_namespace = rack_namespace
        self.trains = trains or (lambda: True)  # whether this rank trains the step being taken (speed-aware rounds)
        self._trained = True
        self.steps: list[dict] = []
        self.evals: list[dict] = []
        self.paused_s = 0.0  # evaluation and logging time, left out of the training clock
        self._t0 = 0.0
        self._mark: dict = {}  # time and counters where the current step's accounting starts
        self._begin_s = 0.0
        self.sync_begin: dict = {}

    def _read(self) -> dict[str, int]:
        return {**uplink_bytes(), **(rack_bytes(self.rack_namespace) if self.rack_namespace else {})}

    def counters(self, drain: bool = False) -> dict[str, int]:
        """The uplink's (and rack trunk's) counters; with ``drain``, once no ``tx`` count has moved for 30 ms
        (at most 2 s)."""
        if not self.read_counters:
            return {}
        current = self._read()
        deadline, still = time.perf_counter() + 2.0, 0
        while drain and still < 3 and time.perf_counter() < deadline:
            time.sleep(0.01)
            latest = self._read()
            moved = any(latest.get(key) != current.get(key) for key in ("tx_bytes", "rack_tx_bytes"))
            still = 0 if moved else still + 1
            current = latest
        return current

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def on_train_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()
        self._mark = {"t": 0.0, **self.counters()}

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin_s = self._now()
        self._trained = self.trains()

    def on_step_end(self, args, state, control, **kwargs):
        now = self._now()
        end = {"t": now, **self.counters(drain=control.should_evaluate or control.should_training_stop)}
        sync = self.sync_begin or end
        record = {"step": state.global_step, "begin_s": self._begin_s, "end_s": now,
                  "train_clock_s": now - self.paused_s, "sync_s": now - sync["t"],
                  "trained": self._trained}  # fmt: skip
        for key in ("tx_bytes", "rx_bytes", "rack_tx_bytes", "rack_rx_bytes"):
            if key in end:
                record[key] = end[key] - self._mark[key]
                record[f"sync_{key}"] = end[key] - sync[key]
        self.steps.append(record)
        self._mark, self.sync_begin = end, {}

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        now = self._now()
        self.paused_s += now - self._mark["t"]
        self._mark = {"t": now, **self.counters()}
        clock = self.steps[-1]["train_clock_s"] if self.steps and self.steps[-1]["step"] == state.global_step else 0.0
        self.evals.append({"step": state.global_step, "train_clock_s": clock, "eval_loss": metrics["eval_loss"]})


class SyncStamp(TrainerCallback):
    """Placed right before the averaging callback: marks where a step's averaging starts, for its time and bytes."""

    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder

    def on_step_end(self, args, state, control, **kwargs):
        self.recorder.sync_begin = {"t": self.recorder._now(), **self.recorder.counters()}


class EvalOffset(TrainerCallback):
    """Moves the Trainer's evaluations, and its logs with them, from multiples of ``eval_steps`` to ``offset`` steps
    past them (and the last step); inserted right after Trainer's flow callback, so every later callback (the
    averaging, the recorder) sees the moved requests."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def on_step_end(self, args, state, control, **kwargs):
        due = state.global_step % state.eval_steps == self.offset % state.eval_steps
        control.should_evaluate = control.should_log = due or state.global_step >= state.max_steps


def world_max(value: float) -> float:
    """The largest ``value`` over every rank of the world (the value itself without a process group)."""
    return _world_reduce(value, torch.distributed.ReduceOp.MAX)


def world_sum(value: float) -> float:
    """The sum of ``value`` over every rank of the world (the value itself without a process group)."""
    return _world_reduce(value, torch.distributed.ReduceOp.SUM)


def _world_reduce(value: float, op) -> float:
    if not torch.distributed.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=op)
    return tensor.item()


class BudgetStop(TrainerCallback):
    """Stops training at the first evaluation whose training clock has reached ``budget_s``, on every rank at once.

    Every rank takes the largest of the ranks' clocks at the evaluated step (one all-reduce of a float), so all of
    them, in every group, stop after the same step. Added before the `StepRecorder`: its ``on_evaluate`` runs
    inside the evaluation's pause, so the all-reduce is left out of the clock as the evaluation is.
    """

    def __init__(self, recorder: StepRecorder, budget_s: float) -> None:
        self.recorder, self.budget_s = recorder, budget_s

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == 0:  # the evaluation at the start: no clock yet, the same on every rank
            return
        if world_max(self.recorder.steps[-1]["train_clock_s"]) >= self.budget_s:
            control.should_training_stop = True


class TargetStop(TrainerCallback):
    """Stops training at the first evaluation at which the eval loss is down to ``target_loss`` and the world has
    trained ``target_tokens`` tokens, on every rank at once.

    The largest eval loss over the ranks and the sum of their trained tokens (one all-reduce each) make the decision
    the same everywhere; added before the `StepRecorder`, like `BudgetStop`, so both run inside the evaluation's
    pause. A step this rank passed over (a speed-aware round past its group's share) trains no token.
    """

    def __init__(self, recorder: StepRecorder, target_loss: float, target_tokens: int, tokens_per_step: int) -> None:
        self.recorder, self.target_loss, self.target_tokens = recorder, target_loss, target_tokens
        self.tokens_per_step = tokens_per_step

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if state.global_step == 0:
            return
        trained = sum(s["trained"] for s in self.recorder.steps) * self.tokens_per_step
        if world_max(metrics["eval_loss"]) <= self.target_loss and world_sum(trained) >= self.target_tokens:
            control.should_training_stop = True


class StartGate(TrainerCallback):
    """Holds every rank at the start of training until the study says go: writes ``ready<R>`` into ``folder`` and
    waits for ``folder/go`` (at most ``timeout_s``). Added before the `StepRecorder`, whose clock starts after it."""

    def __init__(self, folder: str, timeout_s: float = 600.0) -> None:
        self.folder, self.timeout_s = Path(folder), timeout_s

    def on_train_begin(self, args, state, control, **kwargs):
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"ready{args.process_index}").touch()
        deadline = time.monotonic() + self.timeout_s
        while not (self.folder / "go").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {self.folder / 'go'} within {self.timeout_s:g} s: the study did not start us")
            time.sleep(0.02)


class LocalSGDCallback(TrainerCallback):
    """Accelerate's `LocalSGD` around the Trainer's loop: no gradient sync, parameters averaged every H steps."""

    def __init__(self, trainer: FedShardTrainer, sync_steps: int) -> None:
        self.trainer, self.sync_steps, self.local_sgd = trainer, sync_steps, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.local_sgd = LocalSGD(self.trainer.accelerator, self.trainer.model_wrapped, self.sync_steps)
        self.local_sgd.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self.local_sgd.step()

    def on_train_end(self, args, state, control, **kwargs):
        self.local_sgd.__exit__(None, None, None)


def main(argv: list[str] | None = None) -> None:
    disable_progress_bars()
    bench, args = HfArgumentParser((BenchArguments, FedShardTrainingArguments)).parse_args_into_dataclasses(argv)
    data = load_from_disk(os.path.join(bench.data_dir, "blocks"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(bench.data_dir, "tokenizer"))
    set_seed(args.seed)
    rss_before_model_kib = memory_kib("VmRSS")
    block_size = len(data["train"][0]["input_ids"])
    model = build_model(bench.model_size, len(tokenizer), block_size)
    params = sum(p.numel() for p in model.parameters())
    # Accelerate's FSDP2 keeps the [final norm, output head] unit unsharded after forward: gathered once per step.
    once_params = sum(p.numel() for name, p in model.named_parameters() if name.startswith(("lm_head.", "model.norm.")))
    trainer = FedShardTrainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    if bench.eval_offset_steps:
        callbacks = trainer.callback_handler.callbacks
        flow = next(i for i, c in enumerate(callbacks) if isinstance(c, DefaultFlowCallback))
        callbacks.insert(flow + 1, EvalOffset(bench.eval_offset_steps))
    first_on_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    fed_callback = trainer.fed_callback  # the speed-aware round's plan says which steps this rank trains
    trains = (lambda: fed_callback.trains_next_step) if fed_callback is not None else None
    recorder = StepRecorder(first_on_node, os.environ.get(RACK_NETNS_ENV) if first_on_node else None, trains)
    averaging = LocalSGDCallback(trainer, bench.local_sgd_steps) if bench.local_sgd_steps else trainer.fed_callback
    if averaging is not None:  # (re-)added after the stamp, so the stamp runs right before it
        if averaging is trainer.fed_callback:
            trainer.remove_callback(averaging)
        trainer.add_callback(SyncStamp(recorder))
        if not bench.no_averaging:
            trainer.add_callback(averaging)
        elif averaging is trainer.fed_callback:
            trainer.fed_callback = None  # the ideal never averages, not even temporarily for an evaluation
    if bench.budget_s > 0:
        trainer.add_callback(BudgetStop(recorder, bench.budget_s))  # before the recorder: inside the eval's pause
    if bench.target_loss > 0:
        tokens_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * block_size
        trainer.add_callback(TargetStop(recorder, bench.target_loss, bench.target_tokens, tokens_per_step))
    if bench.start_gate:  # before the recorder: its clock starts once every rank is let go
        trainer.add_callback(StartGate(bench.start_gate))
    trainer.add_callback(recorder)
    if bench.progress_log:  # last: its averaging events follow the averaging
        fed_metrics = trainer.fed_callback.metrics if trainer.fed_callback is not None else dict
        trainer.add_callback(ProgressLog(bench.progress_log, args.fed_sync_steps, fed_metrics, bench.stop_file))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # as the recipes do: Trainer ignores the field
    fed = trainer.fed_callback.metrics() if trainer.fed_callback is not None and not bench.no_averaging else {}
    record = {
        "rank": args.process_index,
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "reads_rack": recorder.rack_namespace is not None,
        "rss_before_model_bytes": rss_before_model_kib * 1024,
        "peak_rss_bytes": memory_kib("VmHWM") * 1024,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "method": trainer.fed_layout.method if args.fed_requested else ("LocalSGD" if bench.local_sgd_steps else "—"),
        "params": params,
        "once_params": once_params,
        "units": model.config.num_hidden_layers + 2,  # blocks, input embedding, [final norm, output head]
        "steps": recorder.steps,
        "evals": recorder.evals,
        "fed": fed,
        "log_history": trainer.state.log_history if args.process_index == 0 else [],
    }
    Path(bench.record_dir).mkdir(parents=True, exist_ok=True)
    Path(bench.record_dir, f"rank{args.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1:])
