"""What a run will cost, said before it is submitted: output tokens, node-hours and wall time.

The output tokens come from the plan: every planned output at most its dataset's max_new_tokens (the
upper bound), and expected at a mean output length — the one a run of the job measured (its progress
files) when there is one, else `[estimate] mean_output_tokens`. Node-hours and wall time need one
engine's output rate, `[estimate] tokens_per_s` (each recipe in jobs/ gives a published figure with
its source), plus one model load per task (`[estimate] load_minutes`). Pure arithmetic on the plan,
except `measured_mean`, which reads the run's progress files. docs/submit.md says the method.
"""

from __future__ import annotations

import math

import msgspec

from toolkit.formats.progress import read_progress
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan

__all__ = ["Cost", "estimate", "measured_mean", "describe", "time_warning", "said"]

MEASURED_AT_LEAST = 32  # outputs a run must have recorded before its mean output length is used


class Cost(msgspec.Struct, kw_only=True):
    outputs: int  # planned outputs
    max_tokens: int  # every output to its max_new_tokens
    mean_tokens: float | None  # expected output length (None: unknown)
    mean_source: str  # where mean_tokens comes from
    tokens_per_s: float | None  # one engine's output tokens/s at full batch
    engines: int  # engines generating at once (the array's tasks)
    nodes_per_engine: int
    load_minutes: float | None  # one model load (weights, CUDA graphs)
    shards: int

    @property
    def expected_tokens(self) -> int | None:
        if self.mean_tokens is None:
            return None
        return min(self.max_tokens, round(self.outputs * self.mean_tokens))

    def generating_hours(self, tokens: int) -> float | None:
        """Engine-hours of generation for `tokens` output tokens (None: no rate known)."""
        if not self.tokens_per_s:
            return None
        return tokens / self.tokens_per_s / 3600

    def node_hours(self, tokens: int) -> float | None:
        gen = self.generating_hours(tokens)
        if gen is None:
            return None
        loads = self.engines * (self.load_minutes or 0) / 60
        return (gen + loads) * self.nodes_per_engine

    def wall_hours(self, tokens: int) -> float | None:
        gen = self.generating_hours(tokens)
        if gen is None:
            return None
        return gen / max(1, self.engines) + (self.load_minutes or 0) / 60


def measured_mean(rd: RunDir, plan: RunPlan) -> tuple[float, int] | None:
    """(mean output tokens per recorded output, outputs recorded) over the run's progress files, or
    None when the run has recorded fewer than MEASURED_AT_LEAST outputs."""
    done = tokens = 0
    for s in plan.shards:
        p = read_progress(rd, s.index)
        if p is not None and p.done:
            done += p.done - p.failed
            tokens += p.output_tokens
    if done < MEASURED_AT_LEAST:
        return None
    return tokens / done, done


def estimate(plan: RunPlan, *, engines: int, measured: tuple[float, int] | None = None) -> Cost:
    """The cost of `plan` with `engines` engines at once; `measured`: `measured_mean` of its run."""
    spec = plan.spec
    e = spec.estimate
    max_tokens = sum(
        d.planned * int(spec.sampling_for(d.name).get("max_new_tokens") or 0) for d in plan.datasets
    )
    if measured is not None:
        mean, n = measured
        source = f"measured: the mean of the {n:,} outputs this run has recorded"
    elif e.mean_output_tokens is not None:
        mean, source = float(e.mean_output_tokens), "[estimate] mean_output_tokens"
    else:
        mean, source = None, "unknown"
    return Cost(
        outputs=plan.total,
        max_tokens=max_tokens,
        mean_tokens=mean,
        mean_source=source,
        tokens_per_s=e.tokens_per_s,
        engines=max(1, min(engines, len(plan.shards))),
        nodes_per_engine=spec.engine.nodes,
        load_minutes=e.load_minutes,
        shards=len(plan.shards),
    )


def _tokens(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _hours(cost: Cost, tokens: int) -> str:
    nh, wall = cost.node_hours(tokens), cost.wall_hours(tokens)
    if nh is None or wall is None:
        return ""
    return f" = {nh:,.1f} node-hours, {wall:,.1f} h wall"


def describe(cost: Cost, kind: str) -> list[str]:
    """The estimate in lines (`kind`: the engine kind; the stub costs no GPU time)."""
    if kind == "stub":
        return ["cost: the stub engine generates synthetic text on the CPU; no GPU time"]
    per = f"{cost.nodes_per_engine} nodes" if cost.nodes_per_engine > 1 else "1 node"
    lines = [
        f"cost: {cost.outputs:,} outputs, at most {_tokens(cost.max_tokens)} output tokens "
        f"(every output to max_new_tokens){_hours(cost, cost.max_tokens)}"
    ]
    if cost.expected_tokens is not None:
        lines.append(
            f"  expected {_tokens(cost.expected_tokens)} at {cost.mean_tokens:,.0f} tokens per "
            f"output ({cost.mean_source}){_hours(cost, cost.expected_tokens)}"
        )
    else:
        lines.append(
            "  expected: unknown until the run measures its outputs; set [estimate] "
            "mean_output_tokens (reasoning outputs often average 5-8k tokens)"
        )
    if cost.tokens_per_s:
        load = (
            f", {cost.load_minutes:g} min per model load"
            if cost.load_minutes
            else ", model loads not counted ([estimate] load_minutes)"
        )
        lines.append(
            f"  at {cost.tokens_per_s:,.0f} output tokens/s per engine ([estimate] tokens_per_s), "
            f"{cost.engines} engine(s) of {per} at once{load}"
        )
    else:
        lines.append(
            "  node-hours: set [estimate] tokens_per_s (one engine's output tokens/s; the recipes "
            "in jobs/ give published figures)"
        )
    return lines


def time_warning(cost: Cost, time_minutes: int, signal_delay_s: int) -> str | None:
    """Why a task's time limit is too short to load the model and generate one shard (None: it is
    long enough, or the figures are unknown)."""
    tokens = cost.expected_tokens if cost.expected_tokens is not None else cost.max_tokens
    gen = cost.generating_hours(math.ceil(tokens / max(1, cost.shards)))
    if gen is None:
        return None
    usable = time_minutes - signal_delay_s / 60
    needed = (cost.load_minutes or 0) + gen * 60
    if usable >= needed:
        return None
    load = f"a model load ({cost.load_minutes:g} min) plus " if cost.load_minutes else ""
    return (
        f"a task's time limit leaves {usable:.0f} min before its stop signal, less than {load}one "
        f"shard ({gen * 60:.0f} min at {cost.tokens_per_s:,.0f} tokens/s): each task would stop "
        "before finishing a shard and be requeued to load again; give a longer --time or more "
        "[sharding] shards"
    )


def said(
    plan: RunPlan, rd: RunDir, *, engines: int, time_minutes: int, signal_delay_s: int
) -> tuple[str | None, list[str]]:
    """What `check` and `submit --dry-run` say of a run of `plan` in `rd` (its measured mean, once
    it has one) with `engines` at once: (a warning on the tasks' time limit, or None; the estimate's
    lines)."""
    c = estimate(plan, engines=engines, measured=measured_mean(rd, plan))
    return time_warning(c, time_minutes, signal_delay_s), describe(c, plan.spec.engine.kind)
