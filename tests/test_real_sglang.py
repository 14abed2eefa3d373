"""The toolkit against real SGLang 0.5.23 on the CPU (tests/realsglang.py): what the stub stands in for."""

from __future__ import annotations

import json

import pytest

from realsglang import sglang_job, toolkit
from toolkit.shardfile import read_shard

pytestmark = pytest.mark.sglang


def test_a_whole_job_of_two_shards_check_run_merge_audit_and_every_export(tmp_path, tiny_model):
    job = sglang_job(tmp_path, tiny_model, n=12, shards=2)
    r = toolkit("check", str(job))
    assert "ok" in r.stdout
    r = toolkit("run", str(job))
    print(r.stdout, r.stderr)
    run = tmp_path / "run"
    records = [rec for k in range(2) for rec in read_shard(run / "shards" / f"{k:05d}.zst")]
    assert len(records) == 12
