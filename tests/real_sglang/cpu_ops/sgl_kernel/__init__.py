"""Test-only stand-in for sgl-kernel's CPU build, for SGLang 0.5.23 on a CPU-only test machine.

PyPI's `sglang-kernel` is a CUDA build; its CPU build exists only as source. With SGLANG_USE_CPU_ENGINE=1, SGLang
imports exactly two CPU ops from it to serve a small dense model (the Triton kernels' CPU twins): both are
bookkeeping (which KV-cache rows belong to which request), not model math, so plain torch does them here. Put
the folder holding this package first on PYTHONPATH of the server process. The speculative-decoding CPU ops
SGLang imports on a CPU exist but raise when called.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = its run of out_cache_loc, the runs
    of all requests laid end to end in out_cache_loc (what the Triton kernel assign_req_to_token_pool does)."""
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    at = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n <= 0:
            continue
        if end > pool_len:
            raise IndexError(f"request row {row}: end {end} past the pool length {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[at : at + n].to(req_to_token.dtype)
        at += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every layer buffer (its address and its row size in bytes): row tgt_loc[i] = row src_loc[i]."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def __getattr__(name: str):
    """The CPU build's other ops (the `*_cpu` names SGLang's speculative-decoding modules import whenever they run
    on a CPU) exist, and raise if called: they are used only with a draft model. Any other name is missing, as
    without sgl-kernel."""
    if not name.endswith("_cpu"):
        raise AttributeError(f"module 'sgl_kernel' (test stand-in) has no attribute {name!r}")

    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not in this test stand-in (speculative decoding only)"
        )

    op.__name__ = name
    return op
