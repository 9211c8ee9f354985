"""Benchmark: shrink/expand kernels vs XLA gather+einsum, one-hot einsum and ragged_dot.

Device time, not host dispatch: each measured program runs K different calls
inside one jit, is run back to back a few times and the wall time is divided by
the number of calls. No call may find its bytes in the 60 MB L2 or share work with
another call: every call has its own x (shrink) or h (expand), token order and weight
stacks (XLA merges dots that share an operand), the expand's y buffers rotate over
enough copies to span twice the L2 (at least 4), and they are donated, so that the
in-place expand needs no defensive copy. (Before session 5 the x was shared and 4
weight copies rotated: small stacks stayed in L2, and XLA computed the one-hot
einsum's x @ A once for all calls sharing a copy.)
Baselines compile in a thread with a time budget; cells over it are reported
as skipped. Bytes for the roofline = x (or h and y read+written) + the
adapters actually used + outputs.

Every cell also checks our kernel's first call against the jnp oracle
(`max rel err` = max |ours - oracle| / max |oracle|, bound per op in ERR_BOUND;
`--no-check` skips it). `--timer trace` replaces wall time by the GPU's busy time
from a `jax.profiler` trace (kernel intervals, without launch gaps and host jitter).
"ours" is the library's default as a server's host-built mapping runs it: the host's
prompt tiles and tokens per slot known (session 18: the latter picks the per-token
kernels where tokens have adapters of their own); "ours_blind" the same with neither
known (a mapping built on the device), "ours_pt" the per-token tiles forced, "ours_pf"
(expand) the default tiles with ``prefetch`` (the next column tile's y loaded ahead),
"ours_s25" (prefill expand) session 25's default tiles (before the ahead-loads), "ours_ri"
(shrink) the default tiles with ``rank_inner`` (a token block's rank blocks launched side
by side), "ours_s42" (shrink, prompts as runs) the default rectangle tiles without
``x_first`` (session 42's: x's first tile requested only once the block's slot is read
back; session 43's run 1 named the opposite, x_first on, "ours_xf", at commit 2517e6d).
(Session 29's cache-hint variants "ours_es" / "ours_ew" / "ours_eb" are in commit 819b5fc.)
"xla" is the library's own XLA backend (`lora_jax.ops` with ``backend="xla"``, what a
CPU or TPU runs and a GPU runs when asked), "xla_gather" / "xla_onehot" the same with its
rule (`ops.ONE_HOT_TOKENS_PER_SLOT`) forced to the per-token gather / the matmul against
every slot.
Token order (``--layout``): "shuffled" (default) puts every batch's tokens in random rows;
"runs" gives each adapter's tokens one run, as a batch of prompts arrives (the issue's
prefill regime: session 40 timed the prefill cells both ways, benchmarks/RESULTS.md).

    python benchmarks/ops.py --out $OUT            # full grid, prints a table, writes ops.json
    python benchmarks/ops.py --sweep --out $OUT    # also the tile candidates of sweeps.py per case
    python benchmarks/ops.py --layout runs --tokens 1024,4096,16384 --adapters 8,64 --out $OUT
    python benchmarks/ops.py --interpret --tokens 16 --hiddens 64 --ranks 16  # CPU smoke test
    python benchmarks/ops.py --model 32 --tokens 16,64,256 --hiddens 4096 --out $OUT

``--model K`` is the model-like mode: K layers (shrink + expand, each with its
own weights) in one jit sharing ONE mapping, as in a model step, so per-step
metadata (the work list) is computed once and shared, as XLA's CSE does for
the layers of a model; it reports µs per layer. ``--fused`` adds the fused
one-launch kernel (`lora_shrink_expand`) at its default tiles and at half and
double the default ``split_n`` (columns of a slice spread over fewer / more programs):

    python benchmarks/ops.py --model 32 --fused --tokens 16,64,256 --hiddens 4096 --out $OUT
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax import mapping as mapping_lib
from lora_jax.kernels import (
    BlockSizes,
    build_work_lists,
    lora_expand,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_expand,
    lora_shrink_reference,
)
from lora_jax.kernels.shrink_expand import tuning_long_shrink
from lora_jax.kernels.shrink_expand.block_sizes import next_pow2
from lora_jax.kernels.shrink_expand.pallas_triton_fused_split import SplitTiles
from lora_jax.kernels.shrink_expand.work_list import prompt_tiles, whole_tiles

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The cells (jax-free, shared with vllm_ops.py; the probes take them from here too).
from cells import (  # noqa: E402
    ERR_BOUND,
    HBM_GBPS,
    MAX_LORAS,
    Case,
    grid,
    ideal_bytes,
    mappings,
    rotation,
)

# The tile candidates of --sweep / --model and the past defaults (`ops.PREFILL_SWEEP` etc.
# stay reachable from here: RESULTS.md and the probes name them so).
from sweeps import (  # noqa: E402
    DECODE_SWEEP,
    OLD_DECODE_SHRINK,
    PREFILL_SWEEP,
    SWEEP,
    fused_variant,
    session25_prefill_expand,
)


def metadata(idx: np.ndarray, max_loras: int) -> dict[str, jax.Array]:
    key = np.where(idx < 0, max_loras, idx)
    sorted_ids = np.argsort(key, kind="stable").astype(np.int32)
    counts = np.bincount(key, minlength=max_loras + 1)[:max_loras].astype(np.int32)
    starts = (np.cumsum(counts) - counts).astype(np.int32)
    active = np.full(max_loras, -1, np.int32)
    used = np.nonzero(counts)[0]
    active[: len(used)] = used
    # The work lists are per-step metadata like the sort (lora_jax.mapping builds them once
    # per step for every layer), so they are made here, outside the timed calls.
    lists = build_work_lists(
        jnp.asarray(counts),
        jnp.asarray(starts),
        jnp.asarray(sorted_ids),
        jnp.asarray(idx.astype(np.int32)),
    )
    return dict(
        token_lora_indices=jnp.asarray(idx.astype(np.int32)),
        sorted_token_ids=jnp.asarray(sorted_ids),
        slot_token_counts=jnp.asarray(counts),
        slot_token_starts=jnp.asarray(starts),
        active_slots=jnp.asarray(active),
        num_active=jnp.asarray(len(used), jnp.int32),
        work_lists=lists,
    )


def build(c: Case, calls: int, seed: int = 0):
    """(inputs, weights, metas) for ``calls`` calls. Shrink inputs: one x [T, H] per call.
    Expand inputs: (one h [1, T, R] per call, rotated y buffers [T, N]); call i updates
    ``ys[i % len(ys)]``. Weights: one stack per call."""
    metas = [metadata(idx, MAX_LORAS) for idx in mappings(c, calls, LAYOUT, seed)]
    k = jax.random.key(seed)
    dt = jnp.bfloat16
    copies = calls  # weights of their own per call: nothing for XLA to merge
    if c.op == "shrink":
        xs = [
            jax.random.normal(jax.random.fold_in(k, 1000 + i), (c.tokens, c.hidden), dt)
            for i in range(calls)
        ]
        w = [
            jax.random.normal(jax.random.fold_in(k, i), (MAX_LORAS, c.rank, c.hidden), dt)
            * (c.hidden**-0.5)
            for i in range(copies)
        ]  # [L, R, H]
        return xs, w, metas
    hs = [
        jax.random.normal(jax.random.fold_in(k, 1000 + i), (1, c.tokens, c.rank), jnp.float32)
        for i in range(calls)
    ]  # [S, T, R]
    ys = [
        jax.random.normal(jax.random.fold_in(k, 2000 + i), (c.tokens, c.hidden), dt)
        for i in range(rotation(c.tokens * c.hidden * 2, calls))
    ]  # [T, N]
    w = [
        jax.random.normal(jax.random.fold_in(k, i), (MAX_LORAS, c.hidden, c.rank), dt)
        for i in range(copies)
    ]  # [L, N, R]
    return (hs, ys), w, metas


REF_CHUNK_BYTES = 1 << 30  # the oracle gathers [tokens, R, H] f32: chunk the tokens


def max_rel_err(
    c: Case,
    inputs,
    w,
    metas,
    bs: BlockSizes | None,
    prompt_tiles: str | None = None,
    tokens_per_slot: int | None = None,
    whole_tiles: str | None = None,
) -> float:
    """Our kernel's first call vs the jnp oracle (evaluated in token chunks), relative
    to the oracle's largest magnitude (``whole_tiles``: the shrink's host hint)."""
    m, a = metas[0], w[0]
    chunk = max(1, min(c.tokens, REF_CHUNK_BYTES // (c.rank * c.hidden * 4)))
    idx = m["token_lora_indices"]
    if c.op == "shrink":
        x = inputs[0]
        got = lora_shrink(
            x,
            (a,),
            **m,
            block_sizes=bs,
            prompt_tiles=prompt_tiles,
            whole_tiles=whole_tiles,
            tokens_per_slot=tokens_per_slot,
            interpret=INTERPRET,
        )[0]
        ref_fn = jax.jit(lambda xc, ic: lora_shrink_reference(xc, (a,), token_lora_indices=ic)[0])
        ref = jnp.concatenate(
            [ref_fn(x[i : i + chunk], idx[i : i + chunk]) for i in range(0, c.tokens, chunk)]
        )
    else:
        h, y = inputs[0][0], inputs[1][0]
        got = lora_expand(
            y,
            h,
            (a,),
            offsets=(0,),
            **m,
            block_sizes=bs,
            prompt_tiles=prompt_tiles,
            tokens_per_slot=tokens_per_slot,
            interpret=INTERPRET,
        )
        ref_fn = jax.jit(
            lambda yc, hc, ic: lora_expand_reference(
                yc, hc, (a,), offsets=(0,), token_lora_indices=ic
            )
        )
        ref = jnp.concatenate(
            [
                ref_fn(y[i : i + chunk], h[:, i : i + chunk], idx[i : i + chunk])
                for i in range(0, c.tokens, chunk)
            ]
        )
    got, ref = got.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


# Each impl: (inputs, weights, metas) -> outputs of `calls` distinct calls, built by
# `per_call` from one call's shrink (x [T, H], a [L, R, H], meta -> [T, R]) and expand
# (y [T, N], h [1, T, R], b [L, N, R], meta -> y).
def per_call(c: Case, shrink_one, expand_one):
    def shrink_fn(xs, w, metas):
        return [shrink_one(xs[i], w[i % len(w)], m) for i, m in enumerate(metas)]

    def expand_fn(hys, w, metas):
        hs, ys = hys
        ys = list(ys)
        for i, m in enumerate(metas):
            j = i % len(ys)
            ys[j] = expand_one(ys[j], hs[i], w[i % len(w)], m)
        return hs, ys  # fed back as the next run's (donated) inputs

    return shrink_fn if c.op == "shrink" else expand_fn


def host_prompt_tiles(metas) -> str | None:
    """What a mapping built from these steps' host indices says of their prompt tiles
    (`work_list.prompt_tiles`, as `make_lora_mapping` finds it), if every step agrees."""
    found = {prompt_tiles(np.asarray(m["token_lora_indices"])) for m in metas}
    return found.pop() if len(found) == 1 else None


def host_whole_tiles(metas) -> str | None:
    """What a mapping built from these steps' host indices says of their whole tiles
    (`work_list.whole_tiles`, the expand's `prompt_tiles`), if every step agrees."""
    found = {whole_tiles(np.asarray(m["token_lora_indices"])) for m in metas}
    return found.pop() if len(found) == 1 else None


def host_tokens_per_slot(metas) -> int | None:
    """What a mapping built from these steps' host indices says of their tokens per slot
    (`lora_jax.mapping.host_tokens_per_slot`), if every step agrees."""
    found = {
        mapping_lib.host_tokens_per_slot(np.asarray(m["token_lora_indices"]), MAX_LORAS)
        for m in metas
    }
    return found.pop() if len(found) == 1 else None


def ours(
    c: Case,
    bs: BlockSizes | None,
    *,
    ready_work_lists: bool = True,
    prompt_tiles: str | None = None,
    tokens_per_slot: int | None = None,
    mosaic: bool | None = None,
    whole_tiles: str | None = None,
):
    """Our kernels; ``ready_work_lists=False``: each call builds its own work list;
    ``prompt_tiles`` / ``tokens_per_slot``: what the host found (`host_prompt_tiles`,
    or for the expand `host_whole_tiles`; `host_tokens_per_slot`), None: not known;
    ``mosaic``: the expand's Mosaic GPU switch (None: its default); ``whole_tiles``: the
    shrink's `host_whole_tiles`."""

    def meta_of(m):
        return m if ready_work_lists else {k: v for k, v in m.items() if k != "work_lists"}

    def shrink_one(x, a, m):
        return lora_shrink(
            x,
            (a,),
            **meta_of(m),
            block_sizes=bs,
            prompt_tiles=prompt_tiles,
            whole_tiles=whole_tiles,
            tokens_per_slot=tokens_per_slot,
            interpret=INTERPRET,
        )

    def expand_one(y, h, b, m):
        return lora_expand(
            y,
            h,
            (b,),
            offsets=(0,),
            **meta_of(m),
            block_sizes=bs,
            mosaic=mosaic,
            prompt_tiles=prompt_tiles,
            tokens_per_slot=tokens_per_slot,
            interpret=INTERPRET,
        )

    return per_call(c, shrink_one, expand_one)


XLA_RULES = {"xla": None, "xla_gather": float("inf"), "xla_onehot": 0.0}
"""The library XLA backend's impls: `lora_jax.ops.ONE_HOT_TOKENS_PER_SLOT` while tracing
(None: the library's own)."""


def library_xla(c: Case, name: str):
    """The library's XLA backend (`lora_jax.ops` with ``backend="xla"``) on the step's
    mapping, its one-hot rule set as ``XLA_RULES[name]`` says while the call is traced."""
    from lora_jax import ops as lops

    def shrink_one(x, a, m):
        return lops.lora_shrink(x, (a,), mapping_lib.LoRAMapping(**m), backend="xla")

    def expand_one(y, h, b, m):
        mapping = mapping_lib.LoRAMapping(**m)
        return lops.lora_expand(y, h, (b,), mapping, offsets=(0,), backend="xla")

    inner = per_call(c, shrink_one, expand_one)
    rule = XLA_RULES[name]

    def run(*args):
        old = lops.ONE_HOT_TOKENS_PER_SLOT
        if rule is not None:
            lops.ONE_HOT_TOKENS_PER_SLOT = rule
        try:
            return inner(*args)
        finally:
            lops.ONE_HOT_TOKENS_PER_SLOT = old

    return run


def _valid(m):
    idx = m["token_lora_indices"]
    return idx >= 0, jnp.where(idx >= 0, idx, 0)


def gather_einsum(c: Case):
    def shrink_one(x, a, m):
        valid, safe = _valid(m)
        o = jnp.einsum("th,trh->tr", x, a[safe], preferred_element_type=jnp.float32)
        return jnp.where(valid[:, None], o, 0.0)

    def expand_one(y, h, b, m):
        valid, safe = _valid(m)
        d = jnp.einsum(
            "tr,tnr->tn", h[0].astype(y.dtype), b[safe], preferred_element_type=jnp.float32
        )
        return jnp.where(valid[:, None], (y.astype(jnp.float32) + d).astype(y.dtype), y)

    return per_call(c, shrink_one, expand_one)


def one_hot_einsum(c: Case):
    def shrink_one(x, a, m):
        oh = jax.nn.one_hot(m["token_lora_indices"], MAX_LORAS, dtype=x.dtype)  # [T, L]
        return jnp.einsum("td,tX,Xld->tl", x, oh, a, preferred_element_type=jnp.float32)

    def expand_one(y, h, b, m):
        oh = jax.nn.one_hot(m["token_lora_indices"], MAX_LORAS, dtype=y.dtype)
        d = jnp.einsum(
            "tr,tX,Xnr->tn", h[0].astype(y.dtype), oh, b, preferred_element_type=jnp.float32
        )
        return (y.astype(jnp.float32) + d).astype(y.dtype)

    return per_call(c, shrink_one, expand_one)


def ragged(c: Case):
    # Weights stored transposed for ragged_dot ([L, H, R] / [L, R, N]), made outside the timing.
    def shrink_one(x, at, m):
        order = m["sorted_token_ids"]
        o = jax.lax.ragged_dot(
            x[order], at, m["slot_token_counts"], preferred_element_type=jnp.float32
        )
        return jnp.zeros_like(o).at[order].set(o)

    def expand_one(y, h, bt, m):
        order = m["sorted_token_ids"]
        d = jax.lax.ragged_dot(
            h[0][order].astype(y.dtype),
            bt,
            m["slot_token_counts"],
            preferred_element_type=jnp.float32,
        )
        return y.at[order].add(d.astype(y.dtype))

    return per_call(c, shrink_one, expand_one)


def dense(c: Case):
    """A floor, not a multi-LoRA method: every token uses slot 0's weights in one plain
    XLA dot (cuBLAS on a GPU), with no per-token gather. Right only where n = 1."""

    def shrink_one(x, a, m):
        del m
        return jnp.einsum("th,rh->tr", x, a[0], preferred_element_type=jnp.float32)

    def expand_one(y, h, b, m):
        del m
        d = jnp.einsum("tr,nr->tn", h[0].astype(y.dtype), b[0], preferred_element_type=jnp.float32)
        return (y.astype(jnp.float32) + d).astype(y.dtype)

    return per_call(c, shrink_one, expand_one)


def rect(c: Case, name: str):
    """A probe, not a multi-LoRA method (right only where n = 1, like `dense`): slot 0's
    weights over rectangles of consecutive tokens in Pallas Triton
    (`stream_floor_triton.shrink_rect` / `expand_rect`), as if a prompt tile's rows were
    read as one block instead of gathered through the token list. ``name``: "rect" (the
    default tiles) or "rect:<tiles>" (shrink block_m:block_k:warps:stages:split, expand
    block_m:block_n:warps; a name runs only the op its tiles are for, `rect_names`)."""
    import stream_floor_triton as sft

    shrink_tiles = expand_tiles = sft.parse_tiles(name, None)

    def shrink_one(x, a, m):
        del m
        return sft.shrink_rect(x, a[0], tiles=shrink_tiles, interpret=INTERPRET)

    def expand_one(y, h, b, m):
        del m
        return sft.expand_rect(y, h[0], b[0], tiles=expand_tiles, interpret=INTERPRET)

    return per_call(c, shrink_one, expand_one)


def rect_names(c: Case, impls) -> list[str]:
    """The `rect` probes asked for that fit this cell: n = 1, and tiles for its op."""
    if c.adapters != 1:
        return []
    fields = {"shrink": 5, "expand": 3}[c.op]
    return [n for n in impls if n == "rect" or (n.startswith("rect:") and n.count(":") == fields)]


def rect_err(c: Case, fn, inputs, w) -> float:
    """A `rect` probe's first call vs the plain f32 product with slot 0's weights."""
    if c.op == "shrink":
        x, a = inputs[0], w[0][0]
        got = fn([x], [w[0]], [None])[0]
        ref = jnp.einsum("th,rh->tr", x, a, preferred_element_type=jnp.float32)
    else:
        h, y, b = inputs[0][0], inputs[1][0], w[0][0]
        got = fn(([h], [jnp.copy(y)]), [w[0]], [None])[1][0].astype(jnp.float32)
        d = jnp.einsum("tr,nr->tn", h[0].astype(y.dtype), b, preferred_element_type=jnp.float32)
        ref = y.astype(jnp.float32) + d
    return float(jnp.max(jnp.abs(got - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


def mexp(c: Case, name: str):
    """The Mosaic GPU expand (`mosaic_gpu_expand`) alone, on the tiles of y whose tokens
    are all one slot's (`tile_items`, built in the call: its own kernels show apart in
    the trace). A probe until the library takes it: right only where those tiles hold
    every token (n = 1, or runs of whole tiles; `mexp_names`). ``name``: "mexp" or
    "mexp:block_m:block_n:stages[:h_in[:variant]]" (`ExpandTiles`)."""
    from lora_jax.kernels.shrink_expand import mosaic_gpu_expand as me

    tiles = mexp_tiles(name)

    def expand_one(y, h, b, m):
        items, _ = me.tile_items(m["token_lora_indices"], block_m=tiles.block_m)
        return me.expand(y, h, (b,), items, None, offsets=(0,), tiles=tiles)

    return per_call(c, None, expand_one)


def mexp_tiles(name: str):
    from lora_jax.kernels.shrink_expand import mosaic_gpu_expand as me

    f = name.split(":")[1:]
    if not f:
        return me.ExpandTiles()
    kw = dict(block_m=int(f[0]), block_n=int(f[1]), stages=int(f[2]))
    if len(f) > 3:
        kw["h_in"] = f[3]
    if len(f) > 4:
        kw["variant"] = f[4]
    return me.ExpandTiles(**kw)


def mexp_names(c: Case, impls) -> list[str]:
    """The `mexp` probes asked for whose tiles hold every token of this cell's steps."""
    if c.op != "expand" or LAYOUT != "runs" and c.adapters != 1:
        return []
    names = [n for n in impls if n == "mexp" or n.startswith("mexp:")]
    return [n for n in names if (c.tokens // c.adapters) % mexp_tiles(n).block_m == 0]


def mexp_err(c: Case, fn, inputs, w, metas) -> float:
    """A `mexp` probe's first call vs the jnp oracle."""
    h, y, a, m = inputs[0][0], inputs[1][0], w[0], metas[0]
    got = fn(([h], [jnp.copy(y)]), [a], [m])[1][0].astype(jnp.float32)
    ref = lora_expand_reference(
        y, h, (a,), offsets=(0,), token_lora_indices=m["token_lora_indices"]
    ).astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


def rexp(c: Case, name: str):
    """The Mosaic GPU row-reduce expand (`row_reduce_expand`, a probe): every mapped
    token, in any order, through the step's ready work list. ``name``: "rexp" or
    "rexp:block_m:block_n:stages[:store[:hoist]]" (`RowTiles`; "hoist": the token ids
    read once per block run)."""
    import row_reduce_expand as mr

    f = name.split(":")[1:]
    kw = {}
    if f:
        kw = dict(block_m=int(f[0]), block_n=int(f[1]), stages=int(f[2]))
    if len(f) > 3:
        kw["store"] = f[3]
    if len(f) > 4:
        kw["hoist"] = f[4] == "hoist"
    tiles = mr.RowTiles(**kw)

    def expand_one(y, h, b, m):
        return mr.expand(
            y, h, (b,), m["work_lists"][tiles.block_m], None, offsets=(0,), tiles=tiles
        )

    return per_call(c, None, expand_one)


def stream(c: Case):
    """A floor, not a LoRA method: one XLA fusion that moves the cell's activation bytes
    with no weights and no dot. The shrink reads x and writes [T, R] f32 (sums of H / R
    columns); the expand reads h and y and writes y. What the HBM gives a well-fused
    XLA kernel at this size: the roofline's 4.3 TB/s is a long copy's rate."""

    def shrink_one(x, a, m):
        del a, m
        t, h = x.shape
        return x.reshape(t, c.rank, h // c.rank).sum(-1, dtype=jnp.float32)

    def expand_one(y, h, b, m):
        del b, m
        # Materialise y: XLA would fuse the chain of updates of one rotated y buffer.
        y = jax.lax.optimization_barrier(y)
        return (y.astype(jnp.float32) + h[0].sum(-1, keepdims=True)).astype(y.dtype)

    return per_call(c, shrink_one, expand_one)


def compile_with_budget(fn, args, budget_s: float, donate: bool = False):
    """``donate``: the first argument is donated (the expand's y buffers, updated in place)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    jitted = jax.jit(fn, donate_argnums=(0,) if donate else ())
    fut = pool.submit(lambda: jitted.lower(*args).compile())
    try:
        return fut.result(timeout=budget_s), None
    except concurrent.futures.TimeoutError:
        return None, f"compile > {budget_s:.0f} s"
    except Exception as e:  # noqa: BLE001 - report the cell, keep the run going
        return None, f"{type(e).__name__}: {str(e)[:600]}"
    finally:
        pool.shutdown(wait=False)


def time_calls(compiled, args, calls: int, reps: int = 3, feed: bool = False) -> float:
    """µs per call: wall time of back-to-back runs ("wall"), or the GPU's busy time per
    call read from a profiler trace ("trace": the union of kernel intervals, so launch
    gaps and host jitter drop out; falls back to wall time where the trace has no GPU).
    ``feed``: each run's output is the next run's first (donated) argument."""
    state = list(args)

    def run():
        out = compiled(*state)
        if feed:
            state[0] = out
        return out

    # Warm up for >= 50 ms of GPU work: after seconds of compiling, the clocks are down
    # and a single warm-up call left the first variant of each case measurably slower.
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        jax.block_until_ready(run())
    LAST_KERNELS.clear()
    if TIMER == "trace":
        busy = trace_busy_us(run, reps)
        if busy == busy:  # not NaN: a GPU trace was read
            return busy / calls
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = run()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / (reps * calls))
    return best * 1e6  # us per call


def trace_busy_us(run, reps: int) -> float:
    """GPU busy µs per ``run()`` over ``reps`` runs, from a jax.profiler trace."""
    from profile_decode import device_events, summarize  # the decode profiler's reducer

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for _ in range(reps):
                out = run()
            jax.block_until_ready(out)
        summary = summarize(device_events(d), reps, 1)
    LAST_KERNELS.update(summary["kernels"])
    return summary["busy_us"]


def write_json(path: str, rows) -> None:
    """``rows`` as indented JSON at ``path`` (its folder made); nothing when ``path`` is empty."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def cases(args):
    """The grid of these arguments (`cells.grid`; ``untrimmed`` optional, default off)."""
    trimmed = not getattr(args, "untrimmed", False)
    return grid(args.ops, args.hiddens, args.ranks, args.tokens, args.adapters, trimmed)


def model_case(tokens: int, hidden: int, rank: int, adapters: int, layers: int, impl: str):
    """(fn, args) for ``layers`` shrink+expand pairs in one jit, sharing one mapping.

    Like the LoRA layers of one model step: every layer has its own A [L, R, H] and
    B [L, H, R] (distinct copies, so weights come from HBM), the same mapping
    arrays, and its input is the previous layer's output (y feeds the next x).
    """
    rng = np.random.default_rng(0)
    chosen = rng.permutation(MAX_LORAS)[:adapters]
    meta = metadata(rng.permutation(chosen[np.arange(tokens) % adapters]), MAX_LORAS)
    k = jax.random.key(1)
    dt = jnp.bfloat16
    y = jax.random.normal(k, (tokens, hidden), dt)  # [T, H]
    a = jax.random.normal(jax.random.fold_in(k, 1), (layers, MAX_LORAS, rank, hidden), dt)
    b = jax.random.normal(jax.random.fold_in(k, 2), (layers, MAX_LORAS, hidden, rank), dt)
    a = [v * (hidden**-0.5) for v in a]  # K x [L, R, H]
    b = [v * (rank**-0.5) for v in b]  # K x [L, H, R]
    shrink_bs = OLD_DECODE_SHRINK if impl == "old" and tokens <= 256 else None
    expand_bs = None
    if impl.startswith(("shrink[", "expand[")):  # a --decode-sweep candidate
        op, i = impl[:-1].split("[")
        shrink_bs = DECODE_SWEEP[op][int(i)] if op == "shrink" else None
        expand_bs = DECODE_SWEEP[op][int(i)] if op == "expand" else None
        impl = op

    def ours_fn(y, a, b, meta):
        for i in range(layers):
            h = lora_shrink(y, (a[i],), **meta, block_sizes=shrink_bs, interpret=INTERPRET)
            y = lora_expand(y, h, (b[i],), offsets=(0,), **meta, interpret=INTERPRET)
        return y

    def shrink_only(y, a, b, meta):
        return [
            lora_shrink(y, (a[i],), **meta, block_sizes=shrink_bs, interpret=INTERPRET)
            for i in range(layers)
        ]

    def expand_only(y, a, b, meta):
        h = jnp.ones((1, tokens, rank), jnp.float32) * 0.01
        for i in range(layers):
            y = lora_expand(
                y, h, (b[i],), offsets=(0,), **meta, block_sizes=expand_bs, interpret=INTERPRET
            )
        return y

    fused_bs = fused_variant(impl, tokens, hidden, rank) if impl.startswith("fused") else None

    def fused_fn(y, a, b, meta):
        for i in range(layers):
            y = lora_shrink_expand(
                y,
                y,
                (a[i],),
                (b[i],),
                offsets=(0,),
                **meta,
                block_sizes=fused_bs,
                interpret=INTERPRET,
            )
        return y

    split = True
    if impl.startswith("split["):  # split[chunk_k:block_n:programs:num_warps]
        chunk_k, block_n, programs, warps = (int(v) for v in impl[6:-1].split(":"))
        split = SplitTiles(chunk_k=chunk_k, block_n=block_n, programs=programs, num_warps=warps)

    def split_fn(y, a, b, meta):
        for i in range(layers):
            y = lora_shrink_expand(
                y, y, (a[i],), (b[i],), offsets=(0,), **meta, split=split, interpret=INTERPRET
            )
        return y

    def gather_fn(y, a, b, meta):
        valid, safe = _valid(meta)
        for i in range(layers):
            h = jnp.einsum("th,trh->tr", y, a[i][safe], preferred_element_type=jnp.float32)
            d = jnp.einsum(
                "tr,tnr->tn", h.astype(dt), b[i][safe], preferred_element_type=jnp.float32
            )
            y = jnp.where(valid[:, None], (y.astype(jnp.float32) + d).astype(dt), y)
        return y

    fn = {
        "ours": ours_fn,
        "old": ours_fn,
        "shrink": shrink_only,
        "expand": expand_only,
        "gather": gather_fn,
        "fused": fused_fn,
        "fused/2": fused_fn,
        "fused*2": fused_fn,
        "split": split_fn,
    }[impl if not impl.startswith("split[") else "split"]
    return fn, (y, a, b, meta)


def model_main(a):
    """--model K: µs per layer (one shrink + one expand) over K layers sharing a mapping."""
    impls = ["ours", "shrink", "expand", "old", "gather"]
    if a.fused:  # the fused kernel next to the 3-launch pair and gather+einsum
        impls = ["fused", "fused/2", "fused*2", "ours", "shrink", "expand", "gather"]
    if a.split:  # the fused kernel with the grid-wide split beside the pair
        impls = ["split", "ours", "fused", "gather"]
        impls += [f"split[{v}]" for v in a.split_tiles.split(",") if v]
    if a.decode_sweep:  # decode tile candidates, each op alone over K layers
        impls = ["shrink", "expand", "gather"]
        impls += [f"{op}[{i}]" for op in ("shrink", "expand") for i in range(len(DECODE_SWEEP[op]))]
    rows, start = [], time.time()
    for rank in a.ranks:
        for t in a.tokens:
            for n in a.adapters:
                if time.time() - start > a.time_budget:
                    print(f"time budget spent; skipping T={t} R={rank} n={n}", flush=True)
                    continue
                n = min(n, t)
                c = Case("shrink", t, a.hiddens[0], rank, n)
                ideal = (ideal_bytes(c) + ideal_bytes(dataclasses.replace(c, op="expand"))) / (
                    HBM_GBPS * 1e3
                )
                res = dict(tokens=t, hidden=c.hidden, rank=rank, adapters=n, ideal_us=ideal)
                outs = {}
                for impl in impls:
                    if impl == "gather" and t * rank * c.hidden * 2 > 4e9:
                        continue
                    fn, args = model_case(t, c.hidden, rank, n, a.model, impl)
                    compiled, err = compile_with_budget(fn, args, 4 * a.compile_budget)
                    if err:
                        res[impl] = err[:60]
                        continue
                    try:
                        res[impl] = time_calls(compiled, args, a.model)
                        if impl in ("fused", "ours", "split"):  # against the pair, last layer's y
                            outs[impl] = np.asarray(compiled(*args), np.float32)
                    except Exception as e:  # noqa: BLE001 - report the cell, keep the run going
                        res[impl] = f"run: {type(e).__name__}: {str(e)[:100]}"
                    del args
                for name in ("fused", "split"):
                    if name in outs and "ours" in outs:
                        ref = outs["ours"]
                        err = np.max(np.abs(outs[name] - ref)) / max(np.max(np.abs(ref)), 1e-30)
                        res[f"{name}_vs_pair_rel_err"] = float(err)
                rows.append(res)
                print(res, flush=True)
                with open(os.path.join(a.out, "ops_model.json"), "w") as f:
                    json.dump(rows, f, indent=1)
    titles = {
        "ours": "ours pair µs",
        "shrink": "shrink µs",
        "expand": "expand µs",
        "old": "before (old shrink tiles) pair µs",
        "gather": "gather+einsum pair µs",
        "fused": "fused µs",
        "fused/2": "fused split_n/2 µs",
        "fused*2": "fused split_n*2 µs",
        "split": "fused, grid split µs",
    }
    titles.update({k: f"{k} µs" for k in impls if k not in titles})
    head = (
        "| T | H | R | n | ideal µs (pair) | "
        + " | ".join(titles[k] for k in impls)
        + " |\n|"
        + "---|" * (5 + len(impls))
    )
    lines = [head]
    for r in rows:
        cell = [f"{r[k]:.1f}" if isinstance(r.get(k), float) else str(r.get(k, "–")) for k in impls]
        lines.append(
            f"| {r['tokens']} | {r['hidden']} | {r['rank']} | {r['adapters']} "
            f"| {r['ideal_us']:.1f} | " + " | ".join(cell) + " |"
        )
    print("\n" + "\n".join(lines))


def main(argv=None):
    global INTERPRET, TIMER, LAYOUT
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="shrink,expand")
    p.add_argument("--tokens", default="1,16,64,256,1024,4096,16384")
    p.add_argument("--hiddens", default="4096,8192")
    p.add_argument("--ranks", default="16,64,128")
    p.add_argument("--adapters", default="1,8,64")
    p.add_argument("--impls", default="ours,gather,onehot,ragged")
    p.add_argument("--compile-budget", type=float, default=40.0)
    p.add_argument("--time-budget", type=float, default=1e9, help="stop starting cases after")
    p.add_argument("--sweep", action="store_true")
    p.add_argument(
        "--sweep-set",
        default="default",
        choices=("default", "prefill"),
        help="with --sweep: the SWEEP (default) or PREFILL_SWEEP tile candidates",
    )
    p.add_argument(
        "--candidates",
        default="",
        help="with --sweep: comma-separated indices into the sweep set (default: all)",
    )
    p.add_argument(
        "--untrimmed",
        action="store_true",
        help="every rank at H = 8192 (the issue's grid keeps rank 64 only there)",
    )
    p.add_argument(
        "--layout",
        default="shuffled",
        choices=("shuffled", "runs"),
        help="token order: shuffled (the issue's grid) or runs (one run per adapter, prompts)",
    )
    p.add_argument("--interpret", action="store_true")
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the accuracy check of our kernels against the jnp oracle",
    )
    p.add_argument(
        "--timer",
        default="wall",
        choices=("wall", "trace"),
        help="wall: back-to-back wall time / calls; trace: GPU busy time from a profiler trace",
    )
    p.add_argument(
        "--model",
        type=int,
        default=0,
        help="K > 0: model-like mode, K shrink+expand layers in one jit sharing one mapping",
    )
    p.add_argument(
        "--fused",
        action="store_true",
        help="with --model: also time the fused one-launch kernel lora_shrink_expand",
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="with --model: time lora_shrink_expand(split=True) (the hidden dim split over "
        "the grid, a grid-wide barrier) beside the pair and the fused kernel",
    )
    p.add_argument(
        "--split-tiles",
        default="",
        help="with --split: also these SplitTiles, comma-separated "
        "chunk_k:block_n:programs:num_warps (e.g. 1024:512:132:4)",
    )
    p.add_argument(
        "--decode-sweep",
        action="store_true",
        help="with --model: time each op alone with the DECODE_SWEEP tile candidates",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    INTERPRET = a.interpret
    TIMER = a.timer
    LAYOUT = a.layout
    a.ops = a.ops.split(",")
    a.tokens = [int(v) for v in a.tokens.split(",")]
    a.hiddens = [int(v) for v in a.hiddens.split(",")]
    a.ranks = [int(v) for v in a.ranks.split(",")]
    a.adapters = [int(v) for v in a.adapters.split(",")]
    impls = a.impls.split(",")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    if a.model:
        model_main(a)
        return
    sweep_set = PREFILL_SWEEP if a.sweep_set == "prefill" else SWEEP
    if a.candidates:  # keep the indices (ours[i] keeps naming the set's entry i)
        keep = {int(i) for i in a.candidates.split(",")}
        sweep_set = {
            op: [bs if i in keep else None for i, bs in enumerate(v)] for op, v in sweep_set.items()
        }
    if a.sweep:
        for op in a.ops:
            for i, bs in enumerate(sweep_set[op]):
                if bs is not None:
                    print(f"{op} ours[{i}] = {bs}", flush=True)
    rows, start = [], time.time()
    for c in cases(a):
        if time.time() - start > a.time_budget:
            print(f"time budget spent; skipping {c}", flush=True)
            continue
        calls = 8 if c.tokens >= 4096 else 32
        if INTERPRET:
            calls = 2
        inputs, w, metas = build(c, calls)
        res = dict(dataclasses.asdict(c), ideal_us=ideal_bytes(c) / HBM_GBPS / 1e3, impls={})
        # A server's mapping, built from host indices, knows the step's prompt tiles and
        # tokens per slot (session 18: the latter picks the per-token kernels).
        tiles = res["prompt_tiles"] = host_prompt_tiles(metas)
        if c.op == "expand":  # the expand's hint: tiles wholly of one slot
            tiles = res["whole_tiles"] = host_whole_tiles(metas)
        per_slot = res["tokens_per_slot"] = host_tokens_per_slot(metas)
        whole = None  # the shrink's whole tiles (the expand's are its `tiles`)
        if c.op == "shrink":
            whole = res["whole_tiles"] = host_whole_tiles(metas)
        if a.check:
            try:
                res["max_rel_err"] = max_rel_err(c, inputs, w, metas, None, tiles, per_slot, whole)
                res["err_ok"] = res["max_rel_err"] <= ERR_BOUND[c.op]
            except Exception as e:  # noqa: BLE001
                res["max_rel_err"], res["err_ok"] = float("nan"), False
                print(f"accuracy check failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        variants = [
            (
                "ours",
                ours(c, None, prompt_tiles=tiles, tokens_per_slot=per_slot, whole_tiles=whole),
                w,
            )
        ]
        if "ours_nowhole" in impls and whole is not None:  # the shrink without that hint
            variants.append(
                ("ours_nowhole", ours(c, None, prompt_tiles=tiles, tokens_per_slot=per_slot), w)
            )
        if "ours_blind" in impls:  # the mapping built on the device: neither is known
            variants.append(("ours_blind", ours(c, None), w))
        candidates = {}
        if a.sweep:
            candidates = {f"ours[{i}]": bs for i, bs in enumerate(sweep_set[c.op]) if bs}
            variants += [
                (name, ours(c, bs, prompt_tiles=tiles, whole_tiles=whole), w)
                for name, bs in candidates.items()
            ]
        if "ours_split" in impls:  # the expand's Mosaic + Triton split, the host silent
            variants.append(("ours_split", ours(c, None, mosaic=True), w))
        if "ours_triton" in impls:  # the op without its Mosaic GPU kernel
            variants.append(("ours_triton", ours(c, None, prompt_tiles=tiles, mosaic=False), w))
        if "ours_pt" in impls:  # the per-token (BGMV) default tiles
            candidates["ours_pt"] = BlockSizes.get_default(
                c.op, num_tokens=c.tokens, hidden=c.hidden, rank=c.rank, per_token=True
            )
            variants.append(("ours_pt", ours(c, candidates["ours_pt"]), w))
        if "ours_pf" in impls and c.op == "expand":  # the default tiles, y loaded ahead
            candidates["ours_pf"] = dataclasses.replace(
                BlockSizes.get_default(
                    c.op, num_tokens=c.tokens, hidden=c.hidden, rank=c.rank
                ),
                prefetch=1,
            )  # fmt: skip
            variants.append(
                ("ours_pf", ours(c, candidates["ours_pf"], prompt_tiles=tiles), w)
            )  # fmt: skip
        if "ours_ri" in impls and c.op == "shrink":  # the default, rank blocks side by side
            candidates["ours_ri"] = dataclasses.replace(
                BlockSizes.get_default(c.op, num_tokens=c.tokens, hidden=c.hidden, rank=c.rank),
                rank_inner=True,
            )
            variants.append(("ours_ri", ours(c, candidates["ours_ri"], prompt_tiles=tiles), w))
        if "ours_s42" in impls and c.op == "shrink" and whole == "all":
            # the default rectangle tiles, x's first tile requested after the slot's read
            rect_bs = tuning_long_shrink.rect_shrink_tiles(c.tokens, c.hidden, next_pow2(c.rank))
            if rect_bs is not None:
                candidates["ours_s42"] = dataclasses.replace(rect_bs, x_first=False)
                variants.append(
                    (
                        "ours_s42",
                        ours(c, candidates["ours_s42"], prompt_tiles=tiles, whole_tiles=whole),
                        w,
                    )
                )
        if "ours_s25" in impls and c.op == "expand" and c.tokens > 256:
            candidates["ours_s25"] = session25_prefill_expand(c.tokens, c.rank)
            variants.append(
                ("ours_s25", ours(c, candidates["ours_s25"], prompt_tiles=tiles), w)
            )  # fmt: skip
        if "gather" in impls:
            gathered = c.tokens * c.rank * c.hidden * 2
            if gathered > 4e9:
                res["impls"]["gather"] = {"skipped": f"gathered weights {gathered / 1e9:.0f} GB"}
            else:
                variants.append(("gather", gather_einsum(c), w))
        variants += [(n, library_xla(c, n), w) for n in XLA_RULES if n in impls]
        if "ours_inline" in impls:
            variants.append(("ours_inline", ours(c, None, ready_work_lists=False), w))
        if "onehot" in impls:
            variants.append(("onehot", one_hot_einsum(c), w))
        if "dense" in impls and c.adapters == 1:
            variants.append(("dense", dense(c), w))
        if "stream" in impls:
            variants.append(("stream", stream(c), w))
        variants += [(n, rect(c, n), w) for n in rect_names(c, impls)]
        variants += [(n, mexp(c, n), w) for n in mexp_names(c, impls)]
        if c.op == "expand":
            variants += [(n, rexp(c, n), w) for n in impls if n.split(":")[0] == "rexp"]
        if "ragged" in impls:
            wt = [jnp.swapaxes(v, 1, 2) for v in w]
            variants.append(("ragged", ragged(c), wt))
        for name, fn, weights in variants:
            if name != "ours" and not name.startswith("ours[") and name not in impls:
                continue
            budget = a.compile_budget if not name.startswith("ours") else 4 * a.compile_budget
            donate = c.op == "expand"  # y is updated in place: donate it, no defensive copy
            # A fresh copy of the inputs per variant: donation consumes them.
            fresh = jax.tree.map(jnp.copy, inputs) if donate else inputs
            compiled, err = compile_with_budget(fn, (fresh, weights, metas), budget, donate)
            if err:
                res["impls"][name] = {"skipped": err}
                continue
            try:
                us = time_calls(compiled, (fresh, weights, metas), calls, feed=donate)
            except Exception as e:  # noqa: BLE001
                res["impls"][name] = {"skipped": f"run: {type(e).__name__}: {str(e)[:100]}"}
                continue
            res["impls"][name] = {"us": us, "gbps": ideal_bytes(c) / us / 1e3}
            if name.startswith("rect"):  # a probe must be right to count
                err = rect_err(c, fn, inputs, weights)
                res["impls"][name]["max_rel_err"] = err
                if err > ERR_BOUND[c.op]:
                    res["impls"][name] = {"skipped": f"wrong: max rel err {err:.1e}"}
            if name.startswith(("mexp", "rexp")) and not name.endswith(":copy"):
                err = mexp_err(c, fn, inputs, weights, metas)
                res["impls"][name]["max_rel_err"] = err
                if err > ERR_BOUND[c.op]:
                    res["impls"][name] = {"skipped": f"wrong: max rel err {err:.1e}"}
            if a.check and name in candidates:  # a candidate must be right to count
                err = max_rel_err(c, inputs, w, metas, candidates[name], tiles, None, whole)
                res["impls"][name]["max_rel_err"] = err
                if err > ERR_BOUND[c.op]:
                    res["impls"][name] = {"skipped": f"wrong: max rel err {err:.1e}"}
            if LAST_KERNELS and name.startswith(
                ("ours", "mexp", "rexp")
            ):  # trace timer: where the time went
                top = sorted(LAST_KERNELS.items(), key=lambda kv: -kv[1])[:6]
                res["impls"][name]["kernels_us"] = {k[:80]: round(v / calls, 2) for k, v in top}
        if a.sweep:
            best = min(
                (k for k in res["impls"] if k.startswith("ours") and "us" in res["impls"][k]),
                key=lambda k: res["impls"][k]["us"],
                default=None,
            )
            res["best"] = best
        rows.append(res)
        print(fmt_row(res, a.sweep), flush=True)
        with open(os.path.join(a.out, "ops.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print("\n" + table(rows))
    checked = [r for r in rows if "err_ok" in r]
    if checked:
        bad = [r for r in checked if not r["err_ok"]]
        worst = max(r["max_rel_err"] for r in checked)
        print(
            f"\naccuracy: {len(checked) - len(bad)}/{len(checked)} cells within the bound "
            f"{ERR_BOUND} (worst max rel err {worst:.1e})",
            flush=True,
        )


def _us(r, k):
    v = r["impls"].get(k, {})
    return v.get("us")


def fmt_row(r, sweep=False):
    s = f"{r['op']:6s} T={r['tokens']:5d} H={r['hidden']} R={r['rank']:3d} n={r['adapters']:2d} "
    for k, v in r["impls"].items():
        s += f"| {k} {v['us']:.1f}us " if "us" in v else f"| {k} skip({v['skipped'][:30]}) "
    if "max_rel_err" in r:
        s += f"| err {r['max_rel_err']:.1e} "
    if sweep:
        s += f"| best={r.get('best')}"
    return s


def table(rows):
    """The issue's table; the floors (`dense`, `stream`) add a column each where run."""
    extras = [
        k
        for k in ("dense", "stream", "ours_blind", *XLA_RULES)
        if any(k in r["impls"] for r in rows)
    ]
    extras += sorted(
        {k for r in rows for k in r["impls"] if k.startswith(("rect", "mexp", "rexp"))}
    )
    head = (
        "| op | T | H | R | n | ideal µs | ours µs | GB/s | % roofline | gather µs | one-hot µs "
        "| ragged_dot µs | × one-hot | × gather | max rel err |"
        + "".join(f" {k} µs |" for k in extras)
        + "\n|"
        + "---|" * (15 + len(extras))
    )
    lines = [head]
    for r in rows:
        o = _us(r, "ours")
        cells = []
        for k in ("gather", "onehot", "ragged", *extras):
            v = r["impls"].get(k, {})
            cells.append(f"{v['us']:.1f}" if "us" in v else ("skip" if v else "–"))
        oh, ga = _us(r, "onehot"), _us(r, "gather")
        err = "–"
        if "max_rel_err" in r:
            err = f"{r['max_rel_err']:.1e}" + ("" if r["err_ok"] else " (over bound)")
        tail = "".join(f" {v} |" for v in cells[3:])
        lines.append(
            f"| {r['op']} | {r['tokens']} | {r['hidden']} | {r['rank']} | {r['adapters']} "
            f"| {r['ideal_us']:.1f} | {o:.1f} | {r['ideal_us'] * HBM_GBPS / o:.0f} "
            f"| {100 * r['ideal_us'] / o:.0f} % | {cells[0]} | {cells[1]} | {cells[2]} "
            f"| {(f'{oh / o:.1f}' if oh else '–')} | {(f'{ga / o:.1f}' if ga else '–')} | {err} |"
            + tail
            if o
            else f"| {r['op']} | {r['tokens']} | {r['hidden']} | {r['rank']} | {r['adapters']} "
            f"| {r['ideal_us']:.1f} | skip | | | {cells[0]} | {cells[1]} | {cells[2]} | | | {err} |"
            + tail
        )
    return "\n".join(lines)


INTERPRET = False
TIMER = "wall"
LAYOUT = "shuffled"
LAST_KERNELS: dict[str, float] = {}  # the last trace's µs per run, by kernel name

if __name__ == "__main__":
    main()
