"""What a person sees at the terminal: quiet login-node commands, --version, status --json, logs that end."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def toolkit(
    *args: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "toolkit", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
def test_check_prints_no_torch_advisory_and_no_tokenizer_chatter():
    r = toolkit("check", "jobs/demo.toml")
    assert r.returncode == 0, r.stderr
    assert "PyTorch was not found" not in r.stderr + r.stdout
    assert (
        "INFO toolkit.job.chat" not in r.stderr
    )  # the tokenizer's load lines are debug detail on a login node
    assert "jobs/demo.toml: ok" in r.stdout and "think '<think>' 3993 / '</think>' 3994" in r.stdout


def test_other_transformers_warnings_still_pass():
    code = (
        "import logging, toolkit; lg = logging.getLogger('transformers'); "
        "print([f.filter(logging.makeLogRecord({'msg': m})) for f in lg.filters "
        "for m in ('PyTorch was not found. Models ...', 'something else')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[False, True]"


def test_version_comes_from_package_metadata():
    from importlib.metadata import version

    r = toolkit("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"toolkit {version('toolkit')}"


# ---------------------------------------------------------------------------------------------------
# status --json, logs -f, logs --failed: on a run directory, no Slurm needed
# ---------------------------------------------------------------------------------------------------
import threading  # noqa: E402
import time  # noqa: E402

import msgspec  # noqa: E402
import pytest  # noqa: E402

import runs  # noqa: E402
from toolkit.cli import main as cli_main  # noqa: E402
from toolkit.cluster.arrays import describe_array  # noqa: E402
from toolkit.cluster.jobs import ArrayJob, Jobs, Submission
from toolkit.cluster.status import RunStatus  # noqa: E402
from toolkit.formats.progress import Progress, write_progress  # noqa: E402


@pytest.fixture
def half_run(tmp_path, toy_tokenizer):
    """Shard 0 done (with a failed record), shard 1 generating: 7 of 9 done at 250 tok/s."""
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 18}, shards=2)
    runs.write_run(s, done=[0], failed=[2], skip=range(9, 18))
    now = time.time()
    write_progress(
        s.rd.progress_file(1),
        Progress(
            shard=1,
            state="generating",
            total=9,
            done=7,
            output_tokens=5000,
            tok_per_s=250.0,
            host="gpu-17",
            started=now - 70,
        ),
    )
    return s


def test_status_json_is_one_typed_object(half_run, capsys):
    s = half_run
    assert cli_main(["status", str(s.root), "--json"]) == 5  # still going
    st = msgspec.json.decode(capsys.readouterr().out, type=RunStatus)
    assert st.exit == 5 and st.verdict == "in progress: shard 1 not finished"
    assert [(r.shard, r.state, r.done, r.total) for r in st.shards] == [
        (0, "completed", 9, 9),
        (1, "running", 7, 9),
    ]
    one = st.shards[1]
    assert (one.node, one.tok_per_s, one.output_tokens) == (
        "gpu-17",
        250.0,
        5000,
    ) and 10 < one.eta_s < 40
    assert st.shards[0].failed == 1 and st.shards[0].eta_s is None
    t = st.totals
    assert (t.done, t.total, t.failed, t.tok_per_s, t.shards) == (
        16,
        18,
        1,
        250.0,
        {"completed": 1, "running": 1},
    )
    assert st.merge.job is None and st.merge.merged is False and st.run == str(s.root.resolve())


@pytest.mark.slow
def test_logs_follow_ends_by_itself_when_the_shard_is_done(half_run):
    s = half_run
    log = s.rd.log_file(1)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("line one\nline two\n")
    p = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "logs", str(s.root), "1", "-f"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # each line read as it is printed (a bounded wait: the follower is killed if a line never comes)
    timer = threading.Timer(60, p.kill)
    timer.start()
    try:
        assert [p.stdout.readline(), p.stdout.readline()] == [
            "line one\n",
            "line two\n",
        ]  # the tail: following
        with open(log, "a") as f:
            f.write("generating...\n")
        assert p.stdout.readline() == "generating...\n", "a line written later is followed"
        assert p.poll() is None, "still following while the shard runs"
        write_progress(s.rd.progress_file(1), Progress(shard=1, state="done", total=9, done=9))
        with open(log, "a") as f:  # the worker writes its last line just after the state
            f.write("shard 1 complete: 9 records\n")
        out, err = p.communicate(timeout=20)
    finally:
        timer.cancel()
    assert p.returncode == 0
    assert out.splitlines() == ["shard 1 complete: 9 records"]
    assert "shard 1 done: stopped following" in err


def test_logs_follow_of_a_finished_shard_prints_its_tail_and_returns(half_run, capsys):
    s = half_run
    s.rd.log_file(0).parent.mkdir(parents=True, exist_ok=True)
    s.rd.log_file(0).write_text("".join(f"l{i}\n" for i in range(50)))
    done = threading.Event()
    t = threading.Thread(
        target=lambda: (cli_main(["logs", str(s.root), "0", "-f", "-n", "3"]), done.set()),
        daemon=True,
    )
    t.start()
    assert done.wait(10), "follow of a finished shard must not wait"
    assert capsys.readouterr().out.splitlines() == ["l47", "l48", "l49"]


def test_logs_failed_shows_the_merge_job_log_and_the_failed_records(half_run, capsys, monkeypatch):
    s = half_run
    write_progress(
        s.rd.progress_file(1),
        Progress(
            shard=1,
            state="failed",
            total=9,
            done=7,
            error="engine died 3 times (limit engine.max_restarts = 2)",
        ),
    )
    s.rd.log_file(1).write_text("ERROR toolkit.worker.run: engine died mid-shard\n")
    sub = Submission(
        submitted="now", arrays=[ArrayJob("70", [0, 1], ["70_0", "70_1"])], merge_job_id="71"
    )
    s.rd.jobs_file.parent.mkdir(parents=True, exist_ok=True)
    s.rd.jobs_file.write_bytes(msgspec.json.encode(Jobs([sub])))
    mlog = s.rd.slurm_dir / "71" / "71_0_log.out"
    mlog.parent.mkdir(parents=True)
    mlog.write_text(
        "submitit INFO - Starting\ntoolkit: error: run: 1 of 2 shards are not done (no done manifest): 1\n"
        "merge job: `toolkit merge run` exited 2 (the lines above say why); once that is fixed, ...\n"
    )
    import toolkit.cluster.slurmview
    import toolkit.cluster.status

    J = toolkit.cluster.slurmview.SlurmJob
    monkeypatch.setattr(
        toolkit.cluster.status,
        "slurm_view",
        lambda ids: toolkit.cluster.slurmview.SlurmView(
            jobs={"70_0": J("COMPLETED", "n1"), "70_1": J("FAILED", "n2"), "71": J("FAILED", "n1")}
        ),
    )
    assert cli_main(["logs", str(s.root), "--failed"]) == 1
    out = capsys.readouterr().out
    assert (
        "==> shard 1: failed (job 70_1, node n2) <==" in out and "error: engine died 3 times" in out
    )
    assert "engine died mid-shard" in out and "==> shard 0" not in out
    assert "==> merge job 71: failed" in out and "71/71_0_log.out" in out
    assert (
        "why: toolkit: error: run: 1 of 2 shards are not done" in out
        and "merge job: `toolkit merge run` exited 2" in out
    )
    assert "==> 1 failed record (" in out and f"{s.refs[2].id}  server error 500: boom" in out


def test_help_says_resubmit_takes_shards_with_failures_that_may_pass_too(capsys):
    """resubmit (and retry --slurm) send a shard with failures that may pass although it has a done manifest: the
    help does not say "only the shards without a done manifest"."""
    from toolkit.cli import main as cli_main

    for argv in (["--help"], ["resubmit", "--help"]):
        with pytest.raises(SystemExit):
            cli_main(argv)
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "without a done manifest, and a new merge job" not in out
        and "only the shards without a done" not in out
    )
    assert (
        "resubmit RUN only the shards not finished (no done manifest, failures that may pass)"
        in out
    )


def test_submit_says_tasks_claim_the_shards():
    claim = "each starts its engine once and claims unfinished shards one after another until none is left"
    assert (
        describe_array(ArrayJob("152", [0, 1, 2, 3, 4, 5, 6, 7], ["152_0", "152_1"], claims=True))
        == f"Submitted batch job 152 (array of 2 tasks 152_[0-1] claiming shards 0-7: {claim})"
    )
    assert (
        describe_array(ArrayJob("160", [1, 5, 7], ["160_0", "160_1", "160_2"], claims=True))
        == f"Submitted batch job 160 (array of 3 tasks 160_[0-2] claiming shards 1,5,7: {claim})"
    )
    assert (
        describe_array(ArrayJob("162", [4, 9], ["162"], claims=True))
        == "Submitted batch job 162 (1 task claiming shards 4,9: it starts its engine once and runs them one after another)"
    )


# ---------------------------------------------------------------------------------------------------
# the live bar of `toolkit run`
# ---------------------------------------------------------------------------------------------------
import io  # noqa: E402
import logging  # noqa: E402

from jobfiles import make_job  # noqa: E402
from toolkit.cluster.livebar import LiveBar  # noqa: E402


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_shows_done_total_rate_and_eta_and_keeps_log_lines_apart(half_run):
    s = half_run
    tty = FakeTTY()
    handler = logging.StreamHandler(tty)
    handler.setFormatter(logging.Formatter("LOG %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with LiveBar(s.rd, s.plan, stream=tty, poll_s=0.05) as bar:
            assert handler not in root.handlers, (
                "console lines go through the bar while it is shown"
            )
            logging.getLogger("toolkit.test").warning("hello from the worker")
            write_progress(
                s.rd.progress_file(1),
                Progress(
                    shard=1,
                    state="generating",
                    total=9,
                    done=9,
                    failed=1,
                    tok_per_s=1234.0,
                    started=time.time() - 5,
                ),
            )
            bar.update()
        assert handler in root.handlers
    finally:
        root.removeHandler(handler)
    text = tty.getvalue()
    segments = [x.strip() for x in text.replace("\r", "\n").split("\n") if x.strip()]
    assert "LOG hello from the worker" in segments  # a line of its own, never inside the bar
    bars = [x for x in segments if "prompts" in x]
    assert bars[0].startswith("synthetic-kimi:  89%|") and "16/18 prompts [" in bars[0]
    assert bars[0].endswith("], 250 tok/s, 1 failed, shards 1/2")
    assert "18/18 prompts [" in bars[-1] and "1,234 tok/s, 2 failed, shards 1/2" in bars[-1]
    assert all(re.search(r"\[\d\d:\d\d<(\?|\d\d:\d\d)\]", b) for b in bars), "elapsed < ETA"


def test_no_bar_when_stderr_is_not_a_terminal(half_run):
    s = half_run
    plain = io.StringIO()
    before = list(logging.getLogger().handlers)
    with LiveBar(s.rd, s.plan, stream=plain, poll_s=0.05) as bar:
        assert not bar.enabled and logging.getLogger().handlers == before
        time.sleep(0.2)
    assert plain.getvalue() == ""


@pytest.mark.slow
def test_toolkit_run_into_a_pipe_has_only_log_lines(tmp_path, toy_tokenizer):
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=6, shards=2, sampling={"max_new_tokens": 32})
    r = toolkit("run", str(job), "--no-merge")
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "prompts [" not in r.stderr and "\x1b" not in r.stderr
    assert all(
        re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ", x) for x in r.stderr.splitlines()
    )


@pytest.mark.slow
def test_commands_on_a_run_take_the_job_file_and_say_which_run_they_use(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 6}, shards=1)
    runs.write_run(s)
    job = str(tmp_path / "job.toml")
    for argv in (
        ["merge", job],
        ["audit", job],
        ["status", job, "--json"],
        ["logs", job, "--failed"],
        ["export", job, "--format", "jsonl"],
    ):
        r = toolkit(*argv)
        assert "looks like a job spec" not in r.stderr and "toolkit: error" not in r.stderr, (
            argv,
            r.stderr,
        )
        assert f"run directory: {s.root} (the newest run of job {job})" in r.stderr, (
            argv,
            r.stderr,
        )
    assert (s.root / "export" / "records.jsonl").exists()


def test_a_job_file_without_a_run_yet_says_how_to_make_one(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 2}, shards=1)
    other = tmp_path / "other.toml"
    other.write_text(
        (tmp_path / "job.toml").read_text().replace('name = "synthetic-kimi"', 'name = "other"')
    )
    r = toolkit("status", str(other))
    assert r.returncode == 2
    assert (
        f"toolkit: error: {other}: job 'other' has no run in its output_dir {s.root} yet (it holds 1 run(s) of "
        f"other jobs); `toolkit run {other}` or `toolkit submit {other}` makes one" in r.stderr
    )


def test_logs_without_a_shard_or_with_one_that_does_not_exist_is_a_toolkit_error(
    tmp_path, toy_tokenizer
):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 4}, shards=2)
    r = toolkit("logs", str(s.root))
    assert r.returncode == 2 and r.stderr.startswith("toolkit: error: which shard? the run ")
    assert "has shards 0..1: e.g. `toolkit logs" in r.stderr
    r = toolkit("logs", str(s.root), "7")
    assert (
        r.returncode == 2
        and r.stderr.startswith("toolkit: error: no shard 7: the run ")
        and "has shards 0..1" in r.stderr
    )


def test_a_workers_first_lines_read_as_plain_english():
    from toolkit.formats.progress import Progress
    from toolkit.worker.run import _resume_line, _where

    assert (
        _where(Progress(shard=0, total=1, host="vm")) == "on vm, not under Slurm"
    )  # not `array None_None`
    assert (
        _where(
            Progress(
                shard=0,
                total=1,
                host="n1",
                gpus="0,1",
                job_id="12",
                array_job_id="10",
                array_task_id="3",
                restart_count=2,
            )
        )
        == "on n1, GPUs 0,1, Slurm job 12 (array 10, task 3), requeued 2 times"
    )
    assert _where(Progress(shard=0, total=1, host="n1", job_id="12")) == "on n1, Slurm job 12"
    assert _resume_line(30, 0, 30, 0, 0) == "30 prompts to generate"
    # not "26 of 30 already recorded; 12 to generate" (26 + 12 > 30)
    assert (
        _resume_line(30, 26, 12, 8, 0)
        == "30 prompts: 26 have a record, 18 kept; 12 to generate: 4 never generated and 8 again (8 failures that may pass)"
    )
    assert (
        _resume_line(1, 1, 1, 0, 1)
        == "1 prompt: 1 has a record, 0 kept; 1 to generate: 1 again (1 asked for by `toolkit retry`)"
    )
    assert _resume_line(30, 30, 0, 0, 0) == "30 prompts: all have a record; nothing to generate"


def test_every_argument_of_every_command_says_what_it_takes():
    """`toolkit COMMAND --help` describes each argument: none is listed bare (as `check`'s `job` once was)."""
    from toolkit.cli import build_parser

    bare = []
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if not action.help and not isinstance(action, argparse._HelpAction):
                bare.append(f"{name} {action.dest}")
    assert not bare, f"arguments without help text: {bare}"


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["1", "2"])
def test_run_quiet_hides_the_info_lines_keeps_warnings_and_ends_with_the_summary(
    tmp_path, toy_tokenizer, parallel
):
    """`toolkit run --quiet`: none of the ~15 INFO lines per shard on the terminal (those of worker processes,
    relayed with --parallel 2, neither), the warnings kept (the stub's), the audit's summary last; the shards' log
    files keep every line."""
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=8, shards=2, sampling={"max_new_tokens": 32})
    r = toolkit("run", "--quiet", str(job), "--parallel", parallel)
    assert r.returncode == 0, r.stderr
    assert " INFO " not in r.stderr, r.stderr
    assert "WARNING toolkit.worker: engine is the STUB" in r.stderr
    out = r.stdout.rstrip().splitlines()
    assert (
        out[0].startswith("run directory: ")
        and out[1].startswith("audit of run t (")
        and "PASSED" in out[1]
    )
    assert out[-1].startswith("report: ") and "audit.html" in out[-1]
    for k in (0, 1):
        assert (
            " INFO toolkit.worker: shard "
            in (tmp_path / "run" / "logs" / f"{k:05d}.log").read_text()
        )
    # merge, with and without --quiet (before or after the command): the INFO lines go, the summary stays
    run = str(tmp_path / "run")
    loud, quiet, first = (
        toolkit("merge", run),
        toolkit("merge", run, "--quiet"),
        toolkit("--quiet", "merge", run),
    )
    assert " INFO toolkit.dataset.merge: merging shard 0" in loud.stderr
    for r in (quiet, first):
        assert (
            r.returncode == 0
            and r.stderr == ""
            and r.stdout.rstrip().splitlines()[-1].startswith("report: ")
        )


def test_every_exit_code_has_one_meaning_said_by_the_help_and_the_docs(capsys):
    """The exit codes live in one list (errors.EXIT_MEANINGS): `toolkit --help` prints it whole, and
    docs/commands.md says each code."""
    from toolkit.errors import EXIT_MEANINGS, EXIT_STUCK

    assert EXIT_STUCK in EXIT_MEANINGS and len(set(EXIT_MEANINGS)) == len(EXIT_MEANINGS)
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    for code, what in EXIT_MEANINGS.items():
        assert f"{code} {what}" in said
    docs = (Path(__file__).parent.parent / "docs" / "commands.md").read_text()
    assert [int(c) for c in re.findall(r"^- (\d+) ", docs, re.M)] == list(EXIT_MEANINGS)


def test_a_command_run_in_process_leaves_the_log_levels_as_they_were(tmp_path, toy_tokenizer):
    """`main` in a process that goes on (a test, a notebook): --quiet and the hidden tokenizer lines of login-node
    commands hold for that command only; a later worker in the same process still logs `loaded tokenizer`."""
    import logging

    from jobfiles import make_job

    chat = logging.getLogger("toolkit.job.chat")
    handlers = [(h, h.level) for h in logging.getLogger().handlers]
    assert cli_main(["--quiet", "check", str(make_job(tmp_path, toy_tokenizer("kimi"), n=2))]) == 0
    assert chat.level == logging.NOTSET
    assert [(h, h.level) for h in logging.getLogger().handlers] == handlers


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["stauts", "runs/none"], "invalid choice: 'stauts' (choose from 'run', "),
        (
            ["run", "jobs/demo.toml", "--paralel", "2"],
            "toolkit run: error: unrecognized arguments: --paralel 2; did you mean "
            "`--parallel` for `--paralel`?",
        ),
        (
            ["submit", "jobs/demo.toml", "--dry-run", "--gres", "gpu:2"],
            "toolkit submit: error: unrecognized arguments: --gres gpu:2; `--gres` is not an option here: any sbatch option "
            'goes in the job\'s [slurm] table as extra = { gres = "..." }',
        ),
    ],
)
def test_a_mistyped_command_or_flag_gets_the_closest_and_an_sbatch_option_gets_slurm_extra(
    argv, said, tmp_path
):
    r = toolkit(*argv)
    assert r.returncode == 2 and said in r.stderr, r.stderr
    if argv[0] == "stauts":
        assert r.stderr.rstrip().endswith("did you mean `status`?")
    assert not (REPO / "runs" / "none").exists()


def test_verbose_and_quiet_on_either_side_of_the_command(tmp_path):
    for argv in (
        ["-v", "status", str(tmp_path)],
        ["status", str(tmp_path), "-v"],
        ["status", "--verbose", str(tmp_path)],
    ):
        r = toolkit(*argv)
        # -v: the error's traceback, then its one line
        assert r.returncode == 2 and "Traceback (most recent call last)" in r.stderr, (
            argv,
            r.stderr,
        )
        assert r.stderr.rstrip().splitlines()[-1].startswith("toolkit: error: "), (argv, r.stderr)
    r = toolkit("status", str(tmp_path), "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.slow
def test_run_of_some_shards_exits_0_and_a_finished_run_run_again_says_nothing_to_generate(
    tmp_path, toy_tokenizer
):
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=6, shards=2, sampling={"max_new_tokens": 32})
    run = tmp_path / "run"
    r = toolkit("run", str(job), "--shards", "0", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        f"shards 0 done; 1 of the run's 2 shards (1) not done: `toolkit retry {run}` generates them and merges "
        "the run"
    ) in r.stdout
    assert not (run / "merged").exists()  # a part of the run is not merged
    again = toolkit("run", str(job), "--shards", "0", "--quiet")
    assert again.returncode == 0 and f"nothing to generate: shards 0 of {run} done" in again.stdout
    assert (
        toolkit("run", str(job), "--quiet").returncode == 0
        and (run / "merged" / "manifest.json").exists()
    )
    merged_at = (run / "merged" / "manifest.json").stat().st_mtime_ns
    last = toolkit("run", str(job))
    assert last.returncode == 0, last.stderr
    assert last.stdout.splitlines()[1:] == [
        f"nothing to generate: every shard of {run} done",
        f"run: complete: every shard done, merged, audit passed (exit 0); `toolkit export {run}` writes the training "
        "file",
    ]
    assert (
        "merging shard" not in last.stderr
        and (run / "merged" / "manifest.json").stat().st_mtime_ns == merged_at
    )
