"""Distributed check script: trains a tiny Llama and writes what each rank saw and holds.

Launched by the tests with torchrun (gloo, CPU):

    torchrun --nproc_per_node 4 tests/scripts/train_tiny.py --output_dir /tmp/x --fed_group_size 2 \
        --max_steps 4 --dump_dir /tmp/x/dump

Each rank writes ``rank{R}.pt``: log history, sample indices read, per-step checksums of its local shards,
DTensor placements and mesh shape, the full (group-gathered) parameters and its local shards at the end.

Faults for the reliability tests fire on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so that a
job restarted by ``torchrun --max-restarts`` runs clean:

    --kill_at_step 5 --fault_rank 1            SIGKILL rank 1 as step 5 begins (--fault_group G: group G's only)
    --kill_launcher_at_step 5 --fault_rank 0   rank 0 SIGKILLs its torchrun (only) as step 5 begins
    --kill_while_saving_step 4 --fault_rank 1  SIGKILL rank 1 after it wrote its shards of checkpoint-4 (in the
                                               background with --fed_async_checkpoint)
    --stop_at_step 5 --fault_rank 3            SIGSTOP rank 3 as step 5 begins (prints its pid and "stopping at <time>")
    --sleep_group 1 --sleep_at_step 2          group 1 sleeps --sleep_s seconds as step 2 begins
    --slow_group 1 --slow_step_s 0.5           group 1 sleeps 0.5 s before each step it trains (a slower group)
    --nan_at 3:1 5:0,1                         a NaN in group 1's first shard after step 3, in both after 5
    --hold_at_step 10 --hold_until F           wait as step 10 begins until file F exists (--restart_marker F:
                                               a restarted launch creates F as it starts; --start_marker F:
                                               any launch does)

``--pretrained_dir D`` loads the model from the folder D as the recipes do (`build_model`: with
``--fsdp_config '{"cpu_ram_efficient_loading": true}'`` only rank 0 reads it); the dump then says whether the model
the trainer was given was on the meta device and holds its shards as preparing left them (``prepared``).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, set_seed

from hf_fedshard import AveragingObserver, FedShardTrainer, FedShardTrainingArguments
from hf_fedshard.errors import ConfigError
from hf_fedshard.integrations.fsdp import loads_weights
from hf_fedshard.tools.models import build_model
from hf_fedshard.transports.mesh import destroy_gloo_groups_at_exit

SEQ_LEN = 16
VOCAB = 128


@dataclass
class ScriptArguments:
    dump_dir: str = field(metadata={"help": "Folder for the per-rank dumps."})
    trainer: str = field(default="fed", metadata={"help": "fed: FedShardTrainer; plain: transformers.Trainer."})
    num_samples: int = field(default=64, metadata={"help": "Training samples (sample i starts with token i)."})
    num_eval_samples: int = field(default=24, metadata={"help": "Evaluation samples."})
    freeze_all: bool = field(default=False, metadata={"help": "Freeze every parameter (error case)."})
    transport_module: str | None = field(
        default=None, metadata={"help": "A module imported before the arguments are parsed (it registers a transport)."}
    )
    export_dir: str | None = field(default=None, metadata={"help": "save_model() here after training."})
    export_at_step: int | None = field(
        default=None, metadata={"help": "Call save_model(export_dir) at the end of this step instead."}
    )
    fault_rank: int = field(default=1, metadata={"help": "Rank that --kill_* faults kill."})
    fault_group: int | None = field(
        default=None, metadata={"help": "Only this federation group's fault_rank (default: every group's)."}
    )
    kill_at_step: int | None = field(default=None, metadata={"help": "SIGKILL fault_rank as this step begins."})
    kill_launcher_at_step: int | None = field(
        default=None, metadata={"help": "fault_rank SIGKILLs its launcher (torchrun) as this step begins."}
    )
    stop_at_step: int | None = field(default=None, metadata={"help": "SIGSTOP fault_rank as this step begins."})
    kill_while_saving_step: int | None = field(
        default=None, metadata={"help": "SIGKILL fault_rank after it wrote its shards of this checkpoint."}
    )
    step_sleep_s: float = field(default=0.0, metadata={"help": "Seconds every rank sleeps before each step."})
    restart_marker: str | None = field(
        default=None, metadata={"help": "A file this script creates when torchrun restarted it (attempt > 0)."}
    )
    start_marker: str | None = field(
        default=None, metadata={"help": "A file this script creates as it starts (before it joins the federation)."}
    )
    hold_at_step: int | None = field(
        default=None, metadata={"help": "Wait as this step begins until the file --hold_until exists."}
    )
    hold_until: str | None = field(default=None, metadata={"help": "The file --hold_at_step waits for."})
    sleep_group: int | None = field(default=None, metadata={"help": "Federation group that sleeps."})
    sleep_at_step: int = field(default=2, metadata={"help": "Step at whose beginning sleep_group sleeps."})
    sleep_s: float = field(default=90.0, metadata={"help": "Seconds sleep_group sleeps."})
    slow_group: int | None = field(default=None, metadata={"help": "Federation group slowed on every step it trains."})
    slow_step_s: float = field(default=0.0, metadata={"help": "Seconds slow_group sleeps before each trained step."})
    record_eval_params: bool = field(
        default=False, metadata={"help": "Keep each group's full parameters at every evaluation, before averaging."}
    )
    record_resume: bool = field(
        default=False, metadata={"help": "Record what training starts from: model, anchors, moments, schedule."}
    )
    record_syncs: bool = field(
        default=False,
        metadata={"help": "Keep this group's full parameters around every averaging, and each exchange's Δ and mean."},
    )
    nan_at: list[str] = field(
        default_factory=list, metadata={"help": "STEP:GROUPS events, e.g. 3:1 5:0,1: a NaN in those groups after STEP."}
    )
    pretrained_dir: str | None = field(
        default=None, metadata={"help": "Load the model from this folder as the recipes do (build_model)."}
    )


class TokenDataset(torch.utils.data.Dataset):
    """Sample i: token i, then random tokens from a generator seeded with i (identical on every rank)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rest = torch.randint(0, VOCAB, (SEQ_LEN - 1,), generator=torch.Generator().manual_seed(i))
        ids = torch.cat([torch.tensor([i % VOCAB]), rest])
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_llama(tie_word_embeddings: bool = False) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=tie_word_embeddings,
    )
    set_seed(0)
    return LlamaForCausalLM(config)


def local_checksum(model: torch.nn.Module) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.detach().double().sum()
    return total.item()


class PreparedRecorder(TrainerCallback):
    """Put first: this rank's local shards and the embeddings' tie as preparing left them (before any averaging)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.state = trainer, {}

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model
        self.state = {
            "local": {n: local_of(p) for n, p in model.named_parameters(remove_duplicate=False)},
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        }


def local_of(param: torch.Tensor) -> torch.Tensor:
    return (param.to_local() if isinstance(param, DTensor) else param).detach().clone()


class Recorder(TrainerCallback):
    """Runs after FedAvgCallback: records this rank's local checksum and the time (``time.time()``) at the end of
    each optimizer step, its averaging included, and when training began."""

    def __init__(self) -> None:
        self.checksums: dict[int, float] = {}
        self.step_times: dict[int, float] = {}
        self.started_at_step: int | None = None
        self.started_at: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.started_at_step, self.started_at = state.global_step, time.time()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.checksums[state.global_step] = local_checksum(model)
        self.step_times[state.global_step] = time.time()


def first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class Faults(TrainerCallback):
    """Test-only faults at given steps (first attempt only); runs after FedAvgCallback."""

    def __init__(self, script: ScriptArguments, rank: int, group: int) -> None:
        self.script, self.rank, self.group = script, rank, group

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step + 1
        time.sleep(self.script.step_sleep_s)
        if step == self.script.hold_at_step:  # e.g. until a restarted group is up, however slow the machine
            deadline = time.monotonic() + 300
            while not os.path.exists(self.script.hold_until) and time.monotonic() < deadline:
                time.sleep(0.2)
        if not first_attempt() or self.script.fault_group not in (None, self.group):
            return
        if step == self.script.kill_at_step and self.rank == self.script.fault_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.script.kill_launcher_at_step and self.rank == self.script.fault_rank:
            os.kill(os.getppid(), signal.SIGKILL)  # torchrun alone: its workers live in sessions of their own
        if step == self.script.stop_at_step and self.rank == self.script.fault_rank:
            print(f"rank {self.rank} (pid {os.getpid()}) stopping at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == self.script.sleep_at_step and self.group == self.script.sleep_group:
            time.sleep(self.script.sleep_s)

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        events = dict(event.split(":") for event in self.script.nan_at)
        groups = {int(g) for g in events.get(str(state.global_step), "").split(",") if g}
        first_rank_of_group = args.fed_launch_layout.position(self.rank) == 0
        if self.group in groups and first_rank_of_group:
            param = next(model.parameters())
            (param.to_local() if isinstance(param, DTensor) else param).view(-1)[0] = math.nan


class Pace(TrainerCallback):
    """Records the steps this group trains (``fed_round_policy speed`` passes over the rest) and slows
    ``--slow_group`` on each of them; runs after FedAvgCallback."""

    def __init__(self, trainer: FedShardTrainer, script: ScriptArguments, group: int) -> None:
        self.trainer, self.script, self.group, self.trained = trainer, script, group, []

    def on_step_begin(self, args, state, control, **kwargs):
        if self.trainer.fed_callback is None or not self.trainer.fed_callback.trains_next_step:
            return
        self.trained.append(state.global_step + 1)
        if self.group == self.script.slow_group:
            time.sleep(self.script.slow_step_s)


class EvalParamsRecorder:
    """Wraps FedAvgCallback.before_eval: this group's full parameters at each per-group evaluation."""

    def __init__(self, trainer: FedShardTrainer) -> None:
        self.trainer, self.params = trainer, {}
        self.evaluate = trainer.fed_callback.before_eval
        trainer.fed_callback.before_eval = self

    def __call__(self) -> None:
        model = self.trainer.model
        self.params[self.trainer.state.global_step] = {n: full_tensor(p) for n, p in model.named_parameters()}
        self.evaluate()


class SyncRecorder(TrainerCallback, AveragingObserver):
    """Watches the averagings through the averager's public hook (`AveragingObserver`): full parameters around each
    blocking averaging (and the fragments it covered), at each overlapped start and around each apply; local Δ and
    mean Δ of each exchange.

    Runs after FedAvgCallback, so ``on_train_begin`` sees the averager and the first anchor (the averaged initial
    weights).
    """

    def __init__(self, trainer: FedShardTrainer) -> None:
        self.trainer = trainer
        self.params: dict[int, tuple[dict, dict]] = {}
        self.fragments: dict[int, list[int]] = {}
        self.starts: dict[int, tuple[int, dict]] = {}
        self.applies: dict[int, tuple[int, int, dict, dict]] = {}
        self.exchanges: dict[int, tuple[list, list]] = {}
        self.start: dict[str, torch.Tensor] = {}
        self.fragment_names: list[list[str]] = []
        self._before: dict[str, torch.Tensor] = {}
        self._started_at = 0

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: full_tensor(p) for n, p in self.trainer.model.named_parameters()}

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.full_params()
        averager = self.trainer.fed_callback.averager
        names = [n for n, p in self.trainer.model.named_parameters() if p.requires_grad]
        self.fragment_names = [names[f.start : f.stop] for f in averager.fragments]
        averager.add_observer(self)

    def averaging(self, step, fragments) -> None:
        self._before = self.full_params()

    def averaged(self, step, fragments) -> None:
        self.params[step] = (self._before, self.full_params())
        self.fragments[step] = list(fragments)

    def exchange_started(self, step, fragment) -> None:
        self.starts[step] = (fragment, self.full_params())

    def applying(self, step, fragment, started_at) -> None:
        self._before, self._started_at = self.full_params(), started_at

    def applied(self, step, fragment) -> None:
        self.applies[step] = (fragment, self._started_at, self._before, self.full_params())

    def exchanged(self, step, fragment, deltas, means) -> None:
        sent, got = self.exchanges.setdefault(step, ([], []))
        sent += [t.clone() for t in deltas]
        got += [m.clone() for m in means]


class ResumeRecorder(TrainerCallback):
    """What training starts from, after FedAvgCallback built the averager (and loaded a checkpoint's state): the
    full parameters, anchors and outer momenta, the inner optimizer's moments and steps, the schedule's position."""

    def __init__(self, trainer: FedShardTrainer) -> None:
        self.trainer, self.state = trainer, {}

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        averaging = trainer.fed_callback.averager.state_dict()
        fragments = averaging["outer"]["fragments"]
        anchors = [a for f in fragments for a in f["anchor"]]
        momenta = [f["optimizer"]["state"].get(i, {}).get("momentum_buffer") for f in fragments
                   for i in range(len(f["anchor"]))]  # fmt: skip
        optimizer = trainer.optimizer.optimizer
        moments = {n: {k: full_tensor(v) for k, v in optimizer.state[p].items() if k.startswith("exp_")}
                   for n, p in named}  # fmt: skip
        self.state = {
            "step": state.global_step,
            "params": {n: full_tensor(p) for n, p in trainer.model.named_parameters()},
            "anchor": {n: full_of(a, p) for (n, p), a in zip(named, anchors, strict=True)},
            "momentum": {n: full_of(m, p) for (n, p), m in zip(named, momenta, strict=True) if m is not None},
            "moments": moments,
            "inner_steps": {n: float(optimizer.state[p]["step"]) for n, p in named if "step" in optimizer.state[p]},
            "last_epoch": trainer.lr_scheduler.last_epoch,
            "feedback": {n: full_of(e, p) for (n, p), e in zip(named, averaging["feedback"] or [], strict=False)},
        }


def full_of(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's shard, laid out like ``param`` (a group collective)."""
    if not isinstance(param, DTensor):
        return local.detach().clone()
    spec = {"shape": param.shape, "stride": param.stride(), "run_check": False}
    return (
        DTensor.from_local(local, param.device_mesh, param.placements, **spec).full_tensor().clone()
    )  # 1 rank: a view


class ExportMidTraining(TrainerCallback):
    """Calls save_model at the end of one step (after FedAvgCallback), keeping the parameters it found there."""

    def __init__(self, trainer: Trainer, step: int, export_dir: str) -> None:
        self.trainer, self.step, self.export_dir = trainer, step, export_dir
        self.params_before: dict[str, torch.Tensor] = {}
        self.params_after: dict[str, torch.Tensor] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            self.params_before = {n: full_tensor(p) for n, p in model.named_parameters()}
            self.trainer.save_model(self.export_dir)
            self.params_after = {n: full_tensor(p) for n, p in model.named_parameters()}


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


class SaveKillingTrainer(FedShardTrainer):
    """Test-only: SIGKILLs one rank right after it wrote its shards of one checkpoint, before it is complete
    (``fed_async_checkpoint``: in the background thread, once its model and optimizer shards are on disk, while
    the main thread trains on)."""

    def __init__(self, *args, kill_step: int, kill_rank: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kill_step, self.kill_rank = kill_step, kill_rank

    def _save_group_optimizer(self, output_dir: str, write=None) -> None:
        super()._save_group_optimizer(output_dir, *([write] if write else []))
        here = self.state.global_step == self.kill_step and self.args.process_index == self.kill_rank
        if not (here and first_attempt()):
            return
        if self._checkpointer is None:
            os.kill(os.getpid(), signal.SIGKILL)
        write = self._checkpointer._write_state

        def write_then_die(state: dict, directory: str) -> None:
            write(state, directory)
            if os.path.basename(directory) == "optimizer":
                os.kill(os.getpid(), signal.SIGKILL)

        self._checkpointer._write_state = write_then_die


def import_transport(argv: list[str]) -> None:
    """Import ``--transport_module`` first, as a user's script imports the module of its own transport: it must be
    registered before the arguments name it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--transport_module")
    module = pre.parse_known_args(argv)[0].transport_module
    if module:
        importlib.import_module(module)


def raised_by_every_rank(err: BaseException) -> bool:
    """A refusal the library raises on every rank alike: bad input (`ConfigError`), a checkpoint written damaged."""
    return isinstance(err, ConfigError) or str(err).startswith("hf_fedshard: resuming from")


@contextlib.contextmanager
def said_by_every_rank(mark_dir: str, rank: int, world: int, wait_s: float = 60.0) -> Iterator[None]:
    """Print a refusal that every rank raises on every rank before any rank exits, then exit 1.

    The tests count the refusal once per rank. Raised as usual, the first rank to exit has torchrun stop the others
    with SIGTERM, and under load a rank scheduled late was stopped before it printed (3 of 4 counted). Each rank
    prints its traceback, marks it in ``mark_dir`` and waits (at most ``wait_s``) for every rank's mark: a rank that
    never refuses (went on into a collective) leaves its mark missing and the count short, as it should.
    """
    try:
        yield
    except Exception as err:
        if not raised_by_every_rank(err):
            raise
        traceback.print_exc()
        sys.stderr.flush()
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        os.makedirs(mark_dir, exist_ok=True)
        open(os.path.join(mark_dir, f"refused-{run}-rank{rank}"), "w").close()
        deadline = time.monotonic() + wait_s
        while len(glob.glob(os.path.join(mark_dir, f"refused-{run}-rank*"))) < world and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    import_transport(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((ScriptArguments, FedShardTrainingArguments))
    script, args = parser.parse_args_into_dataclasses(argv)
    destroy_gloo_groups_at_exit()  # the plain-Trainer reference runs need it too
    if script.restart_marker and not first_attempt():
        open(script.restart_marker, "a").close()
    if script.start_marker:
        open(script.start_marker, "a").close()
    if script.pretrained_dir is None:
        model = tiny_llama()
    else:
        model = build_model("micro", VOCAB, SEQ_LEN, script.pretrained_dir, empty=not loads_weights(args))
    on_meta = all(p.is_meta for p in model.parameters())
    if script.freeze_all:
        model.requires_grad_(False)
    seen: list[int] = []
    model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.extend(kw["input_ids"][:, 0].tolist()) if model.training else None,
        with_kwargs=True,
    )
    kwargs = {"train_dataset": TokenDataset(script.num_samples), "eval_dataset": TokenDataset(script.num_eval_samples)}
    if script.kill_while_saving_step is not None:
        trainer = SaveKillingTrainer(
            model, args, kill_step=script.kill_while_saving_step, kill_rank=script.fault_rank, **kwargs
        )
    else:
        trainer = (FedShardTrainer if script.trainer == "fed" else Trainer)(model=model, args=args, **kwargs)
    recorder = Recorder()
    trainer.add_callback(recorder)
    prepared = PreparedRecorder(trainer)
    if script.pretrained_dir is not None:
        trainer.callback_handler.callbacks.insert(0, prepared)
    if isinstance(trainer, FedShardTrainer):
        trainer.add_callback(Faults(script, args.process_index, args.fed_group_index(args.process_index)))
        pace = Pace(trainer, script, args.fed_group_index(args.process_index))
        trainer.add_callback(pace)
    eval_params = EvalParamsRecorder(trainer) if script.record_eval_params else None
    resume = ResumeRecorder(trainer) if script.record_resume else None
    if resume is not None:
        trainer.add_callback(resume)
    syncs = SyncRecorder(trainer) if script.record_syncs else None
    if syncs is not None:
        trainer.add_callback(syncs)
    exporter = None
    if script.export_at_step is not None:
        exporter = ExportMidTraining(trainer, script.export_at_step, script.export_dir)
        trainer.add_callback(exporter)
    with said_by_every_rank(script.dump_dir, args.process_index, args.world_size):
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if script.export_dir is not None and exporter is None:
        trainer.save_model(script.export_dir)
    metrics = trainer.evaluate()
    for module in trainer.model.modules():  # evaluation leaves the no-reshard tail unsharded
        if isinstance(module, FSDPModule):
            module.reshard()
    param = next(trainer.model.parameters())
    averager = trainer.fed_callback.averager if getattr(trainer, "fed_callback", None) else None
    dump = {
        "log_history": trainer.state.log_history,
        "eval": metrics,
        "seen": seen,
        "checksums": recorder.checksums,
        "trained": pace.trained if isinstance(trainer, FedShardTrainer) else None,
        "started_at_step": recorder.started_at_step,
        "started_at": recorder.started_at,
        "step_times": recorder.step_times,
        "resumed": resume.state if resume else None,
        "fed_counters": averager.state_dict()["counters"] if averager else None,
        "params_before_export": exporter.params_before if exporter else None,
        "params_after_export": exporter.params_after if exporter else None,
        "sync_params": syncs.params if syncs else None,
        "sync_start": syncs.start if syncs else None,
        "sync_exchanges": syncs.exchanges if syncs else None,
        "sync_fragments": syncs.fragments if syncs else None,
        "exchange_starts": syncs.starts if syncs else None,
        "exchange_applies": syncs.applies if syncs else None,
        "fragment_names": syncs.fragment_names if syncs else None,
        "start_params": syncs.start if syncs else None,
        "eval_params": eval_params.params if eval_params else None,
        "on_meta": on_meta,
        "prepared": prepared.state,
        "is_dtensor": [isinstance(p, DTensor) for p in trainer.model.parameters()],
        "placements": [str(pl) for pl in param.placements] if isinstance(param, DTensor) else None,
        "mesh_shape": list(param.device_mesh.shape) if isinstance(param, DTensor) else None,
        "full_params": {n: full_tensor(p) for n, p in trainer.model.named_parameters()},
        "local_params": {n: local_of(p) for n, p in trainer.model.named_parameters()},
    }
    os.makedirs(script.dump_dir, exist_ok=True)
    torch.save(dump, os.path.join(script.dump_dir, f"rank{trainer.args.process_index}.pt"))


if __name__ == "__main__":
    main(sys.argv[1:])
