"""`python -m grader ops [--json results/<gpu>.json]`: the course's ops as people use them, beside PyTorch.

The grader times a stage's kernels alone; a model pays more: the host time of every call (Python,
checks, descriptors, launches) and the layouts it hands over. This measures that, on the GPU at hand:

- attention: ops.attention forward and backward on the [B, H, S, D] views of [B, S, H, D] projections
  that a Hugging Face Llama hands over (GQA, bf16, causal), beside SDPA on the same views: host µs per
  call, ms per call in a loop, and the CUDA kernels one forward + backward launches (copies counted);
- the host time of one forward and one backward call, piece by piece (checks, allocations, dispatch,
  tensor maps, launches);
- tiny: four small shapes (fp16, D 64, forward; TINY_SHAPES), course ms per call against SDPA's;
- moe_layer: ops.moe_layer's host µs and ms per call beside PyTorch's grouped-GEMM layer, and its forward +
  backward (stage 7 then stage 14 on what it saved) beside the grouped-GEMM layer's under autograd;
- block_sparse_serving: the serving figures the course set, in-process, at block-sparse attention's first
  benchmark shape (B1, the 100K-token neighbourhood graph, D 64, fp16): latency P50 and P99 over 100
  synchronized calls of ops.block_sparse_attention's forward from Python, and calls per second of 100
  calls ended by one synchronization, beside compiled FlexAttention with the same BlockMask;
- models: a transformers Llama (forward + backward) with the course's attention registered, beside the
  same model on SDPA and on eager attention, and the same model compiled (torch.compile, fullgraph) with
  the course's attention beside SDPA; a Mixtral MoE block's forward on ops.moe_layer beside the
  block's own (needs transformers: `pip install -e ".[models]"`, skipped with the reason where absent).

Timings are medians over rounds that alternate the contenders (side by side); "ms" is wall time per call
of a loop of calls ended by a synchronization, what a training loop sees whichever of the host and the
GPU is slower.
"""
from __future__ import annotations

import inspect
import itertools
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

ROUNDS = 5          # side-by-side rounds; each value is the median over them
LOOP_CALLS = 20     # calls per timed loop
HOST_CALLS = 30     # calls whose host time is taken one by one

# (B, H, H_kv, S, D): the shapes a Llama-style model calls attention at (bf16, causal)
ATTENTION_SHAPES = [(2, 32, 8, 2048, 64), (1, 32, 8, 4096, 128), (8, 32, 8, 512, 64), (8, 16, 16, 512, 64)]
TINY_SHAPES = [(1, 1, 128), (8, 4, 128), (32, 8, 128), (32, 8, 256)]  # (B, H, S): D 64, fp16, forward
MOE_TOKENS = (128, 4096)  # ops.moe_layer at a decode-sized and a prefill-sized batch (Mixtral's layer)
MOE_SHAPE = dict(hidden=4096, inter=14336, experts=8, top_k=2)
LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32000)
MODEL_BATCHES = [(2, 2048), (8, 512)]  # (batch, sequence)
SERVING_CALLS = 100  # the serving figures: latencies of 100 calls, and a loop of 100
# A server runs at the clocks its power cap leaves: at 700 W an H100 starts a busy run at 1,980 MHz and
# settles at 1,400-1,700 within about a second (nvidia-smi, 2026-11-27). Timing the first calls would time
# the boost, so each contender's calls run this long before the timed ones.
SERVING_WARM_SECONDS = 3.0
# its bars: P99 within 1.1 × P50, and calls per second at least 0.9 / P50 (a loop keeps up with single calls)
SERVING_BARS = {"p99_over_p50_at_most": 1.1, "calls_per_second_times_p50_at_least": 0.9}
COURSE = "course"  # the name the course's attention is registered under in transformers (not "flash…")


def median(values) -> float:
    return float(statistics.median(values))


def sync_ms(step, calls: int = LOOP_CALLS) -> float:
    """Wall ms per call of `calls` calls of step(), ended by a synchronization (one warm call first)."""
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def side_by_side(steps: dict, calls: int = LOOP_CALLS) -> dict:
    """{name: median ms per call} over ROUNDS rounds, each timing every step in turn."""
    rounds = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            rounds[name].append(sync_ms(step, calls))
    return {name: median(times) for name, times in rounds.items()}


def host_us(call, before=None, calls: int = HOST_CALLS) -> float:
    """Median host µs of call() (before() runs first each time, untimed), the GPU left busy: what the
    Python side costs while the kernels queue up."""
    times = []
    for _ in range(calls):
        argument = before() if before else None
        start = time.perf_counter_ns()
        call(argument) if before else call()
        times.append(time.perf_counter_ns() - start)
    torch.cuda.synchronize()
    return median(times) / 1e3


# ---------------------------------------------------------------- attention as a model calls it

def model_views(B, H, Hkv, S, D, dtype=torch.bfloat16, seed=0):
    """Leaf [B, S, H, D] projections, and a function giving q, k, v as the [B, H, S, D] views a
    transformers model hands its attention (the leaves' gradients cleared, as an optimizer's zero_grad
    does: no accumulation kernels in the figures), and the gradient an output projection sends back."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    leaves = [torch.randn(B, S, heads, D, generator=gen, device="cuda", dtype=dtype).requires_grad_()
              for heads in (H, Hkv, Hkv)]
    grad = torch.randn(B, S, H, D, generator=gen, device="cuda", dtype=dtype)

    def views():
        for t in leaves:
            t.grad = None
        return [t.transpose(1, 2) for t in leaves]
    return views, grad.transpose(1, 2)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def attention_contenders(ops) -> dict:
    return {"course": lambda q, k, v: ops.attention(q, k, v, causal=True), "sdpa": sdpa}


def measure_attention(ops, shape) -> dict:
    views, grad = model_views(*shape)
    contenders = attention_contenders(ops)
    forward = {name: (lambda f=f: f(*views())) for name, f in contenders.items()}
    both = {name: (lambda f=f: f(*views()).backward(grad)) for name, f in contenders.items()}
    host = {}
    for name, f in contenders.items():
        host[f"{name}_forward"] = host_us(lambda qkv, f=f: f(*qkv), before=views)
        host[f"{name}_backward"] = host_us(lambda o: o.backward(grad), before=lambda f=f: f(*views()))
    ms = {f"{name}_forward": t for name, t in side_by_side(forward).items()}
    ms |= {f"{name}_forward_backward": t for name, t in side_by_side(both).items()}
    B, H, Hkv, S, D = shape
    return {"shape": dict(B=B, H=H, Hkv=Hkv, S=S, D=D, causal=True, dtype="bfloat16", layout="[B, S, H, D] views"),
            "host_us": host, "ms": ms, "speedup_forward_backward": ms["sdpa_forward_backward"] /
            ms["course_forward_backward"], "kernels": kernels_launched(lambda: both["course"]())}


def kernels_launched(step) -> dict:
    """{CUDA kernel name: launches} of one step(), from PyTorch's profiler; "copies" counts PyTorch's copy
    and elementwise kernels among them."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        step()
        torch.cuda.synchronize()
    names: dict = {}
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("Memcpy"):
            names[event.name[:60]] = names.get(event.name[:60], 0) + 1
    copies = sum(n for name, n in names.items() if "elementwise" in name or "copy" in name.lower())
    return {"names": names, "copies": copies}


# ---------------------------------------------------------------- where a call's host time goes

def host_breakdown(ops, shape=ATTENTION_SHAPES[0]) -> dict:
    """Host µs of one ops.attention forward and one backward call, whole and by piece (the input checks,
    the op's launch function, the stage's launch, its tensor maps and kernel launches; the backward's
    Function inside autograd's engine), the pieces those of the call whose whole time is the median,
    timed inside it, so that they add up. The GPU is left busy, as in a training loop. Two sets of inputs
    alternate, as a model's activations do, so that the tensor maps are re-pointed every call."""
    import stages.common.launcher as launcher

    sets = [model_views(*shape, seed=seed) for seed in (0, 1)]
    alternating = itertools.cycle(sets)

    def views():
        return next(alternating)[0]()

    grad = sets[0][1]
    for _ in range(3):  # compiled, loaded, descriptors encoded
        ops.attention(*views(), causal=True).backward(grad)
    launches = {"op": [(ops.dense, "forward_launch"), (ops.dense, "backward_launch")],
                "stage": [(ops.shared, "launch_fastest")], "maps": _tensor_map_owners(),
                "kernels": [(launcher.KernelSet, "_launch")]}
    forward = nested_host_us(lambda qkv: ops.attention(*qkv, causal=True), views,
                             {"checks": [(ops.dense, "attention_input_problem")], **launches})
    backward = nested_host_us(lambda o: o.backward(grad), lambda: ops.attention(*views(), causal=True),
                              {"function": [(ops.dense._Attention, "backward")], **launches})
    return {"forward": {"whole": forward["whole"], "checks": forward["checks"], **_launch_pieces(forward),
                        "ops, rest (autograd, dispatch)": forward["whole"] - forward["checks"] - forward["op"]},
            "backward": {"whole": backward["whole"], **_launch_pieces(backward),
                         "the Function's backward, rest (saved tensors)": backward["function"] - backward["op"],
                         "autograd's engine, rest": backward["whole"] - backward["function"]}}


def _launch_pieces(spent: dict) -> dict:
    """An op's launch function by piece: the kernel launches, the tensor maps, the rest of the stage's launch,
    the rest of the op's (its outputs' allocation)."""
    return {"tensor maps": spent["maps"], "kernel launches": spent["kernels"],
            "stage launch, rest (allocations, geometry)": spent["stage"] - spent["maps"] - spent["kernels"],
            "op's launch function, rest (outputs)": spent["op"] - spent["stage"]}


def _tensor_map_owners() -> list:
    """Where the stages' launches find hopper.tensor_map: each loaded module that imported it by name."""
    import sys

    from stages.common import hopper
    return [(module, "tensor_map") for name, module in list(sys.modules.items())
            if name.startswith("stages.") and getattr(module, "tensor_map", None) is hopper.tensor_map]


def moe_host_breakdown(ops, layer: dict, top_k: int) -> dict:
    """Host µs of one ops.moe_layer call as a model makes it again and again ("whole": a small call replays
    a CUDA graph), its input checks, and the launch path a call takes otherwise, by piece: the stage's kernel
    launches, the rest of the stage's launch, the op's own (the outputs' allocation). Each call starts on an
    idle GPU (a large call's kernels would otherwise fill the launch queue and stall the next call's host); the
    pieces are those of the launch-path call whose time is the median, timed inside it, so that they add up."""
    import stages.common.launcher as launcher

    x, wr, w1, w2 = layer["x"], layer["wr"], layer["w1"], layer["w2"]
    idle = torch.cuda.synchronize
    whole = host_us(lambda _: ops.moe_layer(x, wr, w1, w2, top_k), before=idle)
    checks = host_us(lambda _: ops.moe_layer_input_problem(x, wr, None, w1, w2, top_k), before=idle)
    path = nested_host_us(lambda _: ops.moe_launch(x, wr, None, w1, w2, top_k), idle,
                          {"stage": [(ops.shared, "launch_fastest")], "kernels": [(launcher.KernelSet, "_launch")]})
    return {"whole": whole, "checks": checks, "launch path": path["whole"], "kernel launches": path["kernels"],
            "stage launch, rest (allocations, routing sizes, tensor maps)": path["stage"] - path["kernels"],
            "launch path, rest (outputs)": path["whole"] - path["stage"]}


def nested_host_us(call, before, pieces: dict) -> dict:
    """{"whole": host µs of call(before()), and per piece name, the µs spent inside it in the functions the
    piece names (a list of (owner, attribute), each call of each summed)}, those of the call whose whole
    time is the median of HOST_CALLS; before() runs untimed (it may synchronize: an idle GPU)."""
    import inspect

    originals = [(name, owner, attribute, inspect.getattr_static(owner, attribute))
                 for name, functions in pieces.items() for owner, attribute in functions]

    def timed(name, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter_ns() - start
        return wrapper

    for name, owner, attribute, original in originals:
        if isinstance(original, staticmethod):
            setattr(owner, attribute, staticmethod(timed(name, original.__func__)))
        else:
            setattr(owner, attribute, timed(name, original))
    calls, spent = [], dict.fromkeys(pieces, 0)  # spent: the timed call's, added to by the wrappers
    try:
        for _ in range(HOST_CALLS):
            argument = before()  # may call the wrapped functions too (the backward's forward): not counted
            spent = dict.fromkeys(pieces, 0)
            start = time.perf_counter_ns()
            call(argument)
            calls.append({"whole": time.perf_counter_ns() - start, **spent})
    finally:
        for _, owner, attribute, original in originals:
            setattr(owner, attribute, original)
    torch.cuda.synchronize()
    return {name: ns / 1e3 for name, ns in sorted(calls, key=lambda c: c["whole"])[len(calls) // 2].items()}


# ---------------------------------------------------------------- tiny shapes, the MoE layer

def measure_tiny(ops) -> list:
    rows = []
    for B, H, S in TINY_SHAPES:
        q, k, v = (torch.randn(B, H, S, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        ms = side_by_side({"course": lambda: ops.attention(q, k, v), "sdpa": lambda: F.scaled_dot_product_attention(
            q, k, v)})
        rows.append({"shape": dict(B=B, H=H, S=S, D=64, dtype="float16"), "course_ms": ms["course"],
                     "sdpa_ms": ms["sdpa"], "ratio": ms["sdpa"] / ms["course"]})
    return rows


def moe_forward_backward_ms(ops, layer: dict, top_k: int) -> dict:
    """ms per training call of the layer, forward then backward of a fixed dY into x, the router and both
    expert weights (the gradients dropped after each call, not accumulated), through ops.moe_layer (stage 7
    saving for stage 14) beside PyTorch's grouped-GEMM layer (autograd keeping its own activations), both
    routed with the same bias."""
    from reference import moe

    leaves = {n: layer[n].detach().requires_grad_() for n in ("x", "wr", "w1", "w2")}
    dy = torch.randn_like(layer["x"])

    def train(forward):
        def step():
            for leaf in leaves.values():
                leaf.grad = None
            forward().backward(dy)
        return step

    steps = {"course": train(lambda: ops.moe_layer(leaves["x"], leaves["wr"], leaves["w1"], leaves["w2"], top_k,
                                                   router_bias=layer["bias"]))}
    steps |= moe.grouped_mm_baseline(train(lambda: moe.layer_grouped_mm({**leaves, "bias": layer["bias"]}, top_k)))
    return side_by_side(steps)


def measure_moe_layer(ops) -> list:
    from reference import moe

    rows = []
    for tokens in MOE_TOKENS:
        layer = moe.make_layer(tokens, MOE_SHAPE["hidden"], MOE_SHAPE["inter"], MOE_SHAPE["experts"], "bfloat16",
                               seed=0)
        k = MOE_SHAPE["top_k"]
        course = lambda: ops.moe_layer(layer["x"], layer["wr"], layer["w1"], layer["w2"], k)  # noqa: E731
        steps = {"course": course, **moe.grouped_mm_baseline(lambda: moe.layer_grouped_mm(layer, k))}
        ms = side_by_side(steps)
        rows.append({"shape": dict(tokens=tokens, **MOE_SHAPE, dtype="bfloat16"), "host_us": host_us(course),
                     "ms": ms, "host_us_by_piece": moe_host_breakdown(ops, layer, k),
                     "ms_forward_backward": moe_forward_backward_ms(ops, layer, k)})
        del layer
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- block-sparse attention as a server calls it

def measure_block_sparse_serving(ops, calls: int = SERVING_CALLS) -> dict:
    """The serving figures (serving_figures) of ops.block_sparse_attention's forward and of compiled FlexAttention
    with the same BlockMask, at the problem's first benchmark shape, on the inputs the grader times there; a
    GPU no stage runs it on is skipped with the reason."""
    from reference import block_sparse_attention as problem_module

    problem = problem_module.PROBLEM
    shape = problem.benchmarks()[0]
    inputs = problem.make_inputs(shape, shape["dtype"], seed=0)
    if why := ops.stage_problem(problem, inputs["q"]):
        return {"skipped": why}
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    block_mask = problem_module.to_block_mask(inputs, shape["S"], problem_module.element_mask_mod(inputs))
    arguments = ops_mask_arguments(inputs)
    flex_attention = problem_module.compiled_flex_attention()
    contenders = {"course": lambda: ops.block_sparse_attention(q, k, v, block_mask, **arguments),
                  "flex_attention": lambda: flex_attention(q, k, v, block_mask=block_mask, scale=inputs["scale"],
                                                           enable_gqa=k.shape[1] != q.shape[1])}
    with torch.no_grad():
        figures = {name: serving_figures(call, calls) for name, call in contenders.items()}
    return {"shape": dict(shape, label=problem.shape_label(shape)), "calls": calls, "bars": SERVING_BARS, **figures}


def ops_mask_arguments(inputs: dict) -> dict:
    """ops.block_sparse_attention's element mask arguments for the block-sparse problem's inputs."""
    arguments = {"element_mask": inputs["element_mask"]}
    if inputs["element_mask"] == "sliding_window":
        arguments["window"] = inputs["window"]
    if inputs["element_mask"] == "document":
        arguments["document_ids"] = inputs["document_ids"]
    return arguments


def serving_figures(call, calls: int, warm_seconds: float = SERVING_WARM_SECONDS) -> dict:
    """latency_figures of call(): the wall ms of each of `calls` calls ended by a synchronization (a served
    request's latency), and the calls per second of `calls` calls ended by one, after `warm_seconds` of calls
    (compiled, loaded, descriptors encoded, and the clocks where the power cap keeps them)."""
    start = time.perf_counter()
    while True:
        call()
        torch.cuda.synchronize()
        if time.perf_counter() - start >= warm_seconds:
            break
    latencies = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        latencies.append((time.perf_counter() - start) * 1e3)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return latency_figures(latencies, calls / (time.perf_counter() - start))


def latency_figures(latencies_ms: list, calls_per_second: float) -> dict:
    """P50 and P99 of the latencies (interpolated between the calls around them), the calls per second, and the
    two ratios SERVING_BARS bound."""
    percentiles = statistics.quantiles(latencies_ms, n=100, method="inclusive")
    p50, p99 = percentiles[49], percentiles[98]
    return {"p50_ms": p50, "p99_ms": p99, "calls_per_second": calls_per_second, "p99_over_p50": p99 / p50,
            "calls_per_second_times_p50": calls_per_second * p50 / 1e3}


def describe_serving(record: dict) -> str:
    if "skipped" in record:
        return f"block-sparse serving: skipped ({record['skipped']})"
    return (f"block-sparse serving at {record['shape']['label']}: "
            + "; ".join(describe_latencies(name, record[name]) for name in ("course", "flex_attention")))


def describe_latencies(name: str, figures: dict) -> str:
    bars = SERVING_BARS
    return (f"{name} P50 {figures['p50_ms']:.3f} ms, P99 {figures['p99_ms']:.3f} ms ({figures['p99_over_p50']:.2f}x "
            f"P50, bar {bars['p99_over_p50_at_most']}), {figures['calls_per_second']:.1f} calls/s "
            f"({figures['calls_per_second_times_p50']:.2f} / P50, bar {bars['calls_per_second_times_p50_at_least']})")


# ---------------------------------------------------------------- whole models from transformers

def register_course_attention(ops) -> None:
    """The course's attention as a transformers attention implementation named COURSE: transformers hands
    q, k, v as [B, H, S, D] views and wants [B, S, H, D] back; no mask beyond causal is taken."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    def course_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None:
            raise ValueError("the course's attention takes causal masks only (no padding)")
        return ops.attention(query, key, value, causal=True, scale=scaling).transpose(1, 2), None

    def causal_only_mask(*args, **kwargs):
        """None (the causal rule alone) where the model was given no padding mask, as SDPA's mask function
        decides in eager mode and not while torch.compile traces, where it builds the causal mask as a
        tensor; with a padding mask, SDPA's mask, which course_attention refuses."""
        if inspect.signature(sdpa_mask).bind(*args, **kwargs).arguments.get("attention_mask") is None:
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(COURSE, course_attention)
    AttentionMaskInterface.register(COURSE, causal_only_mask)


def measure_models(ops) -> list:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        return [{"skipped": f"transformers is not installed ({error}): pip install -e \".[models]\""}]
    register_course_attention(ops)
    config = LlamaConfig(**LLAMA, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    rows = []
    for batch, seq in MODEL_BATCHES:
        ids = torch.randint(0, LLAMA["vocab_size"], (batch, seq), device="cuda")
        losses = {}

        def step(implementation):
            def run():
                model.set_attn_implementation(implementation)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                losses[implementation] = float(loss)
            return run

        ms = side_by_side({name: step(name) for name in (COURSE, "sdpa", "eager")}, calls=5)
        compiled = measure_compiled_model(model, ids)
        model.zero_grad(set_to_none=True)
        shape = (batch, LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"], seq,
                 LLAMA["hidden_size"] // LLAMA["num_attention_heads"])
        attention = measure_attention(ops, shape)["ms"]
        rows.append({"model": "LlamaForCausalLM " + ", ".join(f"{k} {v}" for k, v in LLAMA.items()),
                     "batch": batch, "seq": seq, "course_ms": ms[COURSE], "sdpa_ms": ms["sdpa"],
                     "eager_ms": ms["eager"], "speedup": ms["sdpa"] / ms[COURSE],
                     "loss": {name: losses[name] for name in (COURSE, "sdpa", "eager")},
                     "attention_course_ms": attention["course_forward_backward"],
                     "attention_sdpa_ms": attention["sdpa_forward_backward"]})
        rows.append(dict(compiled, model=rows[-1]["model"], batch=batch, seq=seq))
        torch.cuda.empty_cache()
    del model
    rows.append(measure_mixtral_block(ops))
    return rows


def measure_compiled_model(model, ids) -> dict:
    """The model's forward + backward under torch.compile (default mode, fullgraph: a graph break is an
    error), the course's attention against SDPA, side by side: {"compiled": True, "course_ms", "sdpa_ms",
    "speedup"}, or {"compiled": True, "failed": the error in one line} where compiling fails."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)

    def step(implementation):
        def run():
            model.set_attn_implementation(implementation)  # a guard of the graph: one graph each
            compiled(input_ids=ids, labels=ids).loss.backward()
        return run
    try:
        ms = side_by_side({name: step(name) for name in (COURSE, "sdpa")}, calls=5)
    except Exception as error:  # noqa: BLE001  (reported in the record: the eager figures stand)
        traceback.print_exc()
        return {"compiled": True, "failed": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"}
    finally:
        torch._dynamo.reset()
    return {"compiled": True, "course_ms": ms[COURSE], "sdpa_ms": ms["sdpa"], "speedup": ms["sdpa"] / ms[COURSE]}


def measure_mixtral_block(ops, tokens: int = 4096) -> dict:
    """A transformers MixtralSparseMoeBlock's forward, and the same weights through ops.moe_layer
    (router weightᵀ, gate_up_projᵀ, down_projᵀ)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=MOE_SHAPE["hidden"], intermediate_size=MOE_SHAPE["inter"],
                           num_local_experts=MOE_SHAPE["experts"], num_experts_per_tok=MOE_SHAPE["top_k"])
    block = MixtralSparseMoeBlock(config).to("cuda", torch.bfloat16)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=MOE_SHAPE["hidden"] ** -0.5)
    x = torch.randn(1, tokens, MOE_SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    wr = block.gate.weight.t().contiguous()
    w1 = block.experts.gate_up_proj.transpose(1, 2).contiguous()
    w2 = block.experts.down_proj.transpose(1, 2).contiguous()

    def theirs():
        out = block(x)
        return out[0] if isinstance(out, tuple) else out

    def ours():
        return ops.moe_layer(x[0], wr, w1, w2, MOE_SHAPE["top_k"])

    with torch.no_grad():
        error = (ours().float() - theirs()[0].float()).abs().max().item()
        ms = side_by_side({"course": ours, "transformers": theirs}, calls=5)
    return {"model": f"MixtralSparseMoeBlock (forward) {MOE_SHAPE}", "tokens": tokens, "course_ms": ms["course"],
            "eager_ms": ms["transformers"], "speedup": ms["transformers"] / ms["course"], "max_abs_diff": error}


# ---------------------------------------------------------------- the command

def run(report=print, with_models: bool = True) -> dict:
    from stages import ops

    torch.manual_seed(0)
    result: dict = {"attention": [], "tiny": [], "moe_layer": [], "models": []}
    for shape in ATTENTION_SHAPES:
        report(f"  attention B{shape[0]} H{shape[1]}/{shape[2]} S{shape[3]} D{shape[4]} ...")
        result["attention"].append(measure_attention(ops, shape))
        report("    " + describe_attention(result["attention"][-1]))
    result["host_breakdown"] = host_breakdown(ops)
    report(f"  host µs by piece: {result['host_breakdown']}")
    result["tiny"] = measure_tiny(ops)
    report("  tiny: " + "; ".join(f"{r['shape']['B']}x{r['shape']['H']}x{r['shape']['S']} {r['ratio']:.2f}x SDPA"
                                  for r in result["tiny"]))
    result["moe_layer"] = measure_moe_layer(ops)
    report(f"  moe_layer: {result['moe_layer']}")
    result["block_sparse_serving"] = measure_block_sparse_serving(ops)
    report("  " + describe_serving(result["block_sparse_serving"]))
    if with_models:
        result["models"] = measure_models(ops)
        report(f"  models: {result['models']}")
    return result


def describe_attention(row: dict) -> str:
    host, ms = row["host_us"], row["ms"]
    return (f"host µs fwd {host['course_forward']:.0f} (SDPA {host['sdpa_forward']:.0f}), bwd "
            f"{host['course_backward']:.0f} (SDPA {host['sdpa_backward']:.0f}); fwd+bwd {ms['course_forward_backward']:.3f}"
            f" ms vs SDPA {ms['sdpa_forward_backward']:.3f} ({row['speedup_forward_backward']:.2f}x); copies "
            f"{row['kernels']['copies']}")


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(report=lambda line: print(line, file=sys.stderr, flush=True),
                         with_models="--no-models" not in sys.argv), indent=1, default=float))
