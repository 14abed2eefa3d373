"""Slurm submission: one array task per shard through submitit, a dependent merge job, resubmit and cancel.

Everything a login node does to put a run on the cluster. The run is validated and planned first (spec,
every prompt line, tokenizer and template — sglang is never imported here), then submitted as job arrays
(split at the cluster's MaxArraySize) and a merge-and-audit job with an `afterany` dependency on them.
What was submitted is appended to `RUN/slurm/jobs.json`, which `status`, `logs`, `resubmit` and `cancel` read.

Time limits and preemption: tasks get `--signal=USR2@<signal_delay_s>` and `--requeue`. On the signal the
worker stops sending requests, writes what it has, shuts the engine down and hands over to submitit's
checkpointing, which requeues the task; the requeued task resumes from its shard file.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from typing import Any

import msgspec

from .errors import EXIT_BAD_INPUT, EXIT_FAILED, ToolkitError
from .files import atomic_write
from .fmt import ranges, utc_now
from .plan import RunPlan, load_run
from .rundir import RunDir
from .shardfile import needs_work, read_done

__all__ = ["Resources", "SlurmError", "SubmitResult", "submit", "resubmit", "cancel", "read_jobs", "ShardTask",
           "MergeTask", "describe_array", "format_dry_run", "format_submission"]

log = logging.getLogger(__name__)


class SlurmError(ToolkitError):
    """A submission Slurm refused, or Slurm that did not answer (exit 1, as sbatch's); a submission the toolkit
    refuses before asking Slurm (a bad option, a size no node has, a run already submitted) is bad input (exit 2,
    `SlurmError(..., exit_code=EXIT_BAD_INPUT)`). The message says what to change."""

    exit_code = EXIT_FAILED


def _refuse(message: str) -> SlurmError:
    """A submission refused here, before Slurm is asked: bad input."""
    return SlurmError(message, exit_code=EXIT_BAD_INPUT)


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


# ---------------------------------------------------------------------------------------------------
# what was submitted
# ---------------------------------------------------------------------------------------------------
class ArrayJob(msgspec.Struct):
    job_id: str
    shards: list[int]      # array task i runs shards[i]
    tasks: list[str] = []  # Slurm id of each task: "123_4", or "123" when submitit sent a single job


class Submission(msgspec.Struct):
    submitted: str
    arrays: list[ArrayJob]
    merge_job_id: str | None
    sbatch: dict[str, Any] = {}


class Jobs(msgspec.Struct):
    submissions: list[Submission] = []


def read_jobs(rd: RunDir) -> Jobs:
    try:
        return msgspec.json.decode(rd.jobs_file.read_bytes(), type=Jobs)
    except FileNotFoundError:
        return Jobs()


def _append_submission(rd: RunDir, sub: Submission) -> None:
    jobs = read_jobs(rd)
    jobs.submissions.append(sub)
    atomic_write(rd.jobs_file, msgspec.json.format(msgspec.json.encode(jobs), indent=2))


def job_ids(rd: RunDir) -> list[str]:
    ids = []
    for s in read_jobs(rd).submissions:
        ids += [a.job_id for a in s.arrays]
        if s.merge_job_id:
            ids.append(s.merge_job_id)
    return ids


# ---------------------------------------------------------------------------------------------------
# the callables Slurm runs (pickled by submitit)
# ---------------------------------------------------------------------------------------------------
def _log_to_stderr() -> None:
    """Inside a Slurm task: the toolkit's log lines go to the task's output (submitit's log file) too."""
    logger = logging.getLogger("toolkit")
    if not any(getattr(h, "_toolkit_stderr", False) for h in logger.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        h._toolkit_stderr = True  # type: ignore[attr-defined]
        logger.addHandler(h)
        logger.setLevel(logging.INFO)


class ShardTask:
    """Runs one shard in an array task; on SIGUSR2 (time limit or preemption) stops cleanly and requeues."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self, shard: int) -> str:
        from .progress import read_progress
        from .worker import STOPPED, run_shard

        _log_to_stderr()
        submitit_handler = signal.getsignal(signal.SIGUSR2)
        result = run_shard(self.run_dir, shard)  # raises ShardFailed: the task fails, Slurm shows FAILED
        if result == STOPPED:
            rd = RunDir(self.run_dir)
            p = read_progress(rd.progress_file(shard))
            if p is not None and p.stop_signal == "SIGUSR2" and callable(submitit_handler):
                # Let submitit do what it does on its signal: checkpoint (this same call) and requeue.
                signal.signal(signal.SIGUSR2, submitit_handler)
                submitit_handler(signal.SIGUSR2, None)
        return result

    def checkpoint(self, shard: int):
        import submitit

        return submitit.helpers.DelayedSubmission(ShardTask(self.run_dir), shard)


class MergeTask:
    """The run's final job: merge every shard and audit the result (fails the job when the audit fails)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> int:
        from .pipeline import merge_and_audit

        _log_to_stderr()
        try:
            code = merge_and_audit(self.run_dir)
        except ToolkitError as e:  # the job's own `toolkit: error:` line, which `logs --failed` shows as why
            sys.stderr.write(f"toolkit: error: {e}\n")
            raise RuntimeError(f"merge of {self.run_dir} refused (exit {e.exit_code})") from None
        if code != 0:
            rd = RunDir(self.run_dir)
            raise RuntimeError(f"merge/audit of {self.run_dir} failed (exit {code}); see "
                               f"{rd.audit_json.relative_to(rd.root).as_posix()}")
        return code


# ---------------------------------------------------------------------------------------------------
# talking to Slurm
# ---------------------------------------------------------------------------------------------------
def _run(argv: list[str], timeout: float = 60) -> str:
    """stdout of a Slurm command, or SlurmError saying in one line why there is none (slurmcmd.call)."""
    from .slurmcmd import call

    a = call(argv, timeout)
    if a.ok:
        return a.out
    if a.why.startswith(argv[0] + " "):  # "sacct did not answer in 5 s" -> "`sacct -j 12` did not answer in 5 s"
        raise SlurmError(f"`{' '.join(argv)}`{a.why[len(argv[0]):]}")
    raise SlurmError(a.why)


def slurm_config(timeout: float = 60) -> dict[str, str]:
    out = {}
    for line in _run(["scontrol", "show", "config"], timeout).splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def max_array_size(config: dict[str, str] | None = None) -> int:
    config = config or slurm_config()
    return int(config.get("MaxArraySize", "1001"))


class PartitionInfo(msgspec.Struct):
    name: str
    gpus_per_node: int   # most GPUs any of its nodes has
    cpus_per_node: int   # most CPUs any of its nodes has (0: unknown)


def partition_info(name: str | None) -> PartitionInfo:
    """The partition `name` (the default partition when None) and the largest node it has."""
    parts = {}
    default = None
    for line in _run(["scontrol", "show", "partition", "-o"]).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        pname = fields.get("PartitionName")
        if pname:
            parts[pname] = fields
            if fields.get("Default") == "YES":
                default = pname
    if name is None:
        if default is None:
            raise _refuse(f"no default partition: pass --partition (one of {', '.join(sorted(parts))})")
        name = default
    if name not in parts:
        raise _refuse(f"unknown partition {name!r}; this cluster has: {', '.join(sorted(parts)) or 'none'}")
    gpus = cpus = 0
    for line in _run(["sinfo", "-h", "-p", name, "-o", "%G|%c"]).split():
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
        raise _refuse(f"--time {t!r}: use a Slurm time such as 24:00:00 or 2-00:00:00")
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


def _executor(rd: RunDir, params: dict[str, Any], *, script_only: bool = False):
    """submitit's executor for the run; `script_only`: one that only renders scripts (no Slurm needed)."""
    import submitit

    cls = submitit.SlurmExecutor
    if script_only:
        class _ScriptOnly(cls):  # submitit refuses to build an executor where `srun` is missing
            @classmethod
            def affinity(cls) -> int:
                return 1

        cls = _ScriptOnly
    ex = cls(folder=str(rd.job_folder()), max_num_timeout=20)
    ex.update_parameters(**params)
    return ex


def sbatch_script(rd: RunDir, params: dict[str, Any], *, array: int | None = None) -> str:
    """The sbatch script submitit writes for these parameters (an array of `array` tasks, or one job), rendered by
    submitit itself (as `map_array` and `submit` do), so what a dry run shows is what is submitted."""
    ex = _executor(rd, params, script_only=True)
    if array is not None:
        ex.parameters["map_count"] = array
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


_AT_LEAST = {"gpus_per_node": 0, "cpus_per_task": 1, "array_parallelism": 1, "signal_delay_s": 1}


def _given(o: Resources, s, key: str):
    """The value of resource `key`: the command line's when given (0 included), else the job's [slurm] table's."""
    value = getattr(o, key)
    return value if value is not None else getattr(s, key)


def check_resources(plan: RunPlan, o: Resources) -> None:
    """Refuse (bad input) a count below what Slurm can run — `--cpus-per-task 0`, `--array-parallelism 0` —, a
    time limit not longer than the signal delay, whether a flag or the job's [slurm] table gives it, and a
    `--gpus-per-node` that an engine of several nodes cannot be laid out on. Pure: no cluster is asked."""
    from .spec import check_engine_layout

    s = plan.spec.slurm
    for key, least in _AT_LEAST.items():
        value = _given(o, s, key)
        if value is not None and value < least:
            where = f"--{key.replace('_', '-')} {value}" if getattr(o, key) is not None else f"[slurm] {key} = {value}"
            raise _refuse(f"{where}: must be at least {least}")
    if s.merge_cpus < 1:
        raise _refuse(f"[slurm] merge_cpus = {s.merge_cpus}: must be at least 1")
    check_signal_delay(time_to_minutes(o.time or s.time), _given(o, s, "signal_delay_s"))
    if o.gpus_per_node is not None:  # [slurm] gpus_per_node was checked with the spec
        problem = check_engine_layout(plan.spec.engine, o.gpus_per_node, where="--gpus-per-node")
        if problem:
            raise _refuse(problem)


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
    # Slurm's own time format in the script (submitit writes minutes); submitit keeps `time` for its bookkeeping.
    params["additional_parameters"] = {"requeue": True, "time": slurm_time(params["time"]), **s.extra}
    for key in ("partition", "account", "qos", "mem"):
        value = getattr(o, key) or getattr(s, key)
        if value:
            params[key] = value
    params.update(multi_node_params(plan.spec.engine.nodes))
    return params


def multi_node_params(nodes: int) -> dict[str, Any]:
    """An engine over `nodes` nodes: each array task allocates them with one task per node (GPUs, CPUs and memory
    per node as for one); the worker runs in a one-task step on the first node (submitit's srun), and starts
    the engine as its own srun step over every node (toolkit.engines.sglang)."""
    if nodes <= 1:
        return {}
    return {"nodes": nodes, "ntasks_per_node": 1, "srun_args": ["--nodes=1", "--ntasks=1"]}


def check_signal_delay(minutes: int, signal_delay_s: int) -> None:
    """A task is told to stop (USR2) `signal_delay_s` before its time limit: a limit not longer than that stops
    every task the moment it starts, and submitit requeues it, forever."""
    if minutes * 60 <= signal_delay_s:
        raise _refuse(
            f"--time {slurm_time(minutes)} ({minutes * 60} s) is not longer than --signal-delay-s {signal_delay_s}: "
            f"every task would be told to stop at once and be requeued forever; give a --time well above "
            f"{signal_delay_s} s or a smaller --signal-delay-s"
        )


_MEM_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def mem_to_mb(mem: str) -> int:
    """Slurm's --mem (MB by default; K, M, G, T suffixes) in megabytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)B?", str(mem).strip().upper())
    if not m:
        raise _refuse(f"--mem {mem!r}: use a Slurm size such as 200G or 64000M")
    return int(float(m.group(1)) * _MEM_UNITS[m.group(2) or "M"])


def node_memory_mb(partition: str) -> int:
    """The most memory (RealMemory, MB) any node of `partition` has; 0 when Slurm does not say."""
    best = 0
    for line in _run(["sinfo", "-h", "-N", "-p", partition, "-o", "%m"]).split():
        digits = line.rstrip("+")
        if digits.isdigit():
            best = max(best, int(digits))
    return best


def check_memory(mem: str | None, partition: str) -> None:
    """--mem against the nodes' RealMemory: Slurm would keep such a task pending for ever (or refuse it)."""
    if not mem:
        return
    want = mem_to_mb(mem)
    if want == 0:  # --mem=0: all the memory of the node
        return
    have = node_memory_mb(partition)
    if have and want > have:
        raise _refuse(f"--mem {mem} ({want} MB) but the nodes of partition {partition!r} have at most {have} MB "
                         f"(RealMemory); lower it or choose another partition")


def merge_params(plan: RunPlan, o: Resources, dependency: str) -> dict[str, Any]:
    s = plan.spec.slurm
    params: dict[str, Any] = dict(
        job_name=f"{plan.name}-merge", time=time_to_minutes(s.merge_time), cpus_per_task=s.merge_cpus,
        setup=list(s.setup) + list(o.setup), dependency=dependency, stderr_to_stdout=True,
    )
    params["additional_parameters"] = {"time": slurm_time(params["time"])}
    for key in ("partition", "account", "qos"):
        value = getattr(o, key) or getattr(s, key)
        if value:
            params[key] = value
    if s.merge_mem:
        params["mem"] = s.merge_mem
    return params


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _submit_arrays(rd: RunDir, plan: RunPlan, shards: list[int], o: Resources) -> Submission:
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    try:
        return _submit_arrays_unguarded(rd, plan, shards, o)
    except (FailedJobError, FailedSubmissionError) as e:  # sbatch itself refused (submitit's error holds its output)
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        said = next((x for x in reversed(lines) if "error" in x.lower()), lines[-1] if lines else "no message")
        raise SlurmError(f"sbatch failed: {said}; check `squeue --me` for jobs this command may already have "
                         "submitted") from None


def _submit_arrays_unguarded(rd: RunDir, plan: RunPlan, shards: list[int], o: Resources) -> Submission:
    params = shard_params(plan, o)
    limit = max_array_size()
    arrays = []
    ex = _executor(rd, params)
    for chunk in _chunks(shards, limit):
        jobs = ex.map_array(ShardTask(str(rd.root)), chunk)
        arrays.append(ArrayJob(jobs[0].job_id.split("_")[0], chunk, [str(j.job_id) for j in jobs]))
    dep = "afterany:" + ":".join(a.job_id for a in arrays)
    mex = _executor(rd, merge_params(plan, o, dep))
    merge_job = mex.submit(MergeTask(str(rd.root)))
    sub = Submission(
        submitted=utc_now(),
        arrays=arrays, merge_job_id=str(merge_job.job_id), sbatch={k: v for k, v in params.items() if k != "setup"},
    )
    _append_submission(rd, sub)
    return sub


def validate_resources(plan: RunPlan, o: Resources) -> Resources:
    """Check partition, GPUs, CPUs and memory against the cluster; returns the options with the partition resolved."""
    return _validate(plan, o)[0]


def _validate(plan: RunPlan, o: Resources) -> tuple[Resources, PartitionInfo]:
    part = partition_info(o.partition or plan.spec.slurm.partition)
    name, gpus = part.name, part.gpus_per_node
    o = msgspec.structs.replace(o, partition=name)
    want = o.gpus_per_node if o.gpus_per_node is not None else plan.spec.slurm.gpus_per_node
    if want > gpus:
        raise _refuse(
            f"--gpus-per-node {want} but the nodes of partition {name!r} have at most {gpus} GPUs; "
            f"lower it (and [engine] tp_size) or choose another partition"
        )
    cpus = _given(o, plan.spec.slurm, "cpus_per_task")
    if part.cpus_per_node and cpus > part.cpus_per_node:
        raise _refuse(f"--cpus-per-task {cpus} but the nodes of partition {name!r} have at most "
                         f"{part.cpus_per_node} CPUs; lower it or choose another partition")
    check_memory(o.mem or plan.spec.slurm.mem, name)
    kind = plan.spec.engine.kind
    tp_dp = plan.spec.engine.tp_size * plan.spec.engine.dp_size
    if kind == "sglang" and plan.spec.engine.nodes == 1 and want < tp_dp:
        raise _refuse(f"[engine] tp_size x dp_size = {tp_dp} GPUs but only {want} per task (--gpus-per-node)")
    check_nodes(plan.spec.engine, name)
    return o, part


# ---------------------------------------------------------------------------------------------------
# dry run: the scripts, with or without a cluster
# ---------------------------------------------------------------------------------------------------
DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's default MaxArraySize, assumed when no cluster answers
DEPENDENCY_PLACEHOLDER = "ARRAY_JOB_ID"
PROBE_TIMEOUT_S = 20           # a dry run waits this long for a cluster to answer


class ClusterCheck(msgspec.Struct):
    reachable: bool
    why: str = ""                           # why not reachable
    partition: PartitionInfo | None = None  # as validated
    max_array_size: int = DEFAULT_MAX_ARRAY_SIZE


class DryRun(msgspec.Struct):
    run_dir: str
    prompts: int
    datasets: int
    shards: int
    fingerprint: str
    cluster: ClusterCheck
    arrays: list[list[int]]     # the shards of each array
    array_scripts: list[str]    # the sbatch script of each array, as submitit writes it
    merge_script: str


def check_cluster(plan: RunPlan, options: Resources) -> tuple[Resources, ClusterCheck]:
    """Validate against the cluster when one answers (a bad partition or size still raises SlurmError)."""
    try:  # (a SLURM_CONF that does not exist is said at once: slurmcmd.call)
        config = slurm_config(timeout=PROBE_TIMEOUT_S)
    except SlurmError as e:
        return options, ClusterCheck(reachable=False, why=str(e).splitlines()[0])
    o, part = _validate(plan, options)
    return o, ClusterCheck(reachable=True, partition=part, max_array_size=max_array_size(config))


def plan_dry_run(plan: RunPlan, options: Resources, rd: RunDir | None = None) -> DryRun:
    """What `submit` would send, without submitting or writing anything: submitit's scripts for each array and
    for the merge job (its dependency on the arrays shown as ARRAY_JOB_ID, known only once they are submitted), for
    the shards submit would send (those without a done manifest of run directory `rd`). An array of one task is a
    plain job, as submitit sends it."""
    rd = rd or RunDir(plan.spec.output_dir)
    check_resources(plan, options)
    o, cluster = check_cluster(plan, options)
    arrays = _chunks(_pending(rd, plan), cluster.max_array_size)
    params = shard_params(plan, o)
    scripts = [sbatch_script(rd, params, array=len(a) if len(a) > 1 else None) for a in arrays]
    names = [DEPENDENCY_PLACEHOLDER] if len(arrays) == 1 else [f"{DEPENDENCY_PLACEHOLDER}_{i + 1}" for i in range(len(arrays))]
    merge = sbatch_script(rd, merge_params(plan, o, "afterany:" + ":".join(names)))
    return DryRun(run_dir=rd.shown, prompts=plan.total, datasets=len(plan.datasets), shards=len(plan.shards),
                  fingerprint=plan.fingerprint, cluster=cluster, arrays=arrays, array_scripts=scripts,
                  merge_script=merge)


def format_dry_run(d: DryRun) -> str:
    c = d.cluster
    lines = [f"dry run: {d.prompts} prompts in {d.datasets} datasets -> {d.shards} shards, fingerprint {d.fingerprint}",
             f"run directory would be: {d.run_dir}"]
    if c.reachable and c.partition:
        p = c.partition
        lines.append(f"validated against the cluster: partition {p.name} (nodes with up to {p.gpus_per_node} GPUs, "
                     f"{p.cpus_per_node or '?'} CPUs), MaxArraySize {c.max_array_size}")
    else:
        lines.append(f"Slurm not reachable: not validated against a cluster ({c.why}); MaxArraySize assumed "
                     f"{c.max_array_size}")
    lines.append(f"{len(d.arrays)} job array(s) (MaxArraySize {c.max_array_size}): "
                 + "; ".join(f"shards {ranges(a, sep=',')}" for a in d.arrays))
    lines.append("nothing submitted. The scripts submitit will write and sbatch:")
    for i, (shards, script) in enumerate(zip(d.arrays, d.array_scripts)):
        runs = (f"one job: runs shard {shards[0]}, sent as a plain job (not an array)" if len(shards) == 1 else
                f"task i runs shard {shards[0]} + i" if shards == list(range(shards[0], shards[0] + len(shards))) else
                "task i runs the i-th of them")
        lines.append(f"\n==> array {i + 1} of {len(d.arrays)}: shards {ranges(shards, sep=',')} ({runs}) <==")
        lines.append(script.rstrip("\n"))
    lines.append(f"\n==> merge + audit job, after the array(s); {DEPENDENCY_PLACEHOLDER} is the array's job id, "
                 "known once it is submitted <==")
    lines.append(d.merge_script.rstrip("\n"))
    return "\n".join(lines)


def check_nodes(engine, partition: str) -> None:
    """An engine of several nodes: the partition has that many (SlurmError otherwise; the layout of its GPUs is
    check_resources')."""
    if engine.nodes <= 1:
        return
    have = partition_nodes(partition)
    if have < engine.nodes:
        raise _refuse(f"[engine] nodes = {engine.nodes} but partition {partition!r} has {have} node(s); lower it "
                         f"(and tp_size) or choose another partition")


def partition_nodes(name: str) -> int:
    for line in _run(["scontrol", "show", "partition", name, "-o"]).splitlines():
        m = re.search(r"\bTotalNodes=(\d+)", line)
        if m:
            return int(m.group(1))
    return 0


class SubmitResult(msgspec.Struct):
    """What `submit` did: the run, and its submission (None with dry_run: `dry_run` says what it would send)."""

    run_dir: str
    plan: RunPlan
    submission: Submission | None = None
    dry_run: DryRun | None = None


def submit(job: str, resources: Resources | None = None, *, dry_run: bool = False,
           new_run: bool = False) -> SubmitResult:
    """Validate and plan `job` (the pre-flight `run` and `check` share), then submit its arrays and merge job, or
    with dry_run only render them (another run in output_dir is then a warning; a real submission is refused
    there)."""
    from .pipeline import prepare_run

    o = resources or Resources()

    def validate(plan: RunPlan, rd: RunDir):
        _check_submittable(rd, plan)
        check_resources(plan, o)
        return plan_dry_run(plan, o, rd) if dry_run else validate_resources(plan, o)

    prep = prepare_run(job, new_run=new_run, dry_run=dry_run, validate=validate, as_submitted=True)
    if dry_run:
        return SubmitResult(str(prep.run_dir.root), prep.plan, dry_run=prep.validated)
    rd, plan, o = prep.run_dir, prep.plan, prep.validated
    return SubmitResult(str(rd.root), plan, submission=_submit_arrays(rd, plan, _pending(rd, plan), o))


def _pending(rd: RunDir, plan: RunPlan) -> list[int]:
    """The shards of a run without a done manifest (all of them for a run not created yet)."""
    return [k for k in range(len(plan.shards)) if read_done(rd.done_file(k)) is None]


def _check_submittable(rd: RunDir, plan: RunPlan) -> None:
    """`submit` (and its dry run) refuses a run already submitted, or with every shard done."""
    if not RunDir.is_run(rd.root):
        return
    if read_jobs(rd).submissions:
        raise _refuse(f"{rd.root} was already submitted; use `toolkit resubmit {rd.root}` for what is left")
    if not _pending(rd, plan):
        raise _refuse(f"every shard of {rd.root} is already done; `toolkit merge {rd.root}` if it is not merged yet")


def live_jobs(rd: RunDir) -> dict[str, str]:
    """Array tasks and jobs of this run that are still pending or running, from squeue: {id: state}."""
    ids = job_ids(rd)
    if not ids:
        return {}
    from .states import parse_squeue

    out = _run(["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i|%T|%N|%r"])  # the rows status reads too
    return {jid: job.state for jid, job in parse_squeue(out.splitlines()).items()}


def resubmit(run_dir: str | os.PathLike, resources: Resources | None = None) -> tuple[RunDir, Submission | None, list[int]]:
    """Submit one array over exactly the shards without a done manifest (or with transient failures left, see
    shardfile.needs_work), and a new merge job."""
    rd, plan = load_run(run_dir)
    live = live_jobs(rd)
    if live:
        shown = ", ".join(f"{j} {s.lower()}" for j, s in sorted(live.items())[:8])
        raise SlurmError(f"{len(live)} jobs of this run are still pending or running ({shown}); wait for them or "
                         f"`toolkit cancel {rd.root}` first")
    missing = [k for k in range(len(plan.shards)) if needs_work(read_done(rd.done_file(k)))]
    if not missing:
        return rd, None, []
    o = validate_resources(plan, resources or Resources())
    return rd, _submit_arrays(rd, plan, missing, o), missing


def why_unfinished(rd: RunDir, shards: list[int]) -> str:
    """Why each of `shards` is (re)submitted, grouped: `0-2 without a done manifest; 4 with ids `toolkit retry --ids`
    asked for; 5 with 3 failures that may pass` (a done manifest that counts transient failures: see
    shardfile.needs_work)."""
    missing, asked, transient = [], [], {}
    for k in shards:
        m = read_done(rd.done_file(k))
        if m is not None:
            transient[k] = m.transient
        else:
            (asked if rd.retry_file(k).exists() else missing).append(k)
    parts = [f"{ranges(missing, sep=',')} without a done manifest"] if missing else []
    if asked:
        parts.append(f"{ranges(asked, sep=',')} with ids `toolkit retry --ids` asked for")
    if transient:
        n = sum(transient.values())
        parts.append(f"{ranges(list(transient), sep=',')} with {n} failure{'s' if n != 1 else ''} that may pass")
    return "; ".join(parts)


def cancel(run_dir: str | os.PathLike) -> list[str]:
    rd, _ = load_run(run_dir)
    ids = job_ids(rd)
    if ids:
        _run(["scancel", *ids])
    return ids


# ---------------------------------------------------------------------------------------------------
# what the commands print
# ---------------------------------------------------------------------------------------------------
MAPPED = 8  # array task -> shard pairs named in full
JOBS_FILE = RunDir(".").jobs_file.as_posix()  # as a run directory holds it: slurm/jobs.json


def describe_array(a: ArrayJob) -> str:
    """Which shard each task of an array runs, in words: `Submitted batch job 7 (array of 3 shard tasks: ...)`."""
    n, first = len(a.shards), a.shards[0]
    task = lambda i: a.tasks[i] if i < len(a.tasks) else f"{a.job_id}_{i}"  # noqa: E731
    if n == 1:  # submitit sends a single task as a plain job
        return f"Submitted batch job {a.job_id} (1 shard task: {task(0)} runs shard {first})"
    if a.shards == list(range(first, first + n)):
        which = "task i runs shard i" if first == 0 else f"task i runs shard {first} + i"
        return f"Submitted batch job {a.job_id} (array of {n} shard tasks {a.job_id}_[0-{n - 1}]: {which}, " \
               f"shards {ranges(a.shards, sep=',')})"
    pairs = ", ".join(f"{task(i)} = shard {k}" for i, k in enumerate(a.shards[:MAPPED]))
    more = f", ... ({n - MAPPED} more; the mapping is in {JOBS_FILE})" if n > MAPPED else ""
    return f"Submitted batch job {a.job_id} (array of {n} shard tasks: {pairs}{more})"


def format_submission(rd: RunDir, sub: Submission) -> str:
    """What `submit` and `resubmit` print: the jobs, like sbatch, then how to watch them."""
    lines = [describe_array(a) for a in sub.arrays]
    lines.append(f"Submitted batch job {sub.merge_job_id} (merge + audit, after {', '.join(a.job_id for a in sub.arrays)})")
    lines += [f"run directory: {rd.shown}", "watch it with:", f"  toolkit status {rd.shown} --watch",
              f"  toolkit logs {rd.shown} {sub.arrays[0].shards[0]} -f", f"  toolkit logs {rd.shown} --failed"]
    return "\n".join(lines)
