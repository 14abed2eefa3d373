"""What a job may put in `[engine] extra_args`: judged first as SGLang's own parser would
(flags.FlagSet.parse), then against what the toolkit sets itself (MANAGED: the model, the parallel
sizes, the address, the port, the key; a job sets those elsewhere) and the flags it refuses
(REFUSED)."""

from __future__ import annotations

import logging

from toolkit.engines.sglang_contract.flags import flag_set

__all__ = ["MANAGED", "REFUSED", "STUB_MANAGED", "check_extra_args"]

log = logging.getLogger(__name__)


# What the toolkit sets itself, by SGLang's destination (so aliases and abbreviations are covered
# too:
# `--model`, `--tensor-parallel-size`, `--tp`, `--tp-s`, `--api-k` ...), and where a job sets it
# instead.
MANAGED = {
    "model_path": "[model] path",
    "tokenizer_path": "[model] tokenizer_path",
    "tp_size": "[engine] tp_size",
    "dp_size": "[engine] dp_size",
    "trust_remote_code": "[model] trust_remote_code",
    "host": "nothing: the server listens on 127.0.0.1",
    "port": "nothing: each start picks a free port",
    "api_key": "nothing: each start draws a random key",
    "nnodes": "[engine] nodes",
    "node_rank": "nothing: each node's rank comes from Slurm (SLURM_PROCID)",
    "dist_init_addr": "nothing: the first node's address and a free port are chosen at each start",
    # 0.5.9 names the destinations after the long spellings
    "tensor_parallel_size": "[engine] tp_size",
    "data_parallel_size": "[engine] dp_size",
}
# The stub is told these from [engine.stub] as well.
STUB_MANAGED = {"context_length": "[engine.stub] context_length"}
REFUSED = {
    "skip_server_warmup": "marks the server ready before warm-up: readiness would be a false "
    "positive",
    "help": "prints SGLang's help and exits: the server would never start",
    "config": "reads more flags from a YAML file the toolkit cannot check (and that could set the "
    "port, the API key or the model); put those flags in extra_args instead",
}


def check_extra_args(
    extra: list[str], *, version: str | None = None, dp_size: int = 1, kind: str = "sglang"
) -> list[str]:
    """Problems with a job's extra server args (empty when fine), judged as SGLang `version`'s
    parser would judge them (default: the newest release in sglang_flags.json), then against what
    the toolkit manages."""
    flags = flag_set(version)
    parsed = flags.parse(list(extra))
    problems = list(parsed.errors)
    managed = {**MANAGED, **(STUB_MANAGED if kind == "stub" else {})}
    for item in parsed.items:
        given = item.token.split("=", 1)[0]
        named = given + (f" (SGLang reads it as {item.option})" if item.abbreviated else "")
        dest = item.flag.dest
        if dest in managed:
            problems.append(
                f"{named} is set by the toolkit; remove it from extra_args and set {managed[dest]}"
            )
        elif dest in REFUSED:
            problems.append(f"{named} {REFUSED[dest]}; remove it from extra_args")
        elif dest == "nccl_port" and dp_size > 1:
            problems.append(
                f"{named} with dp_size = {dp_size}: every data-parallel replica of SGLang binds "
                "this one port, so the second replica fails to start; remove it (SGLang picks a "
                "free port for each replica)"
            )
        elif item.abbreviated:
            log.warning(
                "[engine] extra_args: %s abbreviates %s; SGLang accepts it today, but spell it "
                "out: a new flag with the same prefix would make it ambiguous",
                given,
                item.option,
            )
        if item.flag.choices_unknown:
            log.warning(
                "[engine] extra_args: %s %s is not checked: SGLang %s computes its choices in a "
                "way the flag data could not read (%s)",
                given,
                " ".join(item.values),
                flags.version,
                item.flag.choices_unknown,
            )
        if item.flag.deprecated and item.flag.action != "DeprecatedError":
            log.warning(
                "[engine] extra_args: %s is deprecated in SGLang %s (%s)",
                given,
                flags.version,
                item.flag.deprecated,
            )
    return problems
