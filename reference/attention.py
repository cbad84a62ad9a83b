"""The attention problem: O = softmax(scale · Q Kᵀ [causal mask]) V, and the LSE of each row.

Q: [B, H, Sq, D], K and V: [B, H_kv, Skv, D], O: [B, H, Sq, D], all contiguous, float16 or bfloat16;
LSE: [B, H, Sq] float32, lse_i = log Σ_j exp(scale · q_i · k_j) over the keys row i sees (natural log).
scale is 1/√D. Causal masking is top-left aligned, as in PyTorch: query i sees keys j <= i.

Grouped-query attention (GQA; MQA when H_kv = 1): H is a multiple of H_kv, and query head h attends with
KV head h // (H / H_kv), as PyTorch's enable_gqa and Llama's repeat_kv (repeat_interleave) have it. Llama-3
and Mixtral: 32 query heads over 8 KV heads. A shape's "Hkv" is H where it is absent.

Work: 4·D flops for each (query, key) pair a row sees (2·D for q·k, 2·D for p·v): 4·B·H·S²·D, about
half that when causal. Fewest bytes: Q, K, V read once (K and V: H_kv heads), O and the LSE written once.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from reference import tolerance
from reference.problem import FLOAT_POISON, Case, Problem

LSE_RTOL = 4e-5  # fp32 scores over D <= 128 terms: a few ulp of Σ|q·k|, relative to 1 + |lse|


def _case(index, B, H, Sq, Skv, D, causal, dtype, input_scale=1.0, Hkv=None, base_seed=0) -> Case:
    mask = "causal" if causal else "full"
    scaled = f" x{input_scale:g}" if input_scale != 1 else ""
    grouped = f" Hkv{Hkv}" if Hkv not in (None, H) else ""
    name = f"B{B} H{H}{grouped} Sq{Sq} Skv{Skv} D{D} {mask} {'fp16' if dtype == 'float16' else 'bf16'}{scaled}"
    shape = dict(B=B, H=H, Sq=Sq, Skv=Skv, D=D, causal=causal)
    if grouped:  # only then: the shapes (and results) of H_kv = H mean what they always did
        shape["Hkv"] = Hkv
    return Case(name, shape, dtype, input_scale, base_seed * 1000 + index)


def kv_heads(shape: dict) -> int:
    """H_kv, the heads of K and V: the shape's "Hkv", or H where it has none."""
    return shape.get("Hkv", shape["H"])


def kv_group(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query heads per KV head, H / H_kv, of q [B, H, ...] and k [B, H_kv, ...]."""
    return q.shape[1] // k.shape[1]


def expand_kv(inputs: dict) -> dict:
    """The inputs with K and V repeated to H heads (KV head h // group for query head h): plain attention."""
    group = kv_group(inputs["q"], inputs["k"])
    if group == 1:
        return inputs
    return {**inputs, **{n: inputs[n].repeat_interleave(group, dim=1) for n in "kv"}}


# (B, H, Sq, Skv, D, causal, dtype, input scale): single rows, lengths that are no multiple of any
# tile, Sq != Skv both ways, both masks, both dtypes, large scores, many heads, a long sequence,
# more (batch, head) pairs than a grid dimension other than x holds.
_CASES = [
    (1, 1, 1, 1, 64, False, "float16", 1), (1, 1, 1, 1, 128, True, "bfloat16", 1),
    (2, 3, 17, 17, 64, True, "float16", 1), (1, 2, 17, 17, 128, False, "bfloat16", 1),
    (2, 2, 64, 64, 64, True, "bfloat16", 1), (1, 4, 128, 128, 128, False, "float16", 1),
    (2, 2, 239, 239, 64, True, "bfloat16", 1), (1, 3, 239, 239, 128, True, "float16", 1),
    (1, 2, 1000, 1000, 64, False, "float16", 1), (1, 2, 1000, 1000, 128, True, "bfloat16", 1),
    (1, 1, 2047, 2047, 64, False, "bfloat16", 1), (1, 1, 2047, 2047, 128, True, "float16", 1),
    (2, 2, 1, 1000, 64, False, "float16", 1), (1, 2, 100, 333, 128, True, "bfloat16", 1),
    (1, 2, 333, 100, 64, True, "float16", 1), (1, 1, 77, 1, 128, False, "float16", 1),
    (2, 2, 512, 512, 64, False, "float16", 10), (1, 2, 1000, 1000, 128, True, "bfloat16", 10),
    (1, 1, 2047, 2047, 64, True, "float16", 10), (1, 1, 1, 1, 128, False, "bfloat16", 10),
    (4, 8, 256, 256, 64, True, "bfloat16", 1), (8, 1, 96, 96, 64, True, "float16", 1),
    (3, 5, 4096, 4096, 128, False, "float16", 1), (1, 1, 4096, 4096, 64, True, "bfloat16", 10),
    # more (batch, head) pairs than a grid's y or z dimension holds (65,535): a decode-sized batch
    (280, 250, 16, 16, 64, False, "float16", 1), (300, 229, 5, 33, 128, True, "bfloat16", 1),
    # GQA and MQA (H_kv, last): groups of 4, Llama-3's and Mixtral's 32 query heads over 8 KV heads, MQA,
    # Sq != Skv both ways, large scores, and B·H beyond 65,535 pairs (launches cut between groups).
    (2, 8, 239, 239, 64, True, "float16", 1, 2), (1, 32, 1000, 1000, 128, True, "bfloat16", 1, 8),
    (2, 4, 333, 333, 64, False, "bfloat16", 1, 1), (1, 32, 1000, 1000, 64, False, "float16", 1, 8),
    (2, 6, 100, 333, 128, True, "float16", 1, 2), (1, 4, 333, 100, 64, True, "bfloat16", 1, 1),
    (2, 8, 512, 512, 128, True, "float16", 10, 2), (280, 256, 16, 16, 64, True, "bfloat16", 1, 32),
]

_BENCHMARKS = [
    dict(B=16, H=16, Sq=2048, Skv=2048, D=64, causal=False),
    dict(B=16, H=16, Sq=2048, Skv=2048, D=64, causal=True),
    dict(B=4, H=16, Sq=8192, Skv=8192, D=128, causal=False),
    dict(B=4, H=16, Sq=8192, Skv=8192, D=128, causal=True),
]


class AttentionProblem(Problem):
    name = "attention"
    outputs = ("o", "lse")
    primary_input = "q"
    # What kernels may take as compile-time constants: the head dimension, and the causal mask (0 or 1)
    parameters = {"D": (64, 128), "causal": (0, 1)}

    # ---- cases and shapes -------------------------------------------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return [_case(i, *c, base_seed=seed) for i, c in enumerate(_CASES)]

    def benchmarks(self) -> list[dict]:
        return [dict(shape, dtype="float16") for shape in _BENCHMARKS]

    @staticmethod
    def shape_label(shape: dict) -> str:
        seq = f"S{shape['Sq']}" if shape["Sq"] == shape["Skv"] else f"Sq{shape['Sq']} Skv{shape['Skv']}"
        grouped = f" Hkv{kv_heads(shape)}" if kv_heads(shape) != shape["H"] else ""
        return f"B{shape['B']} H{shape['H']}{grouped} {seq} D{shape['D']}{' causal' if shape['causal'] else ''}"

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        return random_inputs(shape, dtype, torch.Generator(device=device).manual_seed(seed), input_scale)

    def allocate_outputs(self, inputs: dict) -> dict:
        q = inputs["q"]
        return dict(o=torch.full_like(q, FLOAT_POISON),
                    lse=torch.full(q.shape[:3], FLOAT_POISON, dtype=torch.float32, device=q.device))

    def parameter_values(self, inputs: dict) -> dict:
        return {"D": inputs["q"].shape[-1], "causal": int(inputs["causal"])}

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        stage.launch(kernels, inputs["q"], inputs["k"], inputs["v"], outputs["o"], outputs["lse"],
                     inputs["scale"], inputs["causal"])

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        q, k, v = (expand_kv(inputs)[n].to(torch.float64) for n in "qkv")
        scores = (q @ k.transpose(-1, -2)) * inputs["scale"]
        if inputs["causal"]:
            scores = scores.masked_fill(causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        return dict(o=torch.exp(scores - lse[..., None]) @ v, lse=lse)

    def library_output(self, inputs: dict) -> dict:
        """PyTorch's own attention in the inputs' dtype: what the tolerance rule measures against."""
        return dict(o=sdpa(inputs))

    def check(self, outputs: dict, exact: dict, library: dict) -> list[tolerance.OutputCheck]:
        return [tolerance.relative_to_library("o", outputs["o"], exact["o"], library["o"]),
                tolerance.absolute_and_relative("lse", outputs["lse"], exact["lse"], LSE_RTOL)]

    # ---- baselines timed beside the kernel -------------------------------------------------------
    def baselines(self, inputs: dict) -> dict:
        """Each SDPA backend this GPU runs on these inputs, and naive PyTorch; name -> callable."""
        found = {}
        for name, backend in sdpa_backends().items():
            run = (lambda b=backend: sdpa(inputs, b))
            try:
                run()
            except RuntimeError:  # this backend does not support these inputs or this GPU
                continue
            found[name] = run
        S2 = inputs["q"].shape[0] * inputs["q"].shape[1] * inputs["q"].shape[2] * inputs["k"].shape[2]
        if "math" in found and S2 > 2**31:  # the math backend's fp32 S×S copies would not fit
            del found["math"]
        found["naive"] = lambda: naive_attention(inputs)
        return found

    # ---- work -----------------------------------------------------------------------------
    @staticmethod
    def flops(shape: dict) -> float:
        return 4.0 * shape["B"] * shape["H"] * shape["D"] * visible_pairs(shape["Sq"], shape["Skv"], shape["causal"])

    @staticmethod
    def min_bytes(shape: dict, element_bytes: int = 2) -> float:
        B, H, Sq, Skv, D = (shape[k] for k in ("B", "H", "Sq", "Skv", "D"))
        return B * H * (2 * Sq * D * element_bytes + Sq * 4) + B * kv_heads(shape) * 2 * Skv * D * element_bytes


def random_inputs(shape: dict, dtype: str, gen: torch.Generator, input_scale: float = 1.0) -> dict:
    """Q, K and V drawn from `gen` in that order (on its device), K and V with H_kv heads, the scale and the mask."""
    B, H, Sq, Skv, D = (shape[k] for k in ("B", "H", "Sq", "Skv", "D"))
    if H % kv_heads(shape):
        raise ValueError(f"H = {H} is not a multiple of H_kv = {kv_heads(shape)}")

    def rand(heads, S):
        return (torch.randn(B, heads, S, D, generator=gen, device=gen.device) * input_scale).to(getattr(torch, dtype))

    return dict(q=rand(H, Sq), k=rand(kv_heads(shape), Skv), v=rand(kv_heads(shape), Skv), scale=1.0 / math.sqrt(D),
                causal=bool(shape["causal"]))


def visible_pairs(seq_q: int, seq_kv: int, causal: bool) -> int:
    """How many (query, key) pairs are not masked: Σ_i min(i + 1, Skv) when causal."""
    if not causal:
        return seq_q * seq_kv
    full_rows = max(seq_q - seq_kv, 0)              # rows i >= Skv see every key
    ramp = min(seq_q, seq_kv)                        # rows 0..ramp-1 see i + 1 keys
    return ramp * (ramp + 1) // 2 + full_rows * seq_kv


def causal_mask(seq_q: int, seq_kv: int, device) -> torch.Tensor:
    """True where key j is hidden from query i (j > i)."""
    return torch.ones(seq_q, seq_kv, dtype=torch.bool, device=device).triu(1)


def sdpa_backends() -> dict:
    from torch.nn.attention import SDPBackend
    names = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
    return {name: getattr(SDPBackend, attr) for name, attr in names.items() if hasattr(SDPBackend, attr)}


def sdpa(inputs: dict, backend=None) -> torch.Tensor:
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    causal = inputs["causal"]
    # PyTorch's is_causal is top-left aligned like ours; an explicit mask says so for Sq != Skv too.
    mask = ~causal_mask(q.shape[2], k.shape[2], q.device) if causal and q.shape[2] != k.shape[2] else None
    context = contextlib.nullcontext()
    if backend is not None:
        from torch.nn.attention import sdpa_kernel
        context = sdpa_kernel(backend)
    with context:
        # enable_gqa (torch >= 2.5) only where H_kv < H: with H_kv = H the call is what it always was
        gqa = {"enable_gqa": True} if kv_group(q, k) > 1 else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=inputs["scale"], **gqa)


def naive_attention(inputs: dict) -> torch.Tensor:
    """Naive PyTorch as model code writes it (Meta's Llama reference implementation): matmul, softmax,
    matmul, the S×S scores in memory, the softmax in float32 (`softmax(scores.float()).type_as(q)`); K and V
    repeated to H heads first (Llama's repeat_kv) where H_kv < H."""
    q, k, v = (expand_kv(inputs)[n] for n in "qkv")
    scores = (q @ k.transpose(-1, -2)) * inputs["scale"]
    if inputs["causal"]:
        scores.masked_fill_(causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.softmax(scores.float(), dim=-1).type_as(q) @ v


PROBLEM = AttentionProblem()
