"""The mission-scale simulation (benchmarks/bench_claims_sim.py) is driven by the worker's own policy functions:
on a small run every policy finishes every shard with the same tokens generated, opening shards early
(`opens_next`) and handing the tail over (`hands_over`) each cut the idle node time, and the simulation follows
what those functions answer (a `hands_over` that always says no is the overlap alone)."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_claims_sim as sim  # noqa: E402


@pytest.fixture(scope="module")
def lengths() -> list[int]:
    rng = random.Random(1)
    return [
        min(sim.MAX_NEW, max(1, round(rng.lognormvariate(math.log(sim.MEDIAN), sim.SIGMA))))
        for _ in range(4000)
    ]


def run(lengths, policy: str, **kw) -> dict:
    return sim.simulate(lengths, nodes=4, shards=32, policy=policy, preemptions=[(900.0, 1)], **kw)


def test_each_policy_generates_every_token_and_overlap_then_handover_cut_the_idle_time(lengths):
    got = {
        p: run(lengths, p) for p in ("claims", "claims + overlap", "claims + overlap + handover")
    }
    for r in got.values():
        # preempted partials continue: no token lost (but rounding the partials to whole tokens)
        assert r["tokens"] == pytest.approx(sum(lengths), rel=1e-5)
        assert r["starts"] == 5  # one load per node, one more for the preempted task
    claims, overlap, handover = (
        got[p] for p in ("claims", "claims + overlap", "claims + overlap + handover")
    )
    assert overlap["idle_h"] < 0.5 * claims["idle_h"]
    assert handover["idle_h"] < 0.7 * overlap["idle_h"]
    assert handover["alloc_h"] < overlap["alloc_h"] < claims["alloc_h"]
    h = handover["handed"]
    assert (
        1 <= h["tasks"] <= 3 and h["sequences"] > 0 and h["tokens"] > 0
    )  # one task stays to the end
    assert overlap["handed"]["tasks"] == 0


def test_the_simulation_follows_the_policy_functions(lengths, monkeypatch):
    overlap = run(lengths, "claims + overlap")
    monkeypatch.setattr(sim, "hands_over", lambda *a, **k: False)
    assert run(lengths, "claims + overlap + handover") == overlap
    monkeypatch.setattr(
        sim, "opens_next", lambda *a: False
    )  # never open a shard early, nor the first: no work
    with pytest.raises(AssertionError, match="shards done"):
        run(lengths, "claims + overlap")


def test_a_prefill_for_continued_partials_costs_node_time(lengths):
    free = run(lengths, "claims + overlap + handover")
    paid = run(lengths, "claims + overlap + handover", prefill_tok_s=2000.0)
    assert paid["tokens"] == pytest.approx(free["tokens"], rel=1e-5)
    assert paid["idle_h"] > free["idle_h"]
