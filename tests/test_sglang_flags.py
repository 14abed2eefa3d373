"""SGLang's flag data (generated from its wheels by scripts/sglang_flags.py) and the parser emulation on top."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import zipfile
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from toolkit.engines.sglang_flags import DATA_FILE, add_to_parser, flag_set, versions

REPO = Path(__file__).resolve().parents[1]


def test_data_names_its_releases_and_sources():
    assert versions()[:2] == ["0.5.23", "0.5.9"], "newest first"
    for v in versions():
        fs = flag_set(v)
        assert fs.source.startswith(f"sglang-{v}-") and "sglang/srt/server_args.py ServerArgs.add_cli_args" in fs.source
        assert {"--model-path", "--tp-size", "--port", "--api-key", "--config", "-h", "--help"} <= set(fs.by_option)
    assert "arg_groups/fields" in flag_set("0.5.23").source, "0.5.23 derives most flags from dataclass fields"
    assert "--cuda-graph-max-bs" in flag_set("0.5.9") and "--cuda-graph-max-bs" not in flag_set("0.5.23")
    assert flag_set("0.5.23").by_option["--trust-remote-code"].nargs == 0
    assert flag_set("0.5.23").by_option["--tp-size"].type == "int"
    assert flag_set().version == "0.5.23"


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
            assert action[0] is not None and action[0].dest in (flag.dest, "help"), (prefix, resolved)
    assert len(seen) > 5000 and ambiguous > 1000


def test_generator_reads_a_wheel_without_importing_it(tmp_path):
    """The script on a tiny wheel: add_cli_args' own add_argument calls, a helper it hands the parser to, and
    dataclass fields (0.5.2x layout)."""
    spec = importlib.util.spec_from_file_location("sglang_flags_script", REPO / "scripts" / "sglang_flags.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    server_args = '''
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
'''
    fields = '''
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
'''
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sglang/srt/server_args.py", server_args)
        z.writestr("sglang/srt/arg_groups/fields/parallel.py", fields)
    d = script.read_wheel(wheel)
    flags = {f["options"][0]: f for f in d["flags"]}
    assert d["version"] == "9.9.9" and "_more(parser)" in d["source"]
    assert flags["--tp-size"] == {"options": ["--tp-size", "--tensor-parallel-size"], "dest": "tp_size", "nargs": None,
                                  "type": "int"}
    assert flags["--nccl-port"]["type"] == "int" and flags["--fast"]["nargs"] == 0
    assert flags["--kind"]["choices"] == ["x", "y"] and "--hidden" not in flags and "--derived" not in flags
    assert flags["--flip"]["options"] == ["--flip", "--no-flip"] and flags["--flip"]["nargs"] == 0
    assert flags["--ids"]["nargs"] == "+" and flags["--mode"]["choices"] == ["a", "b"]
    assert flags["--old"]["nargs"] == 0 and "--new" in flags["--old"]["deprecated"] and "--config" in flags
    # the committed data is what the script writes: one flag per line, header first
    out = tmp_path / "flags.json"
    script.write({"about": "x", "versions": {"9.9.9": d}}, out)
    assert ast.literal_eval(out.read_text().replace("null", "None").replace("true", "True").replace("false", "False"))
    assert DATA_FILE.read_text().startswith('{\n  "about": "SGLang server flags per release')


def test_unsupported_source_stops_the_generator(tmp_path):
    spec = importlib.util.spec_from_file_location("sglang_flags_script", REPO / "scripts" / "sglang_flags.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sglang/srt/server_args.py", "class ServerArgs:\n    def add_cli_args(parser):\n"
                                                "        somewhere.register(parser)\n")
    with pytest.raises(script.Unsupported, match="cannot follow"):
        script.read_wheel(wheel)
