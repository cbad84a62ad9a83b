"""Block-sparse attention: attention over the (query, key) pairs a block mask and an element mask leave visible.

Q: [B, H, S, D], K and V: [B, H_kv, S, D] (GQA as in reference/attention.py: query head h with KV head
h // (H / H_kv)), float16 or bfloat16; O: [B, H, S, D], LSE: [B, H, S] float32 (natural log); scale 1/√D.

The mask, at blocks of BLOCK = 128 tokens (the last block of a length no block divides is shorter), in the
layout of FlexAttention's BlockMask (torch.nn.attention.flex_attention), one mask for every batch and head
(leading dimensions [1, 1], as create_block_mask(B=None, H=None) makes them), all int32:

    kv_num_blocks [1, 1, Qb], kv_indices [1, 1, Qb, KVb]            partial blocks of each query block
    full_kv_num_blocks [1, 1, Qb], full_kv_indices [1, 1, Qb, KVb]  full blocks of each query block

query block m sees the first kv_num_blocks[m] entries of kv_indices[m] (partial) and the first
full_kv_num_blocks[m] of full_kv_indices[m] (full); the rest of each row is padding (the unlisted blocks,
ascending, as FlexAttention orders it). Every pair of a full block is visible; in a partial block, the pairs
the element mask allows, one of ELEMENT_MASKS, with i the query's token and j the key's (the masks made
from an element mask list a block cut by S as partial, as create_block_mask does; pairs past S never exist):

    "none"            none: a mask of this kind lists full blocks only (the neighbourhood graph)
    "causal"          j <= i
    "document"        j <= i within a document: document_ids[i] == document_ids[j] (ids ascending, per token)
    "sliding_window"  0 <= i - j < window

which is what compiled FlexAttention computes with this BlockMask and the element mask as mask_mod (absent
blocks skipped, full blocks unmasked, mask_mod in partial blocks only). Its unfused eager path consults
mask_mod alone, over every pair: there the mask_mod must hold the blocks too.

A query row that sees no key outputs O = 0 and LSE = -inf, as FlexAttention does: its math implementation
(torch/_higher_order_ops/flex_attention.py, math_attention: "Set fully masked rows' sumexp to 0.0") sets
the logsumexp of a fully masked row to -inf and its softmax to 0 (torch._safe_softmax).

The masks of a shape ("mask": "graph", "causal", "document" or "sliding_window") are built from the shape
alone (block_masks), so that its work can be counted without inputs; "empty_query_blocks" lists query
blocks whose lists are emptied (their rows see no key). The neighbourhood graph, a
science workload (atoms in groups of 128, each group attending to its neighbourhood): the query blocks on a
ring, each sees the blocks within ring distance "neighbours" (itself included) and "long_range" others
drawn from a seeded generator ("graph_seed"), all full blocks.

Work: 4·D flops for each pair of a visible block, partial blocks counted whole (a kernel computes the whole
tile and masks it), blocks cut by S counted as the pairs they hold. Fewest bytes: Q of the query blocks that
see a key, K and V of the key blocks some list holds (H_kv heads), O and the LSE of every row (a row that
sees nothing is written too), the lists' used entries and counts, and the document ids where the mask has them.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from reference import tolerance
from reference.attention import LSE_RTOL, AttentionProblem, kv_group, kv_heads, random_inputs
from reference.problem import Case, Problem

BLOCK = 128  # the block mask's block size, queries and keys
ELEMENT_MASKS = ("none", "causal", "document", "sliding_window")
ELEMENT_MASK_OF = {"graph": "none", "causal": "causal", "document": "document", "sliding_window": "sliding_window"}
LAYOUT = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
# SDPA's dense boolean mask is S² bytes (1 GiB at 32K tokens) and its backends copy it to an additive mask
# of the dtype: above this length (the graph's 100K: 10 GiB of mask) it is not timed.
SDPA_MAX_TOKENS = 32768


# ---- the masks of a shape -------------------------------------------------------------------------
def block_bounds(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first token of each block and one past its last (the last block cut at seq_len)."""
    starts = torch.arange(0, seq_len, BLOCK)
    return starts, (starts + BLOCK).clamp(max=seq_len)


def neighbourhood_graph(blocks: int, neighbours: int, long_range: int, seed: int) -> torch.Tensor:
    """[blocks, blocks] bool: block m sees the blocks within ring distance `neighbours` of m (m included) and
    `long_range` of the others, drawn uniformly for each m by a CPU generator seeded with `seed`."""
    index = torch.arange(blocks)
    distance = (index[:, None] - index[None, :]).abs()
    near = torch.minimum(distance, blocks - distance) <= neighbours
    draws = torch.rand(blocks, blocks, generator=torch.Generator().manual_seed(seed)).masked_fill(near, -1.0)
    far_count = int((~near).sum(dim=1).min())
    chosen = draws.topk(min(long_range, far_count), dim=1).indices
    return near.scatter(1, chosen, True)


def document_ids(lengths: list[int]) -> torch.Tensor:
    """[sum(lengths)] int32: each token's document, 0, 1, ... in order."""
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))


def packed_document_lengths(total: int, shortest: int, longest: int, seed: int) -> list[int]:
    """Document lengths drawn uniformly in [shortest, longest] (longest >= 2·shortest) summing to total: each
    draw leaves at least `shortest` tokens, and the last document takes what is left."""
    gen, lengths, remaining = torch.Generator().manual_seed(seed), [], total
    while remaining > longest:
        length = int(torch.randint(shortest, min(longest, remaining - shortest) + 1, (), generator=gen))
        lengths.append(length)
        remaining -= length
    return lengths + [remaining]


def element_visible(i, j, element_mask: str, window: int, ids: torch.Tensor) -> torch.Tensor:
    """Whether query token i sees key token j inside a partial block (i, j: tensors that broadcast); also a
    FlexAttention mask_mod's body."""
    if element_mask == "none":
        return torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)
    visible = j <= i
    if element_mask == "sliding_window":
        visible = visible & (i - j < window)
    if element_mask == "document":
        visible = visible & (ids[i] == ids[j])
    return visible


def element_blocks(seq_len: int, element_mask: str, window: int, ids: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """[Qb, KVb] bool twice: the block pairs holding a visible pair, and those whose pairs all are, from each
    tile's bounds (i - j takes every value between its tile's least and greatest; ids ascend). A tile cut by
    S is never full, as in create_block_mask (which pads S to whole blocks with hidden pairs)."""
    starts, ends = block_bounds(seq_len)
    whole = ends - starts == BLOCK  # not cut by S
    first, last = starts, ends - 1
    least, greatest = first[:, None] - last[None, :], last[:, None] - first[None, :]  # of i - j over a tile
    upper = window - 1 if element_mask == "sliding_window" else seq_len               # i - j <= upper
    some_in_band, all_in_band = (greatest >= 0) & (least <= upper), (least >= 0) & (greatest <= upper)
    id_first, id_last = ids[first].long(), ids[last].long()
    # the tiles' document ranges overlap, or both are one and the same document
    shared_document = (torch.maximum(id_first[:, None], id_first[None, :])
                       <= torch.minimum(id_last[:, None], id_last[None, :]))
    single = (id_first == id_last) & whole
    one_document = single[:, None] & single[None, :] & (id_first[:, None] == id_first[None, :])
    return some_in_band & shared_document, all_in_band & one_document


def mask_parameters(shape: dict) -> tuple[str, int, torch.Tensor]:
    """The element mask of a shape: its kind, its window (0 where it has none) and each token's document
    (all 0 where it has none)."""
    element_mask = ELEMENT_MASK_OF[shape["mask"]]
    if element_mask == "document":
        ids = document_ids(shape["documents"])
        if len(ids) != shape["S"]:
            raise ValueError(f"the documents hold {len(ids)} tokens, not S = {shape['S']}")
    else:
        ids = torch.zeros(shape["S"], dtype=torch.int32)
    return element_mask, shape.get("window", 0), ids


def block_masks(shape: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """[Qb, KVb] bool twice, on the CPU: the partial blocks and the full blocks of the shape's mask."""
    blocks = len(block_bounds(shape["S"])[0])
    if shape["mask"] == "graph":
        full = neighbourhood_graph(blocks, shape["neighbours"], shape["long_range"], shape["graph_seed"])
        partial = torch.zeros_like(full)
    else:
        some, every = element_blocks(shape["S"], *mask_parameters(shape))
        partial, full = some & ~every, every
    empty = torch.tensor(shape.get("empty_query_blocks", []), dtype=torch.long)
    return partial.index_fill(0, empty, False), full.index_fill(0, empty, False)


# ---- the layout: FlexAttention's index lists, and its BlockMask -----------------------------------
def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[Qb, KVb] bool -> counts [1, 1, Qb] and indices [1, 1, Qb, KVb], int32: each row's listed blocks
    ascending, then the others ascending (FlexAttention's own order: a stable descending argsort)."""
    indices = torch.argsort(blocks.int(), dim=-1, descending=True, stable=True)
    return blocks.sum(dim=-1, dtype=torch.int32)[None, None], indices.int()[None, None]


def listed(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """counts [1, 1, Qb] and indices [1, 1, Qb, KVb] -> [Qb, KVb] bool: the blocks each row's first `count`
    entries name (the padding after them ignored)."""
    counts, indices = counts[0, 0].long(), indices[0, 0].long()
    used = torch.arange(indices.shape[-1], device=indices.device)[None, :] < counts[:, None]
    rows = torch.arange(indices.shape[0], device=indices.device)[:, None].expand_as(indices)
    blocks = torch.zeros(indices.shape, dtype=torch.bool, device=indices.device)
    blocks[rows[used], indices[used]] = True  # padding may repeat an index (any value): only used entries count
    return blocks


def block_layout(partial: torch.Tensor, full: torch.Tensor) -> dict:
    """The layout of the module docstring (LAYOUT's four tensors) of [Qb, KVb] partial and full blocks."""
    return dict(zip(LAYOUT, (*ordered(partial), *ordered(full))))


def to_block_mask(layout: dict, seq_len: int, mask_mod=None):
    """FlexAttention's BlockMask of a layout, on its device, for S = seq_len; mask_mod is applied in partial
    blocks (FlexAttention's default, none, where it is None)."""
    from torch.nn.attention.flex_attention import BlockMask
    return BlockMask.from_kv_blocks(*(layout[n] for n in LAYOUT), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(seq_len, seq_len))


def from_block_mask(block_mask) -> dict:
    """The layout of a FlexAttention BlockMask, its padding in the order of `ordered`: one mask for every
    batch and head (leading dimensions [1, 1]), blocks of BLOCK, full blocks apart (create_block_mask's
    default) and S the same for queries and keys."""
    counts = block_mask.kv_num_blocks
    if tuple(counts.shape[:2]) != (1, 1):
        raise ValueError(f"a mask per batch or head ({tuple(counts.shape[:2])}) is not supported: one for all, [1, 1]")
    if tuple(block_mask.BLOCK_SIZE) != (BLOCK, BLOCK):
        raise ValueError(f"blocks of {tuple(block_mask.BLOCK_SIZE)}, not of {BLOCK}")
    if block_mask.full_kv_num_blocks is None:
        raise ValueError("the mask has no full blocks apart: make it with separate_full_blocks=True")
    if block_mask.seq_lengths[0] != block_mask.seq_lengths[1]:
        raise ValueError(f"query and key lengths differ: {block_mask.seq_lengths}")
    return block_layout(listed(counts, block_mask.kv_indices),
                        listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices))


def element_mask_mod(inputs: dict):
    """The inputs' element mask as a FlexAttention mask_mod (what a FlexAttention user writes)."""
    def mask_mod(b, h, i, j):
        return element_visible(i, j, inputs["element_mask"], inputs["window"], inputs["document_ids"])
    return mask_mod


def dense_visible(inputs: dict) -> torch.Tensor:
    """[S, S] bool: which key each query sees, blocks and element mask together (small S only)."""
    partial, full = (listed(inputs[c], inputs[i]) for c, i in (LAYOUT[:2], LAYOUT[2:]))
    tokens = torch.arange(inputs["q"].shape[2], device=inputs["q"].device)
    rows, cols = (tokens // BLOCK)[:, None], (tokens // BLOCK)[None, :]
    elements = element_visible(tokens[:, None], tokens[None, :], inputs["element_mask"], inputs["window"],
                               inputs["document_ids"])
    return full[rows, cols] | (partial[rows, cols] & elements)


# ---- the exact result ----------------------------------------------------------------------------
def block_tokens(blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The tokens of a list of blocks, in its order (the last block's cut at seq_len)."""
    tokens = (blocks.long()[:, None] * BLOCK + torch.arange(BLOCK, device=blocks.device)[None, :]).flatten()
    return tokens[tokens < seq_len]


def visible_keys(inputs: dict):
    """The walk over the visible pairs, one query block at a time: yields its first row and one past its
    last, the key tokens its lists name (its full blocks', then its partial blocks') and [rows, keys] bool,
    which of them each row sees."""
    seq_len, device = inputs["q"].shape[2], inputs["q"].device
    starts, ends = block_bounds(seq_len)
    for m, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        rows = torch.arange(start, end, device=device)
        full, partial = (block_tokens(inputs[i][0, 0, m, :inputs[c][0, 0, m]], seq_len)
                         for c, i in (LAYOUT[2:], LAYOUT[:2]))
        visible = torch.cat([torch.ones(len(rows), len(full), dtype=torch.bool, device=device),
                             element_visible(rows[:, None], partial[None, :], inputs["element_mask"],
                                             inputs["window"], inputs["document_ids"])], dim=1)
        yield start, end, torch.cat([full, partial]), visible


def kv_grouped(inputs: dict, names: str, dtype: torch.dtype) -> dict:
    """The named tensors in dtype, GQA made a broadcast: query-side ones [B, H, S, D] as [B, H_kv, group, S, D]
    (query head h is h // group's), K and V as [B, H_kv, 1, S, D]."""
    kv_count, group = inputs["k"].shape[1], kv_group(inputs["q"], inputs["k"])
    return {n: inputs[n].to(dtype)[:, :, None] if n in ("k", "v")
            else inputs[n].to(dtype).unflatten(1, (kv_count, group)) for n in names}


def block_weights(q_rows: torch.Tensor, k_cols: torch.Tensor, visible: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax weights of a query block over its listed keys, and each row's LSE (-inf where a row sees
    no key, whose weights are then all 0: exp(-inf - 0))."""
    scores = (scale * (q_rows @ k_cols.transpose(-1, -2))).masked_fill(~visible, float("-inf"))
    row_lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - torch.where(row_lse.isfinite(), row_lse, 0.0)[..., None]), row_lse


def blockwise_attention(inputs: dict, dtype: torch.dtype = torch.float64) -> dict:
    """O and LSE computed in dtype (float64: the exact result), one query block at a time over the key blocks
    its lists name (never S×S)."""
    t = kv_grouped(inputs, "qkv", dtype)
    o = torch.zeros_like(t["q"])
    lse = torch.full(o.shape[:-1], float("-inf"), dtype=dtype, device=o.device)
    for start, end, cols, visible in visible_keys(inputs):
        weights, lse[..., start:end] = block_weights(t["q"][..., start:end, :], t["k"][..., cols, :], visible,
                                                     inputs["scale"])
        o[..., start:end, :] = weights @ t["v"][..., cols, :]
    return dict(o=o.flatten(1, 2), lse=lse.flatten(1, 2))


# ---- the library's result and the baselines -------------------------------------------------------
def sdpa_dense_mask(inputs: dict, visible: torch.Tensor) -> torch.Tensor:
    """PyTorch's SDPA with `visible` as its boolean mask (True: attend), in the inputs' dtype."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    gqa = {"enable_gqa": True} if kv_group(q, k) > 1 else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=inputs["scale"], **gqa)


@functools.cache
def compiled_flex_attention():
    """torch.compile'd FlexAttention, in a process whose compiled backwards donate no buffers. A backward baseline
    replays one graph's backward (attention_backward.backward_run, retain_graph=True), which a backward that
    donates its saved activations' buffers refuses; donation is decided when a graph is compiled, and a graph
    compiled once is served again from torch's caches (in memory and on disk, whose keys do not record it), so
    it is turned off for the whole process, before the first compile, not around one call (which on the H100
    still met the refusal on the packed documents).

    Each shape is compiled for itself (dynamic=False), as a user with one shape gets it: by default a second
    shape makes torch.compile recompile with symbolic sizes, and the benchmark shapes after it then run
    kernels compiled for any size (on the H100 the sliding window's backward took 17.7 ms instead of 13.2
    after the packed documents)."""
    import torch._functorch.config as functorch_config
    from torch.nn.attention.flex_attention import flex_attention

    functorch_config.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_of(inputs: dict):
    """attention(tensors, **options) -> compiled FlexAttention on tensors' q, k, v with the inputs' block
    mask, the element mask as its mask_mod, and their scale, as a FlexAttention user calls it."""
    block_mask = to_block_mask(inputs, inputs["q"].shape[2], element_mask_mod(inputs))
    gqa = kv_group(inputs["q"], inputs["k"]) > 1

    def attention(tensors: dict, **options):
        return compiled_flex_attention()(tensors["q"], tensors["k"], tensors["v"], block_mask=block_mask,
                                         scale=inputs["scale"], enable_gqa=gqa, **options)
    return attention


def library_sdpa(tensors: dict, visible: torch.Tensor) -> torch.Tensor:
    """The library's O: SDPA with the dense boolean mask, and O = 0 on rows that see no key. SDPA's backends
    differ on such rows (NaN or 0, and NaN gradients), so they attend to every key here, then are zeroed:
    their gradients are then 0 too, as FlexAttention's."""
    sees_none = ~visible.any(dim=1)[:, None]
    return sdpa_dense_mask(tensors, visible | sees_none).masked_fill(sees_none, 0.0)


def library_attentions(inputs: dict) -> dict:
    """Name -> attention(tensors, **options), O on tensors' q, k, v: compiled FlexAttention with the inputs'
    BlockMask, and SDPA with the dense boolean mask up to SDPA_MAX_TOKENS; both timed on a GPU only
    (FlexAttention's compiled kernels are Triton's)."""
    found = {"flex_attention": flex_attention_of(inputs)}
    if inputs["q"].shape[2] <= SDPA_MAX_TOKENS:
        visible = dense_visible(inputs)
        found["sdpa_dense_mask"] = lambda tensors: sdpa_dense_mask(tensors, visible)
    return found


# ---- cases and benchmarks ---------------------------------------------------------------------------
# (B, H, H_kv, S, D, dtype, input scale, mask): lengths no block divides (1, 127, 300, 641, ...), a block of
# one token, query blocks that see no key (first, middle, of each kind), GQA and MQA, both dtypes, large
# scores of each kind, windows of one token and of one block, documents of one token and across blocks.
_CASES = [
    (1, 2, 2, 1, 64, "float16", 1, dict(mask="causal")),
    (2, 3, 3, 300, 64, "float16", 1, dict(mask="causal")),
    (1, 4, 2, 1000, 128, "bfloat16", 1, dict(mask="causal")),
    (1, 2, 2, 513, 64, "bfloat16", 10, dict(mask="causal")),
    (1, 2, 2, 700, 128, "float16", 1, dict(mask="causal", empty_query_blocks=[0, 3])),
    (1, 2, 2, 1000, 64, "float16", 1, dict(mask="sliding_window", window=200)),
    (2, 4, 1, 777, 128, "bfloat16", 1, dict(mask="sliding_window", window=128)),
    (1, 2, 2, 300, 64, "bfloat16", 1, dict(mask="sliding_window", window=1)),
    (1, 2, 2, 640, 64, "float16", 10, dict(mask="sliding_window", window=300, empty_query_blocks=[2])),
    (1, 4, 2, 700, 128, "bfloat16", 1, dict(mask="document", documents=[100, 37, 163, 1, 300, 99])),
    (2, 2, 2, 1000, 64, "float16", 1, dict(mask="document", documents=[512, 300, 188])),
    (1, 8, 2, 900, 64, "bfloat16", 10, dict(mask="document", documents=[129, 128, 643], empty_query_blocks=[2])),
    (1, 32, 8, 512, 128, "bfloat16", 1, dict(mask="document", documents=[200, 312])),
    (1, 2, 2, 1000, 64, "float16", 1, dict(mask="graph", neighbours=1, long_range=2, graph_seed=0)),
    (2, 4, 2, 641, 128, "bfloat16", 1, dict(mask="graph", neighbours=1, long_range=1, graph_seed=1)),
    (1, 2, 2, 1100, 64, "float16", 1, dict(mask="graph", neighbours=1, long_range=2, graph_seed=2,
                                           empty_query_blocks=[4])),
    (1, 4, 1, 1500, 128, "float16", 10, dict(mask="graph", neighbours=2, long_range=3, graph_seed=3)),
    (1, 2, 2, 127, 64, "bfloat16", 1, dict(mask="graph", neighbours=0, long_range=0, graph_seed=4)),
]

# The three benchmark shapes: the neighbourhood graph (100,000 atoms = 782 blocks, the last
# of 32; 137 ring neighbours and 19 long-range blocks: 156 of 782, 80% of block pairs absent, all full),
# packed documents (32K tokens of documents 512 to 8K long, causal inside each) and a sliding window.
_BENCHMARKS = [
    dict(B=1, H=8, S=100_000, D=64, mask="graph", neighbours=68, long_range=19, graph_seed=0, dtype="float16"),
    dict(B=1, H=32, Hkv=8, S=32768, D=128, mask="document", documents=packed_document_lengths(32768, 512, 8192, 0),
         dtype="bfloat16"),
    dict(B=1, H=32, Hkv=8, S=32768, D=128, mask="sliding_window", window=4096, dtype="float16"),
]


def _case(index, B, H, Hkv, S, D, dtype, input_scale, mask, base_seed) -> Case:
    shape = dict(B=B, H=H, S=S, D=D, **mask)
    if Hkv != H:
        shape["Hkv"] = Hkv
    scaled = f" x{input_scale:g}" if input_scale != 1 else ""
    name = f"{BlockSparseAttentionProblem.shape_label(shape)} {'fp16' if dtype == 'float16' else 'bf16'}{scaled}"
    return Case(name, shape, dtype, input_scale, base_seed * 1000 + index)


def mask_label(shape: dict) -> str:
    if shape["mask"] == "graph":
        label = f"graph ±{shape['neighbours']}+{shape['long_range']} seed{shape['graph_seed']}"
    elif shape["mask"] == "document":
        docs = shape["documents"]
        label = f"{len(docs)} documents {min(docs)}-{max(docs)}"
    elif shape["mask"] == "sliding_window":
        label = f"window {shape['window']}"
    else:
        label = shape["mask"]
    empty = shape.get("empty_query_blocks")
    return label + (f" no key in blocks {','.join(map(str, empty))}" if empty else "")


class BlockSparseAttentionProblem(Problem):
    name = "block_sparse_attention"
    outputs = ("o", "lse")
    primary_input = "q"
    # the head dimension and the element mask, which kernels take as compile-time constants
    parameters = {"D": (64, 128), "element_mask": ELEMENT_MASKS}

    # ---- cases and shapes -------------------------------------------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return [_case(i, *c, base_seed=seed) for i, c in enumerate(_CASES)]

    def benchmarks(self) -> list[dict]:
        return [dict(shape) for shape in _BENCHMARKS]

    @staticmethod
    def shape_label(shape: dict) -> str:
        grouped = f" Hkv{kv_heads(shape)}" if kv_heads(shape) != shape["H"] else ""
        return f"B{shape['B']} H{shape['H']}{grouped} S{shape['S']} D{shape['D']} {mask_label(shape)}"

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        return drawn_inputs(shape, dtype, torch.Generator(device=device).manual_seed(seed), input_scale)

    allocate_outputs = AttentionProblem.allocate_outputs  # O and the LSE, as dense attention's

    def parameter_values(self, inputs: dict) -> dict:
        return {"D": inputs["q"].shape[-1], "element_mask": inputs["element_mask"]}

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        stage.launch(kernels, inputs["q"], inputs["k"], inputs["v"], outputs["o"], outputs["lse"],
                     *(inputs[n] for n in LAYOUT), inputs["document_ids"], inputs["scale"], inputs["window"])

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        return blockwise_attention(inputs)

    def library_output(self, inputs: dict) -> dict:
        """SDPA with the dense boolean mask in the inputs' dtype (library_sdpa)."""
        return dict(o=library_sdpa(inputs, dense_visible(inputs)))

    def check(self, outputs: dict, exact: dict, library: dict) -> list[tolerance.OutputCheck]:
        return [tolerance.relative_to_library("o", outputs["o"], exact["o"], library["o"]),
                tolerance.absolute_and_relative("lse", *lse_where_finite(outputs["lse"], exact["lse"]), LSE_RTOL)]

    # ---- baselines timed beside the kernel -------------------------------------------------------
    def baselines(self, inputs: dict) -> dict:
        """Compiled FlexAttention with the same BlockMask, and SDPA with the dense boolean mask up to
        SDPA_MAX_TOKENS; both on a GPU only (FlexAttention's compiled kernels are Triton's)."""
        from torch.nn.attention.flex_attention import AuxRequest
        runs = {name: functools.partial(attention, inputs) for name, attention in library_attentions(inputs).items()}
        # FlexAttention's O and LSE, as a kernel writes both
        runs["flex_attention"] = functools.partial(runs["flex_attention"], return_aux=AuxRequest(lse=True))
        return runs

    # ---- work -----------------------------------------------------------------------------
    @staticmethod
    def flops(shape: dict) -> float:
        return 4.0 * shape["B"] * shape["H"] * shape["D"] * visible_block_pairs(shape)

    @staticmethod
    def min_bytes(shape: dict, element_bytes: int = 2) -> float:
        query_tokens, key_tokens, mask = listed_traffic(shape)
        B, H, S, D = (shape[n] for n in "BHSD")
        query_side = B * H * (query_tokens * D * element_bytes + S * (D * element_bytes + 4))  # Q read; O, LSE written
        key_side = B * kv_heads(shape) * 2 * key_tokens * D * element_bytes                   # K, V read
        return query_side + key_side + mask


def drawn_inputs(shape: dict, dtype: str, gen: torch.Generator, input_scale: float = 1.0) -> dict:
    """The inputs of a shape, Q, K and V drawn from gen (on its device), which the backward draws on from."""
    device = gen.device
    dense_shape = dict(B=shape["B"], H=shape["H"], Hkv=kv_heads(shape), Sq=shape["S"], Skv=shape["S"],
                       D=shape["D"], causal=False)
    qkv = {n: x for n, x in random_inputs(dense_shape, dtype, gen, input_scale).items() if n in "qkv"}
    element_mask, window, ids = mask_parameters(shape)
    layout = {n: x.to(device) for n, x in block_layout(*block_masks(shape)).items()}
    return dict(qkv, scale=1.0 / math.sqrt(shape["D"]), element_mask=element_mask, window=window,
                document_ids=ids.to(device), **layout)


def listed_traffic(shape: dict) -> tuple[int, int, int]:
    """The tokens of the query blocks that see a key, those of the key blocks some list holds, and the bytes
    of the mask a kernel reads: the lists' used entries and counts, and the document ids where it has them."""
    partial, full = block_masks(shape)
    listed_blocks = partial | full
    starts, ends = block_bounds(shape["S"])
    tokens = ends - starts
    query_tokens = int(tokens[listed_blocks.any(dim=1)].sum())
    key_tokens = int(tokens[listed_blocks.any(dim=0)].sum())
    mask = 4 * (int(listed_blocks.sum()) + 2 * len(starts)) + (4 * shape["S"] if shape["mask"] == "document" else 0)
    return query_tokens, key_tokens, mask


def visible_block_pairs(shape: dict) -> int:
    """The (query, key) pairs of the listed blocks, partial blocks whole, blocks cut by S as cut."""
    partial, full = block_masks(shape)
    starts, ends = block_bounds(shape["S"])
    tokens = ends - starts
    return int(((partial | full) * tokens[:, None] * tokens[None, :]).sum())


def lse_where_finite(out: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The LSE and its exact value with the rows that see no key (exact -inf) set to 0 where the output is
    -inf too, and the output to NaN where it is not (so that the check fails there)."""
    empty = exact == float("-inf")
    out = torch.where(empty, torch.where(out == float("-inf"), 0.0, float("nan")), out.to(torch.float64))
    return out, exact.masked_fill(empty, 0.0)


PROBLEM = BlockSparseAttentionProblem()
