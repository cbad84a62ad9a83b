"""The MoE experts problem: every expert's SwiGLU FFN on tokens already in expert order (stage 6).

Inputs: x_perm [rows, hidden], the token-slots of a layer routed exactly (moe.topk_exact), permuted
as stage 5 leaves them: expert e's token-slots at rows offsets[e] .. offsets[e] + counts[e] - 1, in
(token, slot) order, then padding rows up to offsets[e+1] that repeat the segment's last token-slot
(what stage 7's gather writes; see `permute` for why not zeros): every segment starts at a
multiple of BLOCK = 128 rows, the GEMM tile. rows = offsets[E], the rows in use (known on the host
here: make_inputs is not timed). expert_offsets [E+1] int32, expert_counts [E] int32,
W1 [E, hidden, 2·I] (gate half, then up half), W2 [E, I, hidden]; float16 or bfloat16. hidden and I
are multiples of 8 and at least 64, as in every real model (TMA needs 16-byte strides and a box of
64 columns).

Output: y_perm [rows, hidden] elem_t, y_perm[r] = silu(x_perm[r]·W1[e][:, :I]) * (x_perm[r]·W1[e][:, I:]) · W2[e]
for each row r of expert e's segment.

Checks: the valid rows (counts[e] in each segment) by the library-relative rule, against the float64
FFN; the library is PyTorch expert by expert in the dtype (matmuls, then SwiGLU, rounded to it).
The padding rows are not checked: y_perm holds 0 there before the kernel runs (NaN in the valid rows),
so a kernel may compute them or skip them.

Work: useful flops only, 2·hidden·2I + 2·I·hidden per token-slot (moe.layer_flops): the padding rows
a kernel computes are its overhead. min_bytes: every weight of an expert that gets tokens, the
token-slots' rows of x_perm in and of y_perm out.
"""
from __future__ import annotations

import torch

from reference import moe, tolerance
from reference.problem import FLOAT_POISON, Case, Problem

BLOCK = 128  # every expert's segment starts at a multiple of 128 rows, as stage 5 pads it for the GEMM tiles


def _case(index, T, E, k, hidden, inter, dtype, input_scale=1.0, base_seed=0, **knobs) -> Case:
    shape = dict(tokens=T, experts=E, top_k=k, hidden=hidden, inter=inter, **knobs)
    scaled = f" x{input_scale:g}" if input_scale != 1 else ""
    name = f"{shape_label(shape)} {'fp16' if dtype == 'float16' else 'bf16'}{scaled}"
    return Case(name, shape, dtype, input_scale, base_seed * 1000 + index)


def shape_label(shape: dict) -> str:
    label = (f"T{shape['tokens']} E{shape['experts']} k{shape['top_k']} hidden{shape['hidden']} "
             f"inter{shape['inter']}")
    if shape.get("skew"):
        label += f" skew{shape['skew']:g}"
    if shape.get("empty"):
        label += " empty" + ",".join(map(str, shape["empty"]))
    return label


# (T, E, k, hidden, inter, dtype, input scale, knobs): one token; token counts that are no multiple of
# anything; E from 2 to 64 with k from 1 to 8 (E2 k2: every token to both experts, segments of exactly
# one tile); dimensions (>= 64) that are multiples of 8 but not of 64, and multiples of 64 or 128; skewed routing
# (skew 6: expert 0 takes nearly every token, a segment of several tiles, >= 300 rows in four cases);
# experts no token picks (first, middle, last); large inputs; a Llama-sized hidden.
_CASES = [
    (1, 8, 2, 64, 64, "float16", 1), (1, 64, 8, 128, 128, "bfloat16", 1),
    (37, 8, 1, 72, 104, "bfloat16", 1), (333, 16, 4, 200, 136, "float16", 1),
    (1000, 32, 2, 256, 384, "bfloat16", 1), (1000, 64, 8, 128, 128, "float16", 1),
    (4097, 8, 2, 512, 128, "bfloat16", 1), (1000, 2, 1, 128, 256, "float16", 1),
    (777, 16, 2, 136, 200, "bfloat16", 1), (128, 2, 2, 64, 64, "bfloat16", 1),
    (1000, 32, 2, 256, 128, "bfloat16", 1, dict(skew=6)), (333, 8, 2, 200, 136, "float16", 1, dict(skew=6)),
    (2048, 64, 8, 128, 64, "float16", 1, dict(skew=6)), (4097, 32, 4, 72, 104, "bfloat16", 1, dict(skew=3)),
    (1000, 32, 2, 128, 128, "float16", 1, dict(empty=(0,))), (500, 16, 4, 72, 104, "bfloat16", 1, dict(empty=(3, 7))),
    (999, 64, 8, 64, 128, "float16", 1, dict(empty=(63,))), (1000, 32, 2, 256, 384, "bfloat16", 10),
    (333, 16, 4, 200, 136, "float16", 10), (256, 8, 2, 4096, 256, "bfloat16", 1),
]


def cases(seed: int = 0, extra=()) -> list[Case]:
    """The cases of _CASES, then those of `extra` (rows as _CASES's: a problem's own), each with its own seed."""
    rows = _CASES + list(extra)
    return [_case(i, *c[:7], base_seed=seed, **(c[7] if len(c) > 7 else {})) for i, c in enumerate(rows)]


def benchmarks() -> list[dict]:
    """bfloat16, no skew: the 32-expert layer ("seed") at each of its token counts, Mixtral, DeepSeek."""
    shapes = []
    for name in ("seed", "mixtral", "deepseek"):
        config = moe.CONFIGS[name]
        for tokens in config["tokens"]:
            shapes.append(dict(tokens=tokens, experts=config["experts"], top_k=config["top_k"],
                               hidden=config["hidden"], inter=config["inter"], dtype="bfloat16"))
    return shapes


def make_layer(shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
    """moe.make_layer for a case's or benchmark's shape."""
    return moe.make_layer(shape["tokens"], shape["hidden"], shape["inter"], shape["experts"], dtype, seed,
                          input_scale=input_scale, skew=shape.get("skew", 0.0), empty=shape.get("empty", ()),
                          device=device)


class MoeExpertsProblem(Problem):
    name = "moe_experts"
    primary_input = "x_perm"
    outputs = ("y_perm",)

    # ---- cases and shapes -------------------------------------------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return cases(seed)

    def benchmarks(self) -> list[dict]:
        return benchmarks()

    shape_label = staticmethod(shape_label)

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        layer = make_layer(shape, dtype, seed, input_scale, device)
        ids, _ = moe.topk_exact(moe.router_logits(layer["x"], layer["wr"], layer["bias"]), shape["top_k"])
        counts = torch.bincount(ids.flatten().long(), minlength=shape["experts"]).to(torch.int32)
        offsets = moe.expert_offsets(counts, BLOCK)
        return dict(x_perm=permute(layer["x"], ids, counts, offsets), expert_offsets=offsets, expert_counts=counts,
                    w1=layer["w1"], w2=layer["w2"], shape=dict(shape, dtype=dtype, seed=seed))

    def allocate_outputs(self, inputs: dict) -> dict:
        """y_perm: NaN in the valid rows (so that an unwritten one shows), 0 in the padding rows."""
        y = torch.zeros_like(inputs["x_perm"])
        y[valid_rows(inputs["expert_offsets"], inputs["expert_counts"])] = FLOAT_POISON
        return dict(y_perm=y)

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        i = inputs
        stage.launch(kernels, i["x_perm"], i["expert_offsets"], i["expert_counts"], i["w1"], i["w2"], outputs["y_perm"])

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        return dict(y_perm=experts_loop(inputs, torch.float64),
                    valid_rows=valid_rows(inputs["expert_offsets"], inputs["expert_counts"]))

    def library_output(self, inputs: dict) -> dict:
        return dict(y_perm=experts_loop(inputs, inputs["x_perm"].dtype))

    def check(self, outputs: dict, exact: dict, library: dict) -> list[tolerance.OutputCheck]:
        rows = exact["valid_rows"]  # the padding rows are left out
        return [tolerance.relative_to_library("y_perm", outputs["y_perm"][rows], exact["y_perm"][rows],
                                              library["y_perm"][rows])]

    # ---- baselines timed beside the kernel -------------------------------------------------------
    def baselines(self, inputs: dict) -> dict:
        """torch._grouped_mm on the token-slots' rows without the padding ("grouped_mm", where it runs:
        PyTorch >= 2.8, bf16 on the GPU), and a loop over the experts ("naive"). What is not timed is
        done here, once: the gather of the unpadded rows, the segments copied to the host, y allocated."""
        x_perm, w1, w2 = inputs["x_perm"], inputs["w1"], inputs["w2"]
        counts = inputs["expert_counts"]
        x_compact = x_perm[valid_rows(inputs["expert_offsets"], counts)]
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        found = moe.grouped_mm_baseline(lambda: moe.experts_grouped_mm(x_compact, w1, w2, offs))
        y = torch.zeros_like(x_perm)
        spans = segments(inputs)
        found["naive"] = lambda: experts_loop(inputs, x_perm.dtype, spans, out=y)
        return found

    # ---- work -----------------------------------------------------------------------------
    @staticmethod
    def flops(shape: dict) -> float:
        return moe.layer_flops(shape["tokens"], shape["hidden"], shape["inter"], shape["top_k"])

    @staticmethod
    def min_bytes(shape: dict, element_bytes: int = 2) -> float:
        T, E, k, hidden, inter = (shape[n] for n in ("tokens", "experts", "top_k", "hidden", "inter"))
        weights = (E - len(shape.get("empty", ()))) * 3 * hidden * inter  # W1 and W2 of the experts that get tokens
        rows = 2 * T * k * hidden                                            # the token-slots' rows in and out
        return float((weights + rows) * element_bytes)


# ---------------------------------------------------------------- the permuted layout

def valid_rows(offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The rows of the permuted buffer that hold a token-slot, in order (int64): row i of the
    unpadded order, in expert e, sits offsets[e] - (the token-slots of experts before e) further."""
    counts = counts.long()
    shift = offsets[:-1].long() - (torch.cumsum(counts, 0) - counts)
    return torch.arange(int(counts.sum()), device=counts.device) + torch.repeat_interleave(shift, counts)


def permute(x: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x_perm [offsets[E], hidden]: the token-slots sorted by expert ((token, slot) order within one,
    as a stable sort of the flattened ids leaves them), each expert's at its segment, and each padding
    row a copy of the last token-slot above it. Any values would do there (nobody reads those outputs);
    zeros are the obvious choice but not a neutral one: tiles with a few all-zero rows ran stage 6's
    wgmma kernel at half speed on the H100 (stage 6's lab notebook, docs/notebook/stage6.md), while cuBLAS
    did not slow down."""
    order = torch.argsort(ids.flatten(), stable=True)
    rows = valid_rows(offsets, counts)
    source = torch.zeros(int(offsets[-1]), dtype=torch.long, device=x.device)
    source[rows] = torch.arange(rows.numel(), device=x.device)
    filled = torch.zeros_like(source, dtype=torch.bool)
    filled[rows] = True
    # Each row's nearest valid row at or above it (a running maximum of valid row indices).
    index = torch.where(filled, torch.arange(source.numel(), device=x.device), 0)
    nearest = torch.cummax(index, 0).values
    return x[order // ids.shape[1]][source[nearest]]


def segments(inputs: dict) -> list[tuple[int, int]]:
    """(first row, token-slots) of each expert, on the host."""
    return list(zip(inputs["expert_offsets"][:-1].tolist(), inputs["expert_counts"].tolist()))


def experts_loop(inputs: dict, dtype: torch.dtype, spans=None, out=None) -> torch.Tensor:
    """Expert by expert, the SwiGLU FFN of its segment's token-slots in `dtype` (float64: exact; the
    inputs' dtype: as PyTorch computes it, each matmul and the SwiGLU rounded to it), written into
    `out` (default: zeros, so padding rows are 0)."""
    x_perm, w1, w2 = inputs["x_perm"], inputs["w1"], inputs["w2"]
    inter = w2.shape[1]
    y = torch.zeros(x_perm.shape, dtype=dtype, device=x_perm.device) if out is None else out
    for e, (start, count) in enumerate(segments(inputs) if spans is None else spans):
        if count:
            rows = slice(start, start + count)
            y[rows] = moe.swiglu(x_perm[rows].to(dtype) @ w1[e].to(dtype), inter) @ w2[e].to(dtype)
    return y


PROBLEM = MoeExpertsProblem()
