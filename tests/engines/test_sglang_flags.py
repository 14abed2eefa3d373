"""SGLang's flag data (generated from its wheels by scripts/sglang_flags.py) and the parser emulation on top."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import json
import os
import subprocess
import sys
import zipfile
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import realsglang

from jobfiles import make_job
from toolkit.engines.sglang_contract.extra_args import check_extra_args
from toolkit.engines.sglang_contract.flags import DATA_FILE, add_to_parser, flag_set, versions

REPO = Path(__file__).resolve().parents[2]


def _script():
    """scripts/sglang_flags.py as a module (registered first: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(
        "sglang_flags_script", REPO / "scripts" / "sglang_flags.py"
    )
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    return script


def test_data_names_its_releases_and_sources():
    assert versions()[:2] == ["0.5.23", "0.5.9"], "newest first"
    for v in versions():
        fs = flag_set(v)
        assert (
            fs.source.startswith(f"sglang-{v}-")
            and "sglang/srt/server_args.py ServerArgs.add_cli_args" in fs.source
        )
        assert {
            "--model-path",
            "--tp-size",
            "--port",
            "--api-key",
            "--config",
            "-h",
            "--help",
        } <= set(fs.by_option)
    assert "arg_groups/fields" in flag_set("0.5.23").source, (
        "0.5.23 derives most flags from dataclass fields"
    )
    assert "--cuda-graph-max-bs" in flag_set("0.5.9") and "--cuda-graph-max-bs" not in flag_set(
        "0.5.23"
    )
    assert flag_set("0.5.23").by_option["--trust-remote-code"].nargs == 0
    assert flag_set("0.5.23").by_option["--tp-size"].type == "int"
    assert flag_set().version == "0.5.23"


@pytest.mark.slow
def test_abbreviations_resolve_as_argparse_resolves_them():
    """Every prefix of every option: the emulation and argparse (on the same flags) agree on what it means."""
    fs = flag_set("0.5.23")
    parser = argparse.ArgumentParser(prog="sglang serve", add_help=False)
    add_to_parser(parser, fs, skip_dests=set())
    parser.add_argument("-h", "--help", action="store_true")
    seen = set()
    ambiguous = 0
    for option in sorted(fs.by_option):
        for n in range(3, len(option) + 1):
            prefix = option[:n]
            if prefix in seen:
                continue
            seen.add(prefix)
            flag, resolved, _, problem = fs.resolve(prefix)
            try:
                with redirect_stderr(io.StringIO()) as err:
                    action = parser._parse_optional(prefix)
            except SystemExit:
                assert problem == "ambiguous" and "ambiguous option" in err.getvalue(), prefix
                ambiguous += 1
                continue
            if isinstance(action, list):  # Python >= 3.12 returns every match
                action = action[0]
            assert problem is None, (prefix, problem)
            assert action[0] is not None and action[0].dest in (flag.dest, "help"), (
                prefix,
                resolved,
            )
    assert len(seen) > 5000 and ambiguous > 1000


def test_generator_reads_a_wheel_without_importing_it(tmp_path):
    """The script on a tiny wheel: add_cli_args' own add_argument calls, a helper it hands the parser to, and
    dataclass fields (0.5.2x layout)."""
    script = _script()
    server_args = """
import argparse
from sglang.srt.arg_groups.fields.parallel import Parallel
CHOICES = ["a", "b"]
class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        add_cli_args_from_dataclass(parser, ServerArgs)
        parser.add_argument("--mode", type=str, choices=CHOICES)
        parser.add_argument("--old", action=DeprecatedStoreTrueAction, new_flag="--new")
        _more(parser)
def _more(parser):
    parser.add_argument("--config", type=str)
_INPUT_NAMESPACES = [Parallel]
"""
    fields = """
class Parallel(msgspec.Struct):
    _NS_PATH = "parallel"
    tp_size: A[int, Arg(help="tp", aliases=["--tensor-parallel-size"])] = 1
    nccl_port: A[Optional[int], "port"] = None
    fast: A[bool, "switch"] = False
    kind: A[Literal["x", "y"], "kind"] = "x"
    hidden: A[int, Arg(no_cli=True)] = 0
    flip: A[bool, Arg(action=argparse.BooleanOptionalAction)] = True
    ids: A[Optional[List[int]], "ids"] = None
    derived: A[int, Derived(doc="not an input")] = 0
"""
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sglang/srt/server_args.py", server_args)
        z.writestr("sglang/srt/arg_groups/fields/parallel.py", fields)
    d = script.read_wheel(wheel)
    flags = {f["options"][0]: f for f in d["flags"]}
    assert d["version"] == "9.9.9" and "_more(parser)" in d["source"]
    assert flags["--tp-size"] == {
        "options": ["--tp-size", "--tensor-parallel-size"],
        "dest": "tp_size",
        "nargs": None,
        "type": "int",
    }
    assert flags["--nccl-port"]["type"] == "int" and flags["--fast"]["nargs"] == 0
    assert (
        flags["--kind"]["choices"] == ["x", "y"]
        and "--hidden" not in flags
        and "--derived" not in flags
    )
    assert flags["--flip"]["options"] == ["--flip", "--no-flip"] and flags["--flip"]["nargs"] == 0
    assert flags["--ids"]["nargs"] == "+" and flags["--mode"]["choices"] == ["a", "b"]
    assert (
        flags["--old"]["nargs"] == 0
        and "--new" in flags["--old"]["deprecated"]
        and "--config" in flags
    )
    # the committed data is what the script writes: one flag per line, header first
    out = tmp_path / "flags.json"
    script.write({"about": "x", "versions": {"9.9.9": d}}, out)
    assert ast.literal_eval(
        out.read_text().replace("null", "None").replace("true", "True").replace("false", "False")
    )
    assert DATA_FILE.read_text().startswith('{\n  "about": "SGLang server flags per release')


def test_unsupported_source_stops_the_generator(tmp_path):
    script = _script()
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(
            "sglang/srt/server_args.py",
            "class ServerArgs:\n    def add_cli_args(parser):\n"
            "        somewhere.register(parser)\n",
        )
    with pytest.raises(script.Unsupported, match="cannot follow"):
        script.read_wheel(wheel)


def test_generator_evaluates_choices_sglang_computes_at_import(tmp_path):
    """Choices computed by code, as in 0.5.23 and 0.5.9: a helper reading a names module (its plugin branch not
    taken), a class's dict keys, an Enum's names, a set with an env-gated member, a starred constant; what it
    cannot follow is recorded as unknown, with the reason."""
    script = _script()
    server_args = """
import sys
from sglang.srt.environ import envs
from sglang.srt.parser.reasoning_parser import ReasoningParser
from sglang.srt.choices import QUANT, BACKENDS
DRAFT_QUANT = [*QUANT, "unquant"]

def _parser_choices():
    module = sys.modules.get("sglang.srt.parser.reasoning_parser")
    if module is not None:
        return list(module.ReasoningParser.DetectorMap)
    from sglang.srt.parser.names import NAMES

    return list(NAMES)

def _modes():
    from .modes import Mode
    return list(Mode)

class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        backends = set(BACKENDS)
        if envs.SGLANG_ORACLE.get():
            backends.add("oracle")
        parser.add_argument("--backend", choices=backends)
        names = _parser_choices()
        parser.add_argument("--reasoning-parser", choices=["auto"] + names)
        parser.add_argument("--old-parser", choices=list(ReasoningParser.DetectorMap.keys()))
        parser.add_argument("--mode", choices=[m.name.lower() for m in _modes()])
        parser.add_argument("--draft-quant", choices=DRAFT_QUANT)
        parser.add_argument("--plugin", choices=registry.names())
"""
    files = {
        "sglang/srt/server_args.py": server_args,
        "sglang/srt/environ.py": "class EnvBool:\n    pass\nclass Envs:\n    SGLANG_ORACLE = EnvBool(False)\n"
        "envs = Envs()\n",
        "sglang/srt/parser/reasoning_parser.py": "class ReasoningParser:\n    DetectorMap: dict = {'r1': R1, 'qwen3': Q}\n",
        "sglang/srt/parser/names.py": "NAMES = ['kimi_k2', 'qwen3']\n",
        "sglang/srt/modes.py": "from enum import IntEnum\nclass Mode(IntEnum):\n    NONE = 0\n    ALL = 2\n",
        "sglang/srt/choices.py": "QUANT = ['fp8', 'awq']\nBUILT_IN = frozenset({'pytorch', 'flashinfer'})\n"
        "BACKENDS = set(BUILT_IN)\n",
    }
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    flags = {f["options"][0]: f for f in script.read_wheel(wheel)["flags"]}
    assert flags["--backend"]["choices"] == ["flashinfer", "pytorch"], (
        "a set's members sorted; no oracle by default"
    )
    assert flags["--reasoning-parser"]["choices"] == ["auto", "kimi_k2", "qwen3"]
    assert flags["--old-parser"]["choices"] == ["r1", "qwen3"]
    assert flags["--mode"]["choices"] == ["none", "all"]
    assert flags["--draft-quant"]["choices"] == ["fp8", "awq", "unquant"]
    assert (
        "choices" not in flags["--plugin"]
        and "registry.names()" in flags["--plugin"]["choices_unknown"]
    )
    assert all("choices_unknown" not in f for o, f in flags.items() if o != "--plugin")


def test_committed_data_knows_the_parser_choices_of_each_release():
    for v in versions():
        fs = flag_set(v)
        assert not [f.options for f in fs.flags if f.choices_unknown], (
            f"SGLang {v}: choices left unknown"
        )
    assert {"auto", "kimi_k2", "deepseek-r1", "qwen3"} <= set(
        flag_set("0.5.23").by_option["--reasoning-parser"].choices
    )
    assert {"auto", "kimi_k2", "qwen3_coder"} <= set(
        flag_set("0.5.23").by_option["--tool-call-parser"].choices
    )
    assert flag_set("0.5.23").by_option["--kv-canary-real-data"].choices == (
        "none",
        "partial",
        "all",
    )
    assert "token_oracle" not in flag_set("0.5.23").by_option["--sampling-backend"].choices
    assert {"kimi_k2", "deepseek-r1"} <= set(
        flag_set("0.5.9").by_option["--reasoning-parser"].choices
    )
    assert "auto" not in flag_set("0.5.9").by_option["--reasoning-parser"].choices
    assert {"kimi_k2", "qwen25"} <= set(flag_set("0.5.9").by_option["--tool-call-parser"].choices)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--reasoning-parser", "kimi-k2"],
            "`--reasoning-parser`: invalid choice `kimi-k2`; did you mean `kimi_k2`",
        ),
        (
            ["--tool-call-parser=qwen3-coder"],
            "`--tool-call-parser`: invalid choice `qwen3-coder`; did you mean `qwen3_coder`",
        ),
        (
            ["--reasoning-parser", "nope"],
            "`--reasoning-parser`: invalid choice `nope` (choose from auto, apertus2509,",
        ),
        (
            ["--sampling-backend", "token_oracle"],
            "`--sampling-backend`: invalid choice `token_oracle`",
        ),
        (["--kv-canary-real-data", "Partial"], "invalid choice `Partial`; did you mean `partial`?"),
    ],
)
def test_choices_sglang_computes_at_import_are_checked(extra, expected):
    (problem,) = check_extra_args(extra)
    assert expected in problem
    assert check_extra_args(["--reasoning-parser", "auto", "--tool-call-parser", "kimi_k2"]) == []
    assert check_extra_args(["--reasoning-parser", "auto"], version="0.5.9")[0].startswith(
        "`--reasoning-parser`: invalid choice `auto`"
    ), "0.5.9 has no auto"


@pytest.mark.parametrize("kind", ["sglang", "stub"])
def test_check_run_and_submit_refuse_an_unknown_parser_before_any_gpu_time(
    tmp_path, toy_tokenizer, capsys, kind
):
    from toolkit.cli import main

    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        engine={"kind": kind, "extra_args": ["--reasoning-parser", "kimi-k2"]},
    )
    for argv in (
        ["check", str(job)],
        ["run", str(job)],
        ["submit", str(job), "--dry-run"],
        ["submit", str(job)],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        line = next(x for x in err.splitlines() if str(job) in x)
        assert (
            f"{job}: [engine] extra_args: `--reasoning-parser`: invalid choice `kimi-k2`; did you mean `kimi_k2`"
            in line
        ), (argv, err)
    assert not (tmp_path / "run").exists()


# What real SGLang's own parser registers: run in the SGLang venv, printed as JSON (a set's choices sorted, as
# the data stores them).
REAL_PARSER = """
import argparse, json
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
def choices(c):
    return None if c is None else sorted(c, key=str) if isinstance(c, (set, frozenset)) else list(c)
print(json.dumps([[a.option_strings, a.nargs, choices(a.choices)] for a in parser._actions], default=repr))
"""


@pytest.mark.sglang
def test_the_data_is_what_real_sglang_registers():
    """Every option of real SGLang 0.5.23 (ServerArgs.add_cli_args in its default environment: no plugin, no
    SGLANG_* variables) has the data's option strings, nargs and choices, computed choices included."""
    why = realsglang.missing()
    if why:
        pytest.fail(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    r = subprocess.run(
        [str(realsglang.python()), "-c", REAL_PARSER],
        capture_output=True,
        text=True,
        env=env,
        cwd=realsglang.python().parent,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    real = {
        tuple(options): (nargs, choices)
        for options, nargs, choices in json.loads(r.stdout.splitlines()[-1])
    }
    data = {
        f.options: (f.nargs, None if f.choices is None else list(f.choices))
        for f in flag_set(realsglang.VERSION).flags
    }
    assert sorted(real) == sorted(data), "the same options"
    assert {o: v for o, v in real.items() if v != data[o]} == {}, "the same nargs and choices"


RECIPE_ARGV_CHECK = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(parser)
args = parser.parse_args(sys.argv[1:])
print(json.dumps({"tp": args.tp_size, "dp": args.dp_size, "dp_attention": args.enable_dp_attention}))
"""


@pytest.mark.sglang
@pytest.mark.parametrize(
    "name", ["kimi-k2.5-dp-attention", "deepseek-r1-dp-attention", "kimi-k2.5", "deepseek-r1"]
)
def test_the_recipes_server_command_lines_pass_real_sglangs_parser(name, monkeypatch):
    """The command line the toolkit starts SGLang with for each recipe (its --tp-size, --dp-size and extra_args)
    is taken by real SGLang 0.5.23's own parser, which reads data-parallel attention where the recipe asks it; and the
    recipe uses every GPU it asks Slurm for (tp x pp, dp not counted with DP attention)."""
    why = realsglang.missing()
    if why:
        pytest.fail(why)
    from toolkit.engines.layout import engine_gpus
    from toolkit.job.spec import load_spec

    monkeypatch.setenv("MODEL_ROOT", "/models")
    monkeypatch.setenv("DATA_ROOT", "/data")
    spec = load_spec(
        Path(__file__).resolve().parents[2] / "jobs" / f"{name}.toml", check_paths=False
    )
    e = spec.engine
    argv = [
        "--model-path",
        spec.model.path,
        "--tp-size",
        str(e.tp_size),
        "--dp-size",
        str(e.dp_size),
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--trust-remote-code",
        *e.extra_args,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    r = subprocess.run(
        [str(realsglang.python()), "-c", RECIPE_ARGV_CHECK, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=realsglang.python().parent,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    parsed = json.loads(r.stdout.splitlines()[-1])
    dp_attention = name.endswith("dp-attention")
    assert parsed == {"tp": 8, "dp": 8 if dp_attention else 1, "dp_attention": dp_attention}
    assert engine_gpus(e) == spec.slurm.gpus_per_node == 8
