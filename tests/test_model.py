"""The whole-model problem (reference/model.py) on CPU: its pieces and the whole forward against a plain
re-implementation, the inputs, the work, the check. Tiny configurations, in float64 where the maths is compared."""
import math

import pytest
import torch

import reference
from reference import model as M
from reference.attention import visible_pairs

P = reference.load("model")

TINY = M.model_shape("small", 2, 9, layers=2, hidden=64, heads=4, kv_heads=2, inter=128)
TINY_MOE = M.model_shape("moe", 2, 9, layers=2, hidden=64, heads=4, kv_heads=2, inter=32, experts=4, top_k=2)


def inputs_of(shape, dtype="float64", seed=0, **kw):
    return P.make_inputs(shape, dtype, seed, device="cpu", **kw)


# ---------------------------------------------------------------- the pieces

def test_rope_is_a_rotation_of_complex_pairs_i_and_i_plus_half():
    """Hugging Face's rotate-half: dimension i and i + D/2 are one complex number, turned by p·theta^(-2i/D)."""
    S, D, theta = 11, 16, 10000.0
    x = torch.randn(2, 3, S, D, dtype=torch.float64)
    cos, sin = M.rope_cos_sin(S, D, theta, torch.float64, "cpu")
    z = torch.complex(x[..., :D // 2], x[..., D // 2:])
    angle = torch.arange(S, dtype=torch.float64)[:, None] * theta ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)
    turned = z * torch.polar(torch.ones_like(angle), angle)
    expected = torch.cat((turned.real, turned.imag), dim=-1)
    torch.testing.assert_close(M.apply_rope(x, cos, sin), expected, rtol=1e-12, atol=1e-12)


def test_rope_position_zero_is_the_identity_and_norms_are_kept():
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    cos, sin = M.rope_cos_sin(5, 8, 1e6, torch.float64, "cpu")
    y = M.apply_rope(x, cos, sin)
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_rope_in_bfloat16_rounds_cos_and_sin_from_fp32():
    cos, sin = M.rope_cos_sin(7, 64, 10000.0, torch.bfloat16, "cpu")
    cos32, sin32 = M.rope_cos_sin(7, 64, 10000.0, torch.float32, "cpu")
    assert cos.dtype == torch.bfloat16 and torch.equal(cos, cos32.to(torch.bfloat16)) and torch.equal(sin, sin32.to(torch.bfloat16))


def test_rms_norm_by_its_formula():
    x, w = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    expected = torch.stack([torch.stack([w * r / math.sqrt(float((r * r).sum()) / 16 + 1e-5) for r in row]) for row in x])
    torch.testing.assert_close(M.rms_norm(x, w, 1e-5), expected, rtol=1e-12, atol=1e-12)


def test_rms_norm_in_bfloat16_normalizes_in_fp32_then_rounds_then_scales():
    x, w = torch.randn(4, 32).bfloat16(), (1 + 0.1 * torch.randn(32)).bfloat16()
    wide = x.float()
    expected = w * (wide / torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    out = M.rms_norm(x, w, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=0)


def plain_attention(q, k, v):
    """Causal GQA one query at a time: query head j reads KV head j // (H / KV)."""
    B, H, S, D = q.shape
    groups = H // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for j in range(H):
            for i in range(S):
                s = k[b, j // groups, :i + 1] @ q[b, j, i] / math.sqrt(D)
                p = torch.exp(s - s.max())
                out[b, j, i] = p @ v[b, j // groups, :i + 1] / p.sum()
    return out


@pytest.mark.parametrize("how", ["exact", "naive", "sdpa"])
@pytest.mark.parametrize("KV", [4, 2, 1])
def test_causal_gqa_attention(how, KV):
    q = torch.randn(2, 4, 7, 8, dtype=torch.float64)
    k, v = torch.randn(2, KV, 7, 8, dtype=torch.float64), torch.randn(2, KV, 7, 8, dtype=torch.float64)
    tol = 1e-6 if how == "naive" else 1e-10  # naive: the softmax in fp32, as Llama's code
    torch.testing.assert_close(M.attend(q, k, v, how), plain_attention(q, k, v), rtol=tol, atol=tol)


# ---------------------------------------------------------------- the whole forward

def plain_model(inputs):
    """The model written again, token by token where it can be: float64 throughout."""
    c = inputs["config"]
    L, H, KV, I, E, k = (c[n] for n in ("layers", "heads", "kv_heads", "inter", "experts", "top_k"))
    x = inputs["x"].double()
    B, S, hidden = x.shape
    D = hidden // H
    W = {n: t.double() for n, t in M.weights_of(inputs).items()}

    def norm(t, w):
        return w * t / torch.sqrt((t * t).mean(-1, keepdim=True) + c["eps"])

    def rope(t):  # [B, heads, S, D], pairs (i, i + D/2) as complex numbers
        freqs = c["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        rot = torch.polar(torch.ones(S, D // 2, dtype=torch.float64), torch.arange(S, dtype=torch.float64)[:, None] * freqs)
        z = torch.complex(t[..., :D // 2], t[..., D // 2:]) * rot
        return torch.cat((z.real, z.imag), -1)

    def swiglu(t, w1, w2):
        return (torch.nn.functional.silu(t @ w1[:, :I]) * (t @ w1[:, I:])) @ w2

    h = x
    for l in range(L):
        a = norm(h, W["attn_norm"][l])
        q = a @ W["wqkv"][l][:, :H * D]
        kk = a @ W["wqkv"][l][:, H * D:(H + KV) * D]
        vv = a @ W["wqkv"][l][:, (H + KV) * D:]
        q, kk, vv = (t.reshape(B, S, -1, D).permute(0, 2, 1, 3) for t in (q, kk, vv))
        o = plain_attention(rope(q), rope(kk), vv)
        h = h + o.permute(0, 2, 1, 3).reshape(B, S, H * D) @ W["wo"][l]
        m = norm(h, W["mlp_norm"][l])
        if not E:
            h = h + swiglu(m, W["w1"][l], W["w2"][l])
            continue
        y = torch.zeros_like(m)
        for b in range(B):
            for s in range(S):
                logits = m[b, s] @ W["wr"][l]
                chosen = sorted(range(E), key=lambda e: -float(logits[e]))[:k]
                weights = torch.softmax(logits[chosen], 0)
                for wgt, e in zip(weights, chosen):
                    y[b, s] += wgt * swiglu(m[b, s], W["w1"][l, e], W["w2"][l, e])
        h = h + y
    return norm(h, W["norm"])


@pytest.mark.parametrize("shape", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_exact_reference_equals_a_plain_reimplementation(shape):
    inputs = inputs_of(shape, "bfloat16", seed=4)
    exact = P.reference(inputs)["hidden"]
    assert exact.dtype == torch.float64 and exact.shape == inputs["x"].shape
    torch.testing.assert_close(exact, plain_model(inputs), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape", [TINY, TINY_MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("attention,moe_impl", [("sdpa", "loop"), ("naive", "loop"), ("exact", "exact")])
def test_every_path_of_the_torch_model_computes_the_same_maths(shape, attention, moe_impl):
    """In float64 the library's, the naive and the exact paths agree (the loop's routing and combine in fp32)."""
    inputs = inputs_of(shape, seed=5)
    out = M.forward(inputs["x"], M.weights_of(inputs), inputs["config"], attention=attention, moe_impl=moe_impl)
    torch.testing.assert_close(out, P.reference(inputs)["hidden"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_callables_in_place_of_the_named_attention_and_moe_layer_are_called_once_a_layer(shape):
    """forward passes a callable attention(q, k, v) and moe_impl(m, wr, w1, w2, top_k) to every layer, with
    the named options' arguments: callables that compute "naive" and "grouped_mm" give their outputs exactly."""
    inputs, calls = inputs_of(shape, "float32", seed=6), []
    B, S, H, KV, E = (shape[n] for n in ("B", "S", "heads", "kv_heads", "experts"))
    D = M.head_dim(shape)

    def attention(q, k, v):
        calls.append(("attention", q.shape, k.shape, v.shape))
        return M.attend(q, k, v, "naive")

    def moe_layer(m, wr, w1, w2, top_k):
        calls.append(("moe", m.shape, wr.shape, top_k))
        return M.moe_block(m, wr, w1, w2, top_k, "grouped_mm")

    def model(attention, moe_impl):
        return M.forward(inputs["x"], M.weights_of(inputs), inputs["config"], attention=attention, moe_impl=moe_impl)

    torch.testing.assert_close(model(attention, moe_layer), model("naive", "grouped_mm"), rtol=0, atol=0)
    layer_calls = [("attention", (B, H, S, D), (B, KV, S, D), (B, KV, S, D))]
    if E:
        layer_calls.append(("moe", (B * S, shape["hidden"]), (shape["hidden"], E), shape["top_k"]))
    assert calls == layer_calls * shape["layers"]


def test_compiled_regions_compile_one_layer_for_every_layer_and_compute_the_same():
    """Regional compilation: the start and one decoder layer are compiled, whatever the number of layers,
    and the compiled model computes what the eager one does (here through dynamo's graphs, run as traced)."""
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    inputs = inputs_of(M.model_shape("small", 2, 9, layers=4, hidden=64, heads=4, kv_heads=2, inter=128), "bfloat16")
    regions = M.compiled_regions(backend=counting_backend)
    with torch.no_grad():
        compiled = M.forward(inputs["x"], M.weights_of(inputs), inputs["config"], regions=regions)
    assert len(graphs) == 2, [g.code for g in graphs]
    torch.testing.assert_close(compiled, P.library_output(inputs)["hidden"], rtol=0, atol=0)


def test_library_is_the_model_in_the_dtype_and_close_to_the_exact():
    inputs = inputs_of(TINY_MOE, "bfloat16", seed=2)
    library, exact = P.library_output(inputs)["hidden"], P.reference(inputs)["hidden"]
    assert library.dtype == torch.bfloat16
    assert (library.double() - exact).abs().max() < 0.1 * exact.abs().max()


def test_activations_stay_of_unit_size_through_32_layers():
    """The init's claim: residual branches scaled by 1/sqrt(2·layers) keep the stream O(1) through 32 layers."""
    shape = M.model_shape("large", 1, 64, hidden=256, heads=2, kv_heads=2, inter=512)
    inputs = inputs_of(shape, "float32", seed=1)
    stream = M.forward(inputs["x"], M.weights_of(inputs), inputs["config"], final_norm=False)
    assert torch.isfinite(stream).all() and 1.0 < float(stream.std()) < 2.0, float(stream.std())
    first = M.forward(inputs["x"], M.weights_of(inputs), dict(inputs["config"], layers=1), final_norm=False)
    assert float((first - inputs["x"]).std()) < 0.5  # one layer's two branches add little


# ---------------------------------------------------------------- inputs, shapes, work, the check

def test_make_inputs_is_deterministic_and_shaped():
    a, b, other = inputs_of(TINY_MOE, "bfloat16", 7), inputs_of(TINY_MOE, "bfloat16", 7), inputs_of(TINY_MOE, "bfloat16", 8)
    L, h, H, KV, I, E = 2, 64, 4, 2, 32, 4
    D = h // H
    expected = dict(x=(2, 9, h), attn_norm=(L, h), wqkv=(L, h, (H + 2 * KV) * D), wo=(L, H * D, h), mlp_norm=(L, h),
                    wr=(L, h, E), w1=(L, E, h, 2 * I), w2=(L, E, I, h), norm=(h,))
    for name, size in expected.items():
        assert tuple(a[name].shape) == size and a[name].dtype == torch.bfloat16, name
        assert torch.equal(a[name], b[name]), name
        assert not torch.equal(a[name], other[name]), name
    assert set(M.weights_of(a)) | {"x"} == set(expected)
    assert sum(t.numel() for t in M.weights_of(a).values()) == M.parameters(TINY_MOE)


def test_init_scales():
    shape = M.model_shape("small", 1, 64, layers=8, hidden=512, heads=8, kv_heads=8, inter=1024)
    w = inputs_of(shape, "float32", seed=3)
    assert abs(float(w["x"].std()) - 1) < 0.05
    assert abs(float(w["wqkv"].std()) * 512 ** 0.5 - 1) < 0.02
    assert abs(float(w["wo"].std()) * 512 ** 0.5 * 16 ** 0.5 - 1) < 0.02   # 1/sqrt(fan_in · 2 · layers)
    assert abs(float(w["w2"].std()) * 1024 ** 0.5 * 16 ** 0.5 - 1) < 0.02
    assert abs(float(w["norm"].mean()) - 1) < 0.02 and abs(float(w["attn_norm"].std()) - 0.1) < 0.01
    assert abs(float(inputs_of(shape, "float32", input_scale=10)["x"].std()) - 10) < 0.5


def test_benchmarks_are_the_issues_models_at_their_points():
    found = {(s["model"], s["layers"], s["hidden"], s["heads"], s["kv_heads"], s["B"], s["S"]) for s in P.benchmarks()}
    dense = {("small", 12, 768, 12): (16, 2048), ("medium", 24, 2048, 16): (8, 1024), ("large", 32, 4096, 32): (8, 2048)}
    for (name, L, h, H), big in dense.items():
        assert {(name, L, h, H, H, B, S) for B, S in ((1, 128), (4, 512), big)} <= found
    assert ("moe", 4, 4096, 32, 8, 4, 2048) in found
    moe_shape = next(s for s in P.benchmarks() if s["model"] == "moe")
    assert (moe_shape["experts"], moe_shape["top_k"], moe_shape["inter"]) == (8, 2, 14336)
    assert {s["dtype"] for s in P.benchmarks()} == {"bfloat16"}
    assert CONFIG_INTERS == {n: c["inter"] for n, c in M.CONFIGS.items()}


CONFIG_INTERS = {"small": 2048, "medium": 5632, "large": 11008, "moe": 14336}


def test_cases_cover_gqa_moe_both_head_dims_and_odd_lengths():
    cases = P.cases()
    labels = [c.name for c in cases]
    assert len(set(labels)) == len(labels) and all(isinstance(c.shape, dict) for c in cases)
    shapes = [c.shape for c in cases]
    assert any(s["kv_heads"] < s["heads"] and not s["experts"] for s in shapes)
    assert any(s["experts"] for s in shapes)
    assert {64, 128} <= {M.head_dim(s) for s in shapes} <= set(P.parameters["D"])
    assert any(s["S"] % 16 for s in shapes) and any(s["S"] == 1 for s in shapes)
    assert {"float16", "bfloat16"} == {c.dtype for c in cases}
    assert any(c.input_scale != 1 for c in cases)


def test_flops_by_hand():
    B, S, L, h, H, KV, I = 2, 9, 2, 64, 4, 2, 128
    D = h // H
    per_token = L * 2 * (h * (H + 2 * KV) * D + H * D * h + 3 * h * I)
    attention = L * 4 * B * H * D * (S * (S + 1) // 2)
    assert P.flops(TINY) == per_token * B * S + attention
    moe_per_token = L * 2 * (h * (H + 2 * KV) * D + H * D * h + 2 * 3 * h * 32)  # top_k = 2 experts of inter 32
    assert P.flops(TINY_MOE) == moe_per_token * B * S + attention
    assert visible_pairs(S, S, True) == S * (S + 1) // 2


def test_min_bytes_are_the_weights_and_the_activations_once():
    assert P.min_bytes(TINY) == 2 * (M.parameters(TINY) + 2 * 2 * 9 * 64)
    large = next(s for s in P.benchmarks() if s["model"] == "large")
    assert 6.4e9 < M.parameters(large) < 6.6e9  # Llama-2 7B without its embeddings and head
    moe_model = next(s for s in P.benchmarks() if s["model"] == "moe")
    assert 5.7e9 < M.parameters(moe_model) < 5.9e9


def test_the_check_passes_the_library_and_catches_wrong_outputs():
    inputs = inputs_of(TINY, "bfloat16", seed=9)
    exact, library = P.reference(inputs), P.library_output(inputs)
    assert all(c.passed for c in P.check(library, exact, library))
    poisoned = P.allocate_outputs(inputs)
    assert poisoned["hidden"].isnan().all() and not any(c.passed for c in P.check(poisoned, exact, library))
    skewed = dict(hidden=(library["hidden"].float() * 1.1).bfloat16())
    assert not all(c.passed for c in P.check(skewed, exact, library))


def test_the_mean_check_catches_an_error_spread_over_every_token_that_the_max_lets_through():
    exact = torch.randn(4, 8, 64, dtype=torch.float64)
    library = exact.clone()
    library[0, 0, 0] += 1.0                       # one flipped token: a large error in one place
    library = library.bfloat16()
    spread = (exact + 0.3 * torch.randn_like(exact)).bfloat16()  # every element off, none by more than the flip
    spread = torch.where((spread.double() - exact).abs() > 1.0, exact.bfloat16(), spread)
    from reference import tolerance
    assert tolerance.relative_to_library("h", spread, exact, library).passed
    assert not M.mean_relative_to_library("h", spread, exact, library).passed


def test_variant_is_the_head_dimension():
    assert P.variant(inputs_of(TINY, "bfloat16")) == {"dtype": "bfloat16", "D": 16}
    shape = M.model_shape("large", 1, 4, layers=1, hidden=256, heads=2, kv_heads=2, inter=64)
    assert P.parameter_values(inputs_of(shape, "bfloat16")) == {"D": 128}


def test_baselines_are_lazy_callables_of_the_torch_model(monkeypatch):
    inputs = inputs_of(TINY, "bfloat16")
    found = P.baselines(inputs)
    assert list(found) == ["eager", "naive", "compile", "compile + CUDA graph"]
    monkeypatch.setattr(M, "grouped_mm_runs", lambda inputs: False)  # the MoE loop: it waits for the GPU
    assert "compile + CUDA graph" not in P.baselines(inputs_of(TINY_MOE, "bfloat16"))
    exact = P.reference(inputs)["hidden"]
    for name in ("eager", "naive"):
        assert (found[name]().double() - exact).abs().max() < 0.1, name


def test_transformers_llama_and_mixtral_match_where_installed():
    pytest.importorskip("transformers")
    for shape in (TINY, TINY_MOE):
        inputs = inputs_of(shape, "float32", seed=6)
        theirs = M.transformers_output(inputs)
        torch.testing.assert_close(theirs.double(), P.reference(inputs)["hidden"], rtol=1e-4, atol=1e-4)


def test_transformers_output_is_none_without_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        assert M.transformers_output(inputs_of(TINY, "bfloat16")) is None
    else:
        pytest.skip("transformers is installed")


# ---------------------------------------------------------------- stage 10's forward, its kernels faked

class FakeKernels:
    """stage10_model's kernels in PyTorch, in fp32 and rounded once, as model.cu does."""

    def add_rmsnorm(self, grid, block, h, delta, weight, normed, hidden, eps):
        assert grid == (h.numel() // hidden,) and hidden == h.shape[-1] and block[0] % 32 == 0 and block[0] * 8 >= hidden
        if isinstance(delta, torch.Tensor):
            h.copy_(h + delta)
        normed.copy_(M.rms_norm(h, weight, eps))

    def rope_split(self, grid, block, p):
        from stages.stage10_model import RopeParams
        assert type(p) is RopeParams
        qkv, cos, sin, q, k, seq, heads, kv_heads, items = p
        batch, head_dim = q.shape[0], q.shape[-1]
        assert items == batch * seq * (heads + kv_heads) * head_dim // 16 and grid == (-(-items // block[0]),)
        assert qkv.shape == (batch * seq, (heads + 2 * kv_heads) * head_dim)
        split = qkv.float().reshape(batch, seq, -1, head_dim).transpose(1, 2).split((heads, kv_heads, kv_heads), dim=1)
        q.copy_(M.apply_rope(split[0], cos.float(), sin.float()))
        k.copy_(M.apply_rope(split[1], cos.float(), sin.float()))

    def swiglu(self, grid, block, g, act, inter, vectors):
        assert vectors == act.numel() // 8 and g.shape[-1] == 2 * inter
        gate, up = g.float().split(inter, dim=-1)
        act.copy_(torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("shape", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_stage10_forward_composes_the_model(shape, monkeypatch):
    """The forward's Python (the QKV split, GQA attention, the norms, SwiGLU, the MoE layer) on CPU, with the
    kernels and ops replaced by PyTorch: it passes the problem's check and equals the library model. (The
    launch captures this forward in a CUDA graph: GPU only.)"""
    from reference import moe
    from stages import ops
    from stages.ops import shared
    from stages.stage10_model import forward, rope_tables

    def attention(q, k, v, causal=False, scale=None):
        assert q.shape[1] % k.shape[1] == 0 and q.is_contiguous() and k.is_contiguous()
        assert shared.strides_problem(dict(q=q, k=k, v=v)) is None  # v a view of qkv: the real op's rule
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                                enable_gqa=q.shape[1] != k.shape[1])

    def moe_layer(x, wr, w1, w2, top_k):
        assert x.is_contiguous() and wr.is_contiguous()
        return moe.layer_loop(dict(x=x, wr=wr, w1=w1, w2=w2), top_k)

    monkeypatch.setattr(ops, "attention", attention)
    monkeypatch.setattr(ops, "moe_layer", moe_layer)
    inputs = inputs_of(shape, "bfloat16", seed=11)
    saved = {n: t.clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    outputs = P.allocate_outputs(inputs)
    forward(FakeKernels(), inputs["x"], M.weights_of(inputs), inputs["config"], outputs["hidden"],
            rope_tables(inputs["x"], inputs["config"]))
    assert all(torch.equal(saved[n], inputs[n]) for n in saved)  # x and the weights untouched
    library = P.library_output(inputs)
    assert all(c.passed for c in P.check(outputs, P.reference(inputs), library))
    torch.testing.assert_close(outputs["hidden"], library["hidden"], rtol=2**-7, atol=2**-6)
