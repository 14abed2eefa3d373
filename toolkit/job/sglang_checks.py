"""What SGLang would refuse in a job, found before any GPU time: `[engine] extra_args` as its own
parser would take them, every dataset's sampling_params as its /generate would judge them
(SamplingParams.verify of the release the engine runs), and sampling that its flags make impossible.
Judged from SGLang's contract as data (engines.sglang_contract): no sglang is imported here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from toolkit.engines.sglang_contract import sampling as sglang_sampling
from toolkit.job.specerrors import SpecError

# Every key SGLang's /generate `sampling_params` accepts (0.5.23:
# engines/sglang_contract/sampling.py, read from its source). Anything else is a hard error on the
# server, so it is an error here, before a node is allocated.
SAMPLING_KEYS = frozenset(sglang_sampling.FIELDS) - sglang_sampling.NOT_TAKEN["0.5.23"]


def check_sampling(params: dict[str, Any], where: str, source: str, *, top_level: bool) -> None:
    unknown = sorted(set(params) - SAMPLING_KEYS)
    if unknown:
        raise SpecError(
            f"{source}: {where}: unknown sampling key(s) {', '.join(map(repr, unknown))}; "
            f"SGLang's sampling_params accepts only: {', '.join(sorted(SAMPLING_KEYS))}"
            + (
                " (there is no `seed`: use `sampling_seed`, honoured only with "
                "--enable-deterministic-inference)"
                if "seed" in unknown
                else ""
            )
        )
    if top_level and "max_new_tokens" not in params:
        raise SpecError(
            f"{source}: [sampling] needs `max_new_tokens`: SGLang's /generate silently defaults to "
            "128, which truncates every reasoning trace. Set it to the longest output you want "
            "(e.g. 32768)."
        )
    mnt = params.get("max_new_tokens")
    if "max_new_tokens" in params and (
        not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1
    ):
        raise SpecError(
            f"{source}: {where}: `max_new_tokens` must be a positive integer, got {mnt!r}"
        )
    n = params.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SpecError(
            f"{source}: {where}: `n` (samples per prompt) must be a positive integer, got {n!r}"
        )
    if params.get("ignore_eos"):
        raise SpecError(
            f"{source}: {where}: `ignore_eos = true` would make every output run to max_new_tokens"
        )
    for key, value in params.items():
        try:
            sglang_sampling.check_types({key: value})
        except sglang_sampling.TypeMismatch as e:
            raise SpecError(
                f"{source}: {where}: `{key}`: {e} (SGLang's /generate would refuse every request: "
                "HTTP 400); write it as that type"
            ) from None
    if (params.get("beam_width") or 1) > 1:
        raise SpecError(
            f"{source}: {where}: `beam_width = {params['beam_width']}` asks for beam search, which "
            "keeps the likeliest sequences instead of samples of the model's distribution; "
            "drafter data wants samples: remove it"
        )


def check_requests(spec: Any, source: Path) -> None:
    """Each dataset's sampling_params as SGLang would judge them (SamplingParams.verify of the
    release the engine runs), and with the engine's flags: a request SGLang refuses is refused for
    every prompt, after the weights load, so it is refused here instead."""
    e = spec.engine
    release = _judged_release(e, source) or sglang_sampling.RELEASES[0]
    if release not in sglang_sampling.RELEASES:
        release = sglang_sampling.RELEASES[0]
    skip_tokenizer = (
        e.command is None
        and e.kind in ("sglang", "stub")
        and _has_flag(e, "skip_tokenizer_init", release)
    )
    for d in spec.datasets:
        params = spec.sampling_for(d.name)
        where = f"{source}: dataset {d.name!r}: [sampling]"
        try:
            sglang_sampling.verify(sglang_sampling.make_sampling(params), None, release)
        except sglang_sampling.SamplingError as err:
            raise SpecError(
                f"{where}: SGLang {release} refuses it with HTTP 400 for every request: {err} "
                "Change that key in [sampling] or in the dataset's `sampling`."
            ) from None
        if skip_tokenizer:
            needs = [k for k in ("stop", "stop_regex") if params.get(k)] + (
                ["min_new_tokens"] if (params.get("min_new_tokens") or 0) > 0 else []
            )
            if needs:
                raise SpecError(
                    f"{where}: {', '.join(needs)} need the server's tokenizer, and [engine] "
                    "extra_args has --skip-tokenizer-init: SGLang refuses every such request; use "
                    "stop_token_ids, or remove the flag"
                )


def check_engine_args(e: Any, source: Path) -> None:
    """`[engine] extra_args` as SGLang's own parser would take them (from its flag data: no sglang
    needed here), then against the flags the toolkit sets. The stub is judged by the release it
    imitates."""
    from toolkit.engines.sglang_contract.extra_args import check_extra_args

    problems = check_extra_args(
        e.extra_args, version=_judged_release(e, source), dp_size=e.dp_size, kind=e.kind
    )
    if problems:
        raise SpecError(f"{source}: [engine] extra_args: " + "; ".join(problems))


def _judged_release(e: Any, source: Path) -> str | None:
    """The SGLang release a job's engine is judged by: the stub's, or $TOOLKIT_SGLANG_VERSION, else
    None (the newest the toolkit knows)."""
    from toolkit.engines.sglang_contract.flags import VERSION_ENV, versions

    if e.kind == "stub":
        return e.stub.version if e.stub.version in versions() else None
    version = os.environ.get(VERSION_ENV) or None
    if version is not None and version not in versions():
        raise SpecError(
            f"{source}: ${VERSION_ENV}={version}, but the toolkit knows the flags of SGLang "
            f"{', '.join(versions())} only (scripts/sglang_flags.py adds a release)"
        )
    return version


def _has_flag(e: Any, dest: str, release: str) -> bool:
    """Whether `[engine] extra_args` set SGLang's flag `dest`, read as that release's parser reads
    them."""
    from toolkit.engines.sglang_contract.flags import flag_set

    return any(item.flag.dest == dest for item in flag_set(release).parse(list(e.extra_args)).items)
