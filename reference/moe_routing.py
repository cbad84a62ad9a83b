"""The MoE routing problem: from router logits to expert-contiguous order, and back (stage 5).

Inputs: router logits [T, E] fp32 (x·Wr, computed by PyTorch: the stage starts from the logits),
top_k, the GEMM tile `block` each expert's segment is padded to (0: none), and y_perm [P, hidden]
(float16 or bfloat16): what the experts would output, one row per permuted position, random here
so that the combine is checked on its own. P = T·k + E·(block - 1) when block > 0, else T·k: the
most rows the padded permutation can need, known without looking at the routing.

Outputs (all written by the stage's kernels, no host synchronization):
  topk_ids [T, k] int32, topk_weights [T, k] fp32   softmax over E, top-k in decreasing order (ties:
                                                    lower expert first), weights renormalized to sum 1
  expert_counts [E] int32                           token-slots per expert
  expert_offsets [E+1] int32                        where each expert's segment starts; segments are
                                                    padded to multiples of `block`; offsets[E] = used rows
  dest [T, k] int32, source_token [P] int32         for each (token, slot) its row in the permuted buffer,
                                                    and the token of each row (-1: padding or unused).
                                                    Expert e's token-slots fill rows offsets[e] ..
                                                    offsets[e] + counts[e] - 1, in ANY order (atomics)
  aux_loss, usage_var: fp32 scalars                 α·E·Σ_i f_i·P_i (α = 0.01) and 100·mean_i (E·f_i - 1)²
  out [T, hidden] elem_t                            out[t] = Σ_j topk_weights[t, j] · y_perm[dest[t, j]]

Checks: ids, counts and offsets exactly; the permutation order-insensitively (see check_permutation);
weights and the two scalars against float64 within a few fp32 ulp; out by the library-relative rule,
against the exact combine through the kernel's own permutation.

Work: tiny. flops counts the softmax (~5 per logit) and the combine's multiply-adds (2·k per
output element); min_bytes is what any implementation must read and write once. At real shapes
the combine (k rows of y_perm read and one row written per token) is nearly all of it.
"""
from __future__ import annotations

import torch

from reference import moe, tolerance
from reference.problem import FLOAT_POISON, INT_POISON, Case, Problem

ALPHA = 0.01          # the Switch Transformer's load-balancing coefficient
WEIGHT_RTOL = 1e-5    # fp32 exp and one division: a few ulp, relative to 1 + |w|
LOSS_RTOL = 1e-5      # sums of T fp32 probabilities in any order (atomics), relative to 1 + |value|


def _case(index, T, E, k, block, hidden, dtype, input_scale=1.0, base_seed=0, **knobs) -> Case:
    shape = dict(tokens=T, experts=E, top_k=k, block=block, hidden=hidden, **knobs)
    scaled = f" x{input_scale:g}" if input_scale != 1 else ""
    name = f"{shape_label(shape)} {'fp16' if dtype == 'float16' else 'bf16'}{scaled}"
    return Case(name, shape, dtype, input_scale, base_seed * 1000 + index)


def shape_label(shape: dict) -> str:
    label = f"T{shape['tokens']} E{shape['experts']} k{shape['top_k']} block{shape['block']} hidden{shape['hidden']}"
    if shape.get("skew"):
        label += f" skew{shape['skew']:g}"
    if shape.get("empty"):
        label += " empty" + ",".join(map(str, shape["empty"]))
    if shape.get("ties"):
        label += " ties"
    return label


# (T, E, k, block, hidden, dtype, input scale, knobs): one token; token counts that are no multiple of
# anything; E in {3, 8, 16, 32, 60, 256} (powers of two and not); k from 1 to 8; each padding; skewed
# routing (a few experts take most tokens); experts no token picks (first, middle, last); large logits;
# many exact ties (logits on a 0.5 grid); a hidden size that is no multiple of 8 (no 16-byte vectors);
# many tokens (several tokens per warp in the top-k kernel).
_CASES = [
    (1, 8, 2, 0, 64, "float16", 1), (1, 256, 8, 128, 128, "bfloat16", 1),
    (17, 8, 1, 64, 64, "bfloat16", 1), (100, 3, 2, 64, 64, "float16", 1),
    (300, 16, 4, 64, 128, "bfloat16", 1), (1000, 32, 2, 128, 256, "float16", 1),
    (1000, 60, 6, 64, 128, "bfloat16", 1), (4097, 32, 2, 0, 512, "bfloat16", 1),
    (4097, 256, 8, 128, 64, "float16", 1), (333, 60, 4, 0, 100, "float16", 1),
    (2048, 8, 2, 128, 4096, "bfloat16", 1), (777, 32, 8, 128, 64, "bfloat16", 1),
    (1000, 32, 2, 128, 128, "bfloat16", 1, dict(skew=6)), (4097, 256, 8, 64, 64, "float16", 1, dict(skew=6)),
    (1000, 32, 2, 128, 64, "float16", 1, dict(empty=(3, 17))), (500, 8, 2, 0, 64, "bfloat16", 1, dict(empty=(0,))),
    (999, 60, 6, 128, 64, "float16", 1, dict(empty=(59,))), (1000, 32, 2, 128, 128, "bfloat16", 10),
    (4097, 60, 6, 64, 64, "float16", 10), (1000, 256, 8, 64, 64, "bfloat16", 1, dict(ties=True)),
    (1000, 60, 1, 0, 64, "float16", 1, dict(ties=True)), (40000, 8, 2, 128, 64, "float16", 1, dict(skew=3)),
    (16384, 32, 2, 128, 256, "bfloat16", 1), (8192, 256, 8, 128, 64, "float16", 10, dict(skew=4, empty=(255,))),
]


def _benchmarks() -> list[dict]:
    shapes = []
    for name in ("seed", "mixtral", "deepseek"):
        config = moe.CONFIGS[name]
        for tokens in config["tokens"]:
            shapes.append(dict(tokens=tokens, experts=config["experts"], top_k=config["top_k"], block=128,
                               hidden=config["hidden"], inter=config["inter"]))
    return shapes


class MoeRoutingProblem(Problem):
    """Shapes: tokens, experts, top_k, block, hidden; optional skew, empty, ties. The dtype is y_perm's
    and out's; the input scale 10 makes large logits."""
    name = "moe_routing"
    primary_input = "y_perm"
    outputs = ("topk_ids", "topk_weights", "expert_counts", "expert_offsets", "dest", "source_token",
                      "aux_loss", "usage_var", "out")

    # ---- cases and shapes -------------------------------------------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return [_case(i, *c[:7], base_seed=seed, **(c[7] if len(c) > 7 else {})) for i, c in enumerate(_CASES)]

    def benchmarks(self) -> list[dict]:
        return [dict(shape, dtype="bfloat16") for shape in _benchmarks()]

    shape_label = staticmethod(shape_label)

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        T, E, k, block, hidden = (shape[n] for n in ("tokens", "experts", "top_k", "block", "hidden"))
        layer = moe.make_layer(T, hidden, shape.get("inter", 0), E, dtype, seed, with_experts=False,
                               input_scale=input_scale, skew=shape.get("skew", 0.0), empty=shape.get("empty", ()),
                               device=device)
        logits = moe.router_logits(layer["x"], layer["wr"], layer["bias"])
        if shape.get("ties"):
            logits = torch.round(logits * 2) / 2  # a 0.5 grid: many exact ties
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        rows = moe.padded_capacity(T, E, k, block)
        y_perm = torch.randn(rows, hidden, generator=gen, device=device).to(getattr(torch, dtype))
        return dict(logits=logits.contiguous(), y_perm=y_perm, top_k=k, block=block,
                    shape=dict(shape, dtype=dtype, seed=seed))

    def allocate_outputs(self, inputs: dict) -> dict:
        logits, y_perm, k = inputs["logits"], inputs["y_perm"], inputs["top_k"]
        (T, E), device = logits.shape, logits.device

        def ints(*shape):
            return torch.full(shape, INT_POISON, dtype=torch.int32, device=device)

        def floats(*shape, dtype=torch.float32):
            return torch.full(shape, FLOAT_POISON, dtype=dtype, device=device)

        return dict(topk_ids=ints(T, k), topk_weights=floats(T, k), expert_counts=ints(E),
                    expert_offsets=ints(E + 1), dest=ints(T, k), source_token=ints(y_perm.shape[0]),
                    aux_loss=floats(), usage_var=floats(), out=floats(T, y_perm.shape[1], dtype=y_perm.dtype))

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        o = outputs
        stage.launch(kernels, inputs["logits"], inputs["y_perm"], inputs["top_k"], inputs["block"], ALPHA,
                     o["topk_ids"], o["topk_weights"], o["expert_counts"], o["expert_offsets"], o["dest"],
                     o["source_token"], o["aux_loss"], o["usage_var"], o["out"])

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        logits, k, block = inputs["logits"], inputs["top_k"], inputs["block"]
        ids, weights = moe.topk_exact(logits, k)
        counts = torch.bincount(ids.flatten().long(), minlength=logits.shape[1]).to(torch.int32)
        aux, var = moe.balance_stats(torch.softmax(logits.double(), dim=-1), counts, k, ALPHA)
        f64 = dict(dtype=torch.float64, device=logits.device)
        return dict(topk_ids=ids, topk_weights=weights, expert_counts=counts,
                    expert_offsets=moe.expert_offsets(counts, block), aux_loss=torch.tensor(aux, **f64),
                    usage_var=torch.tensor(var, **f64), y_perm=inputs["y_perm"])

    def library_output(self, inputs: dict) -> dict:
        """Nothing ahead of time: the combine's library result depends on the kernel's permutation
        (any order within an expert is right), so `check` computes it from the kernel's dest."""
        return {}

    def check(self, outputs: dict, exact: dict, library: dict) -> list[tolerance.OutputCheck]:
        checks = [tolerance.exact_match(name, outputs[name], exact[name])
                  for name in ("topk_ids", "expert_counts", "expert_offsets")]
        checks.insert(1, tolerance.absolute_and_relative("topk_weights", outputs["topk_weights"],
                                                         exact["topk_weights"], WEIGHT_RTOL))
        checks.append(check_permutation(outputs["dest"], outputs["source_token"], exact["topk_ids"],
                                        exact["expert_counts"], exact["expert_offsets"]))
        for name in ("aux_loss", "usage_var"):
            checks.append(tolerance.absolute_and_relative(name, outputs[name], exact[name], LOSS_RTOL))
        # The combine through the kernel's own permutation (clamped into range if it is invalid: the
        # permutation check has failed then anyway), exact weights in float64, and as PyTorch would
        # in the dtype: products rounded to it, then summed.
        y = exact["y_perm"]
        rows = outputs["dest"].long().clamp(0, y.shape[0] - 1)
        gathered = y[rows]                                                   # [T, k, hidden]
        exact_out = (gathered.double() * exact["topk_weights"][..., None]).sum(1)
        library_out = (gathered * exact["topk_weights"].to(y.dtype)[..., None]).sum(1)
        checks.append(tolerance.relative_to_library("out", outputs["out"], exact_out, library_out))
        return checks

    # ---- baselines timed beside the kernel -------------------------------------------------------
    def baselines(self, inputs: dict) -> dict:
        """PyTorch's routing, vectorized ("torch", the reference) and with a loop over the experts
        ("naive"), and, at the benchmark shapes (those with an `inter`), the whole MoE layer in
        PyTorch ("layer_grouped_mm", or "layer_loop" where torch._grouped_mm is missing or fails):
        not a rival, the yardstick routing is measured against (see `notes`)."""
        found = {"torch": lambda: torch_routing(inputs), "naive": lambda: naive_routing(inputs)}
        spec = inputs["shape"]
        if spec.get("inter"):
            try:
                layer = moe.make_layer(spec["tokens"], spec["hidden"], spec["inter"], spec["experts"], "bfloat16",
                                       spec["seed"], skew=spec.get("skew", 0.0), empty=spec.get("empty", ()),
                                       device=inputs["logits"].device)
            except torch.cuda.OutOfMemoryError:  # the layer's weights do not fit beside the routing's buffers
                return found
            found.update(_layer_baseline(layer, spec["top_k"]))
        return found

    @staticmethod
    def notes(shape: dict, ms: float, baseline_ms: dict) -> list[str]:
        layer = {n: t for n, t in baseline_ms.items() if n.startswith("layer_") and t}
        return [f"routing + permutation + combine = {100 * ms / t:.2f}% of the whole layer ({n}: {t:.3f} ms)"
                for n, t in layer.items()]

    # ---- work -----------------------------------------------------------------------------
    @staticmethod
    def flops(shape: dict) -> float:
        T, E, k, hidden = (shape[n] for n in ("tokens", "experts", "top_k", "hidden"))
        return float(T) * (5 * E + 2 * k * hidden)

    @staticmethod
    def min_bytes(shape: dict, element_bytes: int = 2) -> float:
        T, E, k, block, hidden = (shape[n] for n in ("tokens", "experts", "top_k", "block", "hidden"))
        routing = 4 * T * E + 3 * 4 * T * k + 4 * (2 * E + 1) + 8   # logits in; ids, weights, dest, counts, offsets, scalars out
        permutation = 4 * moe.padded_capacity(T, E, k, block)        # source_token, every row written
        combine = (T * k + T) * hidden * element_bytes               # k rows of y_perm in, one row out per token
        return float(routing + permutation + combine)


# ---------------------------------------------------------------- the permutation check

def check_permutation(dest, source_token, ids, counts, offsets) -> tolerance.OutputCheck:
    """Right whatever the order inside each expert's segment: every (token, slot) goes to a distinct
    row of its expert's segment, among the first counts[e] rows (the padding comes after), and
    source_token is the inverse: the token at each of those rows, -1 at every other row."""
    T, k = ids.shape
    rows = source_token.shape[0]
    d, e = dest.long().flatten(), ids.long().flatten()
    total = T * k + rows
    if T * k and (d.min() < 0 or d.max() >= rows):
        bad = int(((d < 0) | (d >= rows)).sum())
        return tolerance.rule("dest, source_token", bad, total, f"{bad} dest outside 0..{rows - 1}")
    start = offsets.long()[e]
    outside = int(((d < start) | (d >= start + counts.long()[e])).sum())
    if outside:
        return tolerance.rule("dest, source_token", outside, total, f"{outside} (token, slot) outside their expert's rows")
    repeated = T * k - int(torch.unique(d).numel())
    if repeated:
        return tolerance.rule("dest, source_token", repeated, total, f"{repeated} rows given to two (token, slot)s")
    expected = torch.full_like(source_token, -1)
    expected[d] = (torch.arange(T * k, device=d.device) // k).to(expected.dtype)
    wrong = int((source_token != expected).sum())
    return tolerance.rule("dest, source_token", wrong, total,
                          f"source_token wrong at {wrong} rows" if wrong else "exact (any order within an expert)")


# ---------------------------------------------------------------- PyTorch baselines

def torch_routing(inputs: dict) -> torch.Tensor:
    """Everything the stage computes, in vectorized PyTorch with no host synchronization: softmax,
    torch.topk, a histogram by index_add, a stable argsort by expert, scatters, a gather-and-sum."""
    logits, y, k, block = inputs["logits"], inputs["y_perm"], inputs["top_k"], inputs["block"]
    (T, E), device = logits.shape, logits.device
    ids, weights, probs = moe.torch_routing(logits, k)
    flat = ids.flatten()
    counts = torch.zeros(E, dtype=torch.int64, device=device).index_add_(0, flat, torch.ones_like(flat))
    offsets = moe.expert_offsets(counts, block).long()
    order = torch.argsort(flat, stable=True)
    first_slot = torch.cumsum(counts, 0) - counts                  # unpadded start of each expert
    sorted_experts = flat[order]
    rank = torch.arange(T * k, device=device) - first_slot[sorted_experts]
    dest = torch.empty_like(flat)
    dest[order] = offsets[sorted_experts] + rank
    source = torch.full((y.shape[0],), -1, dtype=torch.int32, device=device)
    source[dest] = (torch.arange(T * k, device=device) // k).to(torch.int32)
    f = counts.float() / (T * k)
    aux = ALPHA * E * (f * probs.mean(0)).sum()
    var = 100 * ((E * f - 1) ** 2).mean()
    out = (y[dest.view(T, k)].float() * weights[..., None]).sum(1).to(y.dtype)
    return out


def naive_routing(inputs: dict) -> torch.Tensor:
    """The same with a loop over the experts, each finding its token-slots with torch.where (a host
    synchronization per expert), as Hugging Face's Mixtral does; the combine by index_add_."""
    logits, y, k, block = inputs["logits"], inputs["y_perm"], inputs["top_k"], inputs["block"]
    (T, E), device = logits.shape, logits.device
    ids, weights, probs = moe.torch_routing(logits, k)
    dest = torch.empty(T, k, dtype=torch.int64, device=device)
    source = torch.full((y.shape[0],), -1, dtype=torch.int32, device=device)
    counts = torch.zeros(E, dtype=torch.int64, device=device)
    start = 0
    for e in range(E):
        token, slot = torch.where(ids == e)
        n = token.numel()
        rows = torch.arange(start, start + n, device=device)
        dest[token, slot] = rows
        source[rows] = token.to(torch.int32)
        counts[e] = n
        start += -(-n // block) * block if block else n
    f = counts.float() / (T * k)
    aux = ALPHA * E * (f * probs.mean(0)).sum()
    var = 100 * ((E * f - 1) ** 2).mean()
    out = torch.zeros(T, y.shape[1], dtype=torch.float32, device=device)
    out.index_add_(0, torch.arange(T, device=device).repeat_interleave(k), y[dest.flatten()].float() * weights.reshape(-1, 1))
    return out.to(y.dtype)


def _layer_baseline(layer: dict, top_k: int) -> dict:
    if moe.has_grouped_mm():
        try:
            moe.layer_grouped_mm(layer, top_k)
            return {"layer_grouped_mm": lambda: moe.layer_grouped_mm(layer, top_k)}
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return {"layer_loop": lambda: moe.layer_loop(layer, top_k)}


PROBLEM = MoeRoutingProblem()
