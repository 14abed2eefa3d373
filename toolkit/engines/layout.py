"""How SGLang lays an engine out on GPUs: tp_size x pp_size x dp_size (dp_size not counted with
data-parallel attention), and whether `nodes` nodes of `gpus_per_node` GPUs hold exactly that. Pure
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
    a tp_size that did not count every node.
    """
    n = e.nodes
    if n <= 1:
        return None
    pp, _ = _parallel_flags(e)
    total = engine_gpus(e)
    nodes_per_tp_group = max(1, n // pp)
    fix = (f"set tp_size = {n * gpus_per_node * e.tp_size // total} for {n} nodes of "
           f"{gpus_per_node} GPUs")
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
    GPUs (no GPUs when none are known). Raises ValueError, saying why, when `parallel` workers do
    not fit the GPUs."""
    per = max(1, per_worker)
    if parallel is not None and parallel < 1:
        raise ValueError(f"--parallel {parallel}: give at least 1")
    if not gpus:
        n = parallel or 1
        return n, [[] for _ in range(n)]
    fits = len(gpus) // per
    if fits < 1:
        raise ValueError(
            f"one engine needs {per} GPUs but {len(gpus)} are visible ({','.join(gpus)})"
        )
    n = parallel or fits
    if n > fits:
        raise ValueError(
            f"--parallel {n} needs {n * per} GPUs ({per} per engine) but {len(gpus)} are visible "
            f"({','.join(gpus)}); at most --parallel {fits}"
        )
    return n, [gpus[i * per:(i + 1) * per] for i in range(n)]
