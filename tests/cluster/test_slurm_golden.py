"""What the toolkit sends to Slurm, without a cluster: every Slurm command is a mocked subprocess, and the sbatch
scripts submitit writes (array with its `%` throttle, time, output paths, the merge job's `afterany`) are compared
with golden files in tests/fixtures/slurm/. `TOOLKIT_UPDATE_GOLDEN=1` rewrites them.

Paths of this test's folders and this Python are replaced by <TMP> and <PYTHON>; job ids are the fake sbatch's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from jobfiles import make_job
from toolkit.cli import main as cli_main
from toolkit.cluster.jobs import read_jobs
from toolkit.formats.rundir import RunDir

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
SLURM = {
    "partition": "gpu",
    "time": "24:00:00",
    "gpus_per_node": 4,
    "cpus_per_task": 8,
    "mem": "16G",
    "array_parallelism": 2,
    "signal_delay_s": 120,
    "setup": ["module load cuda/12.4"],
    "merge_time": "90",
    "merge_cpus": 2,
    "merge_mem": "8G",
}
ENGINE = {
    "tp_size": 4
}  # every GPU of [slurm] gpus_per_node = 4 used (check and submit refuse idle ones)

SCONTROL_CONFIG = "MaxArraySize            = 1001\n"
SCONTROL_PARTITION = "PartitionName=gpu Default=YES State=UP TotalNodes=2\n"


class FakeSlurm:
    """Answers the Slurm commands slurmcmd runs, and stands for sbatch in submitit; records every call."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.scripts: list[str] = []
        self.next_id = 1000
        self.squeue = ""
        self.sacct = ""

    def answer(self, argv: list[str]) -> tuple[int, str, str]:
        self.calls.append(list(argv))
        cmd = argv[0]
        if cmd == "scontrol" and argv[1:3] == ["show", "config"]:
            return 0, SCONTROL_CONFIG, ""
        if cmd == "scontrol" and argv[1:3] == ["show", "partition"]:
            return 0, SCONTROL_PARTITION, ""
        if cmd == "sinfo":
            return 0, ("64000\n" if "%m" in argv else "gpu:4|8\n"), ""
        if cmd == "squeue":  # rows of id|state|node|reason, cut to the fields asked for (-o)
            n = argv[argv.index("-o") + 1].count("|") + 1
            return (
                0,
                "".join("|".join(row.split("|")[:n]) + "\n" for row in self.squeue.splitlines()),
                "",
            )
        if cmd == "sacct":
            return 0, self.sacct, ""
        if cmd == "scancel":
            return 0, "", ""
        return 1, "", f"{cmd}: error: not expected in this test"

    def sbatch(self, command: list[str]) -> str:
        self.calls.append(["sbatch", "<SCRIPT>"])
        self.scripts.append(Path(command[-1]).read_text())
        self.next_id += 1
        return f"Submitted batch job {self.next_id}\n"


@pytest.fixture
def fake(monkeypatch, tmp_path):
    import submitit.core.utils

    slurm = FakeSlurm()

    class Popen:
        def __init__(self, argv, **kw):
            self.pid = os.getpid()
            self.returncode, self._out, self._err = slurm.answer(argv)

        def communicate(self, timeout=None):
            return self._out, self._err

    class CommandFunction:
        def __init__(self, command, verbose=False, **kw):
            self.command = command

        def __call__(self, *args, **kw):
            return slurm.sbatch(self.command)

    fake_subprocess = types.SimpleNamespace(
        Popen=Popen,
        PIPE=subprocess.PIPE,
        DEVNULL=subprocess.DEVNULL,
        TimeoutExpired=subprocess.TimeoutExpired,
    )
    monkeypatch.setattr("toolkit.cluster.commands.subprocess", fake_subprocess)
    monkeypatch.setattr(submitit.core.utils, "CommandFunction", CommandFunction)
    monkeypatch.delenv("SLURM_CONF", raising=False)
    bin_dir = tmp_path / "bin"  # submitit builds an executor only where it finds srun
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return slurm


def normalize(text: str, tmp: Path) -> str:
    text = text.replace(str(tmp.resolve()), "<TMP>").replace(str(tmp), "<TMP>")
    return text.replace(sys.executable, "<PYTHON>")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("TOOLKIT_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with TOOLKIT_UPDATE_GOLDEN=1 to write it"
    assert text == path.read_text(), (
        f"{name} differs from the golden file (TOOLKIT_UPDATE_GOLDEN=1 to accept)"
    )


def calls_text(calls: list[list[str]]) -> str:
    return "".join(" ".join(c) + "\n" for c in calls)


def submitted(fake: FakeSlurm, tmp: Path) -> str:
    parts = ["# Slurm commands, in order\n" + calls_text(fake.calls)]
    parts += [f"# sbatch script {i + 1}\n{s}" for i, s in enumerate(fake.scripts)]
    return normalize("\n".join(parts), tmp)


def test_submit_sends_one_throttled_array_and_a_merge_job_after_it(
    fake, tmp_path, toy_tokenizer, capsys
):
    job = make_job(
        tmp_path, toy_tokenizer("kimi"), n=6, shards=3, name="golden", slurm=SLURM, engine=ENGINE
    )
    assert cli_main(["submit", str(job), "--time", "2:00:00"]) == 0
    out = capsys.readouterr().out
    assert (
        "Submitted batch job 1001 (array of 2 tasks 1001_[0-1] claiming shards 0-2: each starts its engine once "
        "and claims unfinished shards one after another until none is left)"
    ) in out
    assert "Submitted batch job 1002 (merge + audit, after 1001)" in out
    array, merge = fake.scripts
    assert "#SBATCH --array=0-1%2" in array and "#SBATCH --time=02:00:00" in array
    assert "#SBATCH --dependency=afterany:1001" in merge and "#SBATCH --time=01:30:00" in merge
    check_golden("submit.txt", submitted(fake, tmp_path))
    subs = read_jobs(RunDir(tmp_path / "run")).submissions
    assert [(a.job_id, a.shards, a.tasks, a.claims) for a in subs[0].arrays] == [
        ("1001", [0, 1, 2], ["1001_0", "1001_1"], True)
    ]
    assert subs[0].merge_job_id == "1002"


def test_status_cancel_and_resubmit_ask_slurm_this(fake, tmp_path, toy_tokenizer, capsys):
    job = make_job(
        tmp_path, toy_tokenizer("kimi"), n=6, shards=3, name="golden", slurm=SLURM, engine=ENGINE
    )
    assert cli_main(["submit", str(job)]) == 0
    run = str(tmp_path / "run")
    fake.calls.clear()
    fake.scripts.clear()

    from toolkit.formats.progress import Progress, write_progress

    rd = RunDir(
        run
    )  # task 1001_1 failed on shard 1; 1001_0 ran out of time on shard 2; nobody took shard 0
    write_progress(
        rd.progress_file(1),
        Progress(
            shard=1,
            total=2,
            state="failed",
            task="1001_1",
            group="1001",
            host="n2",
            task_engine_starts=1,
            task_shards=1,
        ),
    )
    write_progress(
        rd.progress_file(2),
        Progress(
            shard=2,
            total=2,
            state="generating",
            task="1001_0",
            group="1001",
            host="n1",
            task_engine_starts=1,
            task_shards=1,
        ),
    )
    fake.sacct = "1001_0|TIMEOUT|n1\n1001_1|FAILED|n2\n1002|CANCELLED by 0|\n"
    assert cli_main(["status", run]) == 1
    out = capsys.readouterr().out
    assert (
        "    0 incomplete" in out
        and "no task of array 1001 claimed it before they all ended" in out
    )
    assert (
        "    1 failed      1001_1" in out
        and "    2 timeout     1001_0" in out
        and "merge: job 1002 cancelled" in out
    )
    assert (
        "tasks: 2, 2 engine starts in all" in out
        and "  1001_0 on n1: shards 2 (engine started 1 time)" in out
    )
    status_calls = calls_text(fake.calls)
    fake.calls.clear()

    assert cli_main(["cancel", run]) == 0
    assert capsys.readouterr().out.strip() == "cancelled 1001, 1002"
    cancel_calls = calls_text(fake.calls)
    fake.calls.clear()

    fake.squeue = "1001_1|RUNNING|n2|None\n"
    assert cli_main(["resubmit", run]) == 1
    assert (
        "1 jobs of this run are still pending or running (1001_1 running)"
        in capsys.readouterr().err
    )
    fake.squeue = ""
    assert cli_main(["resubmit", run, "-p", "gpu"]) == 0
    assert "resubmitting 3 shards: 0-2 without a done manifest" in capsys.readouterr().out
    text = normalize(
        "# status\n"
        + status_calls
        + "\n# cancel\n"
        + cancel_calls
        + "\n# resubmit\n"
        + calls_text(fake.calls)
        + "\n"
        + "\n".join(f"# sbatch script {i + 1}\n{s}" for i, s in enumerate(fake.scripts)),
        tmp_path,
    )
    check_golden("status_cancel_resubmit.txt", text)


def test_a_bad_option_is_refused_before_slurm_is_asked_to_submit(
    fake, tmp_path, toy_tokenizer, capsys
):
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=6,
        shards=3,
        name="golden",
        slurm=SLURM,
        engine={"tp_size": 8},
    )
    assert cli_main(["submit", str(job), "--gpus-per-node", "8"]) == 2
    assert "have at most 4 GPUs" in capsys.readouterr().err
    assert not fake.scripts and all(c[0] != "sbatch" for c in fake.calls)


def test_slurm_refusing_the_submission_exits_1(fake, tmp_path, toy_tokenizer, capsys, monkeypatch):
    from submitit.core.utils import FailedJobError

    def refuse(command):
        raise FailedJobError(
            "sbatch: error: Batch job submission failed: Invalid qos specification"
        )

    monkeypatch.setattr(fake, "sbatch", refuse)
    job = make_job(
        tmp_path, toy_tokenizer("kimi"), n=6, shards=3, name="golden", slurm=SLURM, engine=ENGINE
    )
    assert cli_main(["submit", str(job)]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "toolkit: error: sbatch failed: sbatch: error: Batch job submission failed: Invalid qos specification; check "
            "`squeue --me` for jobs this command may already have submitted"
        )
    )


def test_retry_slurm_says_why_each_shard_goes_again(fake, tmp_path, toy_tokenizer, capsys):
    import hashlib

    import msgspec

    from toolkit.formats.manifests import DoneManifest
    from toolkit.formats.run import Run
    from toolkit.job.schema import JobSpec

    job = make_job(
        tmp_path, toy_tokenizer("kimi"), n=6, shards=3, name="golden", slurm=SLURM, engine=ENGINE
    )
    assert cli_main(["submit", str(job)]) == 0
    rd = RunDir(tmp_path / "run")
    fingerprint = Run.open(rd.root, JobSpec, finish=True).plan.fingerprint
    for k, transient in (
        (0, 2),
        (1, 0),
    ):  # shard 0 finished with 2 failures that may pass, 1 cleanly, 2 not at all
        rd.shard_file(k).write_bytes(b"")  # (the manifests describe these files: they are trusted)
        rd.done_file(k).write_bytes(
            msgspec.json.encode(
                DoneManifest(
                    shard=k,
                    fingerprint=fingerprint,
                    records=2,
                    ok=2 - transient,
                    failed=transient,
                    prompt_tokens=1,
                    output_tokens=1,
                    bytes=0,
                    sha256=hashlib.sha256(b"").hexdigest(),
                    host="n1",
                    finished="2026-01-01T00:00:00+00:00",
                    transient=transient,
                )
            )
        )
    capsys.readouterr()
    assert cli_main(["retry", str(rd.root), "--slurm"]) == 0
    out = capsys.readouterr().out
    assert "retrying in 2 shards: 0, 2" in out
    assert (
        "resubmitting 2 shards: 2 without a done manifest; 0 with 2 failures that may pass" in out
    )
    assert "without a done manifest: 0" not in out


def test_the_dry_run_of_one_shard_shows_the_plain_job_submit_sends(
    fake, tmp_path, toy_tokenizer, capsys
):
    """submitit sends a single task as a plain job (no --array, %j paths): the dry run shows exactly that."""
    job = make_job(
        tmp_path, toy_tokenizer("kimi"), n=3, shards=1, name="golden", slurm=SLURM, engine=ENGINE
    )
    assert cli_main(["submit", str(job), "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert (
        "==> array 1 of 1: shards 0 (one job, sent as a plain job (not an array): it starts its engine once and "
        "claims unfinished shards one after another until none is left) <=="
    ) in dry
    shown = dry.split("==> array 1 of 1")[1].split("\n", 1)[1].split("\n==> merge")[0]
    assert (
        "--array" not in shown
        and "%A_%a" not in shown
        and f"{tmp_path}/run/slurm/%j/%j_0_log.out" in shown
    )
    assert not fake.scripts, "a dry run submits nothing"
    assert cli_main(["submit", str(job)]) == 0
    sent = fake.scripts[0]
    assert (
        "(1 task claiming shards 0: it starts its engine once and runs them one after another)"
        in capsys.readouterr().out
    )
    assert [x for x in sent.splitlines() if x.startswith("#SBATCH")] == [
        x for x in shown.splitlines() if x.startswith("#SBATCH")
    ]


def test_a_dry_run_of_a_submitted_run_is_refused_as_submit_refuses_it(
    fake, tmp_path, toy_tokenizer, capsys
):
    job = make_job(
        tmp_path, toy_tokenizer("kimi"), n=6, shards=3, name="golden", slurm=SLURM, engine=ENGINE
    )
    assert cli_main(["submit", str(job)]) == 0
    capsys.readouterr()
    for dry in (["--dry-run"], []):
        assert cli_main(["submit", str(job), *dry]) == 2
        assert capsys.readouterr().err.strip() == (
            f"toolkit: error: {tmp_path / 'run'} was already submitted; use "
            f"`toolkit resubmit {tmp_path / 'run'}` for what is left"
        )
