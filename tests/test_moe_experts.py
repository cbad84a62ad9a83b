"""The experts problem (reference/moe_experts.py) against independent numpy and loop code on small
shapes, on the CPU: the permuted layout, the reference, the check, the baselines, work and cases."""
import numpy as np
import pytest
import torch

from reference import load, moe
from reference.moe_experts import BLOCK

P = load("moe_experts")


def small_inputs(T=45, E=6, k=2, hidden=24, inter=16, dtype="bfloat16", seed=5, scale=1.0, **knobs):
    shape = dict(tokens=T, experts=E, top_k=k, hidden=hidden, inter=inter, **knobs)
    return P.make_inputs(shape, dtype, seed, input_scale=scale, device="cpu")


def failed(outputs, inputs):
    return {c.output for c in P.check(outputs, P.reference(inputs), P.library_output(inputs)) if not c.passed}


def exact_output(inputs):
    """What a correct kernel writes: the exact FFN rounded to the dtype, 0 in the padding rows."""
    return dict(y_perm=P.reference(inputs)["y_perm"].to(inputs["x_perm"].dtype))


def loop_layout(inputs):
    """With Python loops: the routed layer again, and each expert's (token, slot)s in order."""
    spec = inputs["shape"]
    layer = moe.make_layer(spec["tokens"], spec["hidden"], spec["inter"], spec["experts"], spec["dtype"],
                           spec["seed"], skew=spec.get("skew", 0.0), empty=spec.get("empty", ()), device="cpu")
    ids, _ = moe.topk_exact(moe.router_logits(layer["x"], layer["wr"], layer["bias"]), spec["top_k"])
    T, k = ids.shape
    slots = [[(t, j) for t in range(T) for j in range(k) if ids[t, j] == e] for e in range(spec["experts"])]
    return layer, slots


# ---------------------------------------------------------------- inputs and outputs

def test_inputs_are_seeded_and_outputs_poisoned():  # and every case's dimensions suit TMA (stage 6)
    assert all(c.shape["hidden"] % 8 == 0 and c.shape["inter"] % 8 == 0 and min(c.shape["hidden"], c.shape["inter"]) >= 64
               for c in P.cases())
    a, b, c = small_inputs(seed=3), small_inputs(seed=3), small_inputs(seed=4)
    for name in ("x_perm", "expert_offsets", "expert_counts", "w1", "w2"):
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["w1"], c["w1"])
    assert a["expert_offsets"].dtype == a["expert_counts"].dtype == torch.int32
    assert a["w1"].shape == (6, 24, 32) and a["w2"].shape == (6, 16, 24)
    out = P.allocate_outputs(a)
    assert set(out) == set(P.outputs) and out["y_perm"].shape == a["x_perm"].shape
    valid = torch.zeros(a["x_perm"].shape[0], dtype=torch.bool)
    valid[P.reference(a)["valid_rows"]] = True
    assert out["y_perm"][valid].isnan().all() and (out["y_perm"][~valid] == 0).all()  # NaN where checked
    assert P.variant(a) == {"dtype": "bfloat16"}
    assert P.variant(small_inputs(dtype="float16")) == {"dtype": "float16"}


@pytest.mark.parametrize("knobs", [dict(T=45, E=6, k=2), dict(T=1, E=8, k=2), dict(T=300, E=4, k=1, skew=6),
                                   dict(T=80, E=7, k=3, empty=(0, 3, 6))])
def test_x_perm_holds_each_experts_token_slots_in_order_then_copies_of_the_last(knobs):
    inputs = small_inputs(**knobs)
    layer, slots = loop_layout(inputs)
    x_perm, offsets, counts = inputs["x_perm"], inputs["expert_offsets"].tolist(), inputs["expert_counts"].tolist()
    assert counts == [len(s) for s in slots]
    assert offsets[0] == 0 and all(o % BLOCK == 0 for o in offsets) and x_perm.shape[0] == offsets[-1]
    assert all(offsets[e + 1] - offsets[e] == -(-counts[e] // BLOCK) * BLOCK for e in range(len(counts)))
    for e, expert_slots in enumerate(slots):
        for r, (t, _) in enumerate(expert_slots):
            assert torch.equal(x_perm[offsets[e] + r], layer["x"][t])
        for r in range(len(expert_slots), offsets[e + 1] - offsets[e]):  # padding: the last token-slot again
            assert torch.equal(x_perm[offsets[e] + r], layer["x"][expert_slots[-1][0]])


# ---------------------------------------------------------------- the reference

def test_reference_matches_numpy_row_by_row():
    inputs = small_inputs(T=30, E=5, k=2, hidden=16, inter=24, dtype="float16", empty=(2,))
    exact = P.reference(inputs)["y_perm"].numpy()
    x, w1, w2 = (inputs[n].double().numpy() for n in ("x_perm", "w1", "w2"))
    offsets, counts = inputs["expert_offsets"].tolist(), inputs["expert_counts"].tolist()
    expected = np.zeros_like(x)
    for e in range(5):
        for r in range(offsets[e], offsets[e] + counts[e]):
            gate, up = np.split(x[r] @ w1[e], 2)
            expected[r] = (gate / (1 + np.exp(-gate)) * up) @ w2[e]
    np.testing.assert_allclose(exact, expected, rtol=1e-12, atol=1e-12)
    assert counts[2] == 0 and np.abs(expected).sum(1).astype(bool).sum() == sum(counts)


# ---------------------------------------------------------------- the check

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_correct_output_passes(dtype):
    inputs = small_inputs(T=60, E=6, k=2, dtype=dtype, empty=(4,))
    assert not failed(exact_output(inputs), inputs)
    assert not failed(P.library_output(inputs), inputs)


def test_the_check_catches_each_wrong_output():
    inputs = small_inputs(T=60, E=6, k=2, hidden=24, inter=16)
    good = exact_output(inputs)["y_perm"]
    offsets, counts = inputs["expert_offsets"].tolist(), inputs["expert_counts"].tolist()
    a, b = [offsets[e] for e in range(6) if counts[e]][:2]  # first rows of two experts
    pad = next(offsets[e] + counts[e] for e in range(6) if counts[e] % BLOCK)

    def changed(change):
        y = good.clone()
        change(y)
        return failed(dict(y_perm=y), inputs)

    assert changed(lambda y: y.index_copy_(0, torch.tensor([a, b]), y[[b, a]])) == {"y_perm"}       # rows swapped between experts
    assert changed(lambda y: y[a].mul_(1.05)) == {"y_perm"}                   # one valid row a little off
    assert changed(lambda y: y[b, 3].fill_(float("nan"))) == {"y_perm"}       # one element not written
    assert changed(lambda y: y[pad].fill_(7.0)) == set()                       # padding rows are not checked
    padding = torch.ones(good.shape[0], dtype=torch.bool)
    padding[P.reference(inputs)["valid_rows"]] = False
    assert changed(lambda y: y.masked_fill_(padding[:, None], -3.0)) == set()  # nor all of them
    assert changed(lambda y: y.masked_fill_(~padding[:, None], -3.0)) == {"y_perm"}
    w1 = inputs["w1"]
    swapped = dict(inputs, w1=torch.cat([w1[..., 16:], w1[..., :16]], dim=-1))  # silu applied to the up half
    assert failed(dict(y_perm=P.reference(swapped)["y_perm"].to(good.dtype)), inputs) == {"y_perm"}
    assert failed(P.allocate_outputs(inputs), inputs) == {"y_perm"}


# ---------------------------------------------------------------- the baselines

def test_baselines_compute_the_valid_rows():
    inputs = small_inputs(T=50, E=5, k=2, dtype="bfloat16", empty=(1,))
    exact, library = P.reference(inputs), P.library_output(inputs)
    rows = exact["valid_rows"]
    found = P.baselines(inputs)
    assert "naive" in found and set(found) <= {"naive", "grouped_mm"}
    loop = found["naive"]()
    assert torch.equal(loop, library["y_perm"])  # the library is the loop: the same rows, padding 0
    if "grouped_mm" in found:  # unpadded: one row per token-slot
        grouped = found["grouped_mm"]()
        assert grouped.shape == (len(rows), 24)
        assert P.check(dict(y_perm=loop.index_put((rows,), grouped)), exact, library)[0].passed


# ---------------------------------------------------------------- work, cases

def test_flops_and_bytes():
    seed = moe.CONFIGS["seed"]
    shape = dict(tokens=32768, experts=32, top_k=2, hidden=seed["hidden"], inter=seed["inter"])
    assert P.flops(shape) == 6 * 32768 * 2 * 4096 * 11008 == pytest.approx(17.73e12, rel=1e-3)
    assert P.min_bytes(shape) == 2 * (32 * (4096 * 2 * 11008 + 11008 * 4096) + 2 * 32768 * 2 * 4096)
    assert P.min_bytes(dict(shape, empty=(0, 1))) == P.min_bytes(shape) - 2 * 2 * 3 * 4096 * 11008


def test_cases_cover_what_the_spec_asks():
    cases = P.cases()
    assert len(cases) >= 20
    shapes = [c.shape for c in cases]
    assert {1, 37, 333, 1000, 4097} <= {s["tokens"] for s in shapes}
    assert {2, 8, 16, 32, 64} <= {s["experts"] for s in shapes} and {1, 2, 4, 8} <= {s["top_k"] for s in shapes}
    assert any(s["top_k"] == 8 and s["experts"] == 64 for s in shapes)
    assert all(s["hidden"] % 8 == 0 and s["inter"] % 8 == 0 for s in shapes)
    assert sum(s["hidden"] % 64 != 0 and s["inter"] % 64 != 0 for s in shapes) >= 3
    assert sum(s["hidden"] % 128 == 0 and s["inter"] % 128 == 0 for s in shapes) >= 3
    empties = [s["empty"] for s in shapes if s.get("empty")]
    assert any(0 in e for e in empties) and any(s["experts"] - 1 in s.get("empty", ()) for s in shapes)
    assert any(0 < min(e) for e in empties)  # a middle expert
    assert {"float16", "bfloat16"} == {c.dtype for c in cases} and any(c.input_scale == 10 for c in cases)
    assert all(s["top_k"] <= s["experts"] - len(s.get("empty", ())) for s in shapes)
    assert len({c.seed for c in cases}) == len(cases) and len({c.name for c in cases}) == len(cases)
    assert [c.seed for c in P.cases(seed=7)] != [c.seed for c in cases]


def test_skewed_cases_give_an_expert_several_tiles():
    skewed = [c for c in P.cases() if c.shape.get("skew") and c.shape["hidden"] * c.shape["experts"] <= 8192]
    most = [int(P.make_inputs(c.shape, c.dtype, c.seed, device="cpu")["expert_counts"].max()) for c in skewed]
    assert sum(m >= 300 for m in most) >= 2, most


def test_benchmarks_are_the_configs():
    benches = P.benchmarks()
    assert all(b["dtype"] == "bfloat16" and not b.get("skew") for b in benches)
    assert {(b["tokens"], b["experts"], b["top_k"], b["hidden"], b["inter"]) for b in benches} == {
        (2048, 32, 2, 4096, 11008), (32768, 32, 2, 4096, 11008), (65536, 32, 2, 4096, 11008),
        (4096, 8, 2, 4096, 14336), (4096, 256, 8, 7168, 2048)}
    assert P.shape_label(dict(benches[0], skew=6, empty=(3, 17))) == "T2048 E32 k2 hidden4096 inter11008 skew6 empty3,17"
