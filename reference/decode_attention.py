"""Decode attention over a paged KV cache: a few new tokens of each sequence attend to its whole cache.

Q: [B, H, Sq, D], Sq = 1..8 new tokens per sequence (1 for plain decode, more for speculative decoding's
drafts), float16 or bfloat16. The cache is paged, as vLLM and FlashInfer keep it:

    k_cache, v_cache  [num_pages, page_size, H_kv, D]   the keys and values of every sequence, page by page
    block_table       [B, max_pages] int32             the pages of sequence b, in order
    seq_lens          [B] int32                        tokens in sequence b's cache, the Sq new ones included

Token t of sequence b lies in page block_table[b, t // page_size], slot t % page_size. The Sq new tokens'
keys and values are already in the cache, at positions seq_lens[b] - Sq .. seq_lens[b] - 1, so a sequence
holds at least Sq tokens (seq_lens[b] == Sq is the shortest). The entries of block_table past a sequence's
last page are -1 (no page), and the slots of its last page past its length hold stale values: neither may be
read. Any page_size >= 1 (the cases use 1, 16 and 64; the benchmarks 64).

Causal among the new tokens: new token i (0-based) sits at position seq_lens[b] - Sq + i and sees keys
0 .. that position (bottom-right aligned, as a decoder sees its cache). GQA as in reference/attention.py:
query head h reads KV head h // (H / H_kv). O: [B, H, Sq, D] in Q's dtype, LSE: [B, H, Sq] float32
(natural log), as the attention problem has them; scale 1/√D.

A shape: B, H, Hkv, Sq, S (the longest sequence), D, page_size, and "ragged": the lengths drawn between Sq
and S (seq_lens_of, from the shape alone, so that the work is known without inputs; sequence 0 has S
tokens, and the last has Sq), else every sequence S long. The pages are handed out in a shuffled order
(a seeded permutation), so that no sequence's pages are contiguous.

Baselines: SDPA (each backend this GPU runs) on the cache gathered beforehand into contiguous
[B, H_kv, S, D] tensors, with a boolean mask where lengths differ or Sq > 1: what a server with a
contiguous cache runs, the gather not timed (the fastest of these is the reference); "paged <backend>",
PyTorch on the same paged cache: each sequence's pages gathered by the block table (one index a cache),
then that SDPA backend, timed whole; "naive", the gather and attention in plain PyTorch, timed whole.
FlexAttention over the page table is left out: it needs a paged block mask and its own page-table
conversion (torch's experimental PagedAttention), and on a contiguous cache its decoding reached 2-54% of
the memory bandwidth where SDPA's reached 65-90% (H200, 2026-11-28).

Work: 4·D flops for each (query, key) pair a row sees. Fewest bytes: K and V of every sequence's tokens
read once (H_kv heads), Q read and O and the LSE written once, the block table's used entries and the
lengths: decode is bandwidth-bound, its grade read in % of the memory bandwidth.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from reference.attention import AttentionProblem, sdpa_backends
from reference.problem import Case

MAX_NEW_TOKENS = 8


def _case(index, B, H, Hkv, Sq, S, D, page_size, dtype, input_scale=1.0, ragged=False, base_seed=0) -> Case:
    shape = dict(B=B, H=H, Hkv=Hkv, Sq=Sq, S=S, D=D, page_size=page_size, ragged=ragged)
    scaled = f" x{input_scale:g}" if input_scale != 1 else ""
    name = f"{DecodeAttentionProblem.shape_label(shape)} {'fp16' if dtype == 'float16' else 'bf16'}{scaled}"
    return Case(name, shape, dtype, input_scale, base_seed * 1000 + index)


# (B, H, Hkv, Sq, S, D, page_size, dtype, input scale, ragged): one-token sequences, lengths no page or tile
# divides, Sq > 1 (causal among the new tokens), seq_len == Sq, pages of 1, 16 and 64 tokens, GQA 8:1, 4:1,
# MQA and MHA, large scores, long sequences (many splits), and B·H beyond 65,535 (a grid's y or z).
_CASES = [
    (1, 1, 1, 1, 1, 64, 16, "float16", 1), (2, 32, 4, 1, 1, 128, 64, "bfloat16", 1),
    (3, 4, 4, 1, 100, 64, 16, "float16", 1, True), (4, 32, 4, 1, 1000, 128, 16, "bfloat16", 1, True),
    (2, 8, 1, 4, 333, 64, 64, "float16", 1, True), (3, 32, 8, 8, 777, 128, 64, "bfloat16", 1, True),
    (2, 16, 2, 1, 4097, 128, 64, "float16", 1), (1, 8, 8, 3, 3, 64, 16, "bfloat16", 1),
    (2, 32, 4, 2, 2500, 64, 16, "float16", 10, True), (2, 8, 2, 1, 1023, 128, 64, "bfloat16", 10),
    (2100, 32, 8, 1, 40, 64, 16, "float16", 1, True), (1, 32, 8, 1, 20000, 128, 64, "bfloat16", 1),
    (5, 4, 2, 5, 200, 128, 16, "float16", 1, True), (16, 32, 8, 1, 9000, 64, 64, "float16", 1, True),
    (3, 2, 1, 7, 50, 128, 1, "bfloat16", 1, True), (2, 32, 1, 8, 130, 64, 16, "float16", 10, True),
]

# Batch decode, one new token a sequence, Llama-3-8B's heads (32 over 8 KV heads), pages of 64 tokens.
_BENCHMARKS = [
    dict(B=64, H=32, Hkv=8, Sq=1, S=4096, D=128, page_size=64, ragged=False),
    dict(B=16, H=32, Hkv=8, Sq=1, S=16384, D=128, page_size=64, ragged=False),
    dict(B=1, H=32, Hkv=8, Sq=1, S=65536, D=128, page_size=64, ragged=False),
    dict(B=32, H=32, Hkv=8, Sq=1, S=2048, D=64, page_size=64, ragged=False),
]


def seq_lens_of(shape: dict) -> list[int]:
    """Each sequence's length, from the shape alone: S each, or with "ragged" spread over Sq .. S (sequence 0
    S long, the last Sq long where B > 1, the others at a fixed stride of the range, a multiple of no page)."""
    B, Sq, S = shape["B"], shape["Sq"], shape["S"]
    if not 1 <= Sq <= MAX_NEW_TOKENS:
        raise ValueError(f"Sq = {Sq}: a step appends 1 to {MAX_NEW_TOKENS} new tokens")
    if S < Sq:
        raise ValueError(f"S = {S} holds fewer than the Sq = {Sq} new tokens")
    if not shape.get("ragged") or B == 1:
        return [S] * B
    span = S - Sq + 1
    lens = [Sq + (S - Sq - (b * 7919) % span) % span for b in range(B)]
    lens[0], lens[-1] = S, Sq
    return lens


def pages_of(length: int, page_size: int) -> int:
    return -(-length // page_size)


class DecodeAttentionProblem(AttentionProblem):
    """The attention problem's outputs (O like Q, the LSE), head dimensions and check, over a paged cache:
    its own cases, shapes, inputs, launch, reference and baselines."""
    name = "decode_attention"
    parameters = {"D": AttentionProblem.parameters["D"]}  # the causal rule among the new tokens is not compiled in

    def parameter_values(self, inputs: dict) -> dict:
        return {"D": inputs["q"].shape[-1]}

    # ---- cases and shapes -------------------------------------------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return [_case(i, *c, base_seed=seed) for i, c in enumerate(_CASES)]

    def benchmarks(self) -> list[dict]:
        return [dict(shape, dtype="float16") for shape in _BENCHMARKS]

    @staticmethod
    def shape_label(shape: dict) -> str:
        grouped = f" Hkv{shape['Hkv']}" if shape["Hkv"] != shape["H"] else ""
        ragged = " ragged" if shape.get("ragged") else ""
        return (f"B{shape['B']} H{shape['H']}{grouped} Sq{shape['Sq']} S{shape['S']}{ragged} D{shape['D']} "
                f"page{shape['page_size']}")

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        return random_inputs(shape, dtype, torch.Generator(device=device).manual_seed(seed), input_scale)

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        stage.launch(kernels, inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_table"],
                     inputs["seq_lens"], outputs["o"], outputs["lse"], inputs["scale"], inputs["max_len"])

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        k, v, visible = gathered(inputs, torch.float64)
        return attention_over(inputs["q"].to(torch.float64), k, v, visible, inputs["scale"])

    def library_output(self, inputs: dict) -> dict:
        """SDPA in the inputs' dtype on the gathered cache: what the tolerance rule measures against."""
        k, v, visible = gathered(inputs)
        return dict(o=sdpa_over(inputs["q"], k, v, visible, inputs["scale"]))

    # ---- baselines timed beside the kernel -------------------------------------------------------
    def baselines(self, inputs: dict) -> dict:
        """Each SDPA backend this GPU runs on the cache gathered beforehand (not timed), the same after
        gathering the pages (timed), and naive PyTorch (the gather timed too); name -> callable."""
        k, v, visible = gathered(inputs)
        mask = None if bool(visible.all()) else visible
        paged_masked = mask is not None or inputs["block_table"].shape[1] * inputs["k_cache"].shape[1] != k.shape[2]
        found = {}
        for name, backend in sdpa_backends().items():
            ways = {name: (lambda b=backend: sdpa_over(inputs["q"], k, v, mask, inputs["scale"], b)),
                    f"paged {name}": (lambda b=backend: paged_sdpa(inputs, paged_masked, b))}
            for way, run in ways.items():
                try:
                    run()
                except RuntimeError:  # this backend does not support these inputs or this GPU
                    continue
                found[way] = run
        found["naive"] = lambda: naive_decode(inputs)
        return found

    # ---- work -----------------------------------------------------------------------------
    @staticmethod
    def flops(shape: dict) -> float:
        return 4.0 * shape["H"] * shape["D"] * sum(visible_pairs(n, shape["Sq"]) for n in seq_lens_of(shape))

    @staticmethod
    def min_bytes(shape: dict, element_bytes: int = 2) -> float:
        B, H, Hkv, Sq, D = (shape[k] for k in ("B", "H", "Hkv", "Sq", "D"))
        lens = seq_lens_of(shape)
        cache = 2 * sum(lens) * Hkv * D * element_bytes
        table = 4 * (sum(pages_of(n, shape["page_size"]) for n in lens) + B)
        return cache + table + B * H * Sq * (2 * D * element_bytes + 4)


def visible_pairs(length: int, new_tokens: int) -> int:
    """(query, key) pairs the new tokens of a sequence of `length` see: token i sees length - Sq + i + 1 keys."""
    return sum(length - new_tokens + i + 1 for i in range(new_tokens))


def random_inputs(shape: dict, dtype: str, gen: torch.Generator, input_scale: float = 1.0) -> dict:
    """Q, then the K and V caches, drawn from `gen` (on its device); the pages handed out in a seeded shuffled
    order, one spare page never listed; the scale and the longest length."""
    B, H, Hkv, Sq, D, page_size = (shape[k] for k in ("B", "H", "Hkv", "Sq", "D", "page_size"))
    if H % Hkv:
        raise ValueError(f"H = {H} is not a multiple of H_kv = {Hkv}")
    device, elem = gen.device, getattr(torch, dtype)
    lens = seq_lens_of(shape)
    needed = [pages_of(n, page_size) for n in lens]
    num_pages = sum(needed) + 1

    def rand(*size):
        return (torch.randn(*size, generator=gen, device=device) * input_scale).to(elem)

    q = rand(B, H, Sq, D)
    k_cache, v_cache = rand(num_pages, page_size, Hkv, D), rand(num_pages, page_size, Hkv, D)
    order = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    block_table = torch.full((B, max(needed)), -1, dtype=torch.int32, device=device)
    first = 0
    for b, n in enumerate(needed):
        block_table[b, :n] = order[first:first + n]
        first += n
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), scale=1.0 / math.sqrt(D),
                max_len=max(lens))


def gathered(inputs: dict, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V of every sequence gathered from their pages into contiguous [B, H_kv, S, D] (S the longest
    length; the slots past a sequence's end are zeros), and visible [B, 1, Sq, S]: key j is seen by new
    token i of sequence b where j <= seq_lens[b] - Sq + i."""
    q, block_table, seq_lens = inputs["q"], inputs["block_table"].long(), inputs["seq_lens"].long()
    B, _, Sq, D = q.shape
    page_size, Hkv = inputs["k_cache"].shape[1], inputs["k_cache"].shape[2]
    S = inputs["max_len"]
    j = torch.arange(S, device=q.device)
    page = block_table.gather(1, (j // page_size).expand(B, S).clamp(max=block_table.shape[1] - 1))
    in_sequence = j[None, :] < seq_lens[:, None]                               # [B, S]
    rows = (page.clamp(min=0) * page_size + j % page_size).where(in_sequence, 0)  # a row of [pages·page_size, ...]

    def gather(cache):
        flat = cache.reshape(-1, Hkv, D)
        out = flat[rows.reshape(-1)].reshape(B, S, Hkv, D)
        out = out.masked_fill(~in_sequence[:, :, None, None], 0)
        return out.transpose(1, 2).contiguous().to(dtype or cache.dtype)

    return gather(inputs["k_cache"]), gather(inputs["v_cache"]), visible_keys(seq_lens, Sq, S)


def visible_keys(seq_lens: torch.Tensor, new_tokens: int, keys: int) -> torch.Tensor:
    """Boolean [B, 1, Sq, keys]: key j is seen by new token i of sequence b where j <= seq_lens[b] - Sq + i."""
    position = seq_lens[:, None] - new_tokens + torch.arange(new_tokens, device=seq_lens.device)[None, :]  # [B, Sq]
    return (torch.arange(keys, device=seq_lens.device)[None, None, :] <= position[:, :, None])[:, None]


def attention_over(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> dict:
    """O and the LSE of q [B, H, Sq, D] over k, v [B, H_kv, S, D] where visible [B, 1, Sq, S] says, in q's dtype."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return dict(o=torch.exp(scores - lse[..., None]) @ v, lse=lse)


def sdpa_over(q, k, v, visible, scale, backend=None) -> torch.Tensor:
    context = contextlib.nullcontext()
    if backend is not None:
        from torch.nn.attention import sdpa_kernel
        context = sdpa_kernel(backend)
    with context:
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, **gqa)


def paged_sdpa(inputs: dict, masked: bool, backend=None) -> torch.Tensor:
    """PyTorch's way on a paged cache: K and V of every sequence's pages gathered by the block table into
    [B, H_kv, max_pages·page_size, D] views (one index a cache; a -1 entry reads page 0, masked), then SDPA,
    `masked` where a sequence ends before its last page does or Sq > 1."""
    q = inputs["q"]
    table = inputs["block_table"].clamp(min=0)
    k, v = (cache[table].flatten(1, 2).transpose(1, 2) for cache in (inputs["k_cache"], inputs["v_cache"]))
    mask = visible_keys(inputs["seq_lens"], q.shape[2], k.shape[2]) if masked else None
    return sdpa_over(q, k, v, mask, inputs["scale"], backend)


def naive_decode(inputs: dict) -> torch.Tensor:
    """Plain PyTorch as model code writes it: the pages gathered, K and V repeated to H heads, matmul,
    softmax in float32, matmul."""
    k, v, visible = gathered(inputs)
    q = inputs["q"]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * inputs["scale"]
    scores.masked_fill_(~visible, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).type_as(q) @ v


PROBLEM = DecodeAttentionProblem()
