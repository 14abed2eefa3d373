"""How SGLang lays an engine out on GPUs: tp_size x pp_size x dp_size (dp_size not counted with data-parallel
attention), and whether `nodes` nodes of `gpus_per_node` GPUs hold exactly that. Pure arithmetic on the
[engine] table and its extra_args."""

from __future__ import annotations

from typing import Any


def _parallel_flags(e: Any) -> tuple[int, bool]:
    """(pp_size, data-parallel attention) as `[engine] extra_args` set them (1, False by default)."""
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
    """GPUs one engine uses across all its nodes, as SGLang lays it out: tp_size x pp_size, times dp_size unless
    data-parallel attention (`--enable-dp-attention`) puts the replicas inside the tensor-parallel group."""
    pp, dp_attention = _parallel_flags(e)
    return e.tp_size * pp * (1 if dp_attention else e.dp_size)


def check_engine_layout(e: Any, gpus_per_node: int, where: str = "[slurm] gpus_per_node") -> str | None:
    """Why an engine of `e.nodes` nodes with `gpus_per_node` GPUs each cannot be laid out by SGLang (None: it can).

    SGLang's --tp-size counts the GPUs of all nodes: each node runs tp_size / nodes ranks of the tensor-parallel
    group (tp_size / (nodes / pp_size) with pipeline stages). An engine that would leave GPUs of its nodes idle,
    or need more than they have, is refused: on several nodes that is a tp_size that did not count every node.
    """
    n = e.nodes
    if n <= 1:
        return None
    pp, _ = _parallel_flags(e)
    total = engine_gpus(e)
    nodes_per_tp_group = max(1, n // pp)
    fix = f"set tp_size = {n * gpus_per_node * e.tp_size // total} for {n} nodes of {gpus_per_node} GPUs"
    if e.tp_size % nodes_per_tp_group or total % n:
        return (f"[engine] tp_size = {e.tp_size} does not split over nodes = {n}: SGLang's --tp-size counts the GPUs "
                f"of all nodes and runs tp_size / nodes of them on each; {fix}")
    if total // n != gpus_per_node:
        layout = f"tp_size = {e.tp_size}" + (f", dp_size = {e.dp_size}" if e.dp_size > 1 else "") + (
            f", pp_size = {pp}" if pp > 1 else "")
        return (f"[engine] nodes = {n} with {layout} uses {total} GPUs, {total // n} per node, but {where} = "
                f"{gpus_per_node}: SGLang's --tp-size counts the GPUs of all nodes; {fix}")
    return None
