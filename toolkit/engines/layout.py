"""How SGLang lays an engine out on GPUs: tp_size x pp_size x dp_size (dp_size not counted with
data-parallel attention), whether `nodes` nodes of `gpus_per_node` GPUs hold exactly that (no GPU a
task asks Slurm for is left idle), and how the GPUs of one machine are split between workers. Pure
arithmetic on the [engine] table and its extra_args."""

from __future__ import annotations

from typing import Any


def _parallel_flags(e: Any) -> tuple[int, bool]:
    """(pp_size, data-parallel attention) as `[engine] extra_args` set them (1, False by
    default)."""
    from toolkit.engines.sglang_contract.flags import flag_set

    pp, dp_attention = 1, False
    for item in flag_set().parse(list(e.extra_args)).items:
        if item.flag.dest == "pp_size" and item.values:
            try:
                pp = max(1, int(item.values[-1]))
            except ValueError:
                pass
        elif item.flag.dest == "enable_dp_attention":
            dp_attention = True
    return pp, dp_attention


def engine_gpus(e: Any) -> int:
    """GPUs one engine uses across all its nodes, as SGLang lays it out: tp_size x pp_size, times
    dp_size unless data-parallel attention (`--enable-dp-attention`) puts the replicas inside the
    tensor-parallel group."""
    pp, dp_attention = _parallel_flags(e)
    return e.tp_size * pp * (1 if dp_attention else e.dp_size)


def check_engine_layout(
    e: Any, gpus_per_node: int, where: str = "[slurm] gpus_per_node"
) -> str | None:
    """Why an engine of `e.nodes` nodes with `gpus_per_node` GPUs each cannot be laid out by SGLang
    (None: it can).

    SGLang's --tp-size counts the GPUs of all nodes: each node runs tp_size / nodes ranks of the
    tensor-parallel group (tp_size / (nodes / pp_size) with pipeline stages). An engine that would
    leave GPUs of its nodes idle, or need more than they have, is refused: on several nodes that is
    a tp_size that did not count every node; on one node, GPUs Slurm bills the whole run for while
    no engine uses them (see _one_node).
    """
    n = e.nodes
    if n <= 1:
        return _one_node(e, gpus_per_node, where)
    pp, _ = _parallel_flags(e)
    total = engine_gpus(e)
    nodes_per_tp_group = max(1, n // pp)
    fix = (
        f"set tp_size = {n * gpus_per_node * e.tp_size // total} for {n} nodes of "
        f"{gpus_per_node} GPUs"
    )
    if e.tp_size % nodes_per_tp_group or total % n:
        return (
            f"[engine] tp_size = {e.tp_size} does not split over nodes = {n}: SGLang's --tp-size "
            f"counts the GPUs of all nodes and runs tp_size / nodes of them on each; {fix}"
        )
    if total // n != gpus_per_node:
        layout = (
            f"tp_size = {e.tp_size}"
            + (f", dp_size = {e.dp_size}" if e.dp_size > 1 else "")
            + (f", pp_size = {pp}" if pp > 1 else "")
        )
        return (
            f"[engine] nodes = {n} with {layout} uses {total} GPUs, {total // n} per node, but "
            f"{where} = {gpus_per_node}: SGLang's --tp-size counts the GPUs of all nodes; {fix}"
        )
    return None


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' * (n != 1)}"


def _idle(first: int, total: int) -> str:
    """GPUs `first`..`total - 1` of a task's node, as CUDA_VISIBLE_DEVICES numbers them."""
    return f"GPU {first}" if first == total - 1 else f"GPUs {first}-{total - 1}"


def _one_node(e: Any, gpus: int, where: str) -> str | None:
    """Why the one-node engine `e` does not use exactly the `gpus` GPUs its task asks Slurm for
    (None: it does). An engine the toolkit starts (sglang, stub) takes the first engine_gpus(e) of
    them; an `external` engine starts none, so its tasks need no GPU. The stub asking for none (a
    CPU stand-in) leaves none idle."""
    if e.kind == "external":
        if gpus == 0:
            return None
        return (
            f'[engine] kind = "external" starts no engine: each task only sends requests, and the '
            f"{_gpus(gpus)} that {where} = {gpus} asks Slurm for ({_idle(0, gpus)}) would sit "
            f"idle for the whole run; set {where} = 0"
        )
    used = engine_gpus(e)
    if used == gpus or (e.kind == "stub" and gpus == 0):
        return None
    pp, dp_attention = _parallel_flags(e)
    layout = (
        f"tp_size = {e.tp_size}"
        + (f", dp_size = {e.dp_size}" if e.dp_size > 1 else "")
        + (f", pp_size = {pp}" if pp > 1 else "")
        + (" with --enable-dp-attention" if dp_attention else "")
    )
    if used > gpus:
        return (
            f"[engine] {layout} needs {_gpus(used)} on one node but {where} = {gpus}: set "
            f"{where} = {used} where the nodes have that many, or lower tp_size / dp_size (on "
            f'several nodes, kind = "sglang" with nodes = N and tp_size counting every node)'
        )
    fixes = []
    if not dp_attention and gpus % (e.tp_size * pp) == 0:
        fixes.append(f"dp_size = {gpus // (e.tp_size * pp)} (replicas on the idle GPUs)")
    elif dp_attention and gpus % pp == 0:
        fixes.append(f"tp_size = {gpus // pp} (dp_size is inside tp_size with DP attention)")
    fixes.append(f"{where} = {used}")
    return (
        f"[engine] {layout} uses {_gpus(used)} of the {gpus} that {where} = {gpus} asks Slurm "
        f"for on each task's node: {gpus - used} ({_idle(used, gpus)}) would sit idle for the "
        f"whole run; set " + " or ".join(fixes)
    )


def visible_gpus(env: dict[str, str], count_gpus=None) -> list[str]:
    """The GPUs this machine lets a job use: CUDA_VISIBLE_DEVICES's list when it is set (empty:
    none), else the indices of the GPUs `count_gpus()` finds (nvidia-smi), else none."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    n = count_gpus() if count_gpus is not None else 0
    return [str(i) for i in range(n)]


def split_gpus(
    gpus: list[str], per_worker: int, parallel: int | None
) -> tuple[int, list[list[str]]]:
    """How many workers run on one machine and the GPUs of each: as many as `gpus` hold `per_worker`
    each (one when no GPU is known), or `parallel` when given; each worker gets its own `per_worker`
    GPUs (no GPUs when none are known). Raises ValueError, saying why and what to give instead, when
    `parallel` workers do not fit the GPUs, or the workers would leave some of them idle."""
    per = max(1, per_worker)
    if parallel is not None and parallel < 1:
        raise ValueError(f"--parallel {parallel}: give at least 1")
    if not gpus:
        n = parallel or 1
        return n, [[] for _ in range(n)]
    shown = ",".join(gpus)
    fits = len(gpus) // per
    if fits < 1:
        raise ValueError(
            f"one engine needs {per} GPUs but {len(gpus)} are visible ({shown}); set "
            f"CUDA_VISIBLE_DEVICES to {per} GPUs, or lower tp_size / dp_size"
        )
    n = parallel or fits
    if n > fits:
        raise ValueError(
            f"--parallel {n} needs {n * per} GPUs ({per} per engine) but {len(gpus)} are visible "
            f"({shown}); at most --parallel {fits}"
        )
    if n * per < len(gpus):
        used, idle = gpus[: n * per], gpus[n * per :]
        fixes = [f"--parallel {fits}"] if fits * per == len(gpus) else []
        fixes.append(f"CUDA_VISIBLE_DEVICES={','.join(used)} to name only the GPUs to use")
        raise ValueError(
            f"{n} worker{'s' * (n != 1)} of {per} GPU{'s' * (per != 1)} per engine "
            f"use{'s' * (n == 1)} {n * per} "
            f"of the {len(gpus)} visible GPUs ({shown}): GPU{'s' * (len(idle) != 1)} "
            f"{','.join(idle)} would sit idle for the whole run; give " + ", or ".join(fixes)
        )
    return n, [gpus[i * per : (i + 1) * per] for i in range(n)]
