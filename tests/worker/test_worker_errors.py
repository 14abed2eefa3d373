"""What a worker says when the file system or another worker is in the way: one line, what to do, an exit code."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import msgspec
import pytest

from jobfiles import make_job, prepared_run
from toolkit.cli import main as cli_main
from toolkit.formats.frames import read_shard
from toolkit.formats.manifests import read_done
from toolkit.formats.progress import read_progress
from toolkit.formats.shardfile import ShardWriter
from toolkit.worker.run import DONE, ShardRefused, run_shard
from toolkit.worker.shard import ShardFailed


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


# Where the first write to fail comes from: the shard's own batch (`add`), the watcher's timed
# flush, or the shard's last flush at its end; (flush_records, flush_seconds, token_delay_s).
FULL_DISK_AT = {
    "add": ("shardfile.py", "add", (3, 1e6, 0.0)),
    "timed": ("concurrency.py", "watch", (1000, 0.3, 0.01)),
    "finish": ("openshard.py", "_end", (1000, 1e6, 0.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("where", FULL_DISK_AT)
def test_a_full_disk_fails_the_shard_in_one_line_and_the_rerun_loses_nothing(
    tmp_path, kimi, monkeypatch, where
):
    file, func, (records, seconds, delay) = FULL_DISK_AT[where]
    job = make_job(
        tmp_path,
        kimi,
        n=12,
        sampling={"max_new_tokens": 64},
        stub={"token_delay_s": delay},
        sharding={"flush_records": records, "flush_seconds": seconds},
    )
    rd, _ = prepared_run(job)
    import toolkit.formats.shardfile as sf

    real, calls, failed_in = os.write, {"n": 0}, []

    def write(fd, data):
        calls["n"] += 1
        if calls["n"] > 1:  # the header gets through, the first batch meets a full disk
            failed_in.append([(Path(f.filename).name, f.name) for f in traceback.extract_stack()])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(sf.os, "write", write)
    with pytest.raises(ShardFailed) as e:
        run_shard(rd.root, 0)
    assert len(failed_in) == 1, "nothing is written after a failed write (a torn frame may end it)"
    assert (file, func) in failed_in[0]
    assert e.value.exit_code == 1
    msg = str(e.value)
    assert "No space left on device (ENOSPC)" in msg and "free space" in msg and "\n" not in msg
    assert read_progress(rd, 0).state == "failed"
    assert read_done(rd.done_file(0)) is None
    monkeypatch.setattr(sf.os, "write", real)
    assert run_shard(rd.root, 0).end == DONE
    assert sorted(r.id for r in read_shard(rd.shard_file(0))) == [f"p{i:04d}" for i in range(12)]


def test_a_run_directory_that_cannot_be_written_is_exit_2(tmp_path, kimi, monkeypatch, caplog):
    job = make_job(tmp_path, kimi, n=4, sampling={"max_new_tokens": 64})
    rd, _ = prepared_run(job)
    import toolkit.formats.shardfile as sf

    real = os.open

    def deny(path, *a, **k):
        if str(path).endswith(".zst"):
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(sf.os, "open", deny)
    assert cli_main(["worker", str(rd.root), "0"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert (
        len(errors) == 1
        and "Read-only file system (EROFS)" in errors[0]
        and "must be writable" in errors[0]
    )


def test_a_shard_locked_by_another_worker_is_a_clear_error(tmp_path, kimi, caplog):
    job = make_job(tmp_path, kimi, n=4, sampling={"max_new_tokens": 64})
    rd, plan = prepared_run(job)
    other = ShardWriter(rd.shard_file(0), plan.fingerprint, 0)
    other.open(range(plan.shards[0].first, plan.shards[0].first + plan.shards[0].count))
    try:
        assert cli_main(["worker", str(rd.root), "0"]) == 1
    finally:
        other.close()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "locked by another worker" in errors[0]
    assert (
        "shard 0 failed: " in rd.log_file(0).read_text()
    )  # said in the shard's log too, where `logs` looks
    # the progress file belongs to the worker that holds the shard: the refused one leaves it alone
    assert read_progress(rd, 0) is None


@pytest.mark.slow
def test_a_second_ctrl_c_says_what_the_worker_waits_for(tmp_path, kimi):
    job = make_job(
        tmp_path,
        kimi,
        n=8,
        sampling={"max_new_tokens": 4000},
        stub={
            "ignore_sigterm": True,
            "token_delay_s": 0.02,
            "fixed_output_tokens": 3000,
        },  # a shutdown that hangs until SIGKILL
        engine={"shutdown_timeout_s": 6},
    )
    rd, _ = prepared_run(job)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = rd.log_file(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and "generating" in log.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    # the second Ctrl-C once the engine is being stopped (it ignores SIGTERM: up to shutdown_timeout_s)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "stopping the engine (pid" not in log.read_text():
        assert proc.poll() is None, "the worker ended before its engine was stopped"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    text = log.read_text()
    assert "got SIGINT again: still stopping, waiting for the engine (pid" in text
    assert "SIGKILL after 6 s ([engine] shutdown_timeout_s)" in text
    assert (
        proc.returncode == 130
    )  # Ctrl-C: interrupted (SIGTERM and SIGUSR2 exit 3, to be requeued)


def _with_vocab_size(folder, vocab_size: int) -> None:
    """Say in `folder`'s config.json that the model has `vocab_size` ids: fewer than its tokenizer makes, as
    the tokenizer of another model (a wrong [model] tokenizer_path) gives."""
    import json

    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "vocab_size": vocab_size}))


@pytest.mark.slow
def test_a_tokenizer_with_ids_past_the_models_vocab_size_is_refused_before_any_prompt_is_sent(
    tmp_path, kimi, capsys
):
    import shutil

    from toolkit.job.chat import load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(kimi, model)
    size = len(
        load_tokenizer(
            type(
                "M",
                (),
                {
                    "path": str(model),
                    "tokenizer_path": None,
                    "chat_template": None,
                    "trust_remote_code": False,
                    "chat_template_kwargs": {},
                },
            )()
        )
    )
    job = make_job(tmp_path, model, n=4, sampling={"max_new_tokens": 64})
    rd, _ = prepared_run(job)  # planned while the model folder was right
    _with_vocab_size(model, size - 20)
    assert cli_main(["check", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer makes {size:,} ids but the model has {size - 20:,}" in err
    assert (
        f"{model / 'config.json'} vocab_size" in err
        and "SGLang dies on a prompt holding one" in err
    )
    # The worker refuses it too, before a prompt reaches the engine: no record is written; bad input, exit 2.
    with pytest.raises(ShardRefused, match="outside its embedding") as e:
        run_shard(rd.root, 0)
    assert e.value.exit_code == 2
    assert not rd.shard_file(0).exists() or list(read_shard(rd.shard_file(0))) == []


def test_a_shard_file_holding_records_this_shard_does_not_own_is_refused_untouched(tmp_path, kimi):
    """Records of another shard's positions, or an id at a planned position that is not the plan's: the file was put
    here from another shard or run; the worker says so and writes nothing to it."""
    job = make_job(tmp_path, kimi, n=8, shards=2, sampling={"max_new_tokens": 64})
    rd, plan = prepared_run(job)
    assert run_shard(rd.root, 1).end == DONE
    theirs = list(read_shard(rd.shard_file(1)))
    sp = plan.shards[0]
    for name, records in (
        ("another shard's positions", theirs[:2]),
        (
            "another id at a planned position",
            [msgspec.structs.replace(theirs[0], index=sp.first, id="zz")],
        ),
    ):
        path = rd.shard_file(0)
        path.unlink(missing_ok=True)
        w = ShardWriter(path, plan.fingerprint, 0)
        w.open(range(sp.first, sp.first + sp.count))
        for r in records:
            w.add(r)
        w.close()
        before = path.read_bytes()
        with pytest.raises(
            ShardFailed,
            match=rf"holds ids this shard does not own \(e.g. '{records[0].id}'\).*move it aside",
        ):
            run_shard(rd.root, 0)
        assert path.read_bytes() == before, name
