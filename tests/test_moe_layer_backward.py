"""The MoE layer's backward problem (reference/moe_layer_backward.py) on the CPU: its exact gradients against
finite differences and a loss written token by token, the load-balancing term, the saved routing at a tie,
its cases, inputs, outputs, check, baselines and work."""
import pytest
import torch

from reference import load, moe
from reference.moe_layer_backward import DIFFERENTIATED, routed_layer
from reference.moe_routing import ALPHA

P = load("moe_layer_backward")
FORWARD = load("moe_layer")


def small_inputs(T=6, E=4, k=2, hidden=8, inter=6, dtype="float64", seed=5, **knobs):
    shape = dict(tokens=T, experts=E, top_k=k, hidden=hidden, inter=inter, **knobs)
    return P.make_inputs(shape, dtype, seed, device="cpu")


def plain_loss(inputs, x, wr, bias, w1, w2):
    """L of the module docstring, token by token in float64: Σ dY·out + aux_coef·E·Σ_i f_i·P_i."""
    ids, dy, coef = inputs["topk_ids"].long(), inputs["dy"].double(), inputs["aux_coef"]
    (T, k), E, inter = ids.shape, wr.shape[1], w2.shape[1]
    logits = x @ wr + bias
    loss = 0
    for t in range(T):
        weights = torch.softmax(logits[t, ids[t]], dim=0)
        for j in range(k):
            h1 = x[t] @ w1[ids[t, j]]
            y = (torch.nn.functional.silu(h1[:inter]) * h1[inter:]) @ w2[ids[t, j]]
            loss = loss + weights[j] * (dy[t] @ y)
    f = torch.stack([(ids == i).sum() for i in range(E)]).double() / (T * k)
    return loss + coef * E * (f * torch.softmax(logits, dim=1).mean(0)).sum()


def leaves_of(inputs):
    return tuple(inputs[n].double().clone().requires_grad_() for n in DIFFERENTIATED)


def plain_gradients(inputs):
    leaves = leaves_of(inputs)
    return dict(zip(P.outputs, torch.autograd.grad(plain_loss(inputs, *leaves), leaves)))


def assert_gradients_equal(found, expected):
    for name in P.outputs:
        assert found[name].dtype == torch.float64, name
        torch.testing.assert_close(found[name], expected[name], rtol=1e-10, atol=1e-12, msg=name)


# ---------------------------------------------------------------- the exact gradients

def test_the_layer_reference_differentiates_as_finite_differences():
    inputs = small_inputs(T=4, E=3, k=2, hidden=4, inter=3)

    def layer(*leaves):
        return routed_layer(inputs, dict(zip(DIFFERENTIATED, leaves)), moe.layer_reference, torch.float64)

    assert torch.autograd.gradcheck(layer, leaves_of(inputs))
    assert torch.autograd.gradcheck(lambda *leaves: plain_loss(inputs, *leaves), leaves_of(inputs))


@pytest.mark.parametrize("knobs", [{}, dict(T=1, E=8, k=8), dict(T=9, E=6, k=3, skew=4, empty=(2,)),
                                   dict(dtype="bfloat16", T=7)])
def test_the_reference_is_the_gradient_of_the_loss_written_token_by_token(knobs):
    inputs = small_inputs(**knobs)
    assert_gradients_equal(P.reference(inputs), plain_gradients(inputs))


def test_the_load_balancing_gradient_is_added_to_the_routers():
    """The reference with aux_coef less the reference without: the closed form of the docstring,
    dlogits[t, i] = aux_coef · E / T · p[t, i] · (f_i - Σ_l f_l · p[t, l]), through Wr, the bias and x only."""
    inputs = small_inputs(T=9, E=5, k=2, skew=2)
    with_aux, without = P.reference(inputs), P.reference(dict(inputs, aux_coef=0.0))
    x, wr = inputs["x"], inputs["wr"]
    (T, E), k = (x.shape[0], wr.shape[1]), inputs["top_k"]
    p = torch.softmax(x @ wr + inputs["bias"].double(), dim=1)
    f = torch.bincount(inputs["topk_ids"].flatten().long(), minlength=E).double() / (T * k)
    dlogits = ALPHA * E / T * p * (f - (p * f).sum(1, keepdim=True))
    expected = dict(dx=dlogits @ wr.T, dwr=x.T @ dlogits, dbias=dlogits.sum(0),
                    dw1=torch.zeros_like(inputs["w1"]), dw2=torch.zeros_like(inputs["w2"]))
    assert inputs["aux_coef"] == ALPHA and dlogits.abs().max() > 1e-4
    for name in P.outputs:
        torch.testing.assert_close(with_aux[name] - without[name], expected[name], rtol=1e-9, atol=1e-13, msg=name)


def test_no_gradient_flows_through_the_choice_of_experts():
    """With k = 1 each token's weight is 1 (a softmax over one logit): without the load-balancing term the
    router gets no gradient at all, though every token's expert depends on the logits."""
    inputs = dict(small_inputs(T=7, E=4, k=1), aux_coef=0.0)
    exact = P.reference(inputs)
    assert exact["dbias"].abs().max() == 0 and exact["dwr"].abs().max() == 0
    assert exact["dw1"].abs().max() > 0


def test_the_saved_routing_is_followed_at_a_tie():
    """Experts 0 and 1 tie exactly for every token (equal router columns and biases), behind expert 2: the
    exact top-k picks 0 (ties go to the lower expert); a forward that picked 1 has its own gradients."""
    inputs = small_inputs(T=5, E=4, k=2)
    wr, bias = inputs["wr"].clone(), torch.tensor([1.0, 1.0, 30.0, -30.0])
    wr[:, 1] = wr[:, 0]
    tied = dict(inputs, wr=wr, bias=bias)
    ids = moe.topk_exact(moe.router_logits(tied["x"], wr, bias), 2)[0]
    assert (ids[:, 0] == 2).all() and (ids[:, 1] == 0).all()
    other = ids.clone()
    other[:, 1] = 1
    lower, upper = P.reference(dict(tied, topk_ids=ids)), P.reference(dict(tied, topk_ids=other))
    assert lower["dw1"][1].abs().max() == 0 and lower["dw1"][0].abs().max() > 0
    assert upper["dw1"][0].abs().max() == 0 and upper["dw1"][1].abs().max() > 0
    assert_gradients_equal(upper, plain_gradients(dict(tied, topk_ids=other)))


# ---------------------------------------------------------------- inputs, outputs, cases

def test_inputs_are_the_forwards_with_its_exact_routing_and_a_seeded_dy():
    inputs = small_inputs(T=20, E=8, k=2, hidden=16, inter=8, dtype="bfloat16", seed=3)
    forward = FORWARD.make_inputs(dict(tokens=20, experts=8, top_k=2, hidden=16, inter=8), "bfloat16", 3,
                                  device="cpu")
    for name in ("x", "wr", "bias", "w1", "w2"):
        assert torch.equal(inputs[name], forward[name]), name
    ids, weights = moe.topk_exact(moe.router_logits(forward["x"], forward["wr"], forward["bias"]), 2)
    assert inputs["topk_ids"].dtype == torch.int32 and torch.equal(inputs["topk_ids"], ids)
    assert inputs["topk_weights"].dtype == torch.float32 and torch.equal(inputs["topk_weights"], weights.float())
    assert inputs["dy"].shape == (20, 16) and inputs["dy"].dtype == torch.bfloat16 and inputs["aux_coef"] == ALPHA
    again, other = (small_inputs(T=20, E=8, k=2, hidden=16, inter=8, dtype="bfloat16", seed=s) for s in (3, 4))
    assert torch.equal(again["dy"], inputs["dy"]) and not torch.equal(other["dy"], inputs["dy"])
    assert P.variant(inputs) == {"dtype": "bfloat16"} and P.forward == "moe_layer"


def test_outputs_are_poisoned_and_shaped_as_what_they_differentiate():
    inputs = small_inputs(dtype="float16")
    outputs = P.allocate_outputs(inputs)
    assert set(outputs) == set(P.outputs) == {"dx", "dwr", "dbias", "dw1", "dw2"}
    for name in DIFFERENTIATED:
        grad = outputs[f"d{name}"]
        assert grad.shape == inputs[name].shape and grad.dtype == inputs[name].dtype and grad.isnan().all()
    assert outputs["dbias"].dtype == torch.float32 and outputs["dw1"].shape == (4, 8, 12)


def test_cases_are_the_forwards_then_deepseek_like_ones_each_unique():
    cases, forward = P.cases(), FORWARD.cases()
    assert cases[:len(forward)] == forward and len(cases) > len(forward)
    assert len({c.name for c in cases}) == len({c.seed for c in cases}) == len(cases)
    assert [c.seed for c in P.cases(seed=7)] != [c.seed for c in cases]
    shapes = [c.shape for c in cases]
    assert any(s["tokens"] == 1 for s in shapes) and any(s["tokens"] % 8 for s in shapes)
    assert any(s.get("skew") for s in shapes) and any(s.get("empty") for s in shapes)
    assert {"float16", "bfloat16"} == {c.dtype for c in cases}
    deepseek = [c for c in cases[len(forward):] if c.shape["experts"] == 256 and c.shape["top_k"] == 8]
    assert len(deepseek) == len(cases) - len(forward) and {"float16", "bfloat16"} == {c.dtype for c in deepseek}
    # the forward's benchmark shapes up to 32,768 tokens: the seed's and the DeepSeek-like one among them
    from reference.moe_layer_backward import MAX_BENCHMARK_TOKENS
    assert P.benchmarks() == [s for s in FORWARD.benchmarks() if s["tokens"] <= MAX_BENCHMARK_TOKENS]
    assert {(s["tokens"], s["experts"]) for s in P.benchmarks()} >= {(32768, 32), (4096, 256)}


# ---------------------------------------------------------------- the check and the baselines

def failing(outputs, exact, library):
    return {c.output for c in P.check(outputs, exact, library) if not c.passed}


def test_the_library_passes_and_wrong_gradients_fail():
    inputs = small_inputs(T=40, E=8, k=2, hidden=32, inter=24, dtype="bfloat16", empty=(5,))
    exact, library = P.reference(inputs), P.library_output(inputs)
    assert not failing(library, exact, library)

    def changed(name, change):
        outputs = {n: g.clone() for n, g in library.items()}
        change(outputs[name])
        return failing(outputs, exact, library)

    used = int(inputs["topk_ids"][0, 0])
    assert changed("dx", lambda g: g[3].mul_(1.1)) == {"dx"}
    assert changed("dw1", lambda g: g[used].zero_()) == {"dw1"}
    assert changed("dw2", lambda g: g[5].fill_(float("nan"))) == {"dw2"}  # an empty expert's, left unwritten
    assert changed("dbias", lambda g: g.neg_()) == {"dbias"}
    swapped = dict(inputs, w1=torch.cat([inputs["w1"][..., 24:], inputs["w1"][..., :24]], dim=-1))
    silu_on_the_up_half = {n: g.to(library[n].dtype) for n, g in P.reference(swapped).items()}
    assert failing(silu_on_the_up_half, exact, library) == set(P.outputs)
    assert failing(P.allocate_outputs(inputs), exact, library) == set(P.outputs)


def test_baselines_give_gradients_that_pass():
    inputs = small_inputs(T=30, E=6, k=2, hidden=16, inter=16, dtype="bfloat16", empty=(3,))
    exact, library = P.reference(inputs), P.library_output(inputs)
    for found in (P.baselines(inputs), P.forward_backward_baselines(inputs)):
        assert "naive" in found and set(found) <= {"naive", "grouped_mm"}
        for name, run in found.items():
            first, again = run(), run()  # a backward alone runs again on its kept graph
            assert all(torch.equal(first[n], again[n]) for n in P.outputs), name
            assert not failing(first, exact, library), name
    backward_alone = P.baselines(inputs)
    yardstick = backward_alone.get("grouped_mm") or backward_alone["naive"]  # grouped_mm where it runs
    assert all(torch.equal(yardstick()[n], library[n]) for n in P.outputs)


# ---------------------------------------------------------------- work

def test_flops_are_twice_the_forwards_and_bytes_count_each_tensor_once():
    shape = dict(tokens=3, experts=4, top_k=2, hidden=8, inter=6)
    assert P.flops(shape) == 6 * 12 * 8 * 6 == 2 * FORWARD.flops(shape)  # 6 token-slots, 12·hidden·I each
    weights = (4 + 4) * 3 * 8 * 6 * 2       # W1, W2 in; dW1, dW2 out (bf16)
    router = 2 * (8 * 4 * 2 + 4 * 4)        # Wr, bias in; dWr, dBias out
    tokens = 3 * 3 * 8 * 2 + 2 * 4 * 3 * 2  # x, dY in, dX out; topk_ids, topk_weights in
    assert P.min_bytes(shape) == weights + router + tokens == 2656
    assert P.min_bytes(dict(shape, empty=(1,))) == 2656 - 3 * 8 * 6 * 2  # an empty expert's weights not read
    seed = dict(tokens=32768, experts=32, top_k=2, hidden=4096, inter=11008)
    assert P.flops(seed) == 12 * 32768 * 2 * 4096 * 11008 == pytest.approx(35.46e12, rel=1e-3)
