"""Launch geometry of the attention stages, without a GPU: any B·H a tensor can hold fits CUDA's grid
limits (grid.y and grid.z stop at 65,535), and a launch beyond them is refused in one line."""
import importlib
import math

import pytest
import torch

import reference
import stages
from stages.common.launcher import GRID_LIMITS, LaunchGeometryError, check_geometry, check_shared_memory
from stages.common.attention import head_slices
from test_launcher import assert_arguments_declared

# Stages whose launch runs without a driver (stage 4 builds TMA descriptors, which needs one).
PLAIN_LAUNCH_STAGES = ["stage0", "stage1", "stage2", "stage3"]


class RecordingKernels:
    """Stands in for a KernelSet: records each launch's grid and the pointers it was given."""

    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        return lambda grid, block, *args, smem=0: self.launches.append((name, tuple(grid), tuple(block), args))


def test_the_problem_has_more_heads_than_a_grid_dimension_holds():
    cases = reference.load("attention").cases()
    assert any(c.shape["B"] * c.shape["H"] > GRID_LIMITS[1] for c in cases)


@pytest.mark.parametrize("name", PLAIN_LAUNCH_STAGES)
def test_every_launch_fits_the_grid_limits_at_70000_heads(name):
    stage = stages.load(name)
    B, H, S, D = 280, 250, 16, 64
    q, k, v, o = (torch.empty(B, H, S, D, dtype=torch.float16, device="meta") for _ in range(4))
    lse = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    kernels = RecordingKernels()
    stage.launch(kernels, q, k, v, o, lse, 0.125, False)
    for kernel, grid, block, _ in kernels.launches:
        check_geometry(kernel, grid, block)
    # every (batch, head) pair is launched once: the launches of the last kernel cover B·H pairs (stage 0:
    # grid.y; stages 1-3: grid.y × grid.z, query heads per KV head × KV pairs)
    last = kernels.launches[-1][0]
    covered = sum(math.prod(grid[1:]) for kernel, grid, _, _ in kernels.launches if kernel == last)
    assert covered == B * H


@pytest.mark.parametrize("name", PLAIN_LAUNCH_STAGES)
@pytest.mark.parametrize("H,Hkv", [(250, 50), (256, 32), (8, 1)])
def test_grouped_launches_pair_each_query_head_with_its_kv_head(name, H, Hkv):
    """B·H beyond the grid limit with groups: each launch's K and V views are the KV heads of its query heads."""
    stage = stages.load(name)
    B, S, D = 280 if H > 8 else 2, 16, 64
    q, o = (torch.empty(B, H, S, D, dtype=torch.float16, device="meta") for _ in range(2))
    k, v = (torch.empty(B, Hkv, S, D, dtype=torch.float16, device="meta") for _ in range(2))
    lse = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    kernels = RecordingKernels()
    stage.launch(kernels, q, k, v, o, lse, 0.125, False)
    group, pairs = H // Hkv, 0
    for kernel, grid, block, args in kernels.launches:
        check_geometry(kernel, grid, block)
        if kernel in ("attention_fwd", "attention_scores"):
            q_, k_ = args[0], args[1]
            assert q_.shape[0] == k_.shape[0] * group and q_.shape[0] % group == 0
            if kernel == "attention_fwd":
                assert grid[1:] == (group, k_.shape[0])  # query heads of a group, KV pairs
            else:
                assert grid[2] == q_.shape[0] and args[-1] == group
            pairs += q_.shape[0]
    assert pairs == B * H


def test_head_slices_with_groups_never_cut_a_group_and_pair_each_query_head_with_its_kv_head():
    B, H, Hkv = 3, 10, 2  # groups of 5
    q = torch.arange(B * H, dtype=torch.float32).reshape(B, H, 1)
    k = torch.arange(B * Hkv, dtype=torch.float32).reshape(B, Hkv, 1)
    slices = list(head_slices(q, kv=(k,), group=5, pairs_per_launch=12))  # 12 -> 10 pairs a launch
    assert [s[0].shape[0] for s in slices] == [10, 10, 10]
    for q_, k_ in slices:
        pair = q_[:, 0].long()                  # query pair b·H + h
        b, h = pair // H, pair % H
        expected = b * Hkv + h // 5             # its KV pair, as the problem's repeat_interleave has it
        assert torch.equal(k_[:, 0].long()[torch.arange(len(pair)) // 5], expected)
    assert torch.equal(torch.cat([s[1] for s in slices]), k.flatten(0, 1))
    with pytest.raises(ValueError):
        list(head_slices(q, kv=(k,), group=5, pairs_per_launch=4))


def test_kv_group_refuses_kv_heads_that_do_not_divide_the_query_heads():
    from stages.common.attention import kv_group
    assert kv_group(torch.empty(1, 32, 1, 1), torch.empty(1, 8, 1, 1)) == 4
    with pytest.raises(ValueError, match="no multiple"):
        kv_group(torch.empty(1, 6, 1, 1), torch.empty(1, 4, 1, 1))


def test_head_slices_cut_b_h_into_views_of_at_most_the_limit():
    q = torch.arange(2 * 7 * 3, dtype=torch.float32).reshape(2, 7, 3)
    lse = torch.arange(2 * 7, dtype=torch.float32).reshape(2, 7)
    slices = list(head_slices(q, lse, pairs_per_launch=5))
    assert [s[0].shape[0] for s in slices] == [5, 5, 4]
    assert torch.equal(torch.cat([s[0] for s in slices]), q.flatten(0, 1))
    assert torch.equal(torch.cat([s[1] for s in slices]), lse.flatten(0, 1))
    assert slices[1][0].data_ptr() == q.data_ptr() + 5 * 3 * 4  # a view: the pointer moves, nothing is copied


@pytest.mark.parametrize("grid,block,says", [((1, 70000), (128,), "grid.y = 70000"), ((1, 1, 65536), (32,), "grid.z"),
                                             ((0,), (32,), "grid.x = 0"), ((4,), (32, 33), "1056 threads")])
def test_a_launch_beyond_the_limits_is_one_line(grid, block, says):
    with pytest.raises(LaunchGeometryError) as error:
        check_geometry("attention_fwd", grid, block)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_a_launch_within_the_limits_passes():
    check_geometry("attention_fwd", (2**31 - 1, 65535, 65535), (1024,))


def test_a_block_asking_for_more_shared_memory_than_the_gpu_gives_is_refused_in_one_line():
    # stage 8 at D = 128 on an RTX 4090 (sm_89: 99 KB per block)
    smem = stages.load("stage8").geometry({"HEAD_DIM": "128"})["SHARED_BYTES"]
    with pytest.raises(LaunchGeometryError) as refused:
        check_shared_memory("attention_bwd", smem, 101_376, "NVIDIA GeForce RTX 4090")
    said = str(refused.value)
    assert "\n" not in said and "attention_bwd" in said and "101,376" in said and "CUDA" not in said
    check_shared_memory("attention_bwd", smem, 232_448, "NVIDIA H100 80GB HBM3")  # fits: nothing said


@pytest.mark.parametrize("B,H,Hkv", [(280, 250, 250), (280, 256, 32), (2, 8, 1), (70, 1024, 1024), (2, 32, 8)])
def test_stage9_launches_a_block_per_key_tile_and_kv_pair_walking_its_group(B, H, Hkv, monkeypatch):
    """Stage 9 does GQA in the kernel: one launch, grid.x holding a block per (key tile, KV pair), however
    many pairs, told the group, the number of KV pairs and the pairs a chunk of its schedule takes (enough
    that a chunk's blocks fill the 132 SMs); the tensor maps span all query pairs and all KV pairs (built
    without a driver here: the launch's _tensor_map is replaced by the tensor it would describe)."""
    import stages.stage9_hopper_backward as stage9
    monkeypatch.setattr(stage9, "_tensor_map", lambda x, rows, cols: x)
    monkeypatch.setattr(stage9, "sm_count", lambda device: 132)
    S, D, group = 200, 64, H // Hkv
    q, o, d_o, dq = (torch.empty(B, H, S, D, dtype=torch.float16, device="meta") for _ in range(4))
    k, v, dk, dv = (torch.empty(B, Hkv, S, D, dtype=torch.float16, device="meta") for _ in range(4))
    lse = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    kernels = RecordingKernels()
    stage9.launch(kernels, q, k, v, o, lse, d_o, dq, dk, dv, 0.125, True)
    [(grid, args)] = [(grid, args) for kernel, grid, _, args in kernels.launches if kernel == "attention_bwd"]
    for kernel, grid_, block, _ in kernels.launches:
        check_geometry(kernel, grid_, block)
    q_map, k_map, params = args[0], args[1], args[-1]
    launched_group, kv_pairs, chunk_pairs = params.group, params.kv_pairs, params.chunk_pairs
    assert q_map.shape[:2] == (B, H) and k_map.shape[:2] == (B, Hkv)
    key_tiles = math.ceil(S / 128)
    assert grid == (key_tiles * B * Hkv,) and (launched_group, kv_pairs) == (group, B * Hkv)
    assert chunk_pairs == min(B * Hkv, math.ceil(132 / key_tiles))
    # The kernel's block for KV pair p walks query pairs p·group + g: every query pair once, with the KV
    # pair the problem gives it (query head h uses KV head h // group).
    walked = [(kv * group + g, kv) for kv in range(B * Hkv) for g in range(group)]
    assert [p for p, _ in walked] == list(range(B * H))
    assert all(kv == (p // H) * Hkv + (p % H) // group for p, kv in walked)


@pytest.mark.parametrize("name", ["stage0", "stage1", "stage2", "stage3", "stage4", "stage4:wgmma", "stage4:tma",
                                  "stage4:warp_specialized", "stage8", "stage9"])
def test_every_launch_passes_the_arguments_its_kernel_declares(name, monkeypatch):
    """A launch gives each kernel as many arguments as its C signature has (KernelSet refuses others), and
    each one is of the declared kind: a tensor or an address for a pointer, an integer for an `int` (within
    32 bits) or a `long long`, a float for a `float`, a parameter struct's values (each field of its kind) for
    a struct. Stages 4 (and its rungs) and 9 build TMA descriptors and stage 4 asks for the SM count, which
    need a driver: replaced here."""
    stage = stages.load(name)
    module = importlib.import_module(f"stages.{stage.name}")
    if hasattr(module, "_tensor_map"):
        monkeypatch.setattr(module, "_tensor_map", lambda x, rows, cols: x)
    if stage.rung:  # stage 4's rungs build theirs in the ladder's module
        monkeypatch.setattr(importlib.import_module(f"stages.{stage.name}.ladder"), "tensor_map", lambda x, box: x)
    if hasattr(module, "sm_count"):
        monkeypatch.setattr(module, "sm_count", lambda device: 132)
    B, H, S, D = 2, 4, 100, 64
    q, k, v, d_o, dq, dk, dv = (torch.empty(B, H, S, D, dtype=torch.float16, device="meta") for _ in range(7))
    o = torch.empty(B, S, H, D, dtype=torch.float16, device="meta").transpose(1, 2)  # ops' layout: any strides
    lse = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    kernels = RecordingKernels()
    for causal in (True, False):  # stage 8 launches its tail only without a causal mask
        if stage.problem == "attention":
            stage.launch(kernels, q, k, v, o, lse, 0.125, causal)
        else:
            stage.launch(kernels, q, k, v, o.contiguous(), lse, d_o, dq, dk, dv, 0.125, causal)
    assert kernels.launches
    for kernel, _, _, args in kernels.launches:
        assert_arguments_declared(stage, kernel, args)


