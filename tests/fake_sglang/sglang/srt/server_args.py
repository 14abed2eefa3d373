"""A stand-in for `sglang.srt.server_args`: `ServerArgs.add_cli_args(parser)` registers SGLang's real flags,
read from the toolkit's flag data (toolkit/engines/sglang_contract/sglang_flags.json), as plain argparse options. Version:
$FAKE_SGLANG_VERSION, else the newest in the data."""

import argparse
import json
import os
from pathlib import Path

DATA = (
    Path(__file__).resolve().parents[4]
    / "toolkit"
    / "engines"
    / "sglang_contract"
    / "sglang_flags.json"
)


class ServerArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        versions = json.loads(DATA.read_text())["versions"]
        flags = versions[os.environ.get("FAKE_SGLANG_VERSION") or next(iter(versions))]["flags"]
        for f in flags:
            if f.get("action") == "help":
                continue
            kwargs = {"dest": f["dest"]}
            options = f["options"]
            if f["nargs"] == 0:
                if f.get("action") == "BooleanOptionalAction":
                    kwargs["action"] = argparse.BooleanOptionalAction
                    options = [o for o in options if not o.startswith("--no-")]
                else:
                    kwargs["action"] = "store_true"
            else:
                kwargs["nargs"] = f["nargs"]
                kwargs["type"] = {"int": int, "float": float}.get(f.get("type"), str)
                if f.get("choices") is not None and (
                    f.get("type") or all(isinstance(c, str) for c in f["choices"])
                ):
                    kwargs["choices"] = f["choices"]
            parser.add_argument(*options, **kwargs)
