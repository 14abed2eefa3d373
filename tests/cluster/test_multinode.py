"""An engine over several nodes, on the real local cluster: one srun step with a rank per node.

The two ranks of `nodes = 2` run on the local cluster's two namespaced hosts (partition `hosts` of slurm/start.sh):
`host1` and `host2`, each with its own hostname, network and address on a private subnet, and an /etc/hosts
that maps its own name to 127.0.1.1 and knows no other host, as Debian nodes known to each other only through
Slurm's NodeAddr. The worker runs in a one-task step on host1 as submitit runs it; the engine is one more step
with --overlap, rank 0 on host1 and rank 1 on host2, which must join rank 0 at --dist-init-addr over the subnet
before rank 0 (the fake `sglang` of tests/fake_sglang, as SGLang) answers /ready. What the hosts cannot show:
GPUs split between nodes (theirs are fake), a real torch.distributed rendezvous.
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

import keyscan
import msgspec
import pytest

from jobfiles import make_job, prepared_run, process_running
from toolkit.engines.rendezvous import parse_node_addrs
from toolkit.formats.frames import read_shard

ROOT = Path(__file__).resolve().parents[2]
FAKE_SGLANG = Path(__file__).parents[1] / "fake_sglang"


@pytest.fixture
def cluster():
    if not os.environ.get("SLURM_CONF"):
        pytest.fail(
            'SLURM_CONF is not set: start the local cluster first, eval "$(slurm/start.sh)" (see README)'
        )


@pytest.fixture
def hosts(cluster) -> dict[str, str]:
    """The two namespaced hosts of the local cluster: {name: NodeAddr}, in order."""
    names = subprocess.run(
        ["sinfo", "-h", "-N", "-p", "hosts", "-o", "%N"], capture_output=True, text=True
    ).stdout.split()
    if len(names) < 2:
        pytest.fail(
            f"partition hosts has {names or 'no nodes'}: this cluster was started without the two hosts; "
            "start it again with slurm/start.sh (SLURM_LOCAL_HOSTS=2, see slurm/README.md)"
        )
    out = subprocess.run(
        ["scontrol", "show", "node", "-o", ",".join(names[:2])], capture_output=True, text=True
    ).stdout
    return parse_node_addrs(out)


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
    out = subprocess.run(
        ["squeue", "-h", "-s", "-j", job, "-o", "%i|%j"], capture_output=True, text=True
    ).stdout
    return dict(line.strip().split("|", 1) for line in out.splitlines() if "|" in line)


def _records(run: Path) -> list:
    path = run / "shards" / "00000.zst"
    try:
        return list(read_shard(path))
    except Exception:  # being written: torn last batch
        return []


@pytest.mark.slurm
def test_two_ranks_on_two_hosts_serve_through_rank0_survive_usr2_restart_on_a_dead_rank_and_leave_nothing(
    hosts, tmp_path, toy_tokenizer
):
    """Rank 0 on host1, rank 1 on host2; --dist-init-addr is host1's NodeAddr (issue 24: it was 127.0.1.1, where
    rank 1 never joined), and rank 0 is ready only once rank 1 has joined it from host2's address."""
    (first, first_addr), (second, second_addr) = list(hosts.items())[:2]
    tok = toy_tokenizer("kimi")
    record = tmp_path / "rank{rank}.json"
    n = 120  # long enough that the shard is still generating when a rank is killed, on a loaded machine too
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(ROOT)]),
        "FAKE_SGLANG_RECORD": str(record),
        "FAKE_SGLANG_STUB_ARGS": "--token-delay 0.01 --fixed-output-tokens 40",
        "ENGINE_MARKER": "yes",
    }
    job = make_job(
        tmp_path,
        tok,
        n=n,
        engine={
            "kind": "sglang",
            "nodes": 2,
            "tp_size": 2,
            "env": env,
            "python": sys.executable,
            "max_restarts": 2,
            "shutdown_timeout_s": 10,
            "ready_timeout_s": 60,
        },
        model={"path": str(tok)},
        slurm={"gpus_per_node": 1},
        client={"concurrency": 2},
    )
    rd, _ = prepared_run(str(job))
    run = Path(rd.root)
    out = tmp_path / "job.out"
    # As `toolkit submit` lays out a task of nodes = 2: the worker in a one-task step on the first node
    # (submitit's srun with srun_args), the allocation holding a node per rank.
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--job-name=multinode-test",
            "--partition=hosts",
            f"--nodelist={first},{second}",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            "--gpus-per-node=1",
            "--time=5",
            f"--output={out}",
            f"--export=ALL,PYTHONPATH={ROOT}",
            "--wrap",
            f"srun --nodes=1 --ntasks=1 {sys.executable} -m toolkit worker {run} 0",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    job_id = r.stdout.strip().split(";")[0]
    seen_pids: list[int] = []
    try:
        # the rendezvous is the first node's address as Slurm knows it, not 127.0.1.1 (its own name's there)
        r0 = _wait(lambda: _json(tmp_path / "rank0.json"), 90, "rank 0 to start")
        addr = dict(zip(r0["argv"], r0["argv"][1:]))["--dist-init-addr"]
        host, port = addr.rsplit(":", 1)
        assert host == first_addr, f"--dist-init-addr {addr}: not {first}'s NodeAddr {first_addr}"
        assert 20000 <= int(port) < 32768
        # rank 1 (which records once it has joined) and rank 0 (again, once every rank has joined it)
        r0, r1 = _wait(
            lambda: (lambda a, b: (a, b) if a and a.get("joined") and b else None)(
                _json(tmp_path / "rank0.json"), _json(tmp_path / "rank1.json")
            ),
            60,
            "rank 1 to join rank 0",
        )
        assert r0["joined"] == {"1": second_addr}, (
            "rank 1 joined from the other host, over the subnet"
        )
        # every rank started with the same line but for its rank, the rendezvous on the first node
        for rank, rec in ((0, r0), (1, r1)):
            argv = rec["argv"]
            flags = dict(zip(argv, argv[1:]))
            assert (
                flags["--nnodes"] == "2"
                and flags["--node-rank"] == str(rank)
                and rec["slurm_procid"] == str(rank)
            )
            assert flags["--tp-size"] == "2" and flags["--host"] == "127.0.0.1"
            assert rec["usr2_ignored"] and rec["env_marker"] == "yes"
            seen_pids += [rec["pid"], rec["scheduler_pid"]]
        unranked = lambda argv: [
            a
            for i, a in enumerate(argv)
            if i == 0 or argv[i - 1] not in ("--node-rank", "--config")
        ]
        assert unranked(r0["argv"]) == unranked(r1["argv"]), (
            "the same line on every node but for its rank"
        )
        # the key: in a 0600 file each rank wrote on its own node from the step's environment, which the server
        # does not inherit; on no command line of either host
        configs = [dict(zip(rec["argv"], rec["argv"][1:]))["--config"] for rec in (r0, r1)]
        assert configs[0] != configs[1] and all(rec["config_mode"] == "0o600" for rec in (r0, r1))
        assert not r0["key_in_env"] and not r1["key_in_env"]
        key = keyscan.key_of(r0["argv"])
        assert keyscan.key_of(r1["argv"]) == key and len(key) == 32
        assert keyscan.on_command_lines(key) == []
        assert r0["slurm_step_id"] == r1["slurm_step_id"] != "0", (
            "both ranks are tasks of one step, not the worker's"
        )
        assert (r0["host"], r1["host"]) == (first, second), (
            "each rank on its own host, rank 0 beside the worker"
        )
        step = f"{job_id}.{r0['slurm_step_id']}"
        assert _steps(job_id)[step].startswith("toolkit-engine-")
        # ready through rank 0 only: generation goes on
        _wait(lambda: len(_records(run)) >= 3, 90, "records from the two-rank engine")
        # Slurm's USR2 reaches the engine step and the srun process: the engine does not die of it
        log = (run / "logs" / "00000.log").read_text()
        srun_pid = int(re.findall(r"engine sglang started: pid (\d+)", log)[-1])
        subprocess.run(["scancel", "--signal=USR2", step], check=True)
        os.kill(srun_pid, signal.SIGUSR2)
        # the engine goes on serving after it: more records come from it
        after = len(_records(run))
        _wait(lambda: len(_records(run)) >= after + 2, 90, "records after the USR2")
        assert (
            process_running(srun_pid) and process_running(r0["pid"]) and process_running(r1["pid"])
        )
        # a dead rank anywhere is a dead engine: the worker restarts it (a new step, both ranks again)
        os.kill(r1["pid"], signal.SIGKILL)
        s0, s1 = _wait(
            lambda: (
                lambda a, b: (
                    (a, b) if a and b and a["pid"] != r0["pid"] and b["pid"] != r1["pid"] else None
                )
            )(_json(tmp_path / "rank0.json"), _json(tmp_path / "rank1.json")),
            90,
            "the engine to be restarted",
        )
        assert s0["slurm_step_id"] == s1["slurm_step_id"] != r0["slurm_step_id"]
        seen_pids += [s0["pid"], s0["scheduler_pid"], s1["pid"], s1["scheduler_pid"], srun_pid]
        _wait(
            lambda: (
                job_id
                not in subprocess.run(
                    ["squeue", "-h", "-o", "%i"], capture_output=True, text=True
                ).stdout.split()
            ),
            120,
            "the job to end",
        )
    finally:
        subprocess.run(["scancel", job_id])
    text = out.read_text()
    progress = msgspec.json.decode((run / "progress" / "00000.json").read_bytes())
    assert progress["state"] == "done" and progress["engine_restarts"] == 1, (progress, text)
    assert "engine died mid-shard" in text
    recs = {
        x.id: x for x in _records(run)
    }  # the newest record of each id (a stop may leave partial ones)
    assert len(recs) == n and all(x.status == "ok" for x in recs.values())
    # stop left nothing on either host: every rank, its children, srun
    _wait(
        lambda: not any(process_running(p) for p in seen_pids),
        20,
        "every engine process to be gone",
    )
    server_log = (run / "logs" / "00000.server.log").read_text()
    assert re.search(rf"^0: toolkit: engine rank 0 of 2 on {first}: ", server_log, re.M)
    assert re.search(rf"^1: toolkit: engine rank 1 of 2 on {second}: ", server_log, re.M)
    assert re.search(
        rf"^0: \[rank 0\] rank 1 joined from {re.escape(second_addr)}$", server_log, re.M
    )
    assert "killed by SIGKILL" in server_log
    assert "--config" in server_log and "--api-key" not in server_log
    assert keyscan.files_holding(tmp_path, key) == [], (
        "the key in no file of the run, its logs, the job's output"
    )
    assert not any(Path(c).exists() for c in configs), (
        "each rank removed its key file when its server ended"
    )


def _sbatch_worker(run: Path, first: str, second: str, out: Path) -> str:
    """As `toolkit submit` lays out a task of nodes = 2: the worker in a one-task step on the first node."""
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--requeue",
            "--open-mode=append",
            "--job-name=multinode-test",
            "--partition=hosts",
            f"--nodelist={first},{second}",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            "--gpus-per-node=1",
            "--time=5",
            f"--output={out}",
            f"--export=ALL,PYTHONPATH={ROOT}",
            "--wrap",
            f"srun --nodes=1 --ntasks=1 {sys.executable} -m toolkit worker {run} 0",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return r.stdout.strip().split(";")[0]


def _job_over(job_id: str, timeout: float) -> None:
    _wait(
        lambda: (
            job_id
            not in subprocess.run(
                ["squeue", "-h", "-o", "%i"], capture_output=True, text=True
            ).stdout.split()
        ),
        timeout,
        f"job {job_id} to end",
    )


@pytest.mark.slurm
def test_sigterm_to_every_step_of_a_two_host_task_keeps_what_is_in_flight_and_the_next_task_continues_it(
    hosts, tmp_path, toy_tokenizer
):
    """Preemption, `scancel` and `scontrol requeue` send SIGTERM to every process of every step: the worker, srun,
    each rank's launcher and server. The engine must outlive it long enough for the worker to abort what is in
    flight and record the partial outputs; the next task continues them on a new two-rank engine."""
    (first, _), (second, _) = list(hosts.items())[:2]
    tok = toy_tokenizer("kimi")
    n = 40
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(ROOT)]),
        "FAKE_SGLANG_RECORD": str(tmp_path / "rank{rank}.json"),
        "FAKE_SGLANG_STUB_ARGS": "--token-delay 0.02 --fixed-output-tokens 150",
    }
    job = make_job(
        tmp_path,
        tok,
        n=n,
        engine={
            "kind": "sglang",
            "nodes": 2,
            "tp_size": 2,
            "env": env,
            "python": sys.executable,
            "shutdown_timeout_s": 10,
            "ready_timeout_s": 60,
        },
        model={"path": str(tok)},
        slurm={"gpus_per_node": 1},
        client={"concurrency": 2},
        sampling={"max_new_tokens": 400},
    )
    rd, _ = prepared_run(str(job))
    run = Path(rd.root)
    out = tmp_path / "job.out"
    job_id = _sbatch_worker(run, first, second, out)
    try:
        _wait(lambda: len(_records(run)) >= 2, 120, "records from the two-rank engine")
        # requests in flight (the engine's /v1/loads, in the progress file), each 150 tokens of 3 s: the SIGTERM
        # finds them mid-way, with most of the shard's 60 s of work left
        _wait(
            lambda: (lambda p: p and p.get("running") and p["done"] < n)(
                _json(run / "progress" / "00000.json")
            ),
            60,
            "requests running on the engine",
        )
        subprocess.run(
            ["scontrol", "requeue", job_id], check=True
        )  # SIGTERM to every step, SIGKILL after KillWait
        _job_over(job_id, 240)  # the requeued job runs the shard again, on a new two-rank engine
    finally:
        subprocess.run(["scancel", job_id])
    text = out.read_text()
    progress = msgspec.json.decode((run / "progress" / "00000.json").read_bytes())
    assert progress["state"] == "done" and progress["restart_count"] >= 1, (progress, text)
    log = (run / "logs" / "00000.log").read_text()
    assert "got SIGTERM" in log and re.search(r"aborting the \d+ requests in flight", log), log
    assert "could not abort" not in log and "still unanswered" not in log, log
    written = _records(run)
    newest = {r.id: r for r in written}
    assert len(newest) == n and all(r.status == "ok" for r in newest.values())
    partial = [r for r in written if r.status == "partial"]
    assert partial and all(newest[r.id] is not r for r in partial), (
        "the in-flight outputs were kept as partial"
    )
    assert (
        max(r.segments for r in newest.values()) == 2
    )  # ... and continued where the SIGTERM cut them
    assert all(len(r.output_ids) == 4 * 150 for r in newest.values())


def _dry_run(job: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "toolkit", "submit", str(job), "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_each_array_task_allocates_the_engines_nodes(tmp_path, toy_tokenizer, monkeypatch, capsys):
    """nodes = 2: --nodes=2 --ntasks-per-node=1, GPUs and CPUs per node as for one; the worker in a one-task step.
    Pure: no Slurm command runs (a made-up cluster answers, or none does), and the layout is checked either way."""
    from toolkit.cli import main
    from toolkit.cluster import commands as slurmcmd
    from toolkit.cluster import resources
    from toolkit.job.check import preflight

    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        engine={"kind": "sglang", "nodes": 2, "tp_size": 16},
        slurm={"gpus_per_node": 8, "cpus_per_task": 64},
    )
    monkeypatch.setattr(
        slurmcmd, "call", lambda argv, timeout=None: pytest.fail(f"{argv} ran: this test is pure")
    )
    monkeypatch.setattr(resources, "slurm_config", lambda timeout=60: {"MaxArraySize": "1001"})
    monkeypatch.setattr(
        resources, "partition_info", lambda name: resources.PartitionInfo("gpu", 8, 0)
    )
    monkeypatch.setattr(resources, "partition_nodes", lambda name: 4)
    assert main(["submit", str(job), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=64",
        "_log.out --nodes=1 --ntasks=1 ",
    ):  # the worker: one task, first node
        assert line in out, out
    assert "srun-args" not in out
    params = resources.shard_params(preflight(str(job)).plan, resources.Resources())
    assert (
        params["nodes"] == 2
        and params["ntasks_per_node"] == 1
        and params["srun_args"] == ["--nodes=1", "--ntasks=1"]
    )
    # one node: nothing changes
    job1 = make_job(
        tmp_path / "one", toy_tokenizer("kimi"), engine={"kind": "sglang", "tp_size": 8}
    )
    assert main(["submit", str(job1), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--nodes=2" not in out and "ntasks" not in out
    # --gpus-per-node on the command line is checked against the layout too, whether a cluster answers or not
    assert main(["submit", str(job), "--dry-run", "--gpus-per-node", "4"]) == 2
    assert "uses 16 GPUs, 8 per node, but --gpus-per-node = 4" in capsys.readouterr().err

    def no_cluster(timeout=60):
        raise resources.SlurmError("no cluster")

    monkeypatch.setattr(resources, "slurm_config", no_cluster)
    assert main(["submit", str(job), "--dry-run"]) == 0
    assert (
        "Slurm not reachable: not validated against a cluster (no cluster)"
        in capsys.readouterr().out
    )
    assert main(["submit", str(job), "--dry-run", "--gpus-per-node", "4"]) == 2
    assert "uses 16 GPUs, 8 per node, but --gpus-per-node = 4" in capsys.readouterr().err


@pytest.mark.slurm
def test_submit_refuses_more_nodes_than_the_partition_has(cluster, tmp_path, toy_tokenizer):
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        engine={"kind": "sglang", "nodes": 2, "tp_size": 2},
        slurm={"gpus_per_node": 1, "cpus_per_task": 1},
    )
    r = _dry_run(job)
    assert (
        r.returncode == 2 and "[engine] nodes = 2 but partition 'gpu' has 1 node(s)" in r.stderr
    ), r.stderr
