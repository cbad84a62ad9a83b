"""Decode attention over a paged KV cache (reference/decode_attention.py) and stage 15's launch, on the CPU:
the fp64 reference against a plain per-sequence computation (the pages walked one token at a time, the
causal rule among the new tokens, GQA), the cases' lengths and pages, the work, and the launch's splits and
grid."""
import math

import numpy as np
import pytest
import torch

import stages
from reference.decode_attention import PROBLEM, pages_of, seq_lens_of, visible_pairs
from stages.common.launcher import check_geometry, parameter_types
from stages.stage15_decode import DecodeParams

CASES = PROBLEM.cases()


def inputs_of(case):
    return PROBLEM.make_inputs(case.shape, case.dtype, case.seed, case.input_scale, device="cpu")


def per_sequence(inputs: dict) -> dict:
    """Each sequence on its own: its keys and values read token by token through the block table, query
    head h with KV head h // group, new token i seeing keys 0 .. seq_len - Sq + i."""
    q, k_cache, v_cache = (inputs[n].to(torch.float64) for n in ("q", "k_cache", "v_cache"))
    B, H, Sq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    o, lse = torch.empty(B, H, Sq, D, dtype=torch.float64), torch.empty(B, H, Sq, dtype=torch.float64)
    for b in range(B):
        n = int(inputs["seq_lens"][b])
        slots = [(int(inputs["block_table"][b, t // page_size]), t % page_size) for t in range(n)]
        for h in range(H):
            kv = h // (H // Hkv)
            k = torch.stack([k_cache[p, s, kv] for p, s in slots])
            v = torch.stack([v_cache[p, s, kv] for p, s in slots])
            for i in range(Sq):
                seen = n - Sq + i + 1
                scores = (k[:seen] @ q[b, h, i]) * inputs["scale"]
                lse[b, h, i] = torch.logsumexp(scores, 0)
                o[b, h, i] = torch.softmax(scores, 0) @ v[:seen]
    return dict(o=o, lse=lse)


SMALL = [c for c in CASES if c.shape["B"] * c.shape["H"] * c.shape["S"] <= 300_000]


@pytest.mark.parametrize("case", SMALL, ids=[c.name for c in SMALL])
def test_the_reference_is_attention_over_each_sequences_own_pages(case):
    inputs = inputs_of(case)
    exact, plain = PROBLEM.reference(inputs), per_sequence(inputs)
    assert torch.allclose(exact["o"], plain["o"], rtol=0, atol=1e-12)
    assert torch.allclose(exact["lse"], plain["lse"], rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("case", SMALL[:8], ids=[c.name for c in SMALL[:8]])
def test_every_baseline_computes_the_problem_the_paged_ones_from_the_pages(case):
    inputs = {**inputs_of(case), **{n: inputs_of(case)[n].float() for n in ("q", "k_cache", "v_cache")}}
    exact = PROBLEM.reference(inputs)["o"]
    found = PROBLEM.baselines(inputs)
    assert {"math", "paged math", "naive"} <= set(found)
    for name, run in found.items():
        assert torch.allclose(run().double(), exact, rtol=0, atol=1e-5), name


def test_the_cases_cover_what_a_decode_kernel_meets():
    shapes = [c.shape for c in CASES]
    assert any(s["S"] == 1 for s in shapes) and any(s["S"] == s["Sq"] > 1 for s in shapes)  # the shortest caches
    assert any(s["Sq"] > 1 for s in shapes) and max(s["Sq"] for s in shapes) == 8
    assert {s["page_size"] for s in shapes} >= {1, 16, 64} and {s["D"] for s in shapes} == {64, 128}
    assert any(s["H"] == 8 * s["Hkv"] for s in shapes) and any(s["H"] == s["Hkv"] for s in shapes)
    assert any(s["Hkv"] == 1 and s["H"] > 1 for s in shapes)
    assert any(s["B"] * s["H"] > 65535 for s in shapes) and any(c.input_scale == 10 for c in CASES)
    assert any(n % 64 and n % 16 for s in shapes for n in seq_lens_of(s))  # lengths no page or tile divides
    assert {c.dtype for c in CASES} == {"float16", "bfloat16"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lengths_and_pages(case):
    shape = case.shape
    lens = seq_lens_of(shape)
    assert len(lens) == shape["B"] and max(lens) == shape["S"] and all(shape["Sq"] <= n <= shape["S"] for n in lens)
    if shape["B"] > 100:
        return  # the block table is checked on the smaller cases
    inputs = inputs_of(case)
    table, page_size = inputs["block_table"], shape["page_size"]
    assert inputs["seq_lens"].tolist() == lens and inputs["max_len"] == max(lens)
    listed = [int(p) for b, n in enumerate(lens) for p in table[b, :pages_of(n, page_size)]]
    assert sorted(listed) == sorted(set(listed)) and min(listed) >= 0  # each page listed once
    assert max(listed) < inputs["k_cache"].shape[0]
    assert all((table[b, pages_of(n, page_size):] == -1).all() for b, n in enumerate(lens))  # no page past the end


def test_the_pages_come_shuffled():
    inputs = inputs_of(next(c for c in CASES if c.shape["S"] >= 1000 and c.shape["page_size"] == 16))
    first = inputs["block_table"][0]
    used = first[first >= 0]
    assert (used[1:] - used[:-1] != 1).any()


def test_new_token_i_sees_the_keys_up_to_its_position():
    shape = dict(B=1, H=2, Hkv=1, Sq=3, S=5, D=64, page_size=2, ragged=False)
    inputs = PROBLEM.make_inputs(shape, "float16", 0, device="cpu")
    inputs["v_cache"] = torch.zeros_like(inputs["v_cache"])
    table = inputs["block_table"][0]
    for t in range(5):  # v of token t: t + 1 in every column
        inputs["v_cache"][table[t // 2], t % 2] = t + 1
    inputs["q"] = torch.zeros_like(inputs["q"])  # equal scores: O is the mean of the values seen
    o = PROBLEM.reference(inputs)["o"]
    for i, seen in enumerate((3, 4, 5)):
        assert torch.allclose(o[0, :, i], torch.full_like(o[0, :, i], (seen + 1) / 2))
    assert torch.allclose(PROBLEM.reference(inputs)["lse"][0, 0], torch.tensor([3, 4, 5.0], dtype=torch.float64).log())


def test_the_work_counts_each_visible_pair_and_each_cache_byte_once():
    shape = dict(B=2, H=8, Hkv=2, Sq=2, S=100, D=64, page_size=16, ragged=True)
    lens = seq_lens_of(shape)
    assert visible_pairs(100, 2) == 99 + 100
    assert PROBLEM.flops(shape) == 4 * 8 * 64 * sum(2 * n - 1 for n in lens)
    cache = 2 * sum(lens) * 2 * 64 * 2
    assert PROBLEM.min_bytes(shape) == cache + 4 * (sum(-(-n // 16) for n in lens) + 2) + 2 * 8 * 2 * (2 * 64 * 2 + 4)
    bench = PROBLEM.benchmarks()[0]
    assert PROBLEM.flops(bench) == 4 * 64 * 32 * 4096 * 128


class RecordingKernels:
    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        return lambda grid, block, *args, smem=0: self.launches.append((name, tuple(grid), tuple(block), args, smem))


def meta_inputs(B, H, Hkv, Sq, S, D=128, page_size=64):
    pages = B * -(-S // page_size)
    return dict(q=torch.empty(B, H, Sq, D, dtype=torch.float16, device="meta"),
                k_cache=torch.empty(pages, page_size, Hkv, D, dtype=torch.float16, device="meta"),
                v_cache=torch.empty(pages, page_size, Hkv, D, dtype=torch.float16, device="meta"),
                block_table=torch.empty(B, -(-S // page_size), dtype=torch.int32, device="meta"),
                seq_lens=torch.empty(B, dtype=torch.int32, device="meta"), scale=1 / math.sqrt(D), max_len=S)


@pytest.mark.parametrize("B,H,Hkv,Sq,S", [(64, 32, 8, 1, 4096), (1, 32, 8, 1, 65536), (2100, 32, 8, 1, 40),
                                           (2, 32, 1, 8, 130), (3, 4, 4, 1, 1)])
def test_stage15_launches_every_row_and_key_within_the_grid_limits(B, H, Hkv, Sq, S, monkeypatch):
    module = __import__("stages.stage15_decode", fromlist=["launch"])
    monkeypatch.setattr(module, "sm_count", lambda device: 132)
    monkeypatch.setattr(module, "arrival_counters",
                        lambda device, units: torch.zeros(units, dtype=torch.int32, device="meta"))
    stage = stages.load("stage15")
    inputs = meta_inputs(B, H, Hkv, Sq, S)
    outputs = PROBLEM.allocate_outputs(inputs)
    kernels = RecordingKernels()
    PROBLEM.run_stage(stage, kernels, inputs, outputs)
    [(split, grid, block, (params,), smem)] = kernels.launches  # one kernel: the last split of a row chunk combines
    assert split == "decode_split" and stage.kernels[split] == "const DecodeParams" and type(params) is DecodeParams
    assert smem == stage.geometry({"HEAD_DIM": "128"})["SHARED_BYTES"] > 48 * 1024  # the ring, opted in above 48 KB
    check_geometry(split, grid, block)
    for value, c_type in zip(params, parameter_types(", ".join(t for _, t in DecodeParams._c_fields))):
        integral = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
        assert isinstance(value, torch.Tensor) if c_type == "pointer" else \
            isinstance(value, float) if c_type == "float" else integral and -2**31 <= value < 2**31
    keys_per_split, splits, chunks = params.keys_per_split, params.splits, params.chunks
    assert keys_per_split % 64 == 0 and (splits - 1) * keys_per_split < S <= splits * keys_per_split
    assert chunks * 16 >= (H // Hkv) * Sq > (chunks - 1) * 16
    assert grid == (B * Hkv * chunks * splits,)
    # a counter per row chunk; the outputs
    assert params.arrivals.numel() == B * Hkv * chunks and params.o is outputs["o"] and params.lse is outputs["lse"]
    units, slots = B * Hkv * chunks, stage.geometry({"HEAD_DIM": "128"})["MIN_BLOCKS_PER_SM"] * 132
    if units < slots:  # a wave of blocks, full to within one split of each unit, or a split per tile
        assert units * splits >= slots - units or splits == -(-S // 64)


# ---- ops.decode_attention: the op on a cache the caller keeps ---------------------------------------------

def decode_args(B=2, H=8, Hkv=2, Sq=1, D=64, pages=5, page_size=16, max_pages=3, device="cpu"):
    return (torch.zeros(B, H, Sq, D, dtype=torch.float16, device=device),
            torch.zeros(pages, page_size, Hkv, D, dtype=torch.float16, device=device),
            torch.zeros(pages, page_size, Hkv, D, dtype=torch.float16, device=device),
            torch.zeros(B, max_pages, dtype=torch.int32, device=device),
            torch.ones(B, dtype=torch.int32, device=device))


@pytest.mark.parametrize("change,words", [
    (lambda a: (a[0][:, :, :, :32].contiguous(), *a[1:]), r"expected q \[B, H, Sq, D\]"),
    (lambda a: (a[0][:, :7].contiguous(), *a[1:]), "H_kv must divide"),
    (lambda a: (a[0].float(), *a[1:]), "must all be"),
    (lambda a: (*a[:3], a[3].long(), a[4]), "must be int32"),
    (lambda a: (a[0], a[1].transpose(1, 2).contiguous().transpose(1, 2), *a[2:]), "contiguous"),
    (lambda a: (a[0][..., :48].contiguous(), a[1][..., :48].contiguous(), a[2][..., :48].contiguous(), *a[3:]),
     "head dimension D must be one of"),
    (lambda a: a, "on one CUDA GPU"),  # CPU tensors: every other check passes first
])
def test_decode_attention_refuses_what_the_kernel_does_not_take_in_one_line(change, words):
    from stages import ops
    with pytest.raises(ValueError, match=words) as caught:
        ops.decode_attention(*change(decode_args()))
    assert "\n" not in str(caught.value) and str(caught.value).startswith("ops.decode_attention: ")


def test_decode_attention_traces_with_its_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from stages import ops
    with FakeTensorMode():
        args = decode_args(Sq=3, D=128)
        o = ops.decode_attention(*args)
    assert o.shape == args[0].shape and o.dtype == args[0].dtype


@pytest.mark.gpu
@pytest.mark.parametrize("case", [2, 4, 6, 9], ids=lambda i: CASES[i].name)
def test_decode_attention_passes_the_problems_rule_and_replays_in_a_graph(case):
    """ops.decode_attention against the fp64 reference with the problem's check, then the same call captured in
    a CUDA graph and replayed on new values of q, the cache and the lengths (no value read to the host)."""
    from stages import ops
    c = CASES[case]
    inputs = PROBLEM.make_inputs(c.shape, c.dtype, c.seed, c.input_scale)
    args = [inputs[n] for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens")]

    def check(o):  # O by the problem's rule (the op returns no LSE: the exact one stands in for it)
        exact, library = PROBLEM.reference(inputs), PROBLEM.library_output(inputs)
        checks = [ch for ch in PROBLEM.check(dict(o=o, lse=exact["lse"].float()), exact, library) if ch.output == "o"]
        assert checks and all(ch.passed for ch in checks), "; ".join(f"{ch.output}: {ch.quality}" for ch in checks)

    check(ops.decode_attention(*args, scale=inputs["scale"]))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = ops.decode_attention(*args, scale=inputs["scale"])
    fresh = PROBLEM.make_inputs(c.shape, c.dtype, c.seed + 1, c.input_scale)
    for name in ("q", "k_cache", "v_cache"):
        inputs[name].copy_(fresh[name])
    inputs["seq_lens"].sub_(torch.clamp(inputs["seq_lens"] - c.shape["Sq"], max=1))  # one key fewer where there is one
    graph.replay()
    check(o)
