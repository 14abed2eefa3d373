"""`toolkit submit --dry-run`: submitit's own scripts, shown without a cluster (and validated when there is one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobfiles import make_job

REPO = Path(__file__).resolve().parents[2]
SLURM = {
    "partition": "gpu",
    "time": "24:00:00",
    "gpus_per_node": 8,
    "cpus_per_task": 32,
    "mem": "200G",
    "array_parallelism": 16,
    "signal_delay_s": 120,
    "setup": ["module load cuda/12.4", "source ~/venv/bin/activate"],
    "merge_time": "90",
    "merge_cpus": 4,
    "merge_mem": "16G",
}
ENGINE = {
    "tp_size": 8
}  # every GPU of [slurm] gpus_per_node = 8 used (check and submit refuse idle ones)


def no_slurm_env(tmp: Path) -> dict:
    """SLURM_CONF pointing at nothing and a PATH without any Slurm command."""
    (tmp / "bin").mkdir(exist_ok=True)
    return {
        **os.environ,
        "SLURM_CONF": str(tmp / "nothing" / "slurm.conf"),
        "PATH": str(tmp / "bin"),
        "PYTHONPATH": str(REPO),
    }


def dry_run(job: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "toolkit", "submit", str(job), "--dry-run", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def scripts(out: str) -> tuple[str, str]:
    """The array's script and the merge job's script, as printed."""
    array = out.split("==> array 1 of 1")[1].split("\n", 1)[1].split("\n==> merge")[0]
    merge = out.split("==> merge + audit job")[1].split("\n", 1)[1]
    return array, merge


def sbatch(script: str) -> list[str]:
    return [x for x in script.splitlines() if x.startswith("#SBATCH")]


@pytest.mark.slow
def test_dry_run_without_slurm_shows_the_scripts_submitit_writes(tmp_path, toy_tokenizer):
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=64, shards=64, slurm=SLURM, engine=ENGINE)
    r = dry_run(job, no_slurm_env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "Slurm not reachable: not validated against a cluster" in out
    # as many tasks as run at once (array_parallelism = 16), each claiming the 64 shards one after another
    assert "1 job array(s) (MaxArraySize 1001): 16 tasks claiming shards 0-63" in out
    assert "note:" not in out  # 16 tasks share 64 shards: each loads the model once for four
    assert (
        "==> array 1 of 1: shards 0-63 (16 tasks at once: each task starts its engine once and claims unfinished "
        "shards one after another until none is left) <=="
    ) in out
    run = tmp_path / "run"
    array, merge = scripts(out)
    log = f"{run}/slurm/%A_%a/%A_%a_0_log.out"
    assert sbatch(array) == [
        "#SBATCH --array=0-15%16",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --job-name=t-shards",
        "#SBATCH --mem=200G",
        "#SBATCH --nodes=1",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={log}",
        "#SBATCH --partition=gpu",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --time=24:00:00",
        "#SBATCH --wckey=submitit",
    ]
    # Setup lines are shell lines after the #SBATCH block, before the command.
    lines = array.splitlines()
    last_option = max(i for i, x in enumerate(lines) if x.startswith("#SBATCH"))
    setup = lines.index("module load cuda/12.4")
    assert (
        last_option
        < setup
        < lines.index("source ~/venv/bin/activate")
        < next(i for i, x in enumerate(lines) if x.startswith("srun "))
    )
    assert re.search(
        r"^srun .* -m submitit\.core\._submit " + re.escape(f"{run}/slurm/%j") + "$", array, re.M
    )
    # The merge job: its own time, CPUs and memory, after the array (whose id is known only once submitted).
    m = sbatch(merge)
    assert "#SBATCH --dependency=afterany:ARRAY_JOB_ID" in m and "#SBATCH --time=01:30:00" in m
    assert (
        "#SBATCH --cpus-per-task=4" in m
        and "#SBATCH --mem=16G" in m
        and "#SBATCH --job-name=t-merge" in m
    )
    assert f"#SBATCH --output={run}/slurm/%j/%j_0_log.out" in m and not any(
        "--array" in x for x in m
    )
    assert "module load cuda/12.4" in merge.split("# setup")[1]
    assert not run.exists(), "a dry run writes nothing"


@pytest.mark.slow
def test_dry_run_time_formats(tmp_path, toy_tokenizer):
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=4,
        shards=2,
        slurm={**SLURM, "time": "2-00:00:00"},
        engine=ENGINE,
    )
    env = no_slurm_env(tmp_path)
    out = dry_run(job, env).stdout
    array, merge = scripts(out)
    assert "#SBATCH --time=48:00:00" in sbatch(array) and "#SBATCH --array=0-1%2" in sbatch(array)
    # a task per shard is said, with how to load the model once per node instead
    assert (
        "note: 2 tasks for 2 shards: each loads the model for one shard. To load it once per node, set "
        "--array-parallelism (or [slurm] array_parallelism) to the nodes the run may hold at once"
    ) in out
    array, _ = scripts(dry_run(job, env, "--time", "45").stdout)
    assert "#SBATCH --time=00:45:00" in sbatch(array)


def test_the_shown_time_is_what_slurm_reads():
    from toolkit.cluster.resources import slurm_time, time_to_minutes

    for t in ("24:00:00", "00:10:00", "2-00:00:00", "90", "1-12:30:00"):
        assert time_to_minutes(slurm_time(time_to_minutes(t))) == time_to_minutes(t)
    assert slurm_time(1440) == "24:00:00" and slurm_time(1) == "00:01:00"


@pytest.mark.slow
def test_no_cluster_is_said_plainly_and_quickly(tmp_path, toy_tokenizer):
    import time

    job = make_job(tmp_path, toy_tokenizer("kimi"), n=4, shards=2, slurm=SLURM, engine=ENGINE)
    no_path = {k: v for k, v in no_slurm_env(tmp_path).items() if k != "SLURM_CONF"}
    r = dry_run(job, no_path)
    assert (
        r.returncode == 0
        and "Slurm not reachable: not validated against a cluster (`scontrol` not found" in r.stdout
    )
    t0 = time.monotonic()
    missing = {**os.environ, "SLURM_CONF": str(tmp_path / "nothing.conf"), "PYTHONPATH": str(REPO)}
    r = dry_run(job, missing)  # scontrol itself would retry for a minute
    assert (
        r.returncode == 0 and f"SLURM_CONF={tmp_path / 'nothing.conf'} does not exist" in r.stdout
    )
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_a_time_limit_not_longer_than_the_signal_delay_is_refused_without_a_cluster(
    tmp_path, toy_tokenizer
):
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=4,
        shards=2,
        slurm={**SLURM, "time": "00:02:00"},
        engine=ENGINE,
    )
    r = dry_run(job, no_slurm_env(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        "toolkit: error: --time 00:02:00 (120 s) is not longer than --signal-delay-s 120: every "
        "task would be told to stop at once and be requeued forever; give a --time well above "
        "120 s or a smaller --signal-delay-s"
    )


@pytest.mark.slow
def test_sbatch_options_as_sbatch_spells_them_and_a_merge_partition(tmp_path, toy_tokenizer):
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=4,
        shards=2,
        slurm={**SLURM, "gpus_per_node": 1, "merge_partition": "cpu"},
    )
    r = dry_run(
        job,
        no_slurm_env(tmp_path),
        "-C",
        "h100",
        "-x",
        "node3",
        "--exclusive",
        "--reservation",
        "res1",
        "--mail-type",
        "END,FAIL",
        "--mail-user",
        "me@example.org",
        "-w",
        "node[1-2]",
    )
    assert r.returncode == 0, r.stderr
    array, merge = scripts(r.stdout)
    shards, merged = sbatch(array), sbatch(merge)
    for line in (
        "--constraint=h100",
        "--exclude=node3",
        "--exclusive",
        "--reservation=res1",
        "--mail-type=END,FAIL",
        "--mail-user=me@example.org",
        "--nodelist='node[1-2]'",
        "--partition=gpu",
    ):  # quoted by submitit
        assert f"#SBATCH {line}" in shards
    # the merge job needs no GPU: its own partition, no node constraint, the rest as the tasks
    assert "#SBATCH --partition=cpu" in merged and "#SBATCH --exclude=node3" in merged
    assert "#SBATCH --reservation=res1" in merged and "#SBATCH --mail-type=END,FAIL" in merged
    assert not any(
        x.split("=")[0] in ("#SBATCH --constraint", "#SBATCH --nodelist", "#SBATCH --exclusive")
        for x in merged
    )
    # the command line's merge partition over the job's
    _, merge = scripts(dry_run(job, no_slurm_env(tmp_path), "--merge-partition", "short").stdout)
    assert "#SBATCH --partition=short" in sbatch(merge)
