"""The ops benchmark's cells, without jax: what a cell is, its roofline bytes, the grid, the
token -> slot mapping of each call, and the accuracy bounds.

Shared by ops.py (our kernels and the XLA baselines) and vllm_ops.py (vLLM's Triton ops,
a torch-only script that must not import jax), so both time the same cells with the same
mappings.
"""

from __future__ import annotations

import dataclasses

import numpy as np

HBM_GBPS = 4300.0  # measured device-to-device copy on an H200 of this workplace (KINDS.md)
MAX_LORAS = 64  # adapter slots
L2_BYTES = 60e6  # H200
# max |ours - oracle| / max |oracle| allowed per op (bf16 inputs, f32 accumulation): the
# shrink's f32 output differs only by summation order; the expand rounds to bf16 once.
ERR_BOUND = {"shrink": 1e-4, "expand": 8e-3}


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    tokens: int
    hidden: int
    rank: int
    adapters: int


def ideal_bytes(c: Case) -> float:
    """Roofline bytes: x (shrink) or h and y read + written (expand), the adapters used,
    and the outputs."""
    if c.op == "shrink":
        return c.tokens * c.hidden * 2 + c.adapters * c.rank * c.hidden * 2 + c.tokens * c.rank * 4
    return c.tokens * c.rank * 4 + c.adapters * c.hidden * c.rank * 2 + 2 * c.tokens * c.hidden * 2


def rotation(nbytes: int, calls: int) -> int:
    """Copies to rotate over so one copy is evicted before it is used again."""
    return int(min(calls, max(4, -(-2 * L2_BYTES // max(nbytes, 1)))))


def grid(ops, hiddens, ranks, tokens, adapters, trimmed: bool = True) -> list[Case]:
    """The cells of these axes: H = 8192 only at rank 64 (the issue's trimmed grid; every
    rank with ``trimmed=False``), no more adapters than tokens (the first adapter count
    stands for n = T where T < n)."""
    out = []
    for op in ops:
        for hidden in hiddens:
            for rank in ranks:
                for t in tokens:
                    if trimmed and hidden == 8192 and rank != 64:
                        continue
                    for n in adapters:
                        if n > t and not (n == adapters[0] and t < n):
                            continue
                        out.append(Case(op, t, hidden, rank, min(n, t)))
    return list(dict.fromkeys(out))


def mappings(c: Case, calls: int, layout: str, seed: int = 0) -> list[np.ndarray]:
    """Token -> slot indices [T] of each of ``calls`` calls: ``c.adapters`` slots drawn
    from MAX_LORAS, their tokens shuffled (the issue's grid: a decode-like scatter at every
    length) or, with layout "runs", each adapter's tokens in one run (prompts), the runs
    in random order."""
    rng = np.random.default_rng(seed)
    chosen = rng.permutation(MAX_LORAS)[: c.adapters]
    if layout == "runs":
        per = -(-c.tokens // c.adapters)
        return [np.repeat(rng.permutation(chosen), per)[: c.tokens] for _ in range(calls)]
    base = chosen[np.arange(c.tokens) % c.adapters]
    return [rng.permutation(base) for _ in range(calls)]
