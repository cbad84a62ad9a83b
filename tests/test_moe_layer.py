"""The whole-layer problem (reference/moe_layer.py) against an independent numpy layer on small shapes,
on the CPU: near-ties the kernel may resolve either way, wrong routings, wrong outputs, baselines, work."""
import numpy as np
import pytest
import torch

from reference import load, moe
from reference.moe_layer import TIE_TOL, check_topk
from reference.moe_routing import INT_POISON

P = load("moe_layer")


def small_inputs(T=40, E=8, k=2, hidden=32, inter=24, dtype="bfloat16", seed=5, scale=1.0, **knobs):
    shape = dict(tokens=T, experts=E, top_k=k, hidden=hidden, inter=inter, **knobs)
    return P.make_inputs(shape, dtype, seed, input_scale=scale, device="cpu")


def numpy_logits(inputs) -> np.ndarray:
    x, wr, bias = (inputs[n].double().numpy() for n in ("x", "wr", "bias"))
    return x @ wr + bias


def numpy_layer(inputs, ids) -> torch.Tensor:
    """Token by token in float64, routed by `ids`, weighted by the softmax of the exact logits there;
    rounded to the dtype, as a correct kernel writes it."""
    x, w1, w2 = (inputs[n].double().numpy() for n in ("x", "w1", "w2"))
    logits, ids = numpy_logits(inputs), ids.long().numpy()
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = logits[t, ids[t]]
        weights = np.exp(chosen - chosen.max()) / np.exp(chosen - chosen.max()).sum()
        for j, e in enumerate(ids[t]):
            gate, up = np.split(x[t] @ w1[e], 2)
            out[t] += weights[j] * ((gate / (1 + np.exp(-gate)) * up) @ w2[e])
    return torch.tensor(out).to(inputs["x"].dtype)


def ranked(inputs) -> torch.Tensor:
    """Every token's experts by decreasing exact logit, [T, E] int32."""
    return torch.tensor(np.argsort(-numpy_logits(inputs), axis=1, kind="stable"), dtype=torch.int32)


def outputs_routed_by(inputs, ids):
    return dict(out=numpy_layer(inputs, ids), topk_ids=ids.to(torch.int32))


def failed(outputs, inputs):
    return {c.output for c in P.check(outputs, P.reference(inputs), P.library_output(inputs)) if not c.passed}


# ---------------------------------------------------------------- inputs and outputs

def test_inputs_are_seeded_and_outputs_poisoned():
    a, b, c = small_inputs(seed=3), small_inputs(seed=3), small_inputs(seed=4)
    for name in ("x", "wr", "bias", "w1", "w2"):
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["x"], c["x"]) and a["top_k"] == 2 and a["bias"].dtype == torch.float32
    assert a["w1"].shape == (8, 32, 48) and a["w2"].shape == (8, 24, 32) and a["wr"].shape == (32, 8)
    out = P.allocate_outputs(a)
    assert set(out) == set(P.outputs) and out["out"].isnan().all() and out["out"].shape == (40, 32)
    assert out["topk_ids"].shape == (40, 2) and (out["topk_ids"] == INT_POISON).all()
    assert P.variant(a) == {"dtype": "bfloat16"}
    assert P.variant(small_inputs(dtype="float16")) == {"dtype": "float16"}
    assert P.benchmarks() == load("moe_experts").benchmarks() and P.cases() == load("moe_experts").cases()


# ---------------------------------------------------------------- the check

@pytest.mark.parametrize("dtype,knobs", [("bfloat16", {}), ("float16", dict(empty=(0, 5))),
                                         ("bfloat16", dict(T=1, E=16, k=8, skew=3, scale=10.0))])
def test_a_correct_output_passes(dtype, knobs):
    inputs = small_inputs(dtype=dtype, **knobs)
    ids = ranked(inputs)[:, :inputs["top_k"]]
    assert not failed(outputs_routed_by(inputs, ids), inputs)
    exact = moe.layer_reference(inputs, inputs["top_k"]).to(inputs["x"].dtype)  # the default routing
    assert not failed(dict(out=exact, topk_ids=ids), inputs)


def near_tie(inputs, token=0, gap=2e-7):
    """The inputs with one bias moved so that, for `token`, the (k+1)-th expert's exact logit is `gap`
    (relative to 1 + |logit|) below the k-th one's; the exact ids, and the ids with those two swapped."""
    k = inputs["top_k"]
    order = ranked(inputs)[token]
    kth, next_ = int(order[k - 1]), int(order[k])
    logits = numpy_logits(inputs)[token]
    bias = inputs["bias"].clone()
    bias[next_] += float(logits[kth] - logits[next_] - gap * (1 + abs(logits[kth])))
    tied = dict(inputs, bias=bias)
    ids = ranked(tied)[:, :k]
    other = ids.clone()
    other[token, k - 1] = next_
    return tied, ids, other


def test_a_near_tie_may_go_either_way_but_not_a_clear_choice():
    inputs, ids, other = near_tie(small_inputs())
    logits = numpy_logits(inputs)[0]
    assert 0 < logits[ids[0, 1]] - logits[other[0, 1]] < TIE_TOL and ids[0, 1] != other[0, 1]
    assert not failed(outputs_routed_by(inputs, ids), inputs)
    assert not failed(outputs_routed_by(inputs, other), inputs)
    assert "1 near-ties resolved otherwise" in P.check(outputs_routed_by(inputs, other), P.reference(inputs), {})[0].quality
    clear, ids, other = near_tie(small_inputs(), gap=1e-3)
    assert failed(outputs_routed_by(clear, other), clear) == {"topk_ids"}


def test_wrong_routings_fail():
    inputs = small_inputs(T=30, E=8, k=3)
    order = ranked(inputs)
    ids = order[:, :3].clone()
    logits = numpy_logits(inputs)
    gaps = logits[np.arange(30), order[:, 0]] - logits[np.arange(30), order[:, 1]]
    t = int(np.argmax(gaps))  # a token whose first choice is clear

    def routed(change):
        wrong = ids.clone()
        change(wrong)
        return wrong

    last = routed(lambda i: i.__setitem__((t, 2), order[t, -1]))         # the least likely expert
    assert failed(outputs_routed_by(inputs, last), inputs) == {"topk_ids"}
    assert failed(dict(out=numpy_layer(inputs, ids), topk_ids=last), inputs) == {"topk_ids", "out"}
    twice = routed(lambda i: i.__setitem__((t, 1), i[t, 0]))              # one expert twice
    assert failed(outputs_routed_by(inputs, twice), inputs) == {"topk_ids"}
    reversed_ = routed(lambda i: i[t].copy_(i[t].flip(0)))                 # right experts, wrong order
    assert failed(outputs_routed_by(inputs, reversed_), inputs) == {"topk_ids"}
    outside = routed(lambda i: i.__setitem__((t, 2), 8))                  # no such expert
    assert "topk_ids" in failed(dict(out=numpy_layer(inputs, ids), topk_ids=outside), inputs)
    assert failed(P.allocate_outputs(inputs), inputs) == {"topk_ids", "out"}


def test_wrong_outputs_fail():
    inputs = small_inputs(T=30, E=8, k=2, dtype="float16")
    ids = ranked(inputs)[:, :2]
    good = outputs_routed_by(inputs, ids)

    def changed(change):
        out = good["out"].clone()
        change(out)
        return failed(dict(good, out=out), inputs)

    assert changed(lambda o: o[7].mul_(1.05)) == {"out"}
    assert changed(lambda o: o[3, 5].fill_(float("nan"))) == {"out"}
    unweighted = moe.layer_reference(inputs, 2, ids=ids.long(), weights=torch.ones(30, 2, dtype=torch.float64))
    assert failed(dict(good, out=unweighted.half()), inputs) == {"out"}
    w1 = inputs["w1"]
    swapped = dict(inputs, w1=torch.cat([w1[..., 24:], w1[..., :24]], dim=-1))  # silu applied to the up half
    assert failed(dict(good, out=numpy_layer(swapped, ids)), inputs) == {"out"}


# ---------------------------------------------------------------- moe.py's routed references

def test_the_references_take_a_routing():
    inputs = small_inputs(T=25, E=6, k=2, dtype="float32")
    logits = moe.router_logits(inputs["x"], inputs["wr"], inputs["bias"])
    ids, weights = moe.topk_exact(logits, 2)
    assert torch.equal(moe.layer_reference(inputs, 2, ids=ids, weights=weights), moe.layer_reference(inputs, 2))
    torch.testing.assert_close(moe.layer_loop(inputs, 2, ids=ids, weights=weights.float()), moe.layer_loop(inputs, 2))
    exact = moe.router_logits(inputs["x"], inputs["wr"], inputs["bias"], dtype=torch.float64)
    assert exact.dtype == torch.float64 and np.allclose(exact.numpy(), numpy_logits(inputs), rtol=0, atol=1e-12)
    other = ids.flip(1)
    assert not torch.equal(moe.layer_reference(inputs, 2, ids=other, weights=weights), moe.layer_reference(inputs, 2))


# ---------------------------------------------------------------- baselines, notes, work

def test_baselines_pass_the_check():
    inputs = small_inputs(T=50, E=6, k=2, dtype="bfloat16", empty=(3,))
    ids = ranked(inputs)[:, :2]
    found = P.baselines(inputs)
    assert "naive" in found and set(found) <= {"naive", "grouped_mm"}
    for name, run in found.items():
        assert not failed(dict(out=run(), topk_ids=ids), inputs), name


def test_notes_give_tokens_per_second():
    notes = P.notes(dict(tokens=32768), 27.0, {"grouped_mm": 35.0, "naive": 100.0, "other": None})
    assert notes == ["32768 tokens: 1.21 M tokens/s (grouped_mm 0.94 M tokens/s, 1.30× faster; "
                     "naive 0.33 M tokens/s, 3.70× faster)"]
    assert P.notes(dict(tokens=4096), 20.0, {"grouped_mm": 10.0}) == [
        "4096 tokens: 0.20 M tokens/s (grouped_mm 0.41 M tokens/s, 2.00× slower)"]
    assert P.notes(dict(tokens=4096), 2.0, {}) == ["4096 tokens: 2.05 M tokens/s"]


def test_flops_and_bytes():
    shape = dict(tokens=32768, experts=32, top_k=2, hidden=4096, inter=11008)
    assert P.flops(shape) == 6 * 32768 * 2 * 4096 * 11008 == pytest.approx(17.73e12, rel=1e-3)
    weights = 2 * 32 * 3 * 4096 * 11008 + 2 * 4096 * 32 + 4 * 32
    assert P.min_bytes(shape) == weights + 2 * 2 * 32768 * 4096 + 4 * 32768 * 2


def test_check_topk_on_known_logits():
    logits = torch.tensor([[3.0, 1.0, 1.0 - 5e-6, -2.0], [0.0, 5.0, 4.0, 3.0]], dtype=torch.float64)

    def verdict(first_token_ids):
        check = check_topk(torch.tensor([first_token_ids, [1, 2]], dtype=torch.int32), logits)
        return check.passed, check.quality

    assert verdict([0, 1]) == (True, "exact")
    assert verdict([0, 2]) == (True, "exact but 1 near-ties resolved otherwise")
    assert verdict([2, 0]) == (False, "1 tokens wrong: 1 out of order")
    assert verdict([0, 3]) == (False, "1 tokens wrong: 1 not a top-k")
    assert verdict([0, 0]) == (False, "1 tokens wrong: 1 repeated")
    assert verdict([0, 4]) == (False, "1 tokens wrong: 1 out of range, 1 not a top-k")
    assert verdict([INT_POISON, INT_POISON])[0] is False


@pytest.mark.parametrize("tokens,hidden", [(128, 4096), (1, 64), (100, 200), (333, 4096), (8192, 4096), (5, 7168)])
def test_the_router_splits_hidden_into_whole_chunks_covering_it_when_tokens_are_few(tokens, hidden):
    """router_logits' grid: token tiles × splits of hidden, each split whole 32-element chunks, every
    split non-empty and together exactly [0, hidden); one split (and no router_sum) once the token tiles
    alone fill ROUTER_BLOCKS."""
    import stages.stage7_moe_layer as stage7
    calls = []

    class Kernels:
        def __getattr__(self, name):
            return lambda grid, block, *args, smem=0: calls.append((name, tuple(grid), args))

    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta")
    wr = torch.empty(hidden, 8, dtype=torch.bfloat16, device="meta")
    bias, logits = torch.empty(8, device="meta"), torch.empty(tokens, 8, device="meta")
    stage7.router_logits(Kernels(), x, wr, bias, logits)
    (name, grid, (params,)), *rest = calls
    tiles, splits = grid
    per_split = params.per_split
    assert name == "router_logits" and tiles == -(-tokens // stage7.ROUTER_TOKENS)
    assert per_split % stage7.ROUTER_K == 0
    starts = [s * per_split for s in range(splits)]
    assert all(start < hidden for start in starts) and splits * per_split >= hidden
    assert [n for n, _, _ in rest] == (["router_sum"] if splits > 1 else [])
    if tiles >= stage7.ROUTER_BLOCKS:
        assert splits == 1
