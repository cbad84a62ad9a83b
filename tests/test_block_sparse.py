"""The block-sparse attention problem (reference/block_sparse_attention.py) on the CPU: its block-by-block
reference against dense float64 attention, its masks against FlexAttention's own, the BlockMask conversion,
its work on hand-counted examples, its cases and benchmarks."""
import pytest
import torch

import reference
from reference import block_sparse_attention as bsa

P = reference.load("block_sparse_attention")
CASES = {c.name: c for c in P.cases()}


def case_inputs(index: int) -> dict:
    case = P.cases()[index]
    return P.make_inputs(case.shape, case.dtype, case.seed, case.input_scale, device="cpu")


def dense_mask(inputs: dict) -> torch.Tensor:
    """[S, S] bool from the lists entry by entry and the element masks' definitions, written apart from the module."""
    S = inputs["q"].shape[2]
    visible = torch.zeros(S, S, dtype=torch.bool)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    element = {"none": torch.ones(S, S, dtype=torch.bool), "causal": j <= i,
               "sliding_window": (j <= i) & (j > i - inputs["window"]),
               "document": (j <= i) & (inputs["document_ids"][:, None] == inputs["document_ids"][None, :])}
    for m in range(inputs["kv_num_blocks"].shape[-1]):
        rows = slice(m * 128, (m + 1) * 128)
        for n in inputs["full_kv_indices"][0, 0, m, :inputs["full_kv_num_blocks"][0, 0, m]].tolist():
            visible[rows, n * 128:(n + 1) * 128] = True
        for n in inputs["kv_indices"][0, 0, m, :inputs["kv_num_blocks"][0, 0, m]].tolist():
            cols = slice(n * 128, (n + 1) * 128)
            visible[rows, cols] = element[inputs["element_mask"]][rows, cols]
    return visible


def dense_attention(inputs: dict, visible: torch.Tensor) -> dict:
    q, k, v = (inputs[n].double() for n in "qkv")
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (inputs["scale"] * q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    return dict(o=torch.softmax(scores, dim=-1).nan_to_num() @ v, lse=torch.logsumexp(scores, dim=-1))


# one case of each mask kind, and each kind's case with query blocks that see no key
REFERENCE_CASES = [1, 4, 6, 8, 9, 11, 14, 15]


@pytest.mark.parametrize("index", REFERENCE_CASES, ids=lambda i: P.cases()[i].name)
def test_block_by_block_reference_equals_dense_masked_attention(index):
    inputs = case_inputs(index)
    visible = dense_mask(inputs)
    exact, dense = P.reference(inputs), dense_attention(inputs, visible)
    torch.testing.assert_close(exact["o"], dense["o"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(exact["lse"], dense["lse"], rtol=1e-12, atol=0)  # equal infinities
    assert torch.equal(bsa.dense_visible(inputs), visible)


@pytest.mark.parametrize("index", [4, 8, 11, 15], ids=lambda i: P.cases()[i].name)
def test_rows_that_see_no_key_output_zero_and_lse_minus_infinity(index):
    inputs = case_inputs(index)
    empty = ~dense_mask(inputs).any(dim=1)
    empty_blocks = P.cases()[index].shape["empty_query_blocks"]
    assert empty.sum() == sum(min(128, inputs["q"].shape[2] - 128 * m) for m in empty_blocks)
    exact = P.reference(inputs)
    assert (exact["o"][:, :, empty] == 0).all() and (exact["lse"][:, :, empty] == float("-inf")).all()
    assert exact["lse"][:, :, ~empty].isfinite().all()


def test_the_check_passes_the_library_and_fails_a_wrong_empty_row():
    inputs = case_inputs(15)
    exact, library = P.reference(inputs), P.library_output(inputs)
    good = dict(o=library["o"], lse=exact["lse"].float())
    assert all(check.passed for check in P.check(good, exact, library))
    empty_row = 4 * 128
    for name, value in (("lse", 0.0), ("lse", float("nan")), ("o", float("nan"))):
        bad = {n: x.clone() for n, x in good.items()}
        bad[name][:, :, empty_row] = value
        assert [c.passed for c in P.check(bad, exact, library)] == [name != "o", name != "lse"]


@pytest.mark.parametrize("shape", [
    dict(S=300, mask="causal"), dict(S=1000, mask="causal"), dict(S=1000, mask="sliding_window", window=200),
    dict(S=777, mask="sliding_window", window=128), dict(S=300, mask="sliding_window", window=1),
    dict(S=700, mask="document", documents=[100, 37, 163, 1, 300, 99]),
    dict(S=900, mask="document", documents=[129, 128, 643])], ids=str)
def test_the_masks_partial_and_full_blocks_are_flex_attentions_own(shape):
    """create_block_mask evaluates the element mask on every pair: the tile-bound rule must agree with it."""
    from torch.nn.attention.flex_attention import create_block_mask
    element_mask, window, ids = bsa.mask_parameters(shape)
    flex = create_block_mask(lambda b, h, i, j: bsa.element_visible(i, j, element_mask, window, ids), None, None,
                             shape["S"], shape["S"], device="cpu")
    ours = bsa.block_layout(*bsa.block_masks(shape))
    theirs = bsa.from_block_mask(flex)
    assert all(torch.equal(ours[n], theirs[n]) for n in bsa.LAYOUT)
    assert all(torch.equal(ours[n], flex_tensor) for n, flex_tensor in
               zip(bsa.LAYOUT, (flex.kv_num_blocks, flex.kv_indices, flex.full_kv_num_blocks, flex.full_kv_indices)))


@pytest.mark.parametrize("index", [4, 11, 15, 16], ids=lambda i: P.cases()[i].name)
def test_the_block_mask_conversion_round_trips(index):
    shape = P.cases()[index].shape
    layout = bsa.block_layout(*bsa.block_masks(shape))
    block_mask = bsa.to_block_mask(layout, shape["S"])
    assert block_mask.seq_lengths == (shape["S"], shape["S"]) and block_mask.BLOCK_SIZE == (128, 128)
    back = bsa.from_block_mask(block_mask)
    assert all(torch.equal(back[n], layout[n]) for n in bsa.LAYOUT)
    again = bsa.to_block_mask(back, shape["S"])
    assert torch.equal(again.to_dense(), block_mask.to_dense())


def test_padding_of_any_value_is_ignored_and_unsupported_masks_are_refused():
    layout = bsa.block_layout(*bsa.block_masks(dict(S=640, mask="causal")))
    zero_padded = {n: x.clone() for n, x in layout.items()}
    for counts, indices in ((zero_padded["kv_num_blocks"], zero_padded["kv_indices"]),
                            (zero_padded["full_kv_num_blocks"], zero_padded["full_kv_indices"])):
        past = torch.arange(indices.shape[-1])[None, None, None, :] >= counts[..., None]
        indices.masked_fill_(past, 0)
    back = bsa.from_block_mask(bsa.to_block_mask(zero_padded, 640))
    assert all(torch.equal(back[n], layout[n]) for n in bsa.LAYOUT)
    per_batch = {n: torch.cat([x, x]) for n, x in layout.items()}
    with pytest.raises(ValueError, match="per batch or head"):
        bsa.from_block_mask(bsa.to_block_mask(per_batch, 640))
    from torch.nn.attention.flex_attention import BlockMask
    with pytest.raises(ValueError, match="blocks of"):
        bsa.from_block_mask(BlockMask.from_kv_blocks(*(layout[n] for n in bsa.LAYOUT), BLOCK_SIZE=64))


def test_flops_and_bytes_on_hand_counted_masks():
    # S = 300: blocks of 128, 128, 44 tokens. Causal: the six pairs (m, n <= m), the diagonal partial.
    causal = dict(B=1, H=1, S=300, D=64, mask="causal")
    assert P.flops(causal) == 4 * 64 * (3 * 128 * 128 + 2 * 44 * 128 + 44 * 44)
    # the graph with no neighbour and no long-range block: the diagonal only; GQA counts H for flops
    diagonal = dict(B=2, H=4, Hkv=2, S=300, D=64, mask="graph", neighbours=0, long_range=0, graph_seed=0)
    assert P.flops(diagonal) == 4 * 2 * 4 * 64 * (2 * 128 * 128 + 44 * 44)
    # bytes: Q read for the 300 rows, O and the LSE written for all 300, K and V (2 heads) read once,
    # 3 listed blocks and 2·3 counts of int32; with block 1 emptied, Q and K, V of 172 tokens and 2 blocks
    query_side = 2 * 4 * (300 * 64 * 2 + 300 * (64 * 2 + 4))
    assert P.min_bytes(diagonal) == query_side + 2 * 2 * 2 * 300 * 64 * 2 + 4 * (3 + 6)
    emptied = dict(diagonal, empty_query_blocks=[1])
    assert P.min_bytes(emptied) == (2 * 4 * (172 * 64 * 2 + 300 * (64 * 2 + 4)) + 2 * 2 * 2 * 172 * 64 * 2
                                    + 4 * (2 + 6))
    documents = dict(causal, mask="document", documents=[200, 100])
    assert P.min_bytes(documents) - P.min_bytes(causal) == 4 * 300 - 4 * 1  # the ids; the pair (2, 0) is gone
    # a partial block counts whole: a window of 1 sees the diagonal of the diagonal blocks
    window = dict(causal, mask="sliding_window", window=1)
    assert P.flops(window) == 4 * 64 * (2 * 128 * 128 + 44 * 44)


def test_cases_cover_what_the_issue_asks_with_unique_names_and_seeds():
    cases = P.cases()
    assert len(CASES) == len(cases) and len({c.seed for c in cases}) == len(cases)
    assert [c.seed for c in P.cases(seed=7)] != [c.seed for c in cases]
    shapes = [c.shape for c in cases]
    for kind in ("graph", "causal", "document", "sliding_window"):
        kind_cases = [c for c in cases if c.shape["mask"] == kind]
        assert any(c.shape.get("empty_query_blocks") for c in kind_cases), kind
        assert any(c.input_scale == 10 for c in kind_cases), kind
        assert any(c.shape["S"] % 128 for c in kind_cases), kind
    assert {"float16", "bfloat16"} == {c.dtype for c in cases}
    assert any(s.get("Hkv") == 1 for s in shapes) and any(s["H"] == 32 and s.get("Hkv") == 8 for s in shapes)
    assert {64, 128} == {s["D"] for s in shapes}


def test_benchmarks_are_the_issues_three_shapes():
    graph, documents, window = P.benchmarks()
    partial, full = bsa.block_masks(graph)
    blocks = len(full)
    assert graph["S"] == 100_000 and blocks == 782 and not partial.any()
    assert 0.79 <= 1 - full.float().mean() <= 0.81 and full.diagonal().all()
    assert (graph["D"], graph["dtype"], graph["B"]) == (64, "float16", 1)
    lengths = documents["documents"]
    assert sum(lengths) == documents["S"] == 32768 and all(512 <= n <= 8192 for n in lengths)
    assert (documents["H"], documents["Hkv"], documents["D"], documents["dtype"]) == (32, 8, 128, "bfloat16")
    assert (window["S"], window["window"], window["D"]) == (32768, 4096, 128)


@pytest.mark.parametrize("seed", range(5))
def test_packed_documents_fill_the_length_within_bounds(seed):
    lengths = bsa.packed_document_lengths(20000, 512, 8192, seed)
    assert sum(lengths) == 20000 and all(512 <= n <= 8192 for n in lengths)


def test_the_graph_is_a_ring_neighbourhood_plus_seeded_long_range_blocks():
    graph = bsa.neighbourhood_graph(20, 2, 3, seed=5)
    assert (graph.sum(dim=1) == 5 + 3).all()
    for offset in (-2, -1, 0, 1, 2):
        assert graph[torch.arange(20), (torch.arange(20) + offset) % 20].all()
    assert torch.equal(graph, bsa.neighbourhood_graph(20, 2, 3, seed=5))
    assert not torch.equal(graph, bsa.neighbourhood_graph(20, 2, 3, seed=6))


def test_inputs_are_seeded_and_outputs_poisoned():
    shape = CASES["B1 H4 Hkv2 S700 D128 6 documents 1-300 bf16"].shape
    a, b = (P.make_inputs(shape, "bfloat16", seed=3, device="cpu") for _ in range(2))
    c = P.make_inputs(shape, "bfloat16", seed=4, device="cpu")
    assert torch.equal(a["q"], b["q"]) and not torch.equal(a["q"], c["q"])
    assert a["k"].shape == (1, 2, 700, 128) and a["kv_indices"].dtype == torch.int32
    out = P.allocate_outputs(a)
    assert out["o"].isnan().all() and out["lse"].isnan().all() and out["lse"].dtype == torch.float32
    assert P.variant(a) == {"dtype": "bfloat16", "D": 128, "element_mask": "document"}


def test_baselines_flex_attention_and_sdpa_up_to_its_length(monkeypatch):
    inputs = case_inputs(9)
    baselines = P.baselines(inputs)
    assert set(baselines) == {"flex_attention", "sdpa_dense_mask"}
    torch.testing.assert_close(baselines["sdpa_dense_mask"](), P.library_output(inputs)["o"])
    monkeypatch.setattr(bsa, "SDPA_MAX_TOKENS", 699)
    assert set(P.baselines(inputs)) == {"flex_attention"}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("index", [11, 15], ids=lambda i: P.cases()[i].name)
def test_flex_attention_eager_on_the_cpu_passes_the_check(index):
    """FlexAttention's unfused path (on the CPU) reads mask_mod alone: here it holds the blocks too."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention
    inputs = case_inputs(index)
    visible = bsa.dense_visible(inputs)
    block_mask = bsa.to_block_mask(inputs, inputs["q"].shape[2], lambda b, h, i, j: visible[i, j])
    o, aux = flex_attention(inputs["q"], inputs["k"], inputs["v"], block_mask=block_mask, scale=inputs["scale"],
                            enable_gqa=True, return_aux=AuxRequest(lse=True))
    exact, library = P.reference(inputs), P.library_output(inputs)
    assert all(check.passed for check in P.check(dict(o=o, lse=aux.lse), exact, library))
