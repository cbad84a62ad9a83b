"""python -m stages.stage10_model.train --model small|moe [--steps N] [--batch B] [--seq S] [--lr LR] [--every K]
[--json PATH]

A short training run of stage 10's model (reference/model.py: a Llama/Mixtral-style decoder) three ways, from
the same initial weights, on the same batches, with the same optimizer:

  course   the attention by ops.attention (forward and backward by the course's kernels: stages 4 and 9 on
           sm_90a), the MoE layer by ops.moe_layer (stages 7 and 14); PyTorch for everything else
  pytorch  the same model with PyTorch's SDPA and its grouped_mm MoE layer, eager
  compile  the pytorch way under torch.compile (reference/model.py's regional compilation: one decoder layer)

What it measures, and why. The loss curves: the ways differ only in the attention's and the MoE layer's code,
so a course curve that agrees with PyTorch's within bf16's noise says that the kernels' gradients are right
where it counts, in training; the problems' checks judge one call's outputs, and a small bias in a gradient
would show only over many steps. And tokens/s of whole training steps (forward, backward, AdamW), the course's
kernels against PyTorch eager and against torch.compile.

The text: the bytes of the course's own docs/**/*.md (sorted by path, concatenated), one token per byte
(vocabulary 256): nothing to download. Each step's batch: B windows of S + 1 tokens at offsets drawn by a
seeded generator; the inputs are a window's first S tokens, the targets its last S (each input's next byte).

The model: an embedding table [256, hidden], stage 10's decoder at a reduced size (TRAINED: the model's widths,
fewer layers; the MoE model narrower too) with reference/model.py's initialization, an LM head [hidden, 256].
Every weight is an fp32 master (a leaf tensor that AdamW updates), cast to the model's dtype (bf16 on the GPU)
for each forward, as mixed-precision training does; the LM head's logits in fp32. The loss: the cross-entropy
of the next byte, plus, in the MoE model, the load-balancing loss that ops.moe_layer leaves to its caller
(reference/moe.py's balance_loss, coefficient BALANCE_COEF), computed beside every MoE layer from the router's
fp32 logits by PyTorch's top-k, the same code for the three ways. The losses reported: the cross-entropy, every
`every` steps and at the last.

tokens/s: B·S tokens a step over the steps after the warm-up (the first min(WARMUP_STEPS, steps // 2) steps:
compilation, the kernels' first launches), the GPU synchronized before each reading of the clock. The ops
refuse what their stages cannot run with one ValueError in one line (the MoE layer's backward off sm_90a, where
stage 14 does not run): the course way is then skipped, with that line. Without a CUDA GPU the command says so
in one line and exits with status 2.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from reference import moe
from reference.model import DIMENSIONS, EAGER, compiled_regions, forward, make_inputs, model_shape, moe_block, \
    shape_label, weights_of
from stages import ops

DOCS = Path(__file__).resolve().parents[2] / "docs"
VOCAB = 256  # one token per byte
# name -> the changes to reference/model.py's CONFIGS entry, for a short run: small's widths on 2 layers (14.2 M
# weights in the decoder), Mixtral's 8 experts, top-2, GQA 4:1 and RoPE theta on 2 narrower layers (26.5 M).
TRAINED = {"small": dict(layers=2),
           "moe": dict(layers=2, hidden=512, heads=8, kv_heads=2, inter=1024)}
BALANCE_COEF = 0.01  # the Switch Transformer's
ADAMW = dict(betas=(0.9, 0.95), weight_decay=0.0)
WARMUP_STEPS = 10
SEED = 0
COURSE = "course"  # the way the ops may refuse


# ---------------------------------------------------------------- the text and its batches

def course_text(docs: Path = DOCS) -> bytes:
    """The course's Markdown pages, sorted by path, concatenated."""
    return b"".join(page.read_bytes() for page in sorted(docs.rglob("*.md")))


def tokens_of(text: bytes) -> torch.Tensor:
    """int64 [len(text)]: one token per byte, 0..255."""
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def next_batch(tokens: torch.Tensor, B: int, S: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [B, S]: B windows of S + 1 tokens at random offsets, the targets one token on."""
    starts = torch.randint(0, len(tokens) - S, (B,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(S + 1)]
    return windows[:, :-1], windows[:, 1:]


def batches(tokens: torch.Tensor, B: int, S: int, steps: int, seed: int, device) -> list[tuple]:
    """Each step's (inputs, targets) on `device`, drawn by a generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return [tuple(t.to(device) for t in next_batch(tokens, B, S, generator)) for _ in range(steps)]


# ---------------------------------------------------------------- the model and its loss

def trained_shape(name: str, B: int, S: int) -> dict:
    return model_shape(name, B, S, **TRAINED[name])


def initial_weights(shape: dict, seed: int, device) -> dict:
    """fp32 leaves requiring grad: the decoder's by reference/model.py's initialization; the embedding table
    [256, hidden] ~ N(0, 1) (unit-size inputs, as the model's x) and the LM head [hidden, 256] ~ N(0, 1/hidden)."""
    decoder = weights_of(make_inputs(shape, "float32", seed, device=device))
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    embedding = torch.randn(VOCAB, shape["hidden"], generator=generator, device=device)
    lm_head = torch.randn(shape["hidden"], VOCAB, generator=generator, device=device) * shape["hidden"] ** -0.5
    return {name: w.requires_grad_() for name, w in dict(decoder, embedding=embedding, lm_head=lm_head).items()}


class Balanced:
    """An MoE layer for reference/model.py's moe_block (a name or a callable, `layer`) that also keeps each
    call's load-balancing loss, from the router's fp32 logits routed by PyTorch's top-k: what a caller of
    ops.moe_layer adds (it returns none), the same whatever the layer."""

    def __init__(self, layer: str | Callable):
        self.layer, self.balance_losses = layer, []

    def __call__(self, m, wr, w1, w2, top_k: int) -> torch.Tensor:
        ids, _, probs = moe.torch_routing(moe.router_logits(m, wr), top_k)
        counts = moe.expert_counts(ids, wr.shape[1])
        self.balance_losses.append(moe.balance_loss(probs, counts, top_k, BALANCE_COEF))
        return moe_block(m, wr, w1, w2, top_k, self.layer)

    def take_balance_loss(self) -> torch.Tensor | float:
        """The sum of the losses kept since the last take (0 where no MoE layer ran)."""
        total = sum(self.balance_losses)
        self.balance_losses.clear()
        return total


class Way(NamedTuple):
    """How the model computes its attention and its MoE layer (reference/model.py's attend and moe_block: a
    name or a callable), and torch.compile's options for its regions (None: eager)."""
    attention: str | Callable
    moe_layer: str | Callable
    compile_options: dict | None = None


def ways() -> dict[str, Way]:
    """The three ways of the module docstring (the ops looked up when called)."""
    return {COURSE: Way(functools.partial(ops.attention, causal=True), ops.moe_layer),
            "pytorch": Way("sdpa", "grouped_mm"),
            "compile": Way("sdpa", "grouped_mm", compile_options={})}


def loss_function(way: Way, shape: dict, dtype: torch.dtype) -> Callable:
    """loss(weights, inputs, targets) -> (cross-entropy, the loss to minimize: + the balance loss), the model
    computed `way` in `dtype` from the fp32 masters."""
    config = {k: shape[k] for k in DIMENSIONS}
    moe_layer = Balanced(way.moe_layer)
    regions = EAGER if way.compile_options is None else compiled_regions(**way.compile_options)

    def loss(weights: dict, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        decoder = {name: w.to(dtype) for name, w in weights.items() if name not in ("embedding", "lm_head")}
        x = F.embedding(inputs, weights["embedding"]).to(dtype)
        hidden = forward(x, decoder, config, attention=way.attention, moe_impl=moe_layer, regions=regions)
        logits = hidden.float() @ weights["lm_head"]
        cross_entropy = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return cross_entropy, cross_entropy + moe_layer.take_balance_loss()
    return loss


# ---------------------------------------------------------------- training

def clock(device: torch.device) -> float:
    """Seconds, once the GPU's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train(way: Way, shape: dict, steps_batches: list[tuple], lr: float, dtype: torch.dtype, every: int) -> dict:
    """{"losses": the cross-entropy at steps 0, every, 2·every, ... and the last, "tokens_per_s": over the
    steps after the warm-up}: AdamW from initial_weights(SEED), one step a batch."""
    device = steps_batches[0][0].device
    weights = initial_weights(shape, SEED, device)
    optimizer = torch.optim.AdamW(weights.values(), lr=lr, **ADAMW)
    loss = loss_function(way, shape, dtype)
    warmup = min(WARMUP_STEPS, len(steps_batches) // 2)
    logged = []
    for step, (inputs, targets) in enumerate(steps_batches):
        if step == warmup:
            start = clock(device)
        cross_entropy, total = loss(weights, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        if step % every == 0 or step == len(steps_batches) - 1:
            logged.append(cross_entropy.detach())  # read after the run: no synchronization in the timed steps
    tokens = (len(steps_batches) - warmup) * steps_batches[0][0].numel()
    return dict(losses=[float(l) for l in logged], tokens_per_s=tokens / (clock(device) - start))


def compare(ways: dict[str, Way], shape: dict, steps_batches: list[tuple], lr: float, dtype: torch.dtype,
            every: int) -> tuple[dict, dict]:
    """({way: train's result}, {way: why skipped}): each way trained from the start; the course way skipped
    where an op refuses it (its ValueError's line), a ValueError of any other way raised."""
    results, skipped = {}, {}
    for name, way in ways.items():
        try:
            results[name] = train(way, shape, steps_batches, lr, dtype, every)
        except ValueError as refusal:
            if name != COURSE:
                raise
            skipped[name] = str(refusal)
    return results, skipped


# ---------------------------------------------------------------- the command

def report(results: dict, skipped: dict, steps: int, every: int) -> list[str]:
    """The losses by step, a column a way, then each way's tokens/s, then the skipped ways' reasons."""
    names = list(results)
    logged_steps = [*range(0, steps, every)] + ([steps - 1] if (steps - 1) % every else [])
    lines = [f"{'step':<9}" + "".join(f"{n:>12}" for n in names)]
    lines += [f"{step:<9}" + "".join(f"{results[n]['losses'][i]:>12.4f}" for n in names)
              for i, step in enumerate(logged_steps)]
    lines.append(f"{'tokens/s':<9}" + "".join(f"{results[n]['tokens_per_s']:>12,.0f}" for n in names))
    lines += [f"{name}: skipped: {why}" for name, why in skipped.items()]
    return lines


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stages.stage10_model.train",
                                     description="Stage 10's model trained three ways: the course's kernels, "
                                                 "PyTorch eager, torch.compile.")
    parser.add_argument("--model", choices=sorted(TRAINED), default="small")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--every", type=int, default=10, help="the loss reported every this many steps")
    parser.add_argument("--json", type=Path, help="write the losses and tokens/s here")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch, args.seq, args.every) < 1:
        parser.error("--steps, --batch, --seq and --every must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("stages.stage10_model.train needs a CUDA GPU, and this machine shows none", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    shape = trained_shape(args.model, args.batch, args.seq)
    steps_batches = batches(tokens_of(course_text()), args.batch, args.seq, args.steps, SEED, device)
    print(f"{shape_label(shape)} bf16, {args.steps} steps, AdamW lr {args.lr:g}, on "
          f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    results, skipped = compare(ways(), shape, steps_batches, args.lr, torch.bfloat16, args.every)
    print("\n".join(report(results, skipped, args.steps, args.every)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(model=shape["model"], batch=args.batch, seq=args.seq, steps=args.steps,
                                             every=args.every, ways=results, skipped=skipped), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
