"""The run directory: every path and file name of a run, in one place.

    RUN/run.json                 resolved spec, fingerprint, shard plan (new shards appended when
                                 the job grows)
    RUN/prompts.msgpack          where each planned prompt lives (dataset, line, byte offset), in
                                 planned order
    RUN/check.msgpack            what the pre-flight learned rendering the prompts (check_cache);
                                 `check` writes it in a folder that holds no run yet too
    RUN/shards/NNNNN.zst         append-only record frames;  shards/NNNNN.done  completion manifest
    RUN/shards/NNNNN.zst.lock    the shard's lock where flock does not work;
                                 NNNNN.zst.damaged-STAMP  a damaged file kept aside when its
                                 intact frames were salvaged
    RUN/shards/NNNNN.retry       ids `toolkit retry` asked to generate again (removed when the shard
                                 completes)
    RUN/progress/NNNNN.json      live progress of a shard
    RUN/progress/local/HOST.PID.json  a `toolkit run`, `retry` or `worker` that runs shards of the
                                 run (not as its Slurm task) and the shards it will run, locked
                                 (flock) while it lives
    RUN/logs/NNNNN.log           worker log;  logs/NNNNN.server.log  the engine's own output
    RUN/slurm/jobs.json          the Slurm jobs submitted for this run
    RUN/slurm/JOB/               submitit's folder of one job (its scripts, pickles and logs)
    RUN/merge.lock               locked (flock) while the run is merged: a second merge waits for
                                 the first
    RUN/handover.lock            locked (flock) while a task at the run's tail decides whether it
                                 hands its work over (worker.claims.hand_over)
    RUN/merged/records.zst       the merged dataset;  merged/manifest.json  what the merge found
    RUN/merged/missing_ids.txt   planned ids with no record (written by the merge)
    RUN/merged/failed_ids.txt    ids whose record is a failure (written by the audit)
    RUN/merged/audit.json        the audit report;  merged/audit.html  the same, for a browser
    RUN/export/                  exports written without `-o`: records.jsonl, records.parquet,
                                 tokens.jsonl, conversations.jsonl (by format)

No other module builds a path inside a run directory; each file has one writer, named above. What
run.json holds is in `formats.runplan`, what prompts.msgpack holds and how it is read in
`formats.prompts`, and a run opened in `formats.run`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from toolkit.formats.files import shown_path

__all__ = ["PLAN_FILE", "RunDir"]

PLAN_FILE = "run.json"  # its presence is what makes a folder a run directory
EXPORT_NAMES = {
    "jsonl": "records.jsonl",
    "parquet": "records.parquet",
    "tokens": "tokens.jsonl",
    "conversations": "conversations.jsonl",
}


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    plan_file = property(lambda self: self.root / PLAN_FILE)
    prompts_file = property(lambda self: self.root / "prompts.msgpack")
    check_file = property(lambda self: self.root / "check.msgpack")
    # formats.pending: a change being made
    pending_file = property(lambda self: self.root / "pending.msgpack")
    shards_dir = property(lambda self: self.root / "shards")
    progress_dir = property(lambda self: self.root / "progress")
    logs_dir = property(lambda self: self.root / "logs")
    slurm_dir = property(lambda self: self.root / "slurm")
    jobs_file = property(lambda self: self.root / "slurm" / "jobs.json")
    merged_dir = property(lambda self: self.root / "merged")
    merged_file = property(lambda self: self.root / "merged" / "records.zst")
    merge_lock = property(lambda self: self.root / "merge.lock")
    handover_lock = property(lambda self: self.root / "handover.lock")
    manifest_file = property(lambda self: self.root / "merged" / "manifest.json")
    missing_file = property(lambda self: self.root / "merged" / "missing_ids.txt")
    failed_file = property(lambda self: self.root / "merged" / "failed_ids.txt")
    audit_json = property(lambda self: self.root / "merged" / "audit.json")
    audit_html = property(lambda self: self.root / "merged" / "audit.html")
    export_dir = property(lambda self: self.root / "export")

    @staticmethod
    def is_run(path: str | os.PathLike) -> bool:
        """Whether `path` is a run directory (it holds a plan)."""
        return (Path(path) / PLAN_FILE).exists()

    def finish_command(self) -> str:
        """The command that finishes this run's shards (those unfinished, or whose file changed
        since they were finished): `toolkit resubmit RUN` for a run submitted to Slurm, else
        `toolkit retry RUN` (runs them here)."""
        return f"toolkit {'resubmit' if self.jobs_file.exists() else 'retry'} {self.shown}"

    @property
    def shown(self) -> str:
        """The run directory as a user would type it: relative to the current directory when inside
        it."""
        return shown_path(self.root)

    @staticmethod
    def _numbered(folder: Path, i: int, suffix: str) -> Path:
        """The file of shard `i` in `folder`: its number on five digits, then `suffix`."""
        return folder / f"{i:05d}{suffix}"

    def shard_file(self, i: int) -> Path:
        return self._numbered(self.shards_dir, i, ".zst")

    def done_file(self, i: int) -> Path:
        return self._numbered(self.shards_dir, i, ".done")

    def retry_file(self, i: int) -> Path:
        return self._numbered(self.shards_dir, i, ".retry")

    def progress_file(self, i: int) -> Path:
        return self._numbered(self.progress_dir, i, ".json")

    def local_run_file(self, host: str, pid: int) -> Path:
        return self.progress_dir / "local" / f"{host}.{pid}.json"

    def log_file(self, i: int) -> Path:
        return self._numbered(self.logs_dir, i, ".log")

    def server_log_file(self, i: int) -> Path:
        return self._numbered(self.logs_dir, i, ".server.log")

    def export_file(self, fmt: str) -> Path:
        """Where an export in format `fmt` goes when no output is given."""
        return self.export_dir / EXPORT_NAMES.get(fmt, f"{fmt}.out")

    def job_folder(self, job: str = "%j") -> Path:
        """submitit's folder of one Slurm job (`%j` for the pattern submitit fills in)."""
        return self.slurm_dir / job

    def job_log(self, job: str) -> Path:
        """submitit's log of a one-task job such as the merge job (stdout and stderr together)."""
        return self.slurm_dir / job / f"{job}_0_log.out"

    def job_logs(self, job: str) -> list[Path]:
        """submitit's logs of `job`, wherever submitit put them (an array task's folder is named
        after the array)."""
        return sorted(self.slurm_dir.glob(f"*/{job}_0_log.out"))

    def writable_dirs(self) -> tuple[Path, ...]:
        """The folders a run writes in (made by `make_dirs`)."""
        return self.root, self.shards_dir, self.progress_dir, self.logs_dir, self.slurm_dir

    def make_dirs(self) -> None:
        for d in self.writable_dirs():
            d.mkdir(parents=True, exist_ok=True)
