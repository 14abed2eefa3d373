"""What a run asks of the cluster, and what the cluster has: `Resources` (the [slurm] table and the
sbatch-style options over it), the partitions' limits (GPUs, CPUs, memory, nodes, MaxArraySize),
time and memory as Slurm writes them, the sbatch parameters of the shard tasks and the merge job.
`SlurmError` is what Slurm refused, `SubmitRefused` what the toolkit refused before asking it."""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec

from toolkit.errors import BadInputError, FailedError
from toolkit.formats.runplan import RunPlan

log = logging.getLogger(__name__)


class SlurmError(FailedError):
    """A submission Slurm refused, or Slurm that did not answer (exit 1, as sbatch's). The message
    says what to change."""


class SubmitRefused(BadInputError):
    """A submission the toolkit refuses before asking Slurm (a bad option, a size no node has, a run
    already submitted): bad input, exit 2. The message says what to change."""


def refuse(message: str) -> SubmitRefused:
    """A submission refused here, before Slurm is asked: bad input."""
    return SubmitRefused(message)


class Resources(msgspec.Struct, kw_only=True):
    """What a command line overrides of the job's [slurm] table (None: the table's value)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    array_parallelism: int | None = None
    signal_delay_s: int | None = None
    setup: list[str] = []
    merge_partition: str | None = None
    # sbatch options by sbatch's own long name (`constraint`, `exclude`, ...): over [slurm] extra
    sbatch: dict[str, str | bool] = {}


# The sbatch options the command line takes as sbatch spells them (beside those of the table above),
# and whether the merge job (no GPU) gets them too: a node constraint or list is for the GPU tasks.
SBATCH_FLAGS = {
    "constraint": False,
    "nodelist": False,
    "exclusive": False,
    "exclude": True,
    "reservation": True,
    "mail_type": True,
    "mail_user": True,
    "comment": True,
}


def slurm_output(argv: list[str], timeout: float = 60) -> str:
    """stdout of a Slurm command, or SlurmError saying in one line why there is none
    (cluster.commands.call)."""
    from toolkit.cluster.commands import call

    a = call(argv, timeout)
    if a.ok:
        return a.out
    # "sacct did not answer in 5 s" -> "`sacct -j 12` did not answer in 5 s"
    if a.why.startswith(argv[0] + " "):
        raise SlurmError(f"`{' '.join(argv)}`{a.why[len(argv[0]) :]}")
    raise SlurmError(a.why)


def slurm_config(timeout: float = 60) -> dict[str, str]:
    out = {}
    for line in slurm_output(["scontrol", "show", "config"], timeout).splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def max_array_size(config: dict[str, str] | None = None) -> int:
    config = config or slurm_config()
    return int(config.get("MaxArraySize", "1001"))


class PartitionInfo(msgspec.Struct):
    name: str
    gpus_per_node: int  # most GPUs any of its nodes has
    cpus_per_node: int  # most CPUs any of its nodes has (0: unknown)


def partition_info(name: str | None) -> PartitionInfo:
    """The partition `name` (the default partition when None) and the largest node it has."""
    parts = {}
    default = None
    for line in slurm_output(["scontrol", "show", "partition", "-o"]).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        pname = fields.get("PartitionName")
        if pname:
            parts[pname] = fields
            if fields.get("Default") == "YES":
                default = pname
    if name is None:
        if default is None:
            raise refuse(
                f"no default partition: pass --partition (one of {', '.join(sorted(parts))})"
            )
        name = default
    if name not in parts:
        raise refuse(
            f"unknown partition {name!r}; this cluster has: {', '.join(sorted(parts)) or 'none'}"
        )
    gpus = cpus = 0
    for line in slurm_output(["sinfo", "-h", "-p", name, "-o", "%G|%c"]).split():
        gres, _, ncpu = line.partition("|")
        cpus = max(cpus, int(ncpu)) if ncpu.isdigit() else cpus
        for item in gres.split(","):
            m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item)
            if m:
                gpus = max(gpus, int(m.group(1)))
    return PartitionInfo(name, gpus, cpus)


def time_to_minutes(t: str) -> int:
    """Slurm time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t.strip())
    if not m:
        raise refuse(f"--time {t!r}: use a Slurm time such as 24:00:00 or 2-00:00:00")
    d, a, b, c = m.groups()
    if d is not None:
        hours, mins, secs = int(a), int(b or 0), int(c or 0)
    elif c is not None:
        hours, mins, secs = int(a), int(b), int(c)
    elif b is not None:
        hours, mins, secs = 0, int(a), int(b)
    else:
        hours, mins, secs = 0, int(a), 0
    total = (int(d or 0) * 24 + hours) * 60 + mins + (1 if secs else 0)
    return max(1, total)


def slurm_time(minutes: int) -> str:
    """Minutes as Slurm writes a time limit, hours:minutes:seconds (1440 -> 24:00:00)."""
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


_AT_LEAST = {"gpus_per_node": 0, "cpus_per_task": 1, "array_parallelism": 1, "signal_delay_s": 1}


def _given(o: Resources, s, key: str):
    """The value of resource `key`: the command line's when given (0 included), else the job's
    [slurm] table's."""
    value = getattr(o, key)
    return value if value is not None else getattr(s, key)


def check_resources(plan: RunPlan, o: Resources) -> None:
    """Refuse (bad input) a count below what Slurm can run — `--cpus-per-task 0`,
    `--array-parallelism 0` —, a time limit not longer than the signal delay, whether a flag or the
    job's [slurm] table gives it, and GPUs per node (`--gpus-per-node`, else [slurm]) that the
    engine does not use exactly: GPUs left idle, too few, or an engine of several nodes that cannot
    be laid out on them (engines.layout.check_engine_layout). Pure: no cluster is asked."""
    from toolkit.engines.layout import check_engine_layout

    s = plan.spec.slurm
    for key, least in _AT_LEAST.items():
        value = _given(o, s, key)
        if value is not None and value < least:
            where = (
                f"--{key.replace('_', '-')} {value}"
                if getattr(o, key) is not None
                else f"[slurm] {key} = {value}"
            )
            raise refuse(f"{where}: must be at least {least}")
    if s.merge_cpus < 1:
        raise refuse(f"[slurm] merge_cpus = {s.merge_cpus}: must be at least 1")
    check_signal_delay(time_to_minutes(o.time or s.time), _given(o, s, "signal_delay_s"))
    where = "--gpus-per-node" if o.gpus_per_node is not None else "[slurm] gpus_per_node"
    problem = check_engine_layout(plan.spec.engine, _given(o, s, "gpus_per_node"), where=where)
    if problem:
        raise refuse(problem)


def shard_params(plan: RunPlan, o: Resources) -> dict[str, Any]:
    s = plan.spec.slurm
    check_resources(plan, o)
    params: dict[str, Any] = dict(
        job_name=f"{plan.name}-shards",
        time=time_to_minutes(o.time or s.time),
        gpus_per_node=_given(o, s, "gpus_per_node"),
        cpus_per_task=_given(o, s, "cpus_per_task"),
        signal_delay_s=_given(o, s, "signal_delay_s"),
        array_parallelism=_given(o, s, "array_parallelism") or 256,
        setup=list(s.setup) + list(o.setup),
        stderr_to_stdout=True,
    )
    # Slurm's own time format in the script (submitit writes minutes); submitit keeps `time` for its
    # bookkeeping.
    params["additional_parameters"] = {
        "requeue": True,
        "time": slurm_time(params["time"]),
        **s.extra,
        **o.sbatch,
    }
    for key in ("partition", "account", "qos", "mem"):
        value = getattr(o, key) or getattr(s, key)
        if value:
            params[key] = value
    params.update(multi_node_params(plan.spec.engine.nodes))
    return params


def multi_node_params(nodes: int) -> dict[str, Any]:
    """An engine over `nodes` nodes: each array task allocates them with one task per node (GPUs,
    CPUs and memory per node as for one); the worker runs in a one-task step on the first node
    (submitit's srun), and starts the engine as its own srun step over every node
    (toolkit.engines.sglang)."""
    if nodes <= 1:
        return {}
    return {"nodes": nodes, "ntasks_per_node": 1, "srun_args": ["--nodes=1", "--ntasks=1"]}


def check_signal_delay(minutes: int, signal_delay_s: int) -> None:
    """A task is told to stop (USR2) `signal_delay_s` before its time limit: a limit not longer than
    that stops every task the moment it starts, and submitit requeues it, forever."""
    if minutes * 60 <= signal_delay_s:
        raise refuse(
            f"--time {slurm_time(minutes)} ({minutes * 60} s) is not longer than --signal-delay-s "
            f"{signal_delay_s}: every task would be told to stop at once and be requeued forever; "
            f"give a --time well above {signal_delay_s} s or a smaller --signal-delay-s"
        )


_MEM_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def mem_to_mb(mem: str) -> int:
    """Slurm's --mem (MB by default; K, M, G, T suffixes) in megabytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)B?", str(mem).strip().upper())
    if not m:
        raise refuse(f"--mem {mem!r}: use a Slurm size such as 200G or 64000M")
    return int(float(m.group(1)) * _MEM_UNITS[m.group(2) or "M"])


def node_memory_mb(partition: str) -> int:
    """The most memory (RealMemory, MB) any node of `partition` has; 0 when Slurm does not say."""
    best = 0
    for line in slurm_output(["sinfo", "-h", "-N", "-p", partition, "-o", "%m"]).split():
        digits = line.rstrip("+")
        if digits.isdigit():
            best = max(best, int(digits))
    return best


def check_memory(mem: str | None, partition: str) -> None:
    """--mem against the nodes' RealMemory: Slurm would keep such a task pending for ever (or refuse
    it)."""
    if not mem:
        return
    want = mem_to_mb(mem)
    if want == 0:  # --mem=0: all the memory of the node
        return
    have = node_memory_mb(partition)
    if have and want > have:
        raise refuse(
            f"--mem {mem} ({want} MB) but the nodes of partition {partition!r} have at most {have} "
            "MB (RealMemory); lower it or choose another partition"
        )


def merge_params(plan: RunPlan, o: Resources, dependency: str) -> dict[str, Any]:
    s = plan.spec.slurm
    params: dict[str, Any] = dict(
        job_name=f"{plan.name}-merge",
        time=time_to_minutes(s.merge_time),
        cpus_per_task=s.merge_cpus,
        setup=list(s.setup) + list(o.setup),
        dependency=dependency,
        stderr_to_stdout=True,
    )
    params["additional_parameters"] = {
        "time": slurm_time(params["time"]),
        **{k: v for k, v in o.sbatch.items() if SBATCH_FLAGS.get(k)},
    }
    for key in ("partition", "account", "qos"):
        value = getattr(o, key) or getattr(s, key)
        if value:
            params[key] = value
    merge_partition = o.merge_partition or s.merge_partition
    if merge_partition:
        params["partition"] = merge_partition
    if s.merge_mem:
        params["mem"] = s.merge_mem
    return params


def validate_resources(plan: RunPlan, o: Resources) -> Resources:
    """Check partition, GPUs, CPUs and memory against the cluster; returns the options with the
    partition resolved."""
    return validate_on_cluster(plan, o)[0]


def validate_on_cluster(plan: RunPlan, o: Resources) -> tuple[Resources, PartitionInfo]:
    part = partition_info(o.partition or plan.spec.slurm.partition)
    name, gpus = part.name, part.gpus_per_node
    o = msgspec.structs.replace(o, partition=name)
    want = o.gpus_per_node if o.gpus_per_node is not None else plan.spec.slurm.gpus_per_node
    if want > gpus:
        raise refuse(
            f"--gpus-per-node {want} but the nodes of partition {name!r} have at most {gpus} GPUs; "
            f"lower it (and [engine] tp_size) or choose another partition"
        )
    cpus = _given(o, plan.spec.slurm, "cpus_per_task")
    if part.cpus_per_node and cpus > part.cpus_per_node:
        raise refuse(
            f"--cpus-per-task {cpus} but the nodes of partition {name!r} have at most "
            f"{part.cpus_per_node} CPUs; lower it or choose another partition"
        )
    check_memory(o.mem or plan.spec.slurm.mem, name)
    merge_partition = o.merge_partition or plan.spec.slurm.merge_partition
    if merge_partition:
        partition_info(merge_partition)  # refused when the cluster has no such partition
    kind = plan.spec.engine.kind
    tp_dp = plan.spec.engine.tp_size * plan.spec.engine.dp_size
    if kind == "sglang" and plan.spec.engine.nodes == 1 and want < tp_dp:
        raise refuse(
            f"[engine] tp_size x dp_size = {tp_dp} GPUs but only {want} per task (--gpus-per-node)"
        )
    check_nodes(plan.spec.engine, name)
    return o, part


def check_nodes(engine, partition: str) -> None:
    """An engine of several nodes: the partition has that many (SlurmError otherwise; the layout of
    its GPUs is check_resources')."""
    if engine.nodes <= 1:
        return
    have = partition_nodes(partition)
    if have < engine.nodes:
        raise refuse(
            f"[engine] nodes = {engine.nodes} but partition {partition!r} has {have} node(s); "
            "lower it (and tp_size) or choose another partition"
        )


def partition_nodes(name: str) -> int:
    for line in slurm_output(["scontrol", "show", "partition", name, "-o"]).splitlines():
        m = re.search(r"\bTotalNodes=(\d+)", line)
        if m:
            return int(m.group(1))
    return 0
