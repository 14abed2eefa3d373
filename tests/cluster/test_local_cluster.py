"""The local Slurm cluster of slurm/start.sh: GPU array jobs, accounting and the limits the toolkit relies on.

Needs a running cluster and SLURM_CONF in the environment:
    eval "$(slurm/start.sh)" && python -m pytest tests/cluster/test_local_cluster.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

N_TASKS = 4
TASK_SECONDS = 4  # long enough for the 4 tasks to overlap, so each must hold its own GPU
SACCT_WAIT_S = (
    40.0  # bound for the tasks to run and their records to reach sacct (they lag 0.2-3 s)
)
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
}

TASK_SCRIPT = """#!/bin/bash
start=$(date +%s.%N)
sleep {seconds}
end=$(date +%s.%N)
printf '{{"task": %s, "cuda": "%s", "job_gpus": "%s", "start": %s, "end": %s}}\\n' \\
    "$SLURM_ARRAY_TASK_ID" "${{CUDA_VISIBLE_DEVICES-}}" "${{SLURM_JOB_GPUS-}}" "$start" "$end" \\
    > "{out}/task_$SLURM_ARRAY_TASK_ID.json"
"""


def slurm_env() -> dict[str, str]:
    """The environment for Slurm commands; fails the test (never skips) when the cluster is not configured."""
    conf = os.environ.get("SLURM_CONF")
    if not conf:
        pytest.fail(
            "SLURM_CONF is not set: start the local cluster first with "
            '`eval "$(slurm/start.sh)"` (as root), then run the tests in that shell.',
            pytrace=False,
        )
    if not Path(conf).is_file():
        pytest.fail(f"SLURM_CONF={conf} does not exist: run slurm/start.sh again.", pytrace=False)
    return {**os.environ, "SLURM_CONF": conf}


def run(cmd: list[str], env: dict[str, str]) -> str:
    """Run a Slurm command and return its stdout; a failure shows the command and its stderr."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}"
    return proc.stdout


def task_states(job_id: str, env: dict[str, str]) -> dict[str, str]:
    """State of each array task of job_id according to sacct, keyed by task index ('0', '1', ...)."""
    out = run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State"], env)
    states = {}
    for line in out.splitlines():
        task_id, _, state = line.partition("|")
        prefix, _, index = task_id.partition("_")
        if prefix == job_id and index.isdigit():
            states[index] = state.split()[0]  # "CANCELLED by 0" -> "CANCELLED"
    return states


def test_gpu_array_runs_in_parallel_and_is_accounted(tmp_path: Path) -> None:
    env = slurm_env()
    script = tmp_path / "task.sh"
    script.write_text(TASK_SCRIPT.format(seconds=TASK_SECONDS, out=tmp_path))
    job_id = (
        run(
            [
                "sbatch",
                "--parsable",
                "--partition=gpu",
                f"--array=0-{N_TASKS - 1}",
                "--gpus-per-node=1",
                "--cpus-per-task=1",
                "--mem=2G",
                "--time=5",
                "--job-name=toolkit-local-test",
                f"--chdir={tmp_path}",
                f"--output={tmp_path}/slurm-%A_%a.out",
                str(script),
            ],
            env,
        )
        .strip()
        .split(";")[0]
    )
    assert job_id.isdigit(), f"sbatch --parsable printed {job_id!r}"

    # Poll sacct until every task has a final record; right after an array ends sacct may briefly show a
    # single collapsed row, so wait for the N per-task rows.
    deadline = time.monotonic() + SACCT_WAIT_S
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = task_states(job_id, env)
        if len(states) == N_TASKS and set(states.values()) <= TERMINAL_STATES:
            break
        time.sleep(0.5)
    logs = {p.name: p.read_text() for p in sorted(tmp_path.glob("slurm-*.out"))}
    assert states == {str(i): "COMPLETED" for i in range(N_TASKS)}, (
        f"sacct after {SACCT_WAIT_S:.0f}s for job {job_id}: {states}; task logs: {logs}"
    )

    results = []
    for i in range(N_TASKS):
        path = tmp_path / f"task_{i}.json"
        assert path.is_file(), f"task {i} completed but wrote no {path.name}; task logs: {logs}"
        results.append(json.loads(path.read_text()))
    for r in results:
        assert r["cuda"].isdigit(), (
            f"task {r['task']} saw CUDA_VISIBLE_DEVICES={r['cuda']!r}, not one GPU index"
        )
        assert r["cuda"] == r["job_gpus"], (
            f"task {r['task']}: CUDA_VISIBLE_DEVICES != SLURM_JOB_GPUS: {r}"
        )
    # All tasks ran at the same time, so the 4 fake GPUs were handed out once each.
    latest_start = max(r["start"] for r in results)
    earliest_end = min(r["end"] for r in results)
    assert latest_start < earliest_end, (
        f"the {N_TASKS} tasks did not run at the same time: {results}"
    )
    assert sorted(int(r["cuda"]) for r in results) == list(range(N_TASKS)), (
        f"GPUs shared or missing: {results}"
    )


def test_max_array_size_is_100(tmp_path: Path) -> None:
    env = slurm_env()
    config = run(["scontrol", "show", "config"], env)
    values = dict(
        (key.strip(), value.strip())
        for key, sep, value in (line.partition("=") for line in config.splitlines())
        if sep
    )
    assert values.get("MaxArraySize") == "100", (
        f"MaxArraySize = {values.get('MaxArraySize')!r}, expected '100'"
    )

    # Index 100 is one past the limit: Slurm must refuse the array at submission.
    proc = subprocess.run(
        ["sbatch", "--array=0-100", f"--chdir={tmp_path}", "--wrap=true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode != 0, f"sbatch --array=0-100 was accepted: {proc.stdout.strip()}"
    assert "array" in proc.stderr.lower(), f"unexpected sbatch error: {proc.stderr.strip()}"


HOST_PROBE = """
import json, os, socket, sys
me = socket.gethostname()
peers = dict(a.split("=", 1) for a in sys.argv[1:])  # name=NodeAddr of every host
other = next(name for name in peers if name != me)
def resolves(name):
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((peers[other], 9))  # no packet: the route picks this host's own address toward the other
    mine = s.getsockname()[0]
with socket.create_connection((peers[other], int(os.environ["SLURMD_PORT"])), timeout=5):
    pass  # the other host's slurmd, over the subnet
print(json.dumps({"host": me, "node": os.environ["SLURMD_NODENAME"], "own_name": resolves(me),
                  "other": other, "other_name": resolves(other), "address": mine}))
"""


def test_two_hosts_have_their_own_names_and_addresses_and_know_each_other_only_through_slurm(
    tmp_path: Path,
) -> None:
    """Partition `hosts`: two slurmds, each in its own network and UTS namespace (slurm/start.sh), as two machines of
    a Debian cluster: its own hostname, which it resolves to 127.0.1.1; the other host reached at its NodeAddr on
    the private subnet, which no name resolves to."""
    env = slurm_env()
    names = run(["sinfo", "-h", "-N", "-p", "hosts", "-o", "%N"], env).split()
    assert len(names) == 2, (
        f"partition hosts has {names}: start the cluster with slurm/start.sh (SLURM_LOCAL_HOSTS=2)"
    )
    addrs = {}
    for name in names:
        fields = dict(
            f.split("=", 1)
            for f in run(["scontrol", "show", "node", "-o", name], env).split()
            if "=" in f
        )
        addrs[name] = fields["NodeAddr"]
    config = run(["scontrol", "show", "config"], env).splitlines()
    port = next(
        line.split("=", 1)[1].strip()
        for line in config
        if line.split("=", 1)[0].strip() == "SlurmdPort"
    )
    out = subprocess.run(
        [
            "srun",
            "--partition=hosts",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--time=1",
            f"--chdir={tmp_path}",
            f"--export=ALL,SLURMD_PORT={port}",
            sys.executable,
            "-c",
            HOST_PROBE,
            *(f"{n}={a}" for n, a in addrs.items()),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    seen = {r["host"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert sorted(seen) == sorted(names), out.stdout
    for name, r in seen.items():
        assert r["node"] == name, "each host's hostname is its node name"
        assert r["address"] == addrs[name] and not addrs[name].startswith("127."), (
            "its own address on the subnet"
        )
        assert r["own_name"] == "127.0.1.1", "its own name is 127.0.1.1, as on Debian"
        assert r["other_name"] is None, (
            "the other host has no name here: only Slurm's NodeAddr knows it"
        )


def test_the_node_environment_script_builds_sglang_on_a_node_of_the_cluster(tmp_path):
    """scripts/node-env.sh, the one command the README gives for the GPU nodes' environment, run on the cluster's
    node through srun as a user would (--cpu: SGLang without its GPU-only requirements). The venv of the test tier
    is the one it made at install; run again it must be idempotent and report that both packages import there."""
    repo = Path(__file__).resolve().parents[2]
    venv = Path(os.environ.get("TOOLKIT_SGLANG_VENV") or repo / ".venv-sglang")
    env = slurm_env()
    proc = subprocess.run(
        [
            "srun",
            "-N1",
            "-n1",
            "--gpus-per-node=1",
            "-t",
            "10",
            "bash",
            str(repo / "scripts" / "node-env.sh"),
            str(venv),
            "--cpu",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"[node-env] {venv}: sglang 0.5.23 and the toolkit ready in" in proc.stderr
    assert f"submit with: --setup 'source {venv}/bin/activate'" in proc.stderr
    bad = subprocess.run(
        ["bash", str(repo / "scripts" / "node-env.sh")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "usage: " in bad.stderr
