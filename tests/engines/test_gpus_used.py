"""Every GPU a task asks Slurm for generates: a one-node engine that uses fewer GPUs than `[slurm] gpus_per_node`
(or `--gpus-per-node`), or needs more, is refused by `check`, `submit --dry-run` and `submit` before anything is
written, naming the idle GPUs and both fixes; the template and every recipe pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobfiles import make_job
from toolkit.cli import main as cli_main
from toolkit.engines.layout import check_engine_layout, engine_gpus
from toolkit.job.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "jobs").glob("*.toml")) + [REPO / "templates" / "job.toml"]


@pytest.fixture
def no_slurm(tmp_path, monkeypatch):
    """No Slurm command anywhere: the refusal comes before Slurm is asked."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nothing" / "slurm.conf"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_template_and_every_recipe_use_every_gpu_they_ask_for(path):
    spec = load_spec(path, check_paths=False)
    assert check_engine_layout(spec.engine, spec.slurm.gpus_per_node) is None
    assert engine_gpus(spec.engine) == spec.slurm.gpus_per_node


def test_the_template_defaults_of_before_are_refused(tmp_path):
    """tp_size = 1 with gpus_per_node = 8, the template's old defaults: 7 GPUs billed and idle."""
    text = (REPO / "templates" / "job.toml").read_text()
    job = tmp_path / "job.toml"
    job.write_text(text.replace("\ntp_size = 8 ", "\ntp_size = 1 ", 1))
    spec = load_spec(job, check_paths=False)
    assert spec.engine.tp_size == 1 and spec.slurm.gpus_per_node == 8
    assert "7 (GPUs 1-7) would sit idle" in check_engine_layout(
        spec.engine, spec.slurm.gpus_per_node
    )


@pytest.mark.parametrize(
    "engine, says",
    [
        (
            {"tp_size": 1},
            "[engine] tp_size = 1 uses 1 GPU of the 8 that [slurm] gpus_per_node = 8 asks Slurm for on "
            "each task's node: 7 (GPUs 1-7) would sit idle for the whole run; set dp_size = 8 (replicas on "
            "the idle GPUs) or [slurm] gpus_per_node = 1",
        ),
        (
            {"tp_size": 2, "dp_size": 2},
            "[engine] tp_size = 2, dp_size = 2 uses 4 GPUs of the 8 that [slurm] gpus_per_node "
            "= 8 asks Slurm for on each task's node: 4 (GPUs 4-7) would sit idle for the whole "
            "run; set dp_size = 4 (replicas on the idle GPUs) or [slurm] gpus_per_node = 4",
        ),
        (
            {"tp_size": 4},
            "[engine] tp_size = 4 uses 4 GPUs of the 8 that [slurm] gpus_per_node = 8 asks Slurm for on "
            "each task's node: 4 (GPUs 4-7) would sit idle for the whole run; set dp_size = 2 (replicas on "
            "the idle GPUs) or [slurm] gpus_per_node = 4",
        ),
    ],
    ids=["tp1", "tp2xdp2", "tp4"],
)
def test_an_engine_that_leaves_gpus_idle_is_refused_by_check_and_submit(
    tmp_path, toy_tokenizer, capsys, no_slurm, engine, says
):
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=4,
        engine={"kind": "sglang", **engine},
        slurm={"gpus_per_node": 8, "cpus_per_task": 1, "time": "00:10:00"},
    )
    for argv in (["check", str(job)], ["submit", str(job), "--dry-run"], ["submit", str(job)]):
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.splitlines()[-1] == f"toolkit: error: {says}", argv
        assert not (tmp_path / "run").exists(), f"{argv}: refused before anything is written"
    # either fix passes: the flag that asks for the GPUs the engine uses, or replicas on the rest
    used = engine.get("tp_size", 1) * engine.get("dp_size", 1)
    assert cli_main(["submit", str(job), "--dry-run", "--gpus-per-node", str(used)]) == 0
    assert f"#SBATCH --gpus-per-node={used}" in capsys.readouterr().out
    filled = make_job(
        tmp_path / "filled",
        toy_tokenizer("kimi"),
        n=4,
        engine={"kind": "sglang", **engine, "dp_size": 8 // engine["tp_size"]},
        slurm={"gpus_per_node": 8, "cpus_per_task": 1, "time": "00:10:00"},
    )
    assert cli_main(["submit", str(filled), "--dry-run"]) == 0
    assert "#SBATCH --gpus-per-node=8" in capsys.readouterr().out


@pytest.mark.parametrize(
    "engine, gpus, says",
    [
        # DP attention: the replicas are inside the tensor-parallel group, dp_size is not counted
        ({"tp_size": 8, "dp_size": 8, "extra_args": ["--enable-dp-attention"]}, 8, None),
        (
            {"tp_size": 4, "dp_size": 2, "extra_args": ["--enable-dp-attention"]},
            8,
            "with --enable-dp-attention uses 4 GPUs of the 8 that [slurm] gpus_per_node = 8 asks Slurm for on each task's "
            "node: 4 (GPUs 4-7) would sit idle for the whole run; set tp_size = 8 (dp_size is inside tp_size with DP "
            "attention) or [slurm] gpus_per_node = 4",
        ),
        ({"tp_size": 2, "dp_size": 4}, 8, None),
        (
            {"tp_size": 2, "extra_args": ["--pp-size", "2"]},
            8,
            "tp_size = 2, pp_size = 2 uses 4 GPUs of the 8",
        ),
        (
            {"tp_size": 3},
            8,
            "5 (GPUs 3-7) would sit idle for the whole run; set [slurm] gpus_per_node = 3",
        ),
        (
            {"tp_size": 16},
            8,
            "[engine] tp_size = 16 needs 16 GPUs on one node but [slurm] gpus_per_node = 8: set "
            "[slurm] gpus_per_node = 16 where the nodes have that many",
        ),
        ({"tp_size": 1, "dp_size": 2}, 1, "tp_size = 1, dp_size = 2 needs 2 GPUs on one node"),
        ({"tp_size": 1}, 0, "needs 1 GPU on one node but [slurm] gpus_per_node = 0"),
        # the stub is a stand-in: it uses the GPUs of its task as SGLang would, or asks for none on a CPU machine
        (
            {"kind": "stub", "tp_size": 1},
            4,
            "4 that [slurm] gpus_per_node = 4 asks Slurm for on each task's node: 3 "
            "(GPUs 1-3) would sit idle",
        ),
        ({"kind": "stub", "tp_size": 2}, 0, None),
        # an external server: the tasks only send requests
        ({"kind": "external", "url": "http://127.0.0.1:9"}, 0, None),
        (
            {"kind": "external", "url": "http://127.0.0.1:9"},
            8,
            '[engine] kind = "external" starts no engine: each task only sends requests, and the 8 GPUs that [slurm] '
            "gpus_per_node = 8 asks Slurm for (GPUs 0-7) would sit idle for the whole run; set [slurm] gpus_per_node = 0",
        ),
    ],
)
def test_gpus_of_one_node_counted_as_sglang_lays_them_out(
    tmp_path, toy_tokenizer, engine, gpus, says
):
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=2,
        engine={"kind": "sglang", **engine},
        slurm={"gpus_per_node": gpus},
    )
    spec = load_spec(job)
    problem = check_engine_layout(spec.engine, spec.slurm.gpus_per_node)
    assert problem is None if says is None else says in problem, problem
