"""An engine over several nodes, on the real local cluster: one srun step with a rank per node.

The local cluster has one node, so the two ranks of `nodes = 2` run as two tasks of the step on that node
($TOOLKIT_ENGINE_RANKS_PER_NODE=2; everything else — the worker in a one-task step as submitit runs it, the
engine step with --overlap, rank flags, readiness through rank 0, dead-rank detection, restart, stop — is the
real path). What one node cannot show: ranks on different hosts, the rendezvous address as seen from another
node, GPUs split between nodes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from jobfiles import make_job, prepared_run, process_running
from toolkit.shardfile import read_shard

ROOT = Path(__file__).resolve().parents[1]
FAKE_SGLANG = Path(__file__).parent / "fake_sglang"


@pytest.fixture
def cluster():
    if not os.environ.get("SLURM_CONF"):
        pytest.fail("SLURM_CONF is not set: start the local cluster first, eval \"$(slurm/start.sh)\" (see README)")


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _wait(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _steps(job: str) -> dict[str, str]:
    out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i|%j"], capture_output=True, text=True).stdout
    return dict(line.strip().split("|", 1) for line in out.splitlines() if "|" in line)


def _records(run: Path) -> list:
    path = run / "shards" / "00000.zst"
    try:
        return list(read_shard(path))
    except Exception:  # being written: torn last batch
        return []


@pytest.mark.slurm
def test_two_ranks_serve_through_rank0_survive_usr2_restart_on_a_dead_rank_and_leave_nothing(cluster, tmp_path, toy_tokenizer):
    tok = toy_tokenizer("kimi")
    record = tmp_path / "rank{rank}.json"
    n = 120  # long enough that the shard is still generating when a rank is killed, on a loaded machine too
    env = {"PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(ROOT)]), "FAKE_SGLANG_RECORD": str(record),
           "FAKE_SGLANG_STUB_ARGS": "--token-delay 0.01 --fixed-output-tokens 40", "ENGINE_MARKER": "yes"}
    job = make_job(tmp_path, tok, n=n, engine={"kind": "sglang", "nodes": 2, "tp_size": 2, "env": env,
                                               "max_restarts": 2, "shutdown_timeout_s": 10, "ready_timeout_s": 60},
                   model={"path": str(tok)}, slurm={"gpus_per_node": 1}, client={"concurrency": 2})
    rd, _ = prepared_run(str(job))
    run = Path(rd.root)
    out = tmp_path / "job.out"
    # As `toolkit submit` lays out a task of nodes = 2, on one node: the worker in a one-task step (submitit's
    # srun with srun_args), the allocation holding a task per rank.
    r = subprocess.run(
        ["sbatch", "--parsable", "--job-name=multinode-test", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
         "--gpus-per-node=1", "--time=5", f"--output={out}",
         f"--export=ALL,PYTHONPATH={ROOT},TOOLKIT_ENGINE_RANKS_PER_NODE=2",
         "--wrap", f"srun --nodes=1 --ntasks=1 {sys.executable} -m toolkit worker {run} 0"],
        capture_output=True, text=True, check=True, cwd=ROOT)
    job_id = r.stdout.strip().split(";")[0]
    seen_pids: list[int] = []
    try:
        r0, r1 = _wait(lambda: (lambda a, b: (a, b) if a and b else None)(
            _json(tmp_path / "rank0.json"), _json(tmp_path / "rank1.json")), 90, "both ranks to start")
        # every rank started with the same line but for its rank, the rendezvous on the first node
        for rank, rec in ((0, r0), (1, r1)):
            argv = rec["argv"]
            flags = dict(zip(argv, argv[1:]))
            assert flags["--nnodes"] == "2" and flags["--node-rank"] == str(rank) and rec["slurm_procid"] == str(rank)
            assert flags["--tp-size"] == "2" and flags["--host"] == "127.0.0.1"
            assert rec["usr2_ignored"] and rec["env_marker"] == "yes"
            seen_pids += [rec["pid"], rec["scheduler_pid"]]
        unranked = lambda argv: [a for i, a in enumerate(argv) if i == 0 or argv[i - 1] != "--node-rank"]
        assert unranked(r0["argv"]) == unranked(r1["argv"]), "the same line on every node but for its rank"
        assert r0["slurm_step_id"] == r1["slurm_step_id"] != "0", "both ranks are tasks of one step, not the worker's"
        addr = dict(zip(r0["argv"], r0["argv"][1:]))["--dist-init-addr"]
        host, port = addr.rsplit(":", 1)
        assert 20000 <= int(port) < 32768 and not host.startswith("[")
        step = f"{job_id}.{r0['slurm_step_id']}"
        assert _steps(job_id)[step].startswith("toolkit-engine-")
        # ready through rank 0 only: generation goes on
        _wait(lambda: len(_records(run)) >= 3, 90, "records from the two-rank engine")
        # Slurm's USR2 reaches the engine step and the srun process: the engine does not die of it
        log = (run / "logs" / "00000.log").read_text()
        srun_pid = int(re.findall(r"engine sglang started: pid (\d+)", log)[-1])
        subprocess.run(["scancel", "--signal=USR2", step], check=True)
        os.kill(srun_pid, signal.SIGUSR2)
        time.sleep(1.5)
        assert process_running(srun_pid) and process_running(r0["pid"]) and process_running(r1["pid"])
        # a dead rank anywhere is a dead engine: the worker restarts it (a new step, both ranks again)
        os.kill(r1["pid"], signal.SIGKILL)
        s0, s1 = _wait(lambda: (lambda a, b: (a, b) if a and b and a["pid"] != r0["pid"] and b["pid"] != r1["pid"]
                                else None)(_json(tmp_path / "rank0.json"), _json(tmp_path / "rank1.json")),
                       90, "the engine to be restarted")
        assert s0["slurm_step_id"] == s1["slurm_step_id"] != r0["slurm_step_id"]
        seen_pids += [s0["pid"], s0["scheduler_pid"], s1["pid"], s1["scheduler_pid"], srun_pid]
        _wait(lambda: job_id not in subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True,
                                                   text=True).stdout.split(), 120, "the job to end")
    finally:
        subprocess.run(["scancel", job_id])
    text = out.read_text()
    progress = msgspec.json.decode((run / "progress" / "00000.json").read_bytes())
    assert progress["state"] == "done" and progress["engine_restarts"] == 1, (progress, text)
    assert "engine died mid-shard" in text
    recs = {x.id: x for x in _records(run)}  # the newest record of each id (a stop may leave partial ones)
    assert len(recs) == n and all(x.status == "ok" for x in recs.values())
    # stop left nothing on the node: every rank, its children, srun
    _wait(lambda: not any(process_running(p) for p in seen_pids), 20, "every engine process to be gone")
    server_log = (run / "logs" / "00000.server.log").read_text()
    assert re.search(r"^0: toolkit: engine rank 0 of 2 on ", server_log, re.M)
    assert re.search(r"^1: toolkit: engine rank 1 of 2 on ", server_log, re.M)
    assert "1: toolkit: engine rank 1 of 2 on" in server_log and "killed by SIGKILL" in server_log
    assert "--api-key ***" in server_log


def _dry_run(job: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", "submit", str(job), "--dry-run", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_each_array_task_allocates_the_engines_nodes(tmp_path, toy_tokenizer, monkeypatch, capsys):
    """nodes = 2: --nodes=2 --ntasks-per-node=1, GPUs and CPUs per node as for one; the worker in a one-task step.
    Pure: no Slurm command runs (a made-up cluster answers, or none does), and the layout is checked either way."""
    from toolkit import slurm, slurmcmd
    from toolkit.cli import main
    from toolkit.preflight import preflight

    job = make_job(tmp_path, toy_tokenizer("kimi"), engine={"kind": "sglang", "nodes": 2, "tp_size": 16},
                   slurm={"gpus_per_node": 8, "cpus_per_task": 64})
    monkeypatch.setattr(slurmcmd, "call", lambda argv, timeout=None: pytest.fail(f"{argv} ran: this test is pure"))
    monkeypatch.setattr(slurm, "slurm_config", lambda timeout=60: {"MaxArraySize": "1001"})
    monkeypatch.setattr(slurm, "partition_info", lambda name: slurm.PartitionInfo("gpu", 8, 0))
    monkeypatch.setattr(slurm, "partition_nodes", lambda name: 4)
    assert main(["submit", str(job), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=64", "_log.out --nodes=1 --ntasks=1 "):  # the worker: one task, first node
        assert line in out, out
    assert "srun-args" not in out
    params = slurm.shard_params(preflight(str(job)).plan, slurm.Resources())
    assert params["nodes"] == 2 and params["ntasks_per_node"] == 1 and params["srun_args"] == ["--nodes=1", "--ntasks=1"]
    # one node: nothing changes
    job1 = make_job(tmp_path / "one", toy_tokenizer("kimi"), engine={"kind": "sglang", "tp_size": 8})
    assert main(["submit", str(job1), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--nodes=2" not in out and "ntasks" not in out
    # --gpus-per-node on the command line is checked against the layout too, whether a cluster answers or not
    assert main(["submit", str(job), "--dry-run", "--gpus-per-node", "4"]) == 2
    assert "uses 16 GPUs, 8 per node, but --gpus-per-node = 4" in capsys.readouterr().err

    def no_cluster(timeout=60):
        raise slurm.SlurmError("no cluster")

    monkeypatch.setattr(slurm, "slurm_config", no_cluster)
    assert main(["submit", str(job), "--dry-run"]) == 0
    assert "Slurm not reachable: not validated against a cluster (no cluster)" in capsys.readouterr().out
    assert main(["submit", str(job), "--dry-run", "--gpus-per-node", "4"]) == 2
    assert "uses 16 GPUs, 8 per node, but --gpus-per-node = 4" in capsys.readouterr().err


@pytest.mark.slurm
def test_submit_refuses_more_nodes_than_the_partition_has(cluster, tmp_path, toy_tokenizer):
    job = make_job(tmp_path, toy_tokenizer("kimi"), engine={"kind": "sglang", "nodes": 2, "tp_size": 2},
                   slurm={"gpus_per_node": 1, "cpus_per_task": 1})
    r = _dry_run(job)
    assert r.returncode == 2 and "[engine] nodes = 2 but partition 'gpu' has 1 node(s)" in r.stderr, r.stderr
