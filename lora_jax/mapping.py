"""Per-step adapter mapping: which device slot each token (and each sequence) uses.

One `LoRAMapping` is built per forward step, inside jit, from an int32 `[T]` array of
slot indices (-1 = no adapter). Everything a kernel needs to group tokens by adapter
(sorted order, counts, run starts, active slots) is derived here once per step and
shared by every LoRA layer, with static shapes so a new mix never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax.sharding import unshard


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAMapping:
    """Token→slot mapping plus the grouping metadata the kernels use.

    Build it with `make_lora_mapping`; its arrays are pytree leaves and ``is_prefill`` /
    ``prompt_tiles`` static metadata, so it can be passed through `jax.jit`, `shard_map`
    and NNX state (a new static value is a new trace).

    Example:
        >>> m = make_lora_mapping(jnp.array([1, -1, 1, 0], jnp.int32), max_loras=2)
        >>> m.sorted_token_ids.tolist(), m.slot_token_counts.tolist()
        ([3, 0, 2, 1], [1, 2])
    """

    token_lora_indices: jax.Array  # i32[T]   slot per token, -1 = no adapter
    sorted_token_ids: jax.Array  # i32[T]   token positions stably sorted by slot, -1 last
    slot_token_counts: jax.Array  # i32[L]   tokens per slot
    slot_token_starts: jax.Array  # i32[L]   exclusive cumsum of counts into sorted_token_ids
    active_slots: jax.Array  # i32[L]   slots with >= 1 token, ascending, then -1
    num_active: jax.Array  # i32[]    number of active slots
    # Per-sequence mapping for the sampler / lm_head (LogitsProcessorWithLoRA): one
    # slot per sequence, -1 = none. `None` when the step has no logits LoRA.
    seq_lora_indices: jax.Array | None = None  # i32[B]
    # The kernels' (slot, token block) schedules, one per token-block size
    # (`lora_jax.kernels` work_list.py); `None` when the kernels are not installed.
    # block_m -> i32[4 + block_m, NB]; from 1024 tokens also 0 -> work_list.Segments
    work_lists: dict | None = None
    # vLLM's `LoRAMapping.is_prefill`, static (a different value is a different program):
    # False for a decode step (one token per request, adapters scattered), whose shrink
    # then skips the prompt-tile kernel and its schedule; None (not said) or True: the
    # kernels look for tiles of x that one adapter's prompt fills.
    is_prefill: bool | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Static, found on the host when the step's indices are a numpy array (no device
    # work): "none", "some" or "all" of the mapped tokens lie in aligned tiles of x that a
    # few prompt runs fill (`lora_jax.kernels` work_list.prompt_tiles), so the shrink
    # launches only the kernels that have work; None: not known (device indices).
    prompt_tiles: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Static, found on the host like ``prompt_tiles``: mapped tokens per active slot,
    # bucketed (`TOKENS_PER_SLOT`): 1 (every mapped token has a slot of its own), 2 (two
    # on average at most), 16 (3-16 on average), 64 (at least 64 on average), 0 (between
    # 16 and 64, or no mapped token); None: not known. The kernels run a program per
    # token where that is faster (a decode step of many adapters), and size and fill
    # their token blocks knowing it (`lora_jax.kernels` tuning.AHEAD_TOKENS_PER_SLOT,
    # tuning.FEW_TOKENS_PER_SLOT).
    tokens_per_slot: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Static, found on the host like ``prompt_tiles``: "none", "some" or "all" of the
    # mapped tokens lie in aligned tiles of y wholly of one slot (`lora_jax.kernels`
    # work_list.whole_tiles), which the expand runs through its Mosaic GPU kernel on
    # Hopper; "all" skips the Triton launch for the other tokens. None: not known.
    whole_tiles: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Static, said by the caller (never looked for: a serving step would compile once more
    # for it and gain nothing): True when every mapped token uses one slot, as a training
    # batch's do. The backward pass then multiplies against that slot's weights alone
    # (`lora_jax.ops_grad`, dense matmuls); the forward is unchanged. None: not said.
    single_slot: bool | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def num_tokens(self) -> int:
        return self.token_lora_indices.shape[0]

    @property
    def max_loras(self) -> int:
        return self.slot_token_counts.shape[0]

    def kernel_kwargs(self) -> dict[str, jax.Array]:
        """The metadata as keyword arguments of `lora_jax.kernels` ops."""
        return dict(
            token_lora_indices=self.token_lora_indices,
            sorted_token_ids=self.sorted_token_ids,
            slot_token_counts=self.slot_token_counts,
            slot_token_starts=self.slot_token_starts,
            active_slots=self.active_slots,
            num_active=self.num_active,
            work_lists=self.work_lists,
        )

    def shrink_kwargs(self) -> dict:
        """`kernel_kwargs` plus the shrink's choice of kernels: a decode step
        (``is_prefill=False``) has no prompt tiles, so no Mosaic GPU launch; what the
        host found (``prompt_tiles``) skips a kernel with nothing to do, and whole tiles of
        one slot (``whole_tiles``) let ranks 16-64 read x in rectangles."""
        mosaic = False if self.is_prefill is False else None
        return dict(
            self.kernel_kwargs(),
            mosaic=mosaic,
            prompt_tiles=self.prompt_tiles,
            whole_tiles=self.whole_tiles,
            tokens_per_slot=self.tokens_per_slot,
        )

    def expand_kwargs(self) -> dict:
        """`kernel_kwargs` plus the expand's choice of kernels: no Mosaic GPU launch for a
        decode step; what the host found of the step's whole tiles and tokens per slot."""
        return dict(
            self.kernel_kwargs(),
            mosaic=False if self.is_prefill is False else None,
            prompt_tiles=self.whole_tiles,
            tokens_per_slot=self.tokens_per_slot,
        )

    def with_sequences(self, seq_lora_indices: jax.Array) -> LoRAMapping:
        """A copy carrying the per-sequence mapping used by the logits layer."""
        seq = clean_slots(seq_lora_indices, self.max_loras)
        return dataclasses.replace(self, seq_lora_indices=seq)


def clean_slots(indices, max_loras: int, what: str = "seq_lora_indices") -> jax.Array:
    """1-D integer slot indices as int32, anything outside `[-1, max_loras)` made -1 in the
    input's own width (a 64-bit id must not wrap into a valid slot).

    Example:
        >>> clean_slots(np.array([1, 2**32 + 1, -5]), 4).tolist()
        [1, -1, -1]
    """
    if isinstance(indices, np.ndarray) or not isinstance(indices, jax.Array):
        indices = np.asarray(indices)
    if indices.ndim != 1:
        raise ValueError(f"{what} must be 1-D [num_seqs], got shape {indices.shape}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"{what} must be integers, got {indices.dtype}")
    if isinstance(indices, np.ndarray):
        wide = indices.astype(np.int64)
        return jnp.asarray(np.where((wide >= 0) & (wide < max_loras), wide, -1).astype(np.int32))
    return _clean_device_slots(indices, int(max_loras))


@functools.partial(jax.jit, static_argnums=1)
def _clean_device_slots(indices: jax.Array, max_loras: int) -> jax.Array:
    # one dispatch for an eager caller (inlined under an outer jit); the range test in the
    # input's own dtype, so a 64-bit id cannot wrap into a slot
    return jnp.where((indices >= 0) & (indices < max_loras), indices, -1).astype(jnp.int32)


def make_lora_mapping(
    token_lora_indices: jax.Array,
    max_loras: int,
    seq_lora_indices: jax.Array | None = None,
    *,
    is_prefill: bool | None = None,
    prompt_tiles: str | None = None,
    tokens_per_slot: int | None = None,
    whole_tiles: str | None = None,
    single_slot: bool | None = None,
    host_hints: bool | None = None,
) -> LoRAMapping:
    """Builds the step metadata from `token_lora_indices` (int32 `[T]`, -1 = no adapter).

    Jittable, no host sync; indices outside `[-1, max_loras)` are treated as -1 (no
    adapter) so a stale id can never read another slot's weights. ``is_prefill`` as in
    vLLM: False says the step is decode (see `LoRAMapping.is_prefill`); None leaves the
    kernels to find prompts. Given a numpy array (a server's host-side batch), the
    prompt tiles are also found on the host (`LoRAMapping.prompt_tiles`); a caller that
    knows its layout may say it instead (``prompt_tiles="all"`` for rows of one slot
    each whose length is a power of two of at least `PROMPT_ROWS_MIN_TOKENS`, as a padded
    prefill batch's are). ``tokens_per_slot`` likewise (`LoRAMapping.tokens_per_slot`;
    `host_tokens_per_slot` of numpy indices): a performance hint; the kernels it picks give
    a token the same numbers (bf16 outputs bit for bit).
    ``whole_tiles`` likewise (`LoRAMapping.whole_tiles`; "all" for rows of one slot each
    whose length is a power of two of at least `PROMPT_TILE_TOKENS`). A wrong "all" in
    either hint computes tokens with another adapter's update (or none) on a GPU, or
    wherever the Pallas kernels run.
    ``single_slot=True`` (`LoRAMapping.single_slot`, never found on the host) says every
    mapped token uses one slot, as a training batch's do: the backward pass is then dense
    matmuls against that slot. It is checked where the indices are concrete (numpy, or a
    jax array outside a trace); a wrong True under a trace gives the other slots' tokens
    the gradient of the first active slot's weights.

    ``host_hints``: whether numpy indices give the hints above (they are static: each new
    value is a new trace of a jit the mapping is passed to). None: only where the ops
    would run the Pallas kernels (`lora_jax.ops.resolve_backend`: a GPU, or a backend set
    by `set_default_backend`); XLA reads none of them, so elsewhere a jitted step compiles
    once per bucket.

    Example:
        >>> m = jax.jit(make_lora_mapping, static_argnums=1)(jnp.zeros(8, jnp.int32), 4)
        >>> int(m.num_active)
        1
    """
    if isinstance(max_loras, bool) or not isinstance(max_loras, int | np.integer) or max_loras < 1:
        raise ValueError(f"max_loras must be an int >= 1 (a static value), got {max_loras!r}")
    if is_prefill is not None and not isinstance(is_prefill, bool):
        raise ValueError(f"is_prefill must be True, False or None, got {is_prefill!r}")
    for name, hint in (("prompt_tiles", prompt_tiles), ("whole_tiles", whole_tiles)):
        if hint not in (None, "none", "some", "all"):
            raise ValueError(f"{name} must be None, 'none', 'some' or 'all', got {hint!r}")
    if tokens_per_slot not in (None, *TOKENS_PER_SLOT):
        raise ValueError(
            f"tokens_per_slot must be None or one of {TOKENS_PER_SLOT}, got {tokens_per_slot!r}"
        )
    if isinstance(token_lora_indices, np.ndarray) and np.issubdtype(
        token_lora_indices.dtype, np.integer
    ):
        # Host indices are cleaned on the host, in 64 bits: an unsigned dtype or a value
        # past int32 can neither fail the -1 test nor wrap into a valid slot on the device.
        host_idx = token_lora_indices.astype(np.int64)
        valid = (host_idx >= 0) & (host_idx < max_loras)
        token_lora_indices = np.where(valid, host_idx, -1).astype(np.int32)
    if host_hints is None:
        from lora_jax import ops

        host_hints = ops.resolve_backend() != "xla"
    on_host = isinstance(token_lora_indices, np.ndarray) and host_hints
    if on_host and tokens_per_slot is None:
        tokens_per_slot = host_tokens_per_slot(token_lora_indices, max_loras)
    single_slot = _single_slot(token_lora_indices, max_loras, single_slot)
    host = on_host and prompt_tiles is None
    idx = jnp.asarray(token_lora_indices)
    if idx.ndim != 1:
        raise ValueError(f"token_lora_indices must be 1-D [T], got shape {idx.shape}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"token_lora_indices must be integers, got {idx.dtype}")
    prompts = _prompt_tiles(token_lora_indices, max_loras) if host else prompt_tiles
    whole = whole_tiles
    if on_host and whole is None:
        whole = _prompt_tiles(token_lora_indices, max_loras, whole=True)
    if is_prefill is False:
        prompts = whole = "none"
    if prompts == "none":  # a tile wholly of one slot is a prompt tile
        whole = "none"
    seq = None if seq_lora_indices is None else clean_slots(seq_lora_indices, max_loras)
    return LoRAMapping(
        **_device_metadata(idx, int(max_loras), segments=prompts != "none" and _segments_run()),
        seq_lora_indices=seq,
        is_prefill=is_prefill,
        prompt_tiles=prompts,
        tokens_per_slot=tokens_per_slot,
        whole_tiles=whole,
        single_slot=single_slot,
    )


def _single_slot(indices, max_loras: int, said: bool | None) -> bool | None:
    """`LoRAMapping.single_slot` as the caller said it, checked against concrete indices
    (numpy, or a jax array outside a trace)."""
    if said is not None and not isinstance(said, bool):
        raise ValueError(f"single_slot must be True, False or None, got {said!r}")
    if not said:
        return said
    try:
        idx = np.asarray(indices).reshape(-1)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return said  # under a trace the caller's word is taken
    used = np.unique(idx[(idx >= 0) & (idx < max_loras)])
    if used.size > 1:
        raise ValueError(
            f"single_slot=True, but the tokens map to {used.size} slots "
            f"({used[:8].tolist()}{' ...' if used.size > 8 else ''}); it needs one."
        )
    return said


FEW_TOKENS_PER_SLOT = 16
"""The `TOKENS_PER_SLOT` bucket of more than two and at most 16 mapped tokens per active
slot (the kernels' `tuning.FEW_TOKENS_PER_SLOT`), found for more than
``FEW_MIN_TOKENS - 1`` tokens only."""
FEW_MIN_TOKENS = 257
"""Fewer tokens (a decode step) report 3-16 tokens a slot as 0: only prompt-sized expands
read the bucket (the kernels' decode tiles stop at 256 tokens), and a decode program
compiled for it would be the same kernels compiled again."""
TOKENS_PER_SLOT = (0, 1, 2, FEW_TOKENS_PER_SLOT, 64)
"""`LoRAMapping.tokens_per_slot` buckets: 1 every mapped token's slot is its own, 2 at
most two mapped tokens per active slot on average, 16 more than two and at most 16 (from
`FEW_MIN_TOKENS` tokens), 64 at least 64 on average, 0 between (or nothing mapped)."""


def host_tokens_per_slot(token_lora_indices, max_loras: int) -> int:
    """On the host (numpy): the `TOKENS_PER_SLOT` bucket of mapped tokens per active slot.

    Example:
        >>> host_tokens_per_slot(np.array([3, 1, -1, 2]), 4)
        1
        >>> host_tokens_per_slot(np.array([0, 0, 1]), 4)  # 1.5 tokens per active slot
        2
        >>> host_tokens_per_slot(np.repeat([0, 1, 2], 100), 64)  # 100 per active slot
        64
        >>> host_tokens_per_slot(np.arange(300) % 30, 64)  # 10 per active slot, a prompt
        16
        >>> host_tokens_per_slot(np.arange(30) % 3, 64)  # 10 per active slot, a decode step
        0
        >>> host_tokens_per_slot(np.repeat([0, 1, 2], 100), 4)  # 100 per active slot
        64
    """
    idx = np.asarray(token_lora_indices).reshape(-1)
    mapped = idx[(idx >= 0) & (idx < max_loras)]
    if mapped.size == 0:
        return 0
    per = mapped.size / np.unique(mapped).size
    if per >= 64:
        return 64
    if per > FEW_TOKENS_PER_SLOT or (per > 2 and idx.size < FEW_MIN_TOKENS):
        return 0
    return 1 if per <= 1 else 2 if per <= 2 else FEW_TOKENS_PER_SLOT


@functools.partial(jax.jit, static_argnames=("max_loras", "segments"))
def _device_metadata(idx: jax.Array, max_loras: int, *, segments: bool) -> dict:
    """The mapping's arrays, in one jitted call: an eager caller (a server loop that
    builds each step's mapping outside its model's jit) pays one dispatch, not one per op;
    under an outer jit it is inlined."""
    idx = unshard(idx)  # the sort below needs it replicated
    # range check in the input's own dtype: a 64-bit id must not wrap into a slot
    idx = jnp.where((idx >= 0) & (idx < max_loras), idx, -1).astype(jnp.int32)
    # -1 sorts after every slot; argsort is stable so tokens keep their order per slot.
    key = jnp.where(idx < 0, max_loras, idx)
    sorted_ids = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.zeros((max_loras + 1,), jnp.int32).at[key].add(1)[:max_loras]
    starts = (jnp.cumsum(counts) - counts).astype(jnp.int32)
    is_active = counts > 0
    # Active slots first in ascending order: sort by (inactive, slot).
    order = jnp.argsort(jnp.where(is_active, 0, 1) * max_loras + jnp.arange(max_loras), stable=True)
    return dict(
        token_lora_indices=idx,
        sorted_token_ids=sorted_ids,
        slot_token_counts=counts,
        slot_token_starts=starts,
        active_slots=jnp.where(is_active[order], order, -1).astype(jnp.int32),
        num_active=jnp.sum(is_active).astype(jnp.int32),
        work_lists=_work_lists(counts, starts, sorted_ids, idx, segments=segments),
    )


PROMPT_TILE_TOKENS = 128
"""Tokens per prompt tile at most (`lora_jax.kernels` work_list.segment_block_m: 64 up to
4096 tokens, 128 past): a multiple of every tile size."""
PROMPT_ROWS_MIN_TOKENS = 32
"""Rows of one slot each, laid end to end, whose length is a power of two of at least this
put every mapped token in a prompt tile: an aligned tile of 64 or 128 tokens then holds
at most 4 runs (`lora_jax.kernels` work_list.SEGMENT_BLOCK_M / SEGMENT_MAX_PIECES)."""


def _prompt_tiles(token_lora_indices: np.ndarray, max_loras: int, whole=False) -> str | None:
    """`work_list.prompt_tiles` (``whole``: `work_list.whole_tiles`) of host indices
    (None without the kernels package)."""
    try:
        from lora_jax.kernels.shrink_expand.work_list import prompt_tiles, whole_tiles
    except ImportError:  # pragma: no cover - only when the kernels package is absent
        return None
    idx = np.asarray(token_lora_indices)
    idx = np.where((idx >= 0) & (idx < max_loras), idx, -1)
    return whole_tiles(idx) if whole else prompt_tiles(idx)


def _segments_run() -> bool:
    """Whether the prompt tiles' schedule has a kernel to feed (a Hopper GPU): eager
    callers elsewhere would pay for building it."""
    try:
        from lora_jax.kernels.shrink_expand.mosaic_gpu_shrink import available
    except ImportError:  # pragma: no cover - only when the kernels package is absent
        return False
    return available()


def _work_lists(counts, starts, sorted_ids, idx, *, segments: bool):
    """The kernels' work lists, built once per step (unused ones vanish under jit);
    the prompt tiles' schedule only if ``segments``."""
    try:
        from lora_jax.kernels.shrink_expand.work_list import build_work_lists
    except ImportError:  # pragma: no cover - only when the kernels package is absent
        return None
    return build_work_lists(counts, starts, sorted_ids, idx if segments else None)
