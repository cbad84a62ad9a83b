"""The attention problem's exact reference against an independent numpy implementation."""
import numpy as np
import pytest
import torch

from reference import load
from reference.attention import visible_pairs

P = load("attention")


def numpy_attention(q, k, v, scale, causal):
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    lse = np.zeros(q.shape[:3])
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                s = scale * k[b, h] @ q[b, h, i]
                if causal:
                    s[np.arange(k.shape[2]) > i] = -np.inf
                m = s.max()
                w = np.exp(s - m)
                lse[b, h, i] = m + np.log(w.sum())
                out[b, h, i] = w @ v[b, h] / w.sum()
    return out, lse


@pytest.mark.parametrize("Sq,Skv,causal", [(5, 5, False), (7, 7, True), (3, 9, True), (9, 3, True), (1, 4, False)])
def test_reference_matches_numpy(Sq, Skv, causal):
    shape = dict(B=2, H=3, Sq=Sq, Skv=Skv, D=64, causal=causal)
    inputs = P.make_inputs(shape, "float16", seed=Sq * 31 + Skv, input_scale=3.0, device="cpu")
    exact = P.reference(inputs)
    q, k, v = (inputs[n].double().numpy() for n in "qkv")
    out, lse = numpy_attention(q, k, v, inputs["scale"], causal)
    np.testing.assert_allclose(exact["o"].numpy(), out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(exact["lse"].numpy(), lse, rtol=1e-12)


@pytest.mark.parametrize("Sq,Skv", [(1, 1), (5, 5), (3, 9), (9, 3), (2048, 2048)])
def test_visible_pairs_counts_the_mask(Sq, Skv):
    from reference.attention import causal_mask
    assert visible_pairs(Sq, Skv, True) == int((~causal_mask(Sq, Skv, "cpu")).sum())
    assert visible_pairs(Sq, Skv, False) == Sq * Skv


def test_flops_and_bytes():
    shape = dict(B=16, H=16, Sq=2048, Skv=2048, D=64, causal=False)
    assert P.flops(shape) == 4 * 16 * 16 * 2048 * 2048 * 64
    assert P.flops(dict(shape, causal=True)) == pytest.approx(P.flops(shape) / 2, rel=1e-3)
    assert P.min_bytes(shape) == 16 * 16 * (4 * 2048 * 64 * 2 + 2048 * 4)


def test_cases_cover_what_the_spec_asks():
    cases = P.cases()
    assert len(cases) >= 20
    shapes = [c.shape for c in cases]
    assert any(s["Sq"] == 1 for s in shapes)
    assert {17, 239, 1000, 2047} <= {s["Sq"] for s in shapes}
    assert any(s["Sq"] != s["Skv"] for s in shapes)
    assert {True, False} == {s["causal"] for s in shapes}
    assert {"float16", "bfloat16"} == {c.dtype for c in cases}
    assert any(c.input_scale == 10 for c in cases)
    assert len({c.seed for c in cases}) == len(cases)
    assert [c.seed for c in P.cases(seed=7)] != [c.seed for c in cases]


def test_inputs_are_seeded_and_outputs_poisoned():
    shape = dict(B=1, H=2, Sq=5, Skv=6, D=64, causal=True)
    a = P.make_inputs(shape, "bfloat16", seed=3, device="cpu")
    b = P.make_inputs(shape, "bfloat16", seed=3, device="cpu")
    c = P.make_inputs(shape, "bfloat16", seed=4, device="cpu")
    assert torch.equal(a["q"], b["q"]) and not torch.equal(a["q"], c["q"])
    out = P.allocate_outputs(a)
    assert out["o"].isnan().all() and out["lse"].isnan().all()
    assert P.variant(a) == {"dtype": "bfloat16", "D": 64, "causal": 1}


# ---- grouped-query attention: K and V with H_kv heads, query head h with KV head h // (H / H_kv) ----------
@pytest.mark.parametrize("H,Hkv,Sq,Skv,causal", [(4, 2, 5, 5, False), (6, 2, 7, 7, True), (4, 1, 3, 9, True),
                                                  (8, 2, 9, 3, True)])
def test_grouped_reference_matches_numpy_with_each_query_heads_kv_head(H, Hkv, Sq, Skv, causal):
    shape = dict(B=2, H=H, Hkv=Hkv, Sq=Sq, Skv=Skv, D=64, causal=causal)
    inputs = P.make_inputs(shape, "bfloat16", seed=H * 7 + Hkv, input_scale=3.0, device="cpu")
    assert inputs["k"].shape == inputs["v"].shape == (2, Hkv, Skv, 64) and inputs["q"].shape == (2, H, Sq, 64)
    exact = P.reference(inputs)
    group = H // Hkv
    q, k, v = (inputs[n].double().numpy() for n in "qkv")
    kv_of = np.arange(H) // group  # query head h's KV head
    out, lse = numpy_attention(q, k[:, kv_of], v[:, kv_of], inputs["scale"], causal)
    np.testing.assert_allclose(exact["o"].numpy(), out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(exact["lse"].numpy(), lse, rtol=1e-12)


def test_without_hkv_or_with_hkv_equal_to_h_inputs_names_and_labels_are_as_before():
    shape = dict(B=2, H=4, Sq=7, Skv=9, D=64, causal=True)
    a = P.make_inputs(shape, "float16", seed=11, device="cpu")
    b = P.make_inputs(dict(shape, Hkv=4), "float16", seed=11, device="cpu")
    assert all(torch.equal(a[n], b[n]) for n in "qkv")
    assert P.shape_label(shape) == P.shape_label(dict(shape, Hkv=4)) == "B2 H4 Sq7 Skv9 D64 causal"
    assert P.shape_label(dict(shape, Hkv=1)) == "B2 H4 Hkv1 Sq7 Skv9 D64 causal"
    assert all("Hkv" not in b_ for b_ in P.benchmarks())
    assert [c.name for c in P.cases() if "Hkv" not in c.shape] == [c.name for c in P.cases() if "Hkv" not in c.name]
    # the query heads come from the generator first: with fewer KV heads, q is the same
    c = P.make_inputs(dict(shape, Hkv=2), "float16", seed=11, device="cpu")
    assert torch.equal(a["q"], c["q"]) and c["k"].shape[1] == 2
    with pytest.raises(ValueError, match="not a multiple"):
        P.make_inputs(dict(shape, Hkv=3), "float16", seed=11, device="cpu")


def test_the_cases_have_gqa_and_mqa_beyond_the_grid_limit():
    grouped = [c.shape for c in P.cases() if c.shape.get("Hkv", c.shape["H"]) != c.shape["H"]]
    assert any(s["H"] == 32 and s["Hkv"] == 8 for s in grouped)          # Llama-3, Mixtral
    assert any(s["Hkv"] == 1 for s in grouped)                           # MQA
    assert any(s["Sq"] != s["Skv"] for s in grouped) and {True, False} == {s["causal"] for s in grouped}
    assert any(s["B"] * s["H"] > 65535 and 65535 % (s["H"] // s["Hkv"]) for s in grouped)  # slices round to groups
    assert all(s["H"] % s["Hkv"] == 0 for s in grouped)


def test_grouped_library_and_naive_pass_the_rule_and_bytes_count_kv_heads_once():
    shape = dict(B=1, H=4, Hkv=2, Sq=9, Skv=12, D=64, causal=True)
    inputs = P.make_inputs(shape, "float16", seed=2, device="cpu")
    exact, library = P.reference(inputs), P.library_output(inputs)
    assert all(check.passed for check in P.check(dict(library, lse=exact["lse"].float()), exact, library))
    from reference.attention import naive_attention
    torch.testing.assert_close(naive_attention(inputs).double(), exact["o"], rtol=2e-2, atol=2e-2)
    full = dict(shape, Hkv=4)
    assert P.min_bytes(full) - P.min_bytes(shape) == 1 * 2 * 2 * 12 * 64 * 2  # two fewer heads of K and V
    assert P.flops(full) == P.flops(shape)
