"""A run's settings: the tables of a job that say how to run it, not what it makes, taken from the
job into its run when it is planned again (the change logged); everything in the fingerprint stays
pinned."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from toolkit.formats.files import atomic_write
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan, plan_bytes
from toolkit.job.schema import JobSpec

log = logging.getLogger(__name__)

# Tables of a job that say how to run it, not what it makes: a run takes new values from the job
# when it is planned again (`toolkit run`, `toolkit submit` on the same job), and the change is
# logged. Everything in the fingerprint (model, template, sampling, inputs, shards) stays pinned.
SETTINGS_TABLES = ("engine", "client", "slurm", "audit", "estimate")


SETTINGS_KEYS = {"sharding": ("flush_records", "flush_seconds")}


# [engine] keys whose change may change how outputs are made (not only how the engine is run):
# warned about.
ENGINE_OUTPUT_KEYS = ("kind", "tp_size", "dp_size", "extra_args", "command", "url", "stub")


def settings_changes(old: JobSpec, new: JobSpec) -> list[tuple[str, Any, Any]]:
    """(table.key, old value, new value) of every run setting that differs between two specs."""
    changes = []
    keys = [(t, None) for t in SETTINGS_TABLES] + [
        (t, k) for t, ks in SETTINGS_KEYS.items() for k in ks
    ]
    for table, only in keys:
        a, b = msgspec.to_builtins(getattr(old, table)), msgspec.to_builtins(getattr(new, table))
        for key in sorted(set(a) | set(b)):
            if (only is None or key == only) and a.get(key) != b.get(key):
                changes.append((f"{table}.{key}", a.get(key), b.get(key)))
    return changes


def update_settings(rd: RunDir, old: RunPlan, spec: JobSpec) -> list[tuple[str, Any, Any]]:
    """Take the job's run settings into an existing run (same fingerprint), log each change, rewrite
    run.json."""
    changes = settings_changes(old.spec, spec)
    if not changes:
        return changes
    for table in SETTINGS_TABLES:
        setattr(old.spec, table, getattr(spec, table))
    for table, ks in SETTINGS_KEYS.items():
        for k in ks:
            setattr(getattr(old.spec, table), k, getattr(getattr(spec, table), k))
    atomic_write(rd.plan_file, plan_bytes(old))
    for key, a, b in changes:
        log.info("run %s: setting %s changed from %r to %r", rd.shown, key, a, b)
        if key.split(".")[0] == "engine" and key.split(".")[1] in ENGINE_OUTPUT_KEYS:
            log.warning(
                "run %s: %s changed: records written before and after were made by differently "
                "configured engines",
                rd.shown,
                key,
            )
    return changes
