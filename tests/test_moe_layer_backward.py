"""The MoE layer's backward problem (reference/moe_layer_backward.py) on the CPU: its exact gradients against
finite differences and a loss written token by token, the load-balancing term, the saved routing at a tie, the
saved activations (what make_inputs saves, the reference at their values, NaN padding rows), its cases, inputs,
outputs, check, baselines, work and saved bytes."""
import pytest
import torch

from reference import load, moe
from reference.moe_experts import BLOCK, valid_rows
from reference.moe_layer_backward import (DIFFERENTIATED, Saved, forward_saved, grouped_mm_saved_bytes, routed_layer,
                                          saved_bytes_per_slot, saved_of)
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


def exactly_saved(inputs, **changes):
    """The inputs with `changes`, and what a float64 forward routed by their topk_ids saves: the exact logits,
    their softmax at the ids, and h1 = x·W1 exactly (float64; NaN on the padding rows)."""
    i = dict(inputs, **changes)
    x, wr, bias, w1 = (i[n].double() for n in ("x", "wr", "bias", "w1"))
    saved = forward_saved(i["x"], i["wr"], i["bias"], i["w1"], i["top_k"], i["topk_ids"])
    ids, dest = i["topk_ids"].long(), saved.dest.long()
    logits = moe.router_logits(x, wr, bias, dtype=torch.float64)
    h1 = torch.full(saved.h1.shape, float("nan"), dtype=torch.float64)
    h1[dest.flatten()] = torch.einsum("sh,shn->sn", x.repeat_interleave(i["top_k"], 0), w1[ids.flatten()])
    return dict(i, **saved._replace(logits=logits, topk_weights=torch.softmax(logits.gather(1, ids), 1),
                                    h1=h1)._asdict())


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
    """At exactly saved values (float64 logits and h1) the reference at the saved activations is the plain one."""
    inputs = exactly_saved(small_inputs(**knobs))
    assert_gradients_equal(P.reference(inputs), plain_gradients(inputs))


def test_the_load_balancing_gradient_is_added_to_the_routers():
    """The reference with aux_coef less the reference without: the closed form of the docstring,
    dlogits[t, i] = aux_coef · E / T · p[t, i] · (f_i - Σ_l f_l · p[t, l]), through Wr, the bias and x only."""
    inputs = exactly_saved(small_inputs(T=9, E=5, k=2, skew=2))
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
    lower, upper = P.reference(exactly_saved(tied, topk_ids=ids)), P.reference(exactly_saved(tied, topk_ids=other))
    assert lower["dw1"][1].abs().max() == 0 and lower["dw1"][0].abs().max() > 0
    assert upper["dw1"][0].abs().max() == 0 and upper["dw1"][1].abs().max() > 0
    assert_gradients_equal(upper, plain_gradients(dict(tied, topk_ids=other)))


# ---------------------------------------------------------------- the saved activations

def test_make_inputs_saves_an_exact_forwards_routing_permutation_and_h1():
    """logits and top-k as the exact forward's; counts, offsets, dest and source_token one permutation, each
    expert's token-slots in its segment in (token, slot) order; h1 = x·W1 (fp32, rounded once) on its rows,
    NaN on every padding row and every row past offsets[E]."""
    T, E, k, hidden, inter = 300, 8, 2, 16, 24
    inputs = small_inputs(T=T, E=E, k=k, hidden=hidden, inter=inter, dtype="bfloat16", skew=3, empty=(6,))
    saved = saved_of(inputs)
    assert isinstance(saved, Saved)
    for mine, again in zip(saved, forward_saved(*(inputs[n] for n in ("x", "wr", "bias", "w1")), k)):
        torch.testing.assert_close(mine, again, rtol=0, atol=0, equal_nan=True)
    rows = moe.padded_capacity(T, E, k, BLOCK)
    int32, fp32 = torch.int32, torch.float32
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [
        (int32, (T, k)), (fp32, (T, k)), (fp32, (T, E)), (int32, (E,)), (int32, (E + 1,)), (int32, (T, k)),
        (int32, (rows,)), (torch.bfloat16, (rows, 2 * inter))]
    logits = moe.router_logits(inputs["x"], inputs["wr"], inputs["bias"])
    assert torch.equal(saved.logits, logits)
    ids, weights = moe.topk_exact(logits, k)
    assert torch.equal(saved.topk_ids, ids) and torch.equal(saved.topk_weights, weights.float())
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    assert torch.equal(saved.expert_counts.long(), counts) and counts[6] == 0 and counts.max() > BLOCK
    offsets = saved.expert_offsets.long()
    assert torch.equal(saved.expert_offsets, moe.expert_offsets(saved.expert_counts, BLOCK))
    # dest: one row per token-slot, inside its expert's segment; source_token: its token there, -1 elsewhere
    dest, token = saved.dest.long(), torch.arange(T)[:, None].expand(T, k)
    start = offsets[ids.long()]
    assert (dest >= start).all() and (dest < start + counts[ids.long()]).all() and dest.unique().numel() == T * k
    assert torch.equal(saved.source_token[dest].long(), token)
    valid = valid_rows(saved.expert_offsets, saved.expert_counts)
    padding = torch.ones(rows, dtype=torch.bool)
    padding[valid] = False
    assert (saved.source_token[padding] == -1).all() and padding[offsets[-1]:].all() and rows > offsets[-1]
    for e in range(E):  # (token, slot) order within a segment: the tokens ascend
        assert (saved.source_token[offsets[e]:offsets[e] + counts[e]].diff() >= 0).all()
    expected = (inputs["x"][saved.source_token[valid].long()].float().unsqueeze(1)
                @ inputs["w1"][ids.long().flatten()[torch.argsort(ids.flatten(), stable=True)]].float()).squeeze(1)
    assert torch.equal(saved.h1[valid], expected.bfloat16())
    assert saved.h1[padding].isnan().all()


def test_the_reference_takes_the_saved_values_and_never_the_padding_rows():
    """With h1 and the logits saved off their exact values, dW2 = Σ SwiGLU(h1_saved)ᵀ·(w·dY) with w the softmax
    of the saved logits; the NaN padding rows leave every gradient finite."""
    inputs = exactly_saved(small_inputs(T=10, E=3, k=2, hidden=8, inter=6))
    off = dict(inputs, h1=inputs["h1"] * 1.5, logits=inputs["logits"] * 0.5)
    assert inputs["h1"].isnan().any()
    exact = P.reference(off)
    assert all(torch.isfinite(g).all() for g in exact.values())
    ids, dest = off["topk_ids"].long(), off["dest"].long()
    w = torch.softmax(off["logits"].gather(1, ids), 1)
    h = moe.swiglu(off["h1"][dest], 6)  # [T, k, I]
    dw2 = torch.zeros_like(exact["dw2"])
    for t in range(10):
        for j in range(2):
            dw2[ids[t, j]] += torch.outer(h[t, j], w[t, j] * inputs["dy"][t])
    torch.testing.assert_close(exact["dw2"], dw2, rtol=1e-12, atol=1e-14)
    moved = P.reference(inputs)
    assert all(not torch.allclose(exact[n], moved[n]) for n in P.outputs)


def test_the_references_gradients_are_finite_despite_the_nan_padding_rows():
    inputs = small_inputs(T=50, E=8, k=2, hidden=16, inter=16, dtype="bfloat16", empty=(2,))
    assert inputs["h1"].isnan().any()
    assert all(torch.isfinite(g).all() for g in P.reference(inputs).values())


# ---------------------------------------------------------------- inputs, outputs, cases

def test_inputs_are_the_forwards_with_its_exact_routing_and_a_seeded_dy():
    inputs = small_inputs(T=20, E=8, k=2, hidden=16, inter=8, dtype="bfloat16", seed=3)
    assert set(inputs) == {*DIFFERENTIATED, "top_k", "shape", *Saved._fields, "dy", "aux_coef"}
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
    swapped_w1 = torch.cat([inputs["w1"][..., 24:], inputs["w1"][..., :24]], dim=-1)
    swapped = dict(inputs, w1=swapped_w1, h1=forward_saved(inputs["x"], inputs["wr"], inputs["bias"], swapped_w1, 2).h1)
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
    router = 2 * 8 * 4 * 2 + 4 * 4          # Wr in; dWr, dBias out
    tokens = 3 * 3 * 8 * 2                  # x, dY in, dX out
    h1 = 6 * 2 * 6 * 2                      # the saved h1's valid rows, 2·I per token-slot
    routing = 4 * (4 * 6 + 3 * 4 + 4 + 5)   # topk ids, weights, dest, source_token per slot; logits; counts, offsets
    assert P.min_bytes(shape) == weights + router + tokens + h1 + routing == 2916
    assert P.min_bytes(dict(shape, empty=(1,))) == 2916 - 3 * 8 * 6 * 2  # an empty expert's weights not read
    seed = dict(tokens=32768, experts=32, top_k=2, hidden=4096, inter=11008)
    assert P.flops(seed) == 12 * 32768 * 2 * 4096 * 11008 == pytest.approx(35.46e12, rel=1e-3)


def test_the_saved_tensors_take_fewer_bytes_than_pytorchs_graph():
    """saved_bytes_per_slot is Saved as make_inputs allocates it; PyTorch's graph, counted on meta tensors,
    keeps what it keeps on the CPU; ours is less, at a small shape and at the seed's 32K tokens."""
    small = dict(tokens=256, experts=4, top_k=2, hidden=64, inter=64)
    ours = saved_bytes_per_slot(small)
    inputs = P.make_inputs(small, "bfloat16", 0, device="cpu")
    assert ours * 256 * 2 == sum(t.nbytes for t in saved_of(inputs))
    theirs = grouped_mm_saved_bytes(small)
    assert theirs == grouped_mm_saved_bytes(small, device="cpu") and ours <= theirs
    seed = dict(tokens=32768, experts=32, top_k=2, hidden=4096, inter=11008)
    ours, theirs = saved_bytes_per_slot(seed), grouped_mm_saved_bytes(seed)
    assert ours == pytest.approx(46843, abs=1) and ours <= theirs / 2
    print(f"saved bytes per token-slot: ours {ours:.0f}, PyTorch's {theirs:.0f}")
