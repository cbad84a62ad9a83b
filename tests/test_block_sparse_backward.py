"""The block-sparse attention backward problem (reference/block_sparse_attention_backward.py) on the CPU: its
block-by-block gradients against autograd of dense float64 masked attention and against FlexAttention's, its
inputs against the forward's, its work on a hand-counted example, and its check failing wrong gradients."""
import pytest
import torch

import reference
from reference import block_sparse_attention as bsa

P = reference.load("block_sparse_attention_backward")
FORWARD = reference.load("block_sparse_attention")


def case_inputs(index: int) -> dict:
    case = P.cases()[index]
    return P.make_inputs(case.shape, case.dtype, case.seed, case.input_scale, device="cpu")


def dense_autograd_gradients(inputs: dict) -> dict:
    """dQ, dK, dV by autograd through dense float64 attention under the [S, S] mask, K and V repeated to H
    heads (autograd sums a group's gradients onto its KV head); a row that sees no key weighs every key 0."""
    visible = bsa.dense_visible(inputs)
    sees_none = ~visible.any(dim=1)[:, None]
    q, k, v = (inputs[n].double().requires_grad_() for n in "qkv")
    group = q.shape[1] // k.shape[1]
    scores = inputs["scale"] * q @ k.repeat_interleave(group, dim=1).transpose(-1, -2)
    # 0 rather than -inf on rows that see nothing, so that their softmax (then zeroed) has no NaN to carry back
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(sees_none, 0.0)
    weights = torch.softmax(scores, dim=-1).masked_fill(sees_none, 0.0)
    out = weights @ v.repeat_interleave(group, dim=1)
    return dict(zip(P.outputs, torch.autograd.grad(out, (q, k, v), inputs["do"].double())))


# one case of each mask kind, each kind's case with query blocks that see no key, GQA (6: one KV head)
REFERENCE_CASES = [1, 4, 6, 8, 9, 11, 14, 15]


@pytest.mark.parametrize("index", REFERENCE_CASES, ids=lambda i: P.cases()[i].name)
def test_block_by_block_gradients_equal_autograd_of_dense_masked_attention(index):
    inputs = case_inputs(index)
    exact, expected = P.reference(inputs), dense_autograd_gradients(inputs)
    for name in P.outputs:
        assert exact[name].dtype == torch.float64 and exact[name].shape == inputs[name[1]].shape
        # float64 sums in another order: 1e-12 of the largest gradient (large scores cancel in dP - Δ)
        torch.testing.assert_close(exact[name], expected[name], rtol=1e-10,
                                   atol=1e-12 * expected[name].abs().max().item())


@pytest.mark.parametrize("index", [4, 11, 15], ids=lambda i: P.cases()[i].name)
def test_rows_that_see_no_key_have_dq_zero(index):
    inputs = case_inputs(index)
    keys_seen = bsa.dense_visible(inputs).sum(dim=1)
    sees_none = keys_seen == 0
    assert sees_none.any() and (inputs["lse"][:, :, sees_none] == float("-inf")).all()
    dq = P.reference(inputs)["dq"]
    # a row that sees one key has P = 1 there and dS = 0 too: rows of two keys or more differ from zero
    assert (dq[:, :, sees_none] == 0).all() and (dq[:, :, keys_seen >= 2] != 0).any(dim=-1).all()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_eager_gradients_agree_on_a_tiny_case():
    """FlexAttention's unfused path (on the CPU) reads mask_mod alone: here it holds the blocks too."""
    from torch.nn.attention.flex_attention import flex_attention
    shape = dict(B=1, H=4, Hkv=2, S=300, D=64, mask="causal", empty_query_blocks=[1])
    inputs = P.make_inputs(shape, "bfloat16", seed=2, device="cpu")
    visible = bsa.dense_visible(inputs)
    block_mask = bsa.to_block_mask(inputs, shape["S"], lambda b, h, i, j: visible[i, j])
    leaves = {n: inputs[n].clone().requires_grad_() for n in "qkv"}
    try:
        out = flex_attention(*leaves.values(), block_mask=block_mask, scale=inputs["scale"], enable_gqa=True)
        grads = torch.autograd.grad(out, tuple(leaves.values()), inputs["do"])
    except (RuntimeError, NotImplementedError) as error:
        pytest.skip(f"FlexAttention's backward does not run eagerly on the CPU here: {error}")
    flex = dict(zip(P.outputs, grads))
    exact, library = P.reference(inputs), P.library_output(inputs)
    assert all(check.passed for check in P.check(flex, exact, library))
    assert (flex["dq"][:, :, 128:256] == 0).all()  # FlexAttention's own convention on rows that see no key


def test_the_check_passes_the_library_and_fails_wrong_gradients():
    inputs = case_inputs(11)  # GQA 8/2, documents, an empty query block, large scores
    exact, library = P.reference(inputs), P.library_output(inputs)
    assert all(check.passed for check in P.check(library, exact, library))
    one_head = dict(library, dk=group_first_head_dk(inputs))  # dK of one query head, not the group's sum
    # a row that sees no key divided by its zero sum
    empty_row = dict(library, dq=library["dq"].clone().index_fill_(2, torch.tensor([2 * 128]), float("nan")))
    shifted = dict(library, dv=library["dv"].roll(1, dims=2))       # each key's dV on its neighbour
    for wrong, name in ((one_head, "dk"), (empty_row, "dq"), (shifted, "dv")):
        assert [c.passed for c in P.check(wrong, exact, library)] == [n != name for n in P.outputs]


def group_first_head_dk(inputs: dict) -> torch.Tensor:
    """dK computed as if each KV head served only the first query head of its group."""
    group = inputs["q"].shape[1] // inputs["k"].shape[1]
    first_heads = {**inputs, **{n: inputs[n][:, ::group] for n in ("q", "o", "lse", "do")}}
    return P.reference(first_heads)["dk"].to(inputs["k"].dtype)


def test_the_library_beyond_sdpas_length_is_the_block_by_block_forward_in_the_dtype(monkeypatch):
    inputs = case_inputs(15)
    through_sdpa = P.library_output(inputs)
    monkeypatch.setattr(bsa, "SDPA_MAX_TOKENS", 1099)  # case 15 is 1100 tokens long
    blockwise = P.library_output(inputs)
    exact = P.reference(inputs)
    assert all(blockwise[n].dtype == inputs["q"].dtype for n in P.outputs)
    assert not torch.equal(blockwise["dq"], through_sdpa["dq"])
    # a looser yardstick (fp16 sums: about 3× SDPA's errors here) that passes what SDPA computes
    assert all(check.passed for check in P.check(through_sdpa, exact, blockwise))


def test_inputs_are_the_forwards_with_its_exact_results_and_a_seeded_do():
    case = P.cases()[11]
    inputs = case_inputs(11)
    forward_inputs = FORWARD.make_inputs(case.shape, case.dtype, case.seed, case.input_scale, device="cpu")
    for name, value in forward_inputs.items():
        assert torch.equal(torch.as_tensor(inputs[name]), torch.as_tensor(value)) if name != "element_mask" \
            else inputs[name] == value
    exact = FORWARD.reference(forward_inputs)
    assert torch.equal(inputs["o"], exact["o"].to(torch.bfloat16))
    assert inputs["lse"].dtype == torch.float32 and torch.equal(inputs["lse"], exact["lse"].float())
    assert inputs["do"].shape == inputs["q"].shape and inputs["do"].dtype == torch.bfloat16
    other = P.make_inputs(case.shape, case.dtype, case.seed + 1, case.input_scale, device="cpu")
    assert torch.equal(case_inputs(11)["do"], inputs["do"]) and not torch.equal(other["do"], inputs["do"])
    assert P.variant(inputs) == FORWARD.variant(forward_inputs)
    out = P.allocate_outputs(inputs)
    assert all(out[f"d{n}"].shape == inputs[n].shape and out[f"d{n}"].isnan().all() for n in "qkv")


def test_cases_benchmarks_and_baselines_are_the_forwards():
    assert P.cases(seed=3) == FORWARD.cases(seed=3) and P.benchmarks() == FORWARD.benchmarks()
    assert P.forward == "block_sparse_attention" and set(FORWARD.outputs) <= set(case_inputs(0))
    inputs = case_inputs(9)
    for runs in (P.baselines(inputs), P.forward_backward_baselines(inputs)):
        assert set(runs) == {"flex_attention", "sdpa_dense_mask"}
        assert runs["sdpa_dense_mask"]() is None and runs["sdpa_dense_mask"]() is None


def test_flops_and_bytes_on_a_hand_counted_mask():
    # S = 300: blocks of 128, 128, 44 tokens. Causal: the six pairs (m, n <= m), 2.5 forwards of 4·D a pair
    causal = dict(B=1, H=1, S=300, D=64, mask="causal")
    assert P.flops(causal) == 2.5 * 4 * 64 * (3 * 128 * 128 + 2 * 44 * 128 + 44 * 44)
    # the diagonal graph with block 1 emptied: Q, O, dO and the LSE of 172 rows and K, V of 172 keys read,
    # dQ of 300 rows and dK, dV of 300 keys (2 KV heads) written, 2 listed blocks and 2·3 counts of int32
    emptied = dict(B=2, H=4, Hkv=2, S=300, D=64, mask="graph", neighbours=0, long_range=0, graph_seed=0,
                   empty_query_blocks=[1])
    query_side = 2 * 4 * (172 * (3 * 64 * 2 + 4) + 300 * 64 * 2)
    key_side = 2 * 2 * (2 * 172 * 64 * 2 + 2 * 300 * 64 * 2)
    assert P.min_bytes(emptied) == query_side + key_side + 4 * (2 + 6)


def test_compiled_flex_attention_donates_no_buffers():
    """backward_run replays a graph's backward (retain_graph=True), which a compiled backward with donated
    buffers refuses: compiling FlexAttention turns donation off for the process, before its first compile."""
    import torch._functorch.config as functorch_config

    from reference.block_sparse_attention import compiled_flex_attention

    compiled_flex_attention.cache_clear()
    with functorch_config.patch(donated_buffer=True):
        compiled_flex_attention()
        assert functorch_config.donated_buffer is False


def test_compiled_flex_attention_compiles_each_shape_for_itself():
    """A benchmark shape after another must not run kernels compiled for symbolic sizes."""
    from reference.block_sparse_attention import compiled_flex_attention

    compiled_flex_attention.cache_clear()
    seen = {}
    real = torch.compile

    def spy(fn, **options):
        seen.update(options)
        return real(fn, **options)
    torch.compile = spy
    try:
        compiled_flex_attention()
    finally:
        torch.compile = real
        compiled_flex_attention.cache_clear()
    assert seen.get("dynamic") is False
