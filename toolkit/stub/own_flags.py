"""The stub's own flags (its behaviour and fault injection), in the order its help lists them.

They are spelled in full (command_line._Parser keeps them out of SGLang's prefix matching), and
none may be one of SGLang's own flags (command_line.build_parser checks).
"""

from __future__ import annotations

from toolkit.stub.config import POISONS, VERSIONS


def add_stub_flags(group) -> None:
    """The stub's own flags, added to `group` (an argparse argument group)."""
    _add_wire_flags(group.add_argument)
    _add_pace_flags(group.add_argument)
    _add_length_flags(group.add_argument)
    _add_failure_flags(group.add_argument)
    _add_poison_flags(group.add_argument)
    _add_start_flags(group.add_argument)
    _add_output_flags(group.add_argument)
    _add_check_flag(group.add_argument)


def _add_wire_flags(a) -> None:
    """The release imitated and the reasoning markers."""
    a(
        "--version",
        choices=VERSIONS,
        default="0.5.23",
        help="wire profile to imitate, and SGLang flag set to accept",
    )
    a("--think-start", default="<think>")
    a("--think-end", default="</think>")


def _add_pace_flags(a) -> None:
    """How fast it starts, generates, drains and answers probes."""
    a(
        "--load-delay",
        type=float,
        default=0.0,
        help="seconds before the port opens (weights 'loading')",
    )
    a(
        "--warmup-delay",
        type=float,
        default=0.0,
        help="seconds of 503 on /health* and /ready after the port opens",
    )
    a("--token-delay", type=float, default=0.0, help="seconds per generated token")
    a(
        "--drain-poll",
        type=float,
        default=5.0,
        help="poll interval of the SIGTERM drain (SGLang: 5 s)",
    )
    a(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="idle keep-alive connections close after this (uvicorn: 5 s)",
    )
    a(
        "--health-check-timeout",
        type=float,
        default=20.0,
        help="while generation is wedged (--hang-after), /health* waits this long, then 503 "
        "(SGLang: 20 s)",
    )


def _add_length_flags(a) -> None:
    """How long its outputs are, and how many end in a tool call."""
    a(
        "--fixed-output-tokens",
        type=int,
        help="every output exactly N tokens (think-end and EOS included)",
    )
    a(
        "--output-scale",
        type=int,
        help="draw output lengths as shares of N tokens instead of each request's max_new_tokens "
        "(as a model, whose outputs do not depend on the budget: an output asked for in segments "
        "is then the one-request output)",
    )
    a(
        "--lognormal-lengths",
        metavar="MEDIAN:SIGMA",
        help="draw output lengths from a lognormal of this median (tokens) and sigma, cut by "
        "max_new_tokens: the heavy tail of reasoning traces (instead of shares of the budget; "
        "--truncate-fraction then does not apply)",
    )
    a(
        "--truncate-fraction",
        type=float,
        default=0.10,
        help="share of outputs longer than max_new_tokens",
    )
    a(
        "--tool-call-fraction",
        type=float,
        default=0.15,
        help="share of outputs with a tool-call section",
    )


def _add_failure_flags(a) -> None:
    """A server that hangs, crashes or answers 5xx."""
    a("--hang", action="store_true", help="listen but never become ready; /generate never answers")
    a(
        "--ignore-sigterm",
        action="store_true",
        help="log SIGTERM and go on serving (a shutdown that hangs)",
    )
    a("--hang-after", type=int, help="/generate requests after the N-th never answer")
    a("--crash-after", type=int, help="exit abruptly (status 1) on the N-th /generate request")
    a(
        "--fail-5xx",
        metavar="START:COUNT",
        help="/generate requests START..START+COUNT-1 get HTTP 503",
    )
    a(
        "--fail-5xx-for",
        metavar="START:SECONDS",
        help="every /generate request for SECONDS s from the START-th on gets HTTP 503 (an "
        "overloaded engine: its probes fail too)",
    )
    a(
        "--fail-status",
        type=int,
        default=503,
        metavar="CODE",
        help="the status of the --fail-5xx answers: 503, or 429 as a router that rate-limits "
        "answers",
    )


def _add_poison_flags(a) -> None:
    """Answers spoiled on purpose (POISONS), and SGLang's NaN stop."""
    a(
        "--poison",
        choices=sorted(POISONS),
        help="spoil the answer of every /generate whose prompt holds "
        "--poison-text (of every one, without it): "
        + "; ".join(f"{k}: {v}" for k, v in POISONS.items()),
    )
    a(
        "--poison-text",
        metavar="TEXT",
        help="--poison only the requests whose prompt, decoded, holds TEXT",
    )
    a(
        "--poison-after",
        type=int,
        default=0,
        metavar="N",
        help="--poison only after the first N /generate requests",
    )
    a(
        "--poison-prompt",
        action="append",
        default=[],
        metavar="KIND=TEXT",
        help="spoil the answer of every /generate whose prompt, decoded, holds TEXT, the way KIND "
        "(a --poison kind) says, every time; repeatable (the first that matches applies)",
    )
    a(
        "--nan-every",
        type=int,
        metavar="N",
        help="every N-th /generate request ends in SGLang's NaN stop: half its "
        "output, then an EOS id, finish_reason {type: stop, matched: 'NaN happened'}",
    )


def _add_start_flags(a) -> None:
    """A start that fails."""
    a("--exit-at-start", type=int, metavar="CODE", help="exit with CODE at once")
    a("--exit-at-start-if-exists", metavar="PATH", help="exit 1 at once if PATH exists")
    a(
        "--warmup-fails",
        action="store_true",
        help="the warm-up fails: the process kills itself when it ends",
    )


def _add_output_flags(a) -> None:
    """Outputs of an odd shape: no think-end, a second think-start, loops, identical samples."""
    a("--no-think-end", action="store_true", help="outputs never contain the think-end token")
    a(
        "--double-think-start",
        action="store_true",
        help="emit think-start even when the prompt opened it",
    )
    a(
        "--degenerate-fraction",
        type=float,
        default=0.0,
        help="share of outputs that fall into a repetition loop (a "
        "short span repeated) until max_new_tokens",
    )
    a(
        "--identical-samples",
        action="store_true",
        help="samples of one prompt are token-identical, even with a "
        "sampling_seed (a sampler that ignores it)",
    )


def _add_check_flag(a) -> None:
    """Parse and exit: the toolkit's pre-flight."""
    a(
        "--check-args",
        action="store_true",
        help="parse the command line and exit: 0 when the stub takes it, else 2 with the error "
        "(the toolkit's pre-flight asks this before anything is written)",
    )
