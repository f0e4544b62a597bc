"""Speed-aware rounds against synchronous ones when one group is slower: time to quality with a real slow group.

    sudo python -m benchmarks.speed_rounds            # 4 groups, one 2× and 4× slower, budget 60 s, 2 repetitions,
                                                      # about 26 minutes on a quiet 2-core machine
    sudo python -m benchmarks.speed_rounds --quick    # 2× only, budget 15 s, 1 repetition, under 3 minutes
    sudo python -m benchmarks.speed_rounds --wait-quiet-s 900     # first wait up to 15 min for a quiet machine
    sudo python -m benchmarks.speed_rounds --report-only benchmarks/results/speed_rounds_full/results.json

On the two-tier emulated cluster (benchmarks/harness/netns.py), 4 federation groups of one rank each, each group its
own node (100 Mbit/s between nodes), train Llama `micro` on Shakespeare (benchmarks/harness/bench_train.py, FL+FSDP,
``--fed_group_size 1``, H = 8, the same hyperparameters, data and initialisation for every run). Every group runs in a
cgroup of its own with a fixed CPU quota (benchmarks/harness/cpu_quota.py: CFS bandwidth control, cgroup v1): the
fast groups 0.4 of a core each, the slow one (the last group) 0.4 ÷ F, so it computes F times slower for real (no
sleep in the loop); the quotas add up to at most 1.6 cores, below this machine's 2, so a fast group's speed does not
depend on the slow one's. The quotas hold during training only: every rank waits at the start of training
(``--start_gate``) until the study has set them (the training clock starts then), and they are lifted once training
is over, so start-up and exit run unthrottled. The CFS period is 10 ms, well under a step (about 80 ms of CPU for
`micro` here): with the kernel's default of 100 ms a fast group would run in bursts of 40 ms between pauses of 60 ms,
a step's duration would depend on where it falls in the period (up to ±30%), and a throttled rank could leave a
collective unanswered for up to 90 ms, none of which a slower machine does (``--period-ms 100`` runs it so).

Runs of one repetition, in this order, on one cluster:

1. all fast, ``--fed_round_policy steps``: trains for the budget B (training clock, evaluations excluded; the first
   evaluated step at or past B, as in benchmarks/time_to_quality.py). Its eval perplexity at B (interpolated in the
   clock) is the **target**; its trained tokens at B are the **reference tokens**.
2. for each slowdown F (2, 4): ``steps`` (synchronous rounds: every group trains all H steps, the fast ones wait for
   the slow one at each averaging) and ``speed`` (speed-aware rounds: group g trains H_g of the H steps, see
   hf_fedshard/engine/speed.py). Each stops at the first evaluation at which it has reached the target perplexity
   and the reference tokens (`bench_train.TargetStop`), or at the cap of 3 B.

The global model is evaluated on the same held-out plays every H steps (on averaging steps). Reported per run,
median (min–max) over repetitions: the training time to the target (eval loss interpolated linearly in the clock
between the evaluations around it); trained tokens per second (a step a group passes over under ``speed`` trains no
token: tokens are counted from each rank's trained steps); eval perplexity at the reference tokens (interpolated in
the trained tokens); each group's seconds per trained step (the step's time less the averaging's) and the slowdown
achieved (the slow group's ÷ the fast groups' median); each group's idle time at the averagings' barrier
(``fed_barrier_seconds_total``); the slow group's plan H_g over the rounds after the first, beside the plan the
library's rule gives for the slowdown achieved. Compared, per repetition then as a median: synchronous ÷ speed-aware
time to the target, speed-aware ÷ all-fast time, speed-aware ÷ synchronous perplexity at equal tokens; the targets
(issue 32 §3, at F = 2): ≥ 1.5×, ≤ 1.15×, ≤ 1.02×.

Results (JSON, Markdown, PNG) go to ``--out`` (default benchmarks/results/speed_rounds_<quick|full>/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import time_to_quality as ttq
from benchmarks.harness import REPO, TRAIN_SCRIPT
from benchmarks.harness.cpu_quota import CpuGroups
from benchmarks.harness.methods import (
    BenchConfig,
    busy_cpu_s,
    machine_load,
    method_args,
    others_cpu,
    prepare_data,
    shared_args,
    wait_until_quiet,
)
from benchmarks.harness.netns import Cluster, handle_termination
from benchmarks.harness.report import median_range, new_axes, run_record_lines, save_figure, spread
from benchmarks.harness.study import Study, add_folder_options, new_parser, rewrite
from hf_fedshard.engine.speed import next_round_steps

POLICIES = ("steps", "speed")
FAST = "all fast"
TARGETS_AT = 2.0  # the slowdown the issue's targets are stated for


@dataclass
class SpeedConfig:
    """One study: the federation, the quotas, the budget and cap, the repetitions."""

    groups: int = 4
    factors: tuple[float, ...] = (2.0, 4.0)  # F: the slow group's slowdown in each heterogeneous pair of runs
    fast_cores: float = 0.4  # every fast group's CPU quota, in cores
    period_ms: float = 10.0  # the CFS period of every quota: well under a step (see the module's docstring)
    budget_s: float = 60.0  # B: the all-fast run's training clock
    cap_factor: float = 3.0  # the other runs stop at cap_factor × B if they have not reached the target by then
    repeats: int = 2
    model_size: str = "micro"
    sync_steps: int = 8  # H
    eval_samples: int = 64
    batch_size: int = 4
    block_size: int = 128
    learning_rate: float = 2e-3
    rate_mbit: float = 100.0
    max_train_lines: int | None = None
    timeout_s: float = 600.0  # per run, start-up and evaluations included

    @property
    def cap_s(self) -> float:
        return self.cap_factor * self.budget_s

    @property
    def slow_group(self) -> int:
        return self.groups - 1

    def cores(self, factor: float) -> list[float]:
        """Every group's quota when the slow group is ``factor`` times slower (1: all fast)."""
        return [self.fast_cores] * (self.groups - 1) + [self.fast_cores / factor]

    def bench(self) -> BenchConfig:
        """The harness's settings of every run: one rank per group, each group its own node."""
        steps = 8192 // self.sync_steps * self.sync_steps  # a cap only: the budget or the target stops every run
        return BenchConfig(
            nodes=self.groups, ranks_per_node=1, rate_mbit=self.rate_mbit, methods=("FL+FSDP",),
            model_size=self.model_size, block_size=self.block_size, batch_size=self.batch_size, steps=steps,
            sync_steps=self.sync_steps, warmup_steps=self.sync_steps, eval_steps=self.sync_steps,
            eval_samples=self.eval_samples, max_train_lines=self.max_train_lines, learning_rate=self.learning_rate,
            timeout_s=self.timeout_s,
        )  # fmt: skip

    def validate(self) -> None:
        cpus = os.cpu_count() or 1
        if not self.groups * self.fast_cores < cpus:
            raise ValueError(
                f"--fast-cores={self.fast_cores:g} × {self.groups} groups = {self.groups * self.fast_cores:g} cores "
                f"must stay below this machine's {cpus}, or the fast groups' speed would depend on the slow one's."
            )
        if not all(f >= 1 for f in self.factors):
            raise ValueError(f"--factors {self.factors}: a slowdown is at least 1.")
        if self.cap_factor <= 1:
            raise ValueError(f"--cap-factor={self.cap_factor:g}: the cap must lie past the budget.")
        if self.groups < 2:
            raise ValueError(f"--groups={self.groups}: a federation needs at least 2 groups.")
        period_us = round(self.period_ms * 1000)
        for factor in self.factors:  # the kernel's smallest quota is 1 ms a period
            if self.fast_cores / factor * period_us < 1000:
                raise ValueError(f"{self.fast_cores:g} ÷ {factor:g} cores of a {self.period_ms:g} ms period is under "
                                 "the kernel's 1 ms minimum quota: raise --period-ms or --fast-cores.")  # fmt: skip
        self.bench().validate()


@dataclass(frozen=True)
class Run:
    """One run of a repetition: its label, the slow group's slowdown (1: all fast) and the round policy."""

    label: str
    factor: float
    policy: str


def plan(cfg: SpeedConfig) -> list[Run]:
    """The runs of a repetition, in order: the all-fast reference first (it sets the target), then each pair."""
    runs = [Run(FAST, 1.0, "steps")]
    for factor in cfg.factors:
        runs += [Run(run_label(factor, policy), factor, policy) for policy in POLICIES]
    return runs


def run_label(factor: float, policy: str) -> str:
    return f"{factor:g}× slower, {policy}"


def run_args(cfg: SpeedConfig, run: Run, target: dict | None) -> list[str]:
    """bench_train.py arguments of ``run`` after the shared ones: the federation, its round policy, its stop."""
    args = [*method_args("FL+FSDP", cfg.bench()), "--fed_round_policy", run.policy]
    if target is None:  # the all-fast reference
        return [*args, "--budget_s", f"{cfg.budget_s:g}"]
    return [*args, "--budget_s", f"{cfg.cap_s:g}", "--target_loss", repr(target["loss"]),
            "--target_tokens", str(math.ceil(target["tokens"]))]  # fmt: skip


# ---- The figures (pure functions of the ranks' records) ----


def value_at(points: list[tuple[float, float]], x: float) -> float | None:
    """The value at ``x`` of a curve of (x, value) points, linear between the two points around it; ``None`` past
    its ends (time_to_quality's `loss_at`, which is this for any increasing x)."""
    return ttq.loss_at(points, x)


def world_trained_tokens(records: list[dict], tokens_per_step: int) -> list[int]:
    """Tokens the world had trained by the end of each step (index 0: the start): every rank's trained steps ×
    its tokens per step. A step a speed-aware round passes over (``trained`` false) counts nothing."""
    steps = min(len(r["steps"]) for r in records)
    totals = [0]
    for k in range(steps):
        totals.append(totals[-1] + tokens_per_step * sum(bool(r["steps"][k].get("trained", True)) for r in records))
    return totals


def step_times(steps: list[dict]) -> list[float]:
    """Seconds of each of a rank's trained steps, the averaging left out (the step's time less its ``sync_s``)."""
    return [s["end_s"] - s["begin_s"] - s["sync_s"] for s in steps if s.get("trained", True)]


def trained_step_s(steps: list[dict]) -> float | None:
    """Median seconds of a rank's trained steps, the averaging left out."""
    times = step_times(steps)
    return statistics.median(times) if times else None


def step_spread(steps: list[dict]) -> float | None:
    """How much a rank's trained steps vary: their interquartile range ÷ their median (``None``: under 4 steps)."""
    times = step_times(steps)
    if len(times) < 4:
        return None
    q1, median, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / median


def round_plan(steps: list[dict], sync_steps: int) -> list[int]:
    """The steps a rank trained in each complete round of H steps."""
    rounds = len(steps) // sync_steps
    return [sum(bool(s.get("trained", True)) for s in steps[r * sync_steps : (r + 1) * sync_steps])
            for r in range(rounds)]  # fmt: skip


def limit_read_at(ranks: list[dict], evals: list[dict], limit_s: float) -> float:
    """Where rank 0's curve is read for the run's limit: the limit, or the last evaluation where that ended the run.
    `BudgetStop` stops at the first evaluation whose slowest rank's training clock reached the limit; rank 0's own
    clock there may be a little short of it (7.97 s for an 8 s budget), which left the limit past the curve's end."""
    if not evals or evals[-1]["step"] == 0:
        return limit_s
    step = evals[-1]["step"]
    slowest = max(r["steps"][step - 1]["train_clock_s"] for r in ranks if len(r["steps"]) >= step)
    return min(limit_s, evals[-1]["train_clock_s"]) if slowest >= limit_s else limit_s


def run_summary(records: list[dict], cfg: dict, limit_s: float) -> dict:
    """One run: its curve (clock, trained tokens and eval loss at each evaluation), trained tokens/s, and per group
    (one rank each: group g is rank g) its s per trained step, its idle time at the barrier and its round plan.

    ``limit_s``: the run's budget (the all-fast run's) or cap: its curve is read up to there."""
    ranks = sorted(records, key=lambda r: r["rank"])
    rank0, tokens_per_step = ranks[0], cfg["batch_size"] * cfg["block_size"]
    tokens = world_trained_tokens(ranks, tokens_per_step)
    stop = len(tokens) - 1
    clock = rank0["steps"][stop - 1]["train_clock_s"] if stop else 0.0
    evals = [{**e, "trained_tokens": tokens[e["step"]], "eval_perplexity": math.exp(e["eval_loss"])}
             for e in rank0["evals"]]  # fmt: skip
    read_at = limit_read_at(ranks, evals, limit_s)
    return {
        "limit_s": limit_s,
        "evals": evals,
        "stop_step_per_rank": sorted({len(r["steps"]) for r in ranks}),
        "train_clock_at_stop_s": clock,
        "trained_tokens": tokens[-1],
        "tokens_per_s": tokens[-1] / clock if clock > 0 else None,
        # both linear in the clock between the evaluations around the limit: at the all-fast run's budget, its loss
        # at these tokens (interpolated in the tokens between the same evaluations) is its loss at the budget
        "tokens_at_limit": value_at([(e["train_clock_s"], e["trained_tokens"]) for e in evals], read_at),
        "loss_at_limit": value_at([(e["train_clock_s"], e["eval_loss"]) for e in evals], read_at),
        "groups": [group_summary(r, cfg["sync_steps"]) for r in ranks],
    }


def group_summary(record: dict, sync_steps: int) -> dict:
    """A group's figures from its rank's record: s per trained step and their spread, trained steps, idle time at
    the averagings' barrier (``fed_barrier_seconds_total``), steps trained per round (and, under ``speed``, the
    library's own count of the last round, ``fed_round_steps``, which the last round's here must equal)."""
    steps = record["steps"]
    return {
        "s_per_trained_step": trained_step_s(steps),
        "step_spread": step_spread(steps),
        "trained_steps": sum(bool(s.get("trained", True)) for s in steps),
        "barrier_s": (record.get("fed") or {}).get("fed_barrier_seconds_total"),
        "fed_round_steps": (record.get("fed") or {}).get("fed_round_steps"),  # the library's count of the last round
        "round_plan": round_plan(steps, sync_steps),
    }


def target_of(fast: dict) -> dict:
    """The target the all-fast run sets in its repetition: its eval loss and trained tokens at its budget."""
    return {"loss": fast["loss_at_limit"], "tokens": fast["tokens_at_limit"]}


def time_to_target(run: dict, target_loss: float) -> float | None:
    """The training clock at which ``run``'s eval loss is down to the target, within its budget or cap."""
    return ttq.time_to_reach([(e["train_clock_s"], e["eval_loss"]) for e in run["evals"]], target_loss, run["limit_s"])


def loss_at_tokens(run: dict, tokens: float) -> float | None:
    """Eval loss at ``tokens`` trained tokens, linear between the evaluations around it; ``None``: not reached."""
    return value_at([(e["trained_tokens"], e["eval_loss"]) for e in run["evals"]], tokens)


def slowdown(run: dict, slow_group: int) -> float | None:
    """Seconds per trained step of the slow group ÷ the median of the other groups': the slowdown achieved."""
    per_group = [g["s_per_trained_step"] for g in run["groups"]]
    fast = [s for g, s in enumerate(per_group) if g != slow_group and s]
    return per_group[slow_group] / statistics.median(fast) if fast and per_group[slow_group] else None


def settled_plan(run: dict, group: int) -> list[int]:
    """The steps ``group`` trained in each round after the first (the first trains all H: nothing is measured)."""
    return run["groups"][group]["round_plan"][1:]


def expected_plan(run: dict, sync_steps: int, slow_group: int) -> int | None:
    """H_g the library's rule (`next_round_steps`) gives the slow group for the run's measured seconds per step."""
    per_group = [g["s_per_trained_step"] or 0.0 for g in run["groups"]]
    return next_round_steps(sync_steps, 1, per_group)[slow_group] if any(per_group) else None


def _share(part: float | None, whole: float) -> float | None:
    return part / whole if part is not None and whole else None


def figures(rep: dict, cfg: dict) -> dict:
    """The figures of each run of one repetition against its all-fast run's target."""
    target, slow = rep["target"], cfg["groups"] - 1
    out = {}
    for label, run in rep["runs"].items():
        loss_eq = loss_at_tokens(run, target["tokens"])
        out[label] = {
            "time_to_target_s": time_to_target(run, target["loss"]),
            "tokens_per_s": run["tokens_per_s"],
            "loss_at_equal_tokens": loss_eq,
            "slowdown_achieved": slowdown(run, slow),
            "s_per_trained_step": [g["s_per_trained_step"] for g in run["groups"]],
            "step_spread": [g.get("step_spread") for g in run["groups"]],
            "barrier_s": [g["barrier_s"] for g in run["groups"]],
            "barrier_share": [_share(g["barrier_s"], run["train_clock_at_stop_s"]) for g in run["groups"]],
            "slow_plan": settled_plan(run, slow),
            "expected_slow_plan": expected_plan(run, cfg["sync_steps"], slow),
            "train_clock_at_stop_s": run["train_clock_at_stop_s"],
            "same_stop_step_on_every_rank": len(run["stop_step_per_rank"]) == 1,
        }
    return out


def comparisons(per_run: dict, factor: float, cap_s: float) -> dict:
    """The pair at ``factor`` in one repetition: synchronous ÷ speed-aware time to the target (a lower bound, cap ÷
    speed's, where the synchronous run did not reach it), speed-aware ÷ all-fast time, speed ÷ sync loss at equal
    tokens as a perplexity ratio."""
    sync, speed, fast = (per_run[run_label(factor, "steps")], per_run[run_label(factor, "speed")], per_run[FAST])
    t_sync, t_speed, t_fast = sync["time_to_target_s"], speed["time_to_target_s"], fast["time_to_target_s"]
    l_sync, l_speed = sync["loss_at_equal_tokens"], speed["loss_at_equal_tokens"]
    return {
        "sync_over_speed_time": (t_sync or cap_s) / t_speed if t_speed else None,
        "sync_reached": t_sync is not None,
        "speed_over_fast_time": t_speed / t_fast if t_speed and t_fast else None,
        "ppl_ratio_equal_tokens": math.exp(l_speed - l_sync) if l_speed is not None and l_sync is not None else None,
    }


def _exp(loss: float | None) -> float | None:
    return math.exp(loss) if loss is not None else None


def _spread(values: list) -> dict | None:
    known = [v for v in values if v is not None]
    return spread(known) if known else None


def combine(reps: list[dict], cfg: dict) -> dict:
    """Every figure over the repetitions (median and range of what each repetition measured), and the targets."""
    per_rep = [figures(rep, cfg) for rep in reps]
    cap_s = cfg["cap_factor"] * cfg["budget_s"]
    runs = {}
    for label in reps[0]["runs"]:
        rows = [p[label] for p in per_rep]
        groups = range(cfg["groups"])
        times = [r["time_to_target_s"] for r in rows]
        runs[label] = {
            "time_to_target_s": {"per_repetition": times, "reached": _spread(times)},
            "tokens_per_s": _spread([r["tokens_per_s"] for r in rows]),
            "ppl_at_equal_tokens": _spread([_exp(r["loss_at_equal_tokens"]) for r in rows]),
            "slowdown_achieved": _spread([r["slowdown_achieved"] for r in rows]),
            "s_per_trained_step": [_spread([r["s_per_trained_step"][g] for r in rows]) for g in groups],
            "step_spread": [_spread([r["step_spread"][g] for r in rows]) for g in groups],
            "barrier_s": [_spread([r["barrier_s"][g] for r in rows]) for g in groups],
            "barrier_share": [_spread([r["barrier_share"][g] for r in rows]) for g in groups],
            "slow_plan": _spread([statistics.median(r["slow_plan"]) if r["slow_plan"] else None for r in rows]),
            "slow_plan_per_repetition": [r["slow_plan"] for r in rows],
            "expected_slow_plan": _spread([r["expected_slow_plan"] for r in rows]),
            "train_clock_at_stop_s": _spread([r["train_clock_at_stop_s"] for r in rows]),
            "same_stop_step_on_every_rank": all(r["same_stop_step_on_every_rank"] for r in rows),
        }
    pairs = {}
    for factor in cfg["factors"]:
        per = [comparisons(p, factor, cap_s) for p in per_rep]
        pairs[f"{factor:g}"] = {
            "sync_over_speed_time": _spread([c["sync_over_speed_time"] for c in per]),
            "sync_reached_in": sum(c["sync_reached"] for c in per),
            "speed_over_fast_time": _spread([c["speed_over_fast_time"] for c in per]),
            "ppl_ratio_equal_tokens": _spread([c["ppl_ratio_equal_tokens"] for c in per]),
            "per_repetition": per,
        }
    target_ppl = _spread([math.exp(r["target"]["loss"]) for r in reps])
    target_tokens = _spread([r["target"]["tokens"] for r in reps])
    return {"runs": runs, "pairs": pairs, "target_ppl": target_ppl, "target_tokens": target_tokens,
            "targets": targets(pairs, len(reps))}  # fmt: skip


def targets(pairs: dict, repeats: int) -> list[dict]:
    """The issue's targets at F = 2, on the medians over repetitions; a target not measured is not met."""
    pair = pairs.get(f"{TARGETS_AT:g}")
    if pair is None:
        return []

    def median(key: str) -> float | None:
        return pair[key]["median"] if pair[key] else None

    rows = [
        ("speed-aware reaches the target ≥ 1.5× sooner than synchronous (sync ÷ speed time)",
         median("sync_over_speed_time"), 1.5, "≥"),
        ("speed-aware within 15% of the all-fast federation's time (speed ÷ all-fast time)",
         median("speed_over_fast_time"), 1.15, "≤"),
        ("perplexity at equal tokens within 2% of synchronous (speed ÷ sync)", median("ppl_ratio_equal_tokens"),
         1.02, "≤"),
    ]  # fmt: skip
    out = []
    for name, value, bound, sense in rows:
        met = value is not None and (value >= bound if sense == "≥" else value <= bound)
        # a lower bound (the synchronous run never reached the target) meets "≥" only if the bound itself does
        out.append({"target": f"{TARGETS_AT:g}× slower: {name}", "measured": value, "bound": bound, "sense": sense,
                    "met": met})  # fmt: skip
    if pair["sync_reached_in"] < repeats and out[0]["measured"] is not None:
        out[0]["lower_bound"] = True
    return out


# ---- The report ----


def _cells(values: list[dict | None], fmt: str, scale: float = 1.0) -> str:
    return " / ".join(median_range(v, fmt, scale) for v in values)


def time_cell(run: dict, n: int, cap_s: float) -> str:
    """Seconds to the target, median (min–max), or in how many repetitions it was not reached within the cap."""
    reached, times = run["time_to_target_s"]["reached"], run["time_to_target_s"]["per_repetition"]
    missing = sum(t is None for t in times)
    if reached is None:
        return f"not reached in {cap_s:g} s"
    return median_range(reached, ".1f") + (f"; not reached in {cap_s:g} s in {missing} of {n}" if missing else "")


def ratio_cell(pair: dict, key: str) -> str:
    value, missed = median_range(pair[key], ".2f"), pair["sync_reached_in"] < len(pair["per_repetition"])
    if key == "sync_over_speed_time" and pair[key] is not None and missed:
        value = f"≥ {value} (sync not reached within the cap)"
    return value


def markdown(results: dict) -> str:
    cfg, summary, n = results["config"], results["summary"], results["repeats"]
    cap_s, slow = cfg["cap_factor"] * cfg["budget_s"], cfg["groups"] - 1
    fast_groups = ", ".join(map(str, range(slow)))
    lines = [
        f"{cfg['groups']} groups × 1 rank, each group its own node of the two-tier emulated cluster "
        f"({cfg['rate_mbit']:g} Mbit/s between nodes), Llama `{cfg['model_size']}`, per-device batch "
        f"{cfg['batch_size']} × {cfg['block_size']} tokens, lr {cfg['learning_rate']:g} (AdamW, constant), "
        f"H = {cfg['sync_steps']}, FL+FSDP "
        f"(`--fed_group_size 1`). CPU quotas (cgroup CFS bandwidth, period {cfg['period_ms']:g} ms): groups "
        f"{fast_groups}: {cfg['fast_cores']:g} of a core each; group {slow}: the same ÷ F. The all-fast run (`steps`) "
        f"trains {cfg['budget_s']:g} s of training clock (evaluations excluded); its eval perplexity at the budget is "
        f"the target ({median_range(summary['target_ppl'], '.1f')}) and its trained tokens there the reference "
        f"({median_range(summary['target_tokens'], ',.0f')}); every other run stops at the first evaluation (every H "
        f"steps) past both, or at the cap, {cap_s:g} s. Median (min–max) over {n} repetition(s). Time to target: "
        "training clock (s) at which the eval loss, linear between evaluations, reaches the target. Tokens/s: tokens "
        "trained (steps a group passed over under `speed` count none) ÷ the training clock, to the stop. s/step: each "
        "group's median trained step, the averaging left out; slowdown: the slow group's ÷ the fast groups'. Idle at "
        "barriers: each group's `fed_barrier_seconds_total` (its wait in the averagings' control all-reduce), in s "
        "and as a share of the training clock. H_g: the slow group's trained steps per round after the first "
        "(median over rounds; `expected`: the library's rule applied to the run's measured s/step).",
        "",
        "| run | time to target (s) | trained tokens/s | ppl at equal tokens | slowdown achieved | s/step per group "
        f"(0 … {slow}) | idle at barriers per group (s) | idle share per group | slow group's H_g (expected) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, run in summary["runs"].items():
        plan_cell = "—"
        if label.endswith("speed"):
            plan_cell = f"{median_range(run['slow_plan'], '.1f')} ({median_range(run['expected_slow_plan'], '.0f')})"
        eq = median_range(run["ppl_at_equal_tokens"], ".1f") if run["ppl_at_equal_tokens"] else "not reached"
        cells = [time_cell(run, n, cap_s), median_range(run["tokens_per_s"], ",.0f"), eq,
                 median_range(run["slowdown_achieved"], ".2f"), _cells(run["s_per_trained_step"], ".3f"),
                 _cells(run["barrier_s"], ".1f"), _cells(run["barrier_share"], ".0%"), plan_cell]  # fmt: skip
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| slowdown F | sync ÷ speed time to target | speed ÷ all-fast time | speed ÷ sync ppl at equal "
              "tokens |", "|---:|---:|---:|---:|"]  # fmt: skip
    for factor, pair in summary["pairs"].items():
        keys = ("sync_over_speed_time", "speed_over_fast_time", "ppl_ratio_equal_tokens")
        cells = [ratio_cell(pair, key) for key in keys]
        lines.append(f"| {factor}× | " + " | ".join(cells) + " |")
    if summary["targets"]:
        lines += ["", "| target (issue 32 §3, on the medians) | measured | met |", "|---|---:|:---:|"]
        for t in summary["targets"]:
            value = "—" if t["measured"] is None else f"{'≥ ' if t.get('lower_bound') else ''}{t['measured']:.3f}"
            lines.append(f"| {t['target']} | {value} | {'met' if t['met'] else '**not met**'} |")
    stops = [label for label, run in summary["runs"].items() if not run["same_stop_step_on_every_rank"]]
    lines += ["", "Every rank of every run stopped at the same step." if not stops else
              f"**Ranks stopped at different steps** in: {', '.join(stops)}."]  # fmt: skip
    throttled = {label: _spread([r["runs"][label]["throttled_share"][slow] for r in results["reps"]])
                 for label in summary["runs"]}  # fmt: skip
    others = {label: _spread([r["machine"]["after_each_run"][label]["other_processes_cores"] for r in results["reps"]])
              for label in summary["runs"]}  # fmt: skip
    lines += ["", "How much the trained steps' durations vary (interquartile range ÷ median, per group 0 … "
              f"{slow}): " + "; ".join(f"{label} {_cells(run['step_spread'], '.0%')}"
                                       for label, run in summary["runs"].items()) + "."]  # fmt: skip
    lines += ["", "Share of CFS periods in which the slow group was throttled: "
              + ", ".join(f"{label} {median_range(v, '.0%')}" for label, v in throttled.items()) + ". CPU cores kept "
              "busy by other processes while each run trained (average; median (min–max) over repetitions): "
              + ", ".join(f"{label} {median_range(v)}" for label, v in others.items()) + "."]  # fmt: skip
    before, quiet = results["machine_before"], results.get("quiet_wait")
    lines[-1] += (f" Load average before the study: {' / '.join(f'{x:.2f}' for x in before['loadavg_1_5_15'])} "
                  f"(1 / 5 / 15 min) on {before['cpus']} CPUs.")  # fmt: skip
    if quiet:
        lines[-1] += (f" It waited {quiet['waited_s']} s for a quiet machine: 1-minute load {quiet['load_1min']:.2f} "
                      f"({'quiet' if quiet['quiet'] else 'still busy'}).")  # fmt: skip
    lines += run_record_lines(results)
    return "\n".join(lines)


def plot(results: dict, out: Path) -> Path:
    """Eval perplexity against the training clock, one line per run (solid: the first repetition), a star where each
    reaches the target, the target dotted."""
    summary = results["summary"]
    fig, ax = new_axes((7, 4))
    for index, label in enumerate(summary["runs"]):
        for rep, run in enumerate(results["reps"]):
            evals = run["runs"][label]["evals"]
            ax.plot([e["train_clock_s"] for e in evals], [math.exp(e["eval_loss"]) for e in evals],
                    "-" if rep == 0 else "--", color=f"C{index}", marker="o", markersize=2, linewidth=1,
                    label=None if rep else label)  # fmt: skip
            reached = summary["runs"][label]["time_to_target_s"]["per_repetition"][rep]
            if reached is not None:
                ax.plot([reached], [math.exp(run["target"]["loss"])], "*", color=f"C{index}", markersize=9)
    ax.axhline(summary["target_ppl"]["median"], color="grey", linewidth=0.8, linestyle=":")
    ax.set(xlabel="training clock (s, evaluations excluded)", ylabel="eval perplexity (held-out plays)", yscale="log")
    ax.set_title("Every repetition (solid: first); dotted: the all-fast run's perplexity at its budget; *: reached",
                 fontsize=8)  # fmt: skip
    ax.legend(fontsize=7)
    return save_figure(fig, out / "perplexity_vs_time.png")


# ---- Running it ----


@dataclass
class Gate:
    """A run's quotas, for its training only: set once every rank waits at the gate (``ready<R>`` files), which then
    opens (``go``); lifted once a rank has written its record (training is over on every rank: they stop at one
    step), so that the ranks' exit runs unthrottled. ``cpu.stat`` is read at both ends."""

    folder: Path
    records: Path
    world: int
    cpu: CpuGroups
    cores: list[float]
    opened_at: float | None = None
    stat_open: list[dict] | None = None
    stat_close: list[dict] | None = None

    def tick(self) -> None:
        if self.opened_at is None and len(list(self.folder.glob("ready*"))) >= self.world:
            for group, cores in enumerate(self.cores):
                self.cpu.set_quota(group, cores)
            self.stat_open = self.stat()
            (self.folder / "go").touch()
            self.opened_at = time.monotonic()
        elif self.opened_at is not None and self.stat_close is None and any(self.records.glob("rank*.json")):
            self.close()

    def close(self) -> None:
        """Read the throttling and lift the quotas (at the first record, else once the run has ended)."""
        if self.stat_close is None:
            self.stat_close = self.stat()
        for group in range(len(self.cores)):
            self.cpu.set_quota(group, None)

    def stat(self) -> list[dict]:
        return [self.cpu.stat(g) for g in range(len(self.cores))]


def throttled_share(before: list[dict], after: list[dict]) -> list[float | None]:
    """Per group, the share of CFS periods in which it was throttled between two `CpuGroups.stat` readings."""
    shares = []
    for b, a in zip(before, after, strict=True):
        periods = a["nr_periods"] - b["nr_periods"]
        shares.append((a["nr_throttled"] - b["nr_throttled"]) / periods if periods else None)
    return shares


def train(cluster: Cluster, cpu: CpuGroups, cfg: SpeedConfig, run: Run, target: dict | None, data: Path,
          work: Path, port: int) -> dict:  # fmt: skip
    """One run on the cluster, each group's launch in its cgroup, the quotas set once every rank waits at the gate;
    its summary, the throttling and the machine's load."""
    bench = cfg.bench()
    run_dir = work / run.label.replace(" ", "_").replace(",", "").replace("×", "x")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    args = ["--data_dir", str(data), "--record_dir", str(run_dir / "records"), "--output_dir", str(run_dir / "out"),
            *shared_args(bench), *run_args(cfg, run, target), "--start_gate", str(run_dir / "gate")]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    commands = cluster.torchrun_commands(1, port, [str(TRAIN_SCRIPT), *args])
    logs = [run_dir / f"node{node}.log" for node in range(cfg.groups)]
    gate = Gate(run_dir / "gate", run_dir / "records", cfg.groups, cpu, cfg.cores(run.factor))
    cpu_start, start = busy_cpu_s(), time.monotonic()
    try:
        codes = cluster.run(commands, env, logs, cfg.timeout_s, gate.tick, cpu.wrap)  # node g: group g's cgroup
    finally:
        gate.close()
    trained_s = time.monotonic() - (gate.opened_at or start)
    print(f"  {run.label}: exit codes {codes} in {time.monotonic() - start:.0f} s ({trained_s:.0f} s after the gate)",
          flush=True)  # fmt: skip
    if any(codes) or gate.opened_at is None:
        tail = "\n".join(log.read_text()[-3000:] for log in logs)
        raise RuntimeError(f"{run.label} failed (exit codes {codes}); logs in {run_dir}:\n{tail}")
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "records").glob("rank*.json"))]
    summary = run_summary(records, asdict(cfg), cfg.budget_s if target is None else cfg.cap_s)
    summary["throttled_share"] = throttled_share(gate.stat_open, gate.stat_close)
    summary["cores"] = cfg.cores(run.factor)
    return {"summary": summary, "machine": {**machine_load(), **others_cpu(cpu_start, time.monotonic() - start)}}


def repetition(cluster: Cluster, cpu: CpuGroups, cfg: SpeedConfig, data: Path, work: Path, rep: int) -> dict:
    """Every run of one repetition: the all-fast reference, then each slowdown's synchronous and speed-aware runs
    against its target."""
    runs, machine, target = {}, {}, None
    for index, run in enumerate(plan(cfg)):
        done = train(cluster, cpu, cfg, run, target, data, work / f"r{rep}", 29500 + 10 * rep + index)
        runs[run.label], machine[run.label] = done["summary"], done["machine"]
        if target is None:
            target = target_of(done["summary"])
            print(f"  target: ppl {math.exp(target['loss']):.1f} at {cfg.budget_s:g} s, {target['tokens']:,.0f} "
                  "trained tokens", flush=True)  # fmt: skip
    return {"runs": runs, "target": target, "machine": {"after_each_run": machine}}


def run_study(cfg: SpeedConfig, work: Path, data_cache: Path) -> dict:
    """Every repetition on one emulated cluster with a cgroup per group, both removed whatever happens."""
    load_before = machine_load()
    data = prepare_data(cfg.bench(), data_cache)
    reps = []
    with handle_termination(), CpuGroups(cfg.groups, round(cfg.period_ms * 1000)) as cpu, \
            Cluster(cfg.groups, cfg.rate_mbit) as cluster:  # fmt: skip
        link = cluster.probe_goodput(0, 1)
        for rep in range(cfg.repeats):
            print(f"repetition {rep + 1}/{cfg.repeats}", flush=True)
            reps.append(repetition(cluster, cpu, cfg, data, work, rep))
    return {"config": asdict(cfg), "repeats": cfg.repeats, "link": link, "machine_before": load_before, "reps": reps}


def make_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="F = 2 only, budget 15 s, cap 2.5 × B, 1 repetition, 32 "
                   "eval blocks.")  # fmt: skip
    p.add_argument("--factors", type=float, nargs="+", help="The slow group's slowdowns F (default 2 4; quick 2).")
    p.add_argument("--budget-s", type=float, help="B: the all-fast run's training clock (default 60; quick 15).")
    p.add_argument("--cap-factor", type=float, help="Other runs stop at this × B at the latest (default 3; quick 2.5).")
    p.add_argument("--repeats", type=int, help="Repetitions (default 2; quick 1).")
    p.add_argument("--fast-cores", type=float, help="Each fast group's CPU quota in cores (default 0.4).")
    p.add_argument("--period-ms", type=float, help="The CFS period of the quotas (default 10 ms; the kernel's 100).")
    p.add_argument("--sync-steps", type=int, help="H (default 8).")
    p.add_argument("--model-size", help="Llama preset (default micro).")
    p.add_argument("--max-train-lines", type=int, help="Train on this many lines of the text only (tests).")
    p.add_argument("--timeout-s", type=float, help="Bound on each run, start-up included (default cap + 300 s).")
    p.add_argument("--wait-quiet-s", type=float, default=0.0, help="First wait up to this long for a quiet machine "
                   "(1-minute load average under 0.5; the result is recorded).")  # fmt: skip
    add_folder_options(p, "speed_rounds", work="every run's logs and records", report_only="tables and plot")
    return p


def config_from_args(args: argparse.Namespace) -> SpeedConfig:
    quick = {"factors": (2.0,), "budget_s": 15.0, "cap_factor": 2.5, "repeats": 1, "eval_samples": 32}
    cfg = SpeedConfig(**(quick if args.quick else {}))
    given = {"factors": tuple(args.factors) if args.factors else None, "budget_s": args.budget_s,
             "cap_factor": args.cap_factor, "repeats": args.repeats, "fast_cores": args.fast_cores,
             "period_ms": args.period_ms, "sync_steps": args.sync_steps, "model_size": args.model_size,
             "max_train_lines": args.max_train_lines, "timeout_s": args.timeout_s}  # fmt: skip
    cfg = SpeedConfig(**{**asdict(cfg), **{k: v for k, v in given.items() if v is not None}})
    if args.timeout_s is None:
        cfg.timeout_s = cfg.cap_s + 300
    cfg.validate()
    return cfg


def summary_again(results: dict) -> dict:
    """``--report-only``: the summary of a finished run's repetitions."""
    return combine(results["reps"], results["config"])


def main(argv: list[str] | None = None) -> int:
    study = Study("speed_rounds", make_parser(), argv)
    if study.args.report_only:
        return rewrite(study.args.report_only, summary_again, markdown, plot)
    cfg = config_from_args(study.args)
    with study.running() as work:
        quiet = wait_until_quiet(study.args.wait_quiet_s) if study.args.wait_quiet_s > 0 else None
        results = {**run_study(cfg, work, study.args.data_cache), "quiet_wait": quiet}
    results["summary"] = combine(results["reps"], results["config"])
    return study.finish(results, markdown, plot)


if __name__ == "__main__":
    raise SystemExit(main())
