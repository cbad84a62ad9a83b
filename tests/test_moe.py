"""The MoE references (reference/moe.py) and the routing problem (reference/moe_routing.py) against
independent numpy and loop code on small shapes, on the CPU: routing, loss, permutation check,
combine, the layer, the work counts, the cases."""
import numpy as np
import pytest
import torch

from reference import load, moe
from reference.moe_routing import ALPHA, INT_POISON, check_permutation, naive_routing, torch_routing

P = load("moe_routing")


# ---------------------------------------------------------------- independent implementations

def numpy_routing(logits: np.ndarray, k: int, block: int):
    """Loops and numpy: top-k by (logit descending, index ascending), weights, counts, offsets, loss."""
    T, E = logits.shape
    ids = np.zeros((T, k), dtype=np.int64)
    weights = np.zeros((T, k))
    for t in range(T):
        order = sorted(range(E), key=lambda e: (-float(logits[t, e]), e))[:k]
        ids[t] = order
        chosen = logits[t, order].astype(np.float64)
        w = np.exp(chosen - chosen.max())
        weights[t] = w / w.sum()
    counts = np.array([(ids == e).sum() for e in range(E)])
    offsets = [0]
    for e in range(E):
        offsets.append(offsets[-1] + (-(-counts[e] // block) * block if block else counts[e]))
    z = logits.astype(np.float64)
    probs = np.exp(z - z.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    f = counts / (T * k)
    aux = ALPHA * E * np.sum(f * probs.mean(0))
    var = 100 * np.mean((E * f - 1) ** 2)
    return ids, weights, counts, np.array(offsets), aux, var


def loop_outputs(inputs: dict, shuffle_seed: int | None = None) -> dict:
    """What a correct stage writes, built with Python loops; with shuffle_seed, each expert's
    token-slots in a random order (still correct: any order within an expert is)."""
    logits, y, k, block = inputs["logits"], inputs["y_perm"], inputs["top_k"], inputs["block"]
    T = logits.shape[0]
    ids, weights, counts, offsets, aux, var = numpy_routing(logits.numpy(), k, block)
    rng = np.random.default_rng(shuffle_seed)
    dest = np.zeros((T, k), dtype=np.int64)
    source = np.full(y.shape[0], -1, dtype=np.int64)
    for e in range(len(counts)):
        slots = [(t, j) for t in range(T) for j in range(k) if ids[t, j] == e]
        if shuffle_seed is not None:
            slots = [slots[i] for i in rng.permutation(len(slots))]
        for r, (t, j) in enumerate(slots):
            dest[t, j] = offsets[e] + r
            source[offsets[e] + r] = t
    yd = y.double().numpy()
    out = np.stack([sum(weights[t, j] * yd[dest[t, j]] for j in range(k)) for t in range(T)])
    i32 = dict(dtype=torch.int32)
    return dict(topk_ids=torch.tensor(ids, **i32), topk_weights=torch.tensor(weights, dtype=torch.float32),
                expert_counts=torch.tensor(counts, **i32), expert_offsets=torch.tensor(offsets, **i32),
                dest=torch.tensor(dest, **i32), source_token=torch.tensor(source, **i32),
                aux_loss=torch.tensor(aux, dtype=torch.float32), usage_var=torch.tensor(var, dtype=torch.float32),
                out=torch.tensor(out).to(y.dtype))


def small_inputs(T=37, E=12, k=3, block=8, hidden=16, dtype="bfloat16", seed=5, scale=1.0, **knobs):
    shape = dict(tokens=T, experts=E, top_k=k, block=block, hidden=hidden, **knobs)
    return P.make_inputs(shape, dtype, seed, input_scale=scale, device="cpu")


def failed(outputs, inputs):
    return {c.output for c in P.check(outputs, P.reference(inputs), P.library_output(inputs)) if not c.passed}


# ---------------------------------------------------------------- the routing reference

@pytest.mark.parametrize("T,E,k,block,knobs", [(37, 12, 3, 8, {}), (1, 8, 2, 0, {}), (50, 60, 6, 16, {"ties": True}),
                                               (64, 5, 1, 4, {"skew": 6}), (40, 9, 2, 0, {"empty": (0, 8)})])
def test_routing_reference_matches_numpy(T, E, k, block, knobs):
    inputs = small_inputs(T, E, k, block, **knobs)
    exact = P.reference(inputs)
    ids, weights, counts, offsets, aux, var = numpy_routing(inputs["logits"].numpy(), k, block)
    np.testing.assert_array_equal(exact["topk_ids"].numpy(), ids)
    np.testing.assert_allclose(exact["topk_weights"].numpy(), weights, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(exact["expert_counts"].numpy(), counts)
    np.testing.assert_array_equal(exact["expert_offsets"].numpy(), offsets)
    assert exact["aux_loss"].item() == pytest.approx(aux, rel=1e-12)
    assert exact["usage_var"].item() == pytest.approx(var, rel=1e-12, abs=1e-12)
    assert offsets[-1] <= inputs["y_perm"].shape[0] == moe.padded_capacity(T, E, k, block)


def test_ties_go_to_the_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.5, 0.5, 0.5, 0.5, 0.5]])
    ids, weights = moe.topk_exact(logits, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.allclose(weights, torch.full((2, 3), 1 / 3, dtype=torch.float64))
    assert (P.make_inputs(dict(tokens=200, experts=60, top_k=2, block=0, hidden=8, ties=True), "float16", 1,
                          device="cpu")["logits"] * 2).frac().eq(0).all()


def test_skew_and_empty_experts_shape_the_routing():
    skewed = P.reference(small_inputs(T=2000, E=32, k=2, skew=6))["expert_counts"]
    assert skewed[:3].sum() > 0.5 * skewed.sum()  # a few experts take most token-slots
    empty = P.reference(small_inputs(T=2000, E=32, k=2, empty=(3, 17)))["expert_counts"]
    assert empty[3] == 0 and empty[17] == 0 and empty.sum() == 4000


def test_balance_stats_of_known_routings():
    probs = torch.full((4, 4), 0.25)
    assert moe.balance_stats(probs, torch.tensor([2, 2, 2, 2]), 2, 0.01) == pytest.approx((0.01, 0.0))
    one_hot = torch.eye(4)[[0, 0, 0, 0]]  # every token certain of expert 0, and sent there
    aux, var = moe.balance_stats(one_hot, torch.tensor([4, 0, 0, 0]), 1, 0.01)
    assert aux == pytest.approx(0.01 * 4) and var == pytest.approx(100 * (9 + 1 + 1 + 1) / 4)


# ---------------------------------------------------------------- the check

def test_a_correct_output_passes_whatever_the_order_within_experts():
    inputs = small_inputs(T=45, E=7, k=2, block=4, dtype="float16")
    for shuffle in (None, 1, 2):
        assert not failed(loop_outputs(inputs, shuffle), inputs)


def test_the_permutation_check_rejects_wrong_permutations():
    inputs = small_inputs(T=30, E=6, k=2, block=4)
    exact = P.reference(inputs)
    good = loop_outputs(inputs, 3)
    ids = exact["topk_ids"]

    def check(dest, source):
        return check_permutation(dest, source, ids, exact["expert_counts"], exact["expert_offsets"]).passed

    assert check(good["dest"], good["source_token"])
    a, b = next((a, b) for a in range(60) for b in range(60) if ids.flatten()[a] != ids.flatten()[b])
    swapped, source = good["dest"].clone().flatten(), good["source_token"].clone()
    swapped[a], swapped[b] = swapped[b].clone(), swapped[a].clone()  # two slots in each other's expert
    source[swapped[a]], source[swapped[b]] = a // 2, b // 2
    assert not check(swapped.view(30, 2), source)
    a, b = next((a, b) for a in range(60) for b in range(a + 1, 60) if ids.flatten()[a] == ids.flatten()[b])
    twice = good["dest"].clone().flatten()
    twice[b] = twice[a]                                           # one row for two slots of an expert
    assert not check(twice.view(30, 2), good["source_token"])
    unpadded = good["source_token"].clone()
    unpadded[unpadded == -1] = 0                                  # padding rows not marked
    assert not check(good["dest"], unpadded)
    off_by_one = good["source_token"].clone()
    off_by_one[good["dest"][5, 0]] += 1                           # a row names the wrong token
    assert not check(good["dest"], off_by_one)
    poisoned = torch.full_like(good["dest"], INT_POISON)          # nothing written
    assert not check(poisoned, good["source_token"])
    padding_first = good["dest"].clone()                          # inside the segment, but in its padding
    e = int(ids[0, 0])
    pad_row = int(exact["expert_offsets"][e] + exact["expert_counts"][e])
    if pad_row < int(exact["expert_offsets"][e + 1]):
        padding_first[0, 0] = pad_row
        assert not check(padding_first, good["source_token"])


def test_the_check_catches_each_wrong_output():
    inputs = small_inputs(T=40, E=10, k=3, block=8, dtype="bfloat16")
    good = loop_outputs(inputs, 4)

    def broken(name, change):
        out = {k: v.clone() for k, v in good.items()}
        change(out[name])
        return failed(out, inputs)

    assert broken("topk_ids", lambda t: t.__setitem__((3, 0), (t[3, 0] + 1) % 10)) >= {"topk_ids"}
    assert broken("topk_weights", lambda t: t.mul_(1.001)) == {"topk_weights"}
    assert broken("expert_counts", lambda t: t.__setitem__(0, t[0] + 1)) == {"expert_counts"}
    assert broken("expert_offsets", lambda t: t.__setitem__(-1, t[-1] + 8)) == {"expert_offsets"}
    assert broken("aux_loss", lambda t: t.mul_(1.01)) == {"aux_loss"}
    assert broken("usage_var", lambda t: t.add_(1.0)) == {"usage_var"}
    assert broken("out", lambda t: t[7].mul_(1.05)) == {"out"}
    assert broken("out", lambda t: t.fill_(float("nan"))) == {"out"}
    unweighted = {k: v.clone() for k, v in good.items()}
    y = inputs["y_perm"].double()
    unweighted["out"] = y[good["dest"].long()].sum(1).to(inputs["y_perm"].dtype)
    assert failed(unweighted, inputs) == {"out"}


def test_poisoned_outputs_fail_every_check():
    inputs = small_inputs()
    assert failed(P.allocate_outputs(inputs), inputs) == set(P.outputs) - {"dest", "source_token"} | {"dest, source_token"}


# ---------------------------------------------------------------- the baselines

@pytest.mark.parametrize("block", [0, 8])
def test_pytorch_baselines_combine_like_the_loops(block):
    inputs = small_inputs(T=33, E=6, k=2, block=block, dtype="float16", seed=9)
    expected = loop_outputs(inputs)["out"].float()  # token-slots in (token, slot) order in each expert, as both do
    for baseline in (torch_routing, naive_routing):
        torch.testing.assert_close(baseline(inputs).float(), expected, rtol=2e-3, atol=2e-3)
    assert set(P.baselines(inputs)) == {"torch", "naive"}  # no `inter`: no layer to time


# ---------------------------------------------------------------- the layer

def dense_layer(layer, k):
    """Every expert on every token, in numpy float64, then the top-k mix."""
    x, wr, w1, w2 = (layer[n].double().numpy() for n in ("x", "wr", "w1", "w2"))
    ids, weights = moe.topk_exact(moe.router_logits(layer["x"], layer["wr"], layer["bias"]), k)
    inter = w2.shape[1]
    h1 = np.einsum("th,ehn->etn", x, w1)
    h = h1[..., :inter] / (1 + np.exp(-h1[..., :inter])) * h1[..., inter:]
    y = np.einsum("eti,eih->eth", h, w2)
    T = x.shape[0]
    return np.stack([sum(weights[t, j].item() * y[ids[t, j], t] for j in range(k)) for t in range(T)])


def test_layer_reference_matches_dense_numpy_and_the_loop():
    layer = moe.make_layer(24, 32, 48, 6, "float32", seed=3, skew=1.0, device="cpu")
    exact = moe.layer_reference(layer, 2)
    np.testing.assert_allclose(exact.numpy(), dense_layer(layer, 2), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(moe.layer_loop(layer, 2).double(), exact, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not moe.has_grouped_mm(), reason="torch._grouped_mm is missing")
def test_layer_grouped_mm_matches_the_reference():
    layer = moe.make_layer(40, 64, 32, 4, "bfloat16", seed=4, empty=(2,), device="cpu")
    try:
        out = moe.layer_grouped_mm(layer, 2)
    except (RuntimeError, NotImplementedError) as error:
        pytest.skip(f"torch._grouped_mm does not run here: {error}")
    exact = moe.layer_reference(layer, 2)
    assert (out.double() - exact).abs().max() <= 0.05 * exact.abs().max()
    ids, weights, _ = moe.torch_routing(moe.router_logits(layer["x"], layer["wr"], layer["bias"]), 2)
    assert torch.equal(moe.layer_grouped_mm(layer, 2, ids=ids, weights=weights), out)
    assert not torch.equal(moe.layer_grouped_mm(layer, 2, ids=ids.flip(1), weights=weights), out)


# ---------------------------------------------------------------- work, cases, inputs

def test_flops_and_bytes():
    assert moe.layer_flops(32768, 4096, 11008, 2) == 32768 * 2 * (2 * 4096 * 2 * 11008 + 2 * 11008 * 4096)
    shape = dict(tokens=32768, experts=32, top_k=2, block=128, hidden=4096)
    assert P.flops(shape) == 32768 * (5 * 32 + 2 * 2 * 4096)
    rows = 32768 * 2 + 32 * 127
    assert P.min_bytes(shape) == 4 * 32768 * 32 + 12 * 32768 * 2 + 4 * 65 + 8 + 4 * rows + 3 * 32768 * 4096 * 2


def test_cases_cover_what_the_spec_asks():
    cases = P.cases()
    assert len(cases) >= 20
    shapes = [c.shape for c in cases]
    assert {1, 1000, 4097} <= {s["tokens"] for s in shapes}
    assert {8, 32, 60, 256} <= {s["experts"] for s in shapes}
    assert {1, 2, 6, 8} <= {s["top_k"] for s in shapes}
    assert {0, 64, 128} == {s["block"] for s in shapes}
    assert any(s.get("skew") for s in shapes) and any(s.get("empty") for s in shapes) and any(s.get("ties") for s in shapes)
    assert any(s["hidden"] % 8 for s in shapes)
    assert {"float16", "bfloat16"} == {c.dtype for c in cases}
    assert any(c.input_scale == 10 for c in cases)
    assert all(s["top_k"] <= s["experts"] - len(s.get("empty", ())) for s in shapes)
    assert len({c.seed for c in cases}) == len(cases) and len({c.name for c in cases}) == len(cases)
    assert [c.seed for c in P.cases(seed=7)] != [c.seed for c in cases]
    benches = P.benchmarks()
    assert {(b["experts"], b["top_k"]) for b in benches} == {(32, 2), (8, 2), (256, 8)}
    assert {2048, 32768, 65536} <= {b["tokens"] for b in benches} and all(b.get("inter") for b in benches)


def test_inputs_are_seeded_and_outputs_poisoned():
    a, b, c = small_inputs(seed=3), small_inputs(seed=3), small_inputs(seed=4)
    assert torch.equal(a["logits"], b["logits"]) and torch.equal(a["y_perm"], b["y_perm"])
    assert not torch.equal(a["logits"], c["logits"])
    assert a["logits"].dtype == torch.float32 and a["y_perm"].shape == (moe.padded_capacity(37, 12, 3, 8), 16)
    out = P.allocate_outputs(a)
    assert set(out) == set(P.outputs)
    for name, t in out.items():
        assert (t == INT_POISON).all() if t.dtype == torch.int32 else t.isnan().all(), name
    assert P.variant(a) == {"dtype": "bfloat16"}
    assert P.variant(small_inputs(dtype="float16")) == {"dtype": "float16"}


def test_notes_put_the_kernel_beside_the_layer():
    notes = P.notes({}, 0.35, {"torch": 1.0, "naive": 9.0, "layer_grouped_mm": 35.0, "layer_loop": None})
    assert notes == ["routing + permutation + combine = 1.00% of the whole layer (layer_grouped_mm: 35.000 ms)"]
