"""One way to write ranges and times (fmt), and one owner of every run-directory path (rundir)."""

import re

from toolkit.formats.rundir import RunDir
from toolkit.formats.text import file_stamp, ranges, utc_now


def test_ranges_people_and_slurm():
    assert ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3, 7, 9-10"
    assert ranges([10, 9, 7, 0, 1, 2, 3], sep=",") == "0-3,7,9-10"
    assert ranges([]) == ""
    assert ranges([5]) == "5"
    assert ranges([1, 3, 5, 7], limit=2) == "1, 3, ... (4 in all)"


def test_times():
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", utc_now())
    assert re.fullmatch(r"\d{8}-\d{6}", file_stamp())


def test_rundir_owns_every_merged_file(tmp_path):
    rd = RunDir(tmp_path)
    assert not RunDir.is_run(tmp_path)
    rd.make_dirs()
    rd.plan_file.write_text("{}")
    assert RunDir.is_run(tmp_path)
    names = {
        p.relative_to(tmp_path).as_posix()
        for p in (
            rd.merged_file,
            rd.manifest_file,
            rd.missing_file,
            rd.failed_file,
            rd.audit_json,
            rd.audit_html,
        )
    }
    assert names == {
        "merged/records.zst",
        "merged/manifest.json",
        "merged/missing_ids.txt",
        "merged/failed_ids.txt",
        "merged/audit.json",
        "merged/audit.html",
    }
    assert rd.job_log("123") == tmp_path / "slurm" / "123" / "123_0_log.out"
    (tmp_path / "slurm" / "77").mkdir()
    (tmp_path / "slurm" / "77" / "78_0_log.out").write_text("")
    assert rd.job_logs("78") == [tmp_path / "slurm" / "77" / "78_0_log.out"]
