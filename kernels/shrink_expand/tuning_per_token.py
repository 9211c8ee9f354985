"""The H200 tiles of the per-token (BGMV) kernels, and when a step runs them: for decode
steps whose tokens mostly have an adapter of their own (`tuning.default_block_sizes` with
``per_token``; `api` asks `use_per_token`)."""

from __future__ import annotations

from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes, next_pow2

PER_TOKEN_SMALL_TOKENS = 16
"""Up to this many tokens, two tokens a slot also run the per-token kernels at every rank."""


def use_per_token(tokens_per_slot: int | None, rank: int, num_tokens: int) -> bool:
    """Whether a step whose host found ``tokens_per_slot`` (`LoRAMapping.tokens_per_slot`:
    1 a slot per mapped token, 2 at most two a slot on average, 16 at most 16, 64 at least
    64, 0 between 16 and 64, None not known)
    runs the per-token kernels. H200, session 18 (benchmarks/RESULTS.md, shrink / expand
    µs, per-token vs segment): a token a slot wins at every rank and size measured (T = 1,
    R = 64: 1.6 / 1.5 vs 2.2 / 2.1; T = 64, R = 64: 10.9 / 11.0 vs 11.2 / 12.7); two a slot
    at rank 16 (T = 128: 5.6 / 5.6 vs 5.9 / 7.3) and at 16 tokens (R = 128: 4.9 / 5.2 vs
    5.8 / 6.7), not at rank 64 from 64 tokens (8.4 / 8.6 vs 7.3 / 8.4)."""
    if tokens_per_slot == 1:
        return True
    small = max(16, next_pow2(rank)) <= 16 or num_tokens <= PER_TOKEN_SMALL_TOKENS
    return tokens_per_slot == 2 and small


PER_TOKEN_K = 128
"""Hidden columns per per-token shrink program: one k step each, so every program has its
whole tile of A in flight at once."""


def per_token_default(op: str, hidden: int, rank_p: int) -> BlockSizes:
    """Per-token (BGMV) tiles. H200, session 18 (benchmarks/RESULTS.md), T = 64 with 64
    adapters (a token each), µs against the segment default: shrink [64-row rank blocks,
    128-column k ranges, 4 warps] R = 16 / 64 / 128 4.2 / 11.0 / 18.8 vs 5.9 / 11.3 / 19.5;
    expand [128 columns at rank 16, 64 above] 4.4 / 11.0 / 19.4 vs 7.0 / 12.8 / 21.0."""
    if op == "shrink":
        return BlockSizes(
            per_token=True,
            block_r=min(rank_p, 64),
            block_k=PER_TOKEN_K,
            split_k=max(1, hidden // PER_TOKEN_K),
            num_stages=1,
        )
    return BlockSizes(per_token=True, block_n=128 if rank_p <= 32 else 64, num_stages=1)
