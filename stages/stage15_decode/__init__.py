"""Stage 15 — decode attention over a paged KV cache: split-KV and an LSE combine

A few new tokens a sequence against its whole cache, read through a block table of pages: a read of the
cache, bound by memory bandwidth. Each block takes one (sequence, KV head, split of the keys) with the
group's query heads packed as its 16 rows, so K and V are read once per KV head; a ring of cp.async copies
keeps tiles in flight, and each warp runs the products on its own keys with mma.sync; the splits' partial
outputs are combined by their log-sum-exps, by the last split of each row chunk to finish (no second kernel).
Tensor cores through mma.sync: sm_80 and newer.
"""
import functools

import torch

from stages import Goal, Stage
from stages.common.attention import by_head_dim, kv_group
from stages.common.hopper import sm_count
from stages.common.launcher import current_stream_handle, param_struct

# What the launch uses, per head dimension, as attention.cu computes it (the grader checks each value against
# the kernel): keys per tile, query rows per block (a group's heads × the new tokens; more rows take more
# blocks), threads of decode_split, its dynamic shared memory (a ring of 3 K tiles and 3 V tiles, then the
# warps' row maxes and sums), and the blocks of it an SM holds at once (its shared memory's share).
GEOMETRY = {64: {"BLOCK_N": 128, "ROWS": 16, "NUM_THREADS": 256, "SHARED_BYTES": 99328, "MIN_BLOCKS_PER_SM": 2},
            128: {"BLOCK_N": 64, "ROWS": 16, "NUM_THREADS": 128, "SHARED_BYTES": 98816, "MIN_BLOCKS_PER_SM": 2}}
# decode_split's parameters, as attention.cu's DecodeParams holds them (the grader checks the layout against it).
DecodeParams = param_struct("DecodeParams", [
    ("q", "const elem_t*"), ("k_cache", "const elem_t*"), ("v_cache", "const elem_t*"), ("block_table", "const int*"),
    ("seq_lens", "const int*"), ("o_partial", "float*"), ("lse_partial", "float*"), ("arrivals", "int*"),
    ("o", "elem_t*"), ("lse", "float*"), ("heads", "int"), ("kv_heads", "int"), ("seq_q", "int"), ("page_size", "int"),
    ("max_pages", "int"), ("keys_per_split", "int"), ("splits", "int"), ("chunks", "int"), ("scale", "float")])
# --8<-- [start:launch]


@functools.cache
def split_keys(units: int, max_len: int, slots: int, block_n: int) -> tuple[int, int]:
    """(keys per split, splits) for `units` (sequence, KV head, row chunk) triples, with `slots` blocks running
    at once: the number of splits that takes the fewest waves × tiles a block walks (a block's time is its
    tiles, and a last wave, full or not, takes as long as a full one), the fewest splits on a tie (fewer
    partial rows to combine). Each split is a whole number of tiles of block_n keys."""
    tiles = -(-max_len // block_n)

    def cost(splits: int) -> int:
        return -(-units * splits // slots) * -(-tiles // splits)

    most = min(tiles, -(-2 * slots // units))  # past two waves' worth, more splits only add waves
    splits = min(range(1, most + 1), key=lambda n: (cost(n), n))
    keys_per_split = -(-tiles // splits) * block_n
    return keys_per_split, -(-max_len // keys_per_split)


_ARRIVALS: dict = {}  # (GPU, stream) -> the kernel's arrival counters, which it leaves at zero after each launch


def arrival_counters(device: torch.device, units: int) -> torch.Tensor:
    """An int32 counter of arrived splits for each of `units` row chunks, all zero. Eager launches on one stream
    run one after another, so they share one buffer, made once; a launch captured in a CUDA graph gets its own,
    zeroed by the graph at each replay (a buffer made during a capture holds no zeros until then)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(units, dtype=torch.int32, device=device)
    key = (device.index, current_stream_handle(device.index))
    counters = _ARRIVALS.get(key)
    if counters is None or counters.numel() < units:
        counters = _ARRIVALS[key] = torch.zeros(units, dtype=torch.int32, device=device)
    return counters


def launch(kernels, q, k_cache, v_cache, block_table, seq_lens, o, lse, scale, max_len):
    batch, heads, seq_q, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = kv_group(q, k_cache.transpose(1, 2))  # k_cache [pages, page_size, H_kv, D]: H_kv in dim 1 once swapped
    launched = GEOMETRY[head_dim]
    chunks = -(-group * seq_q // launched["ROWS"])
    slots = launched["MIN_BLOCKS_PER_SM"] * sm_count(q.device)
    keys_per_split, splits = split_keys(batch * kv_heads * chunks, max_len, slots, launched["BLOCK_N"])
    rows = batch * heads * seq_q
    o_partial = torch.empty(rows, splits, head_dim, dtype=torch.float32, device=q.device)
    lse_partial = torch.empty(rows, splits, dtype=torch.float32, device=q.device)
    units = batch * kv_heads * chunks
    params = DecodeParams(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                          o_partial=o_partial, lse_partial=lse_partial, arrivals=arrival_counters(q.device, units), o=o,
                          lse=lse, heads=heads, kv_heads=kv_heads, seq_q=seq_q, page_size=k_cache.shape[1],
                          max_pages=block_table.shape[1], keys_per_split=keys_per_split, splits=splits, chunks=chunks,
                          scale=float(scale))
    kernels.decode_split((units * splits,), (launched["NUM_THREADS"],), params, smem=launched["SHARED_BYTES"])

# --8<-- [end:launch]


STAGE = Stage(
    name="stage15_decode",
    problem="decode_attention",
    source="attention.cu",
    kernels={"decode_split": "const DecodeParams"},
    launch=launch,
    param_structs=(DecodeParams,),
    specializations={"HEAD_DIM": "D"},  # the head dimension, compiled in
    geometry=by_head_dim(GEOMETRY),
    goal=Goal("reference", 1.0),  # the fastest SDPA backend on the cache already gathered contiguous
)
