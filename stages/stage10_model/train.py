"""python -m stages.stage10_model.train [--model NAME [NAME ...]] [--steps N] [--batch B] [--seq S] [--lr LR]
[--every K] [--json PATH]

A short training run of stage 10's model (reference/model.py: a Llama/Mixtral-style decoder) four ways, from
the same initial weights, on the same batches, with the same optimizer:

  course            the attention by ops.attention (forward and backward by the course's kernels: stages 4 and 9
                    on sm_90a), the MoE layer by ops.moe_layer (stages 7 and 14); PyTorch for everything else
  pytorch           the same model with PyTorch's SDPA and its grouped_mm MoE layer, eager
  pytorch-compiled  the pytorch way's regions under torch.compile
  course-compiled   the course way's regions under torch.compile: the ops are custom ops (torch.library) with
                    fake implementations, so each region traces into one graph with the course's kernels in it

The compiled ways are compiled alike: reference/model.py's regions (the code before the first layer, and one
decoder layer, which every layer runs), each compiled once with COMPILED: CUDA graphs (mode="reduce-overhead":
the shapes are static, so inductor's code is captured and replayed, launches and all, forward and backward)
and fullgraph=True (a graph break is an error, not a silent return to eager code). What lies outside the
regions runs eagerly and is the same code in the four ways: the weights' casts to bf16, the embedding, the LM
head and its loss, the sum of the balance losses, AdamW (fused on the GPU: one kernel for all the weights).
A CUDA graph reads its inputs at fixed addresses, so the weights, cast afresh each step, are copied into each
graph's inputs, as much in both compiled ways. Each compiled way starts afresh (torch._dynamo.reset: the
previous way's code and CUDA graphs freed) and reports the graphs Dynamo compiled (two: the regions) and the
graphs inductor ran without CUDA graphs (0; the reason, where not, in TORCH_LOGS=perf_hints).

What it measures, and why. The loss curves: the ways differ only in the attention's and the MoE layer's code
(and, compiled, in how the rest is fused), so a course curve that agrees with PyTorch's within bf16's noise
says that the kernels' gradients are right where it counts, in training; the problems' checks judge one
call's outputs, and a small bias in a gradient would show only over many steps. And tokens/s of whole
training steps (forward, backward, AdamW): the course's kernels against PyTorch eager, and compiled against
compiled.

The text: the bytes of the course's own docs/**/*.md (sorted by path, concatenated), one token per byte
(vocabulary 256): nothing to download. Each step's batch: B windows of S + 1 tokens at offsets drawn by a
seeded generator; the inputs are a window's first S tokens, the targets its last S (each input's next byte).

The models (records.py's TRAINED, each with its batch, sequence, steps and learning rate, which the flags
override): an embedding table [256, hidden], stage 10's decoder at a training size (small and moe: two
short layers; llama and moe-llama: a 1B-like model's widths on 4 layers, dense and with 8 experts of top-2,
at 4 × 2048 tokens) with reference/model.py's initialization, an LM head [hidden, 256]. Every weight is an
fp32 master (a leaf tensor that AdamW updates), cast to the model's dtype (bf16 on the GPU) for each forward,
as mixed-precision training does; the LM head's logits in fp32. The loss: the cross-entropy of the next byte,
plus, in an MoE model, the load-balancing loss that ops.moe_layer leaves to its caller (reference/moe.py's
balance_loss, coefficient BALANCE_COEF), computed beside every MoE layer from the router's fp32 logits by
PyTorch's top-k, the same code for every way. The losses reported: the cross-entropy, every `every` steps
and at the last.

tokens/s: B·S tokens a step over the steps after the warm-up (the first min(WARMUP_STEPS, steps // 2) steps:
compilation, the CUDA graphs' capture, the kernels' first launches), the GPU synchronized before each reading
of the clock; warmup_s, the warm-up's seconds. The ops refuse what their stages cannot run with one
ValueError in one line (the MoE layer's backward off sm_90a, where stage 14 does not run): a course way is
then skipped, with that line. Any other error of a compiled way is reported in one line (its traceback on
stderr) and the other ways still run; the command then exits with status 1. With --json, each model's run
is written into PATH, a records file of this GPU (records.py: results/training/<gpu>.json holds them), in
place of a run of the same model and size. Without a CUDA GPU the command says so in one line and exits with
status 2.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from reference import moe
from reference.model import DIMENSIONS, EAGER, compiled_regions, forward, make_inputs, model_shape, moe_block, \
    shape_label, weights_of
from stages import ops
from stages.stage10_model import records
from stages.stage10_model.records import TRAINED

DOCS = Path(__file__).resolve().parents[2] / "docs"
VOCAB = 256  # one token per byte
BALANCE_COEF = 0.01  # the Switch Transformer's
ADAMW = dict(betas=(0.9, 0.95), weight_decay=0.0)
WARMUP_STEPS = 10
SEED = 0
COMPILED = dict(mode="reduce-overhead", fullgraph=True)  # torch.compile's options for both compiled ways
COURSE_WAYS = ("course", "course-compiled")  # the ways the ops may refuse
SETTINGS = ("batch", "seq", "steps", "lr")  # what a run of TRAINED's sizes takes from it, unless a flag says


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

def trained_shape(name: str, B: int, S: int, **changes) -> dict:
    """TRAINED[name]'s model (with `changes` to its dimensions) at B × S tokens, named `name`."""
    trained = TRAINED[name]
    return dict(model_shape(trained["base"], B, S, **(trained["changes"] | changes)), model=name)


def initial_weights(shape: dict, seed: int, device) -> dict:
    """fp32 leaves requiring grad: the decoder's by reference/model.py's initialization; the embedding table
    [256, hidden] ~ N(0, 1) (unit-size inputs, as the model's x) and the LM head [hidden, 256] ~ N(0, 1/hidden)."""
    decoder = weights_of(make_inputs(shape, "float32", seed, device=device))
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    embedding = torch.randn(VOCAB, shape["hidden"], generator=generator, device=device)
    lm_head = torch.randn(shape["hidden"], VOCAB, generator=generator, device=device) * shape["hidden"] ** -0.5
    return {name: w.requires_grad_() for name, w in dict(decoder, embedding=embedding, lm_head=lm_head).items()}


class Balanced:
    """An MoE layer for reference/model.py's moe_block (a name or a callable, `layer`) that also computes each
    call's load-balancing loss, from the router's fp32 logits routed by PyTorch's top-k: what a caller of
    ops.moe_layer adds (it returns none), the same whatever the layer. A call stores its loss as `last` (a
    plain store, which Dynamo traces without a guard on what was stored before, so that one compiled decoder
    layer serves every layer); `keeping` a region moves it to the step's losses after each call."""

    def __init__(self, layer: str | Callable):
        self.layer, self.last, self.balance_losses = layer, None, []

    def __call__(self, m, wr, w1, w2, top_k: int) -> torch.Tensor:
        ids, _, probs = moe.torch_routing(moe.router_logits(m, wr), top_k)
        counts = moe.expert_counts(ids, wr.shape[1])
        self.last = moe.balance_loss(probs, counts, top_k, BALANCE_COEF)
        return moe_block(m, wr, w1, w2, top_k, self.layer)

    def keeping(self, region: Callable) -> Callable:
        """`region`, then the loss its call stored (if any) kept."""
        def run(*args):
            out = region(*args)
            if self.last is not None:
                self.balance_losses.append(self.last)
                self.last = None
            return out
        return run

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


def ways(compile_options: dict = COMPILED) -> dict[str, Way]:
    """The four ways of the module docstring (the ops looked up when called), in the order they run: eager
    first, the course's compiled way last."""
    course, pytorch = Way(functools.partial(ops.attention, causal=True), ops.moe_layer), Way("sdpa", "grouped_mm")
    return {"course": course, "pytorch": pytorch, "pytorch-compiled": pytorch._replace(compile_options=compile_options),
            "course-compiled": course._replace(compile_options=compile_options)}


def loss_function(way: Way, shape: dict, dtype: torch.dtype) -> Callable:
    """loss(weights, inputs, targets) -> (cross-entropy, the loss to minimize: + the balance loss), the model
    computed `way` in `dtype` from the fp32 masters."""
    config = {k: shape[k] for k in DIMENSIONS}
    moe_layer = Balanced(way.moe_layer)
    regions = EAGER if way.compile_options is None else compiled_regions(**way.compile_options)
    regions = regions._replace(layer=moe_layer.keeping(regions.layer))

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


def fresh_compiler() -> None:
    """torch.compile from the start: the earlier ways' code and CUDA graphs freed (and a model's shapes compiled
    for themselves: past the first, a new shape would make Dynamo's sizes dynamic), its counters at zero."""
    torch._dynamo.reset()
    counters.clear()


def compiled_counts() -> dict:
    """The graphs Dynamo compiled since fresh_compiler, and those inductor ran without CUDA graphs."""
    return dict(graphs=counters["stats"]["unique_graphs"], cudagraph_skips=counters["inductor"]["cudagraph_skips"])


def train(way: Way, shape: dict, steps_batches: list[tuple], lr: float, dtype: torch.dtype, every: int,
          weights: dict | None = None) -> dict:
    """{"losses": the cross-entropy at steps 0, every, 2·every, ... and the last, "tokens_per_s": over the
    steps after the warm-up, "warmup_s": the warm-up's time; compiled, compiled_counts}: AdamW from
    initial_weights(SEED), or from `weights` (fp32 leaves, trained in place), one step a batch."""
    device = steps_batches[0][0].device
    if way.compile_options is not None:
        fresh_compiler()
    weights = initial_weights(shape, SEED, device) if weights is None else weights
    optimizer = torch.optim.AdamW(weights.values(), lr=lr, fused=device.type == "cuda", **ADAMW)
    loss = loss_function(way, shape, dtype)
    warmup = min(WARMUP_STEPS, len(steps_batches) // 2)
    logged, begin = [], clock(device)
    for step, (inputs, targets) in enumerate(steps_batches):
        if step == warmup:
            start = clock(device)
        torch.compiler.cudagraph_mark_step_begin()  # a new step for the CUDA graphs' memory (compiled ways)
        cross_entropy, total = loss(weights, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        if step % every == 0 or step == len(steps_batches) - 1:
            logged.append(cross_entropy.detach())  # read after the run: no synchronization in the timed steps
    end = clock(device)
    tokens = (len(steps_batches) - warmup) * steps_batches[0][0].numel()
    found = dict(losses=[float(l) for l in logged], tokens_per_s=tokens / (end - start), warmup_s=start - begin)
    return found | (compiled_counts() if way.compile_options is not None else {})


class Comparison(NamedTuple):
    results: dict  # way -> train's result
    skipped: dict  # way -> the ops' refusal, in one line
    failed: dict   # way -> a compiled way's error, in one line


def compare(ways: dict[str, Way], shape: dict, steps_batches: list[tuple], lr: float, dtype: torch.dtype,
            every: int, announce: Callable[[str], None] = lambda line: None) -> Comparison:
    """Each way trained from the start (`announce`d when done, in a line); a course way skipped where an op
    refuses it (its ValueError's line), a ValueError of any other way raised; a compiled way's other errors
    reported (their traceback on stderr), an eager way's raised."""
    found = Comparison({}, {}, {})
    for name, way in ways.items():
        try:
            found.results[name] = result = train(way, shape, steps_batches, lr, dtype, every)
            announce(f"{name}: {result['tokens_per_s']:,.0f} tokens/s after a warm-up of {result['warmup_s']:.1f} s")
        except ValueError as refusal:
            if name not in COURSE_WAYS:
                raise
            found.skipped[name] = str(refusal)
        except Exception as error:  # noqa: BLE001  (reported: the other ways still run)
            if way.compile_options is None:
                raise
            traceback.print_exc()
            found.failed[name] = one_line(error)
    return found


def one_line(error: Exception) -> str:
    """"Type: the message's first line", and the next where the first ends in a colon (Dynamo's "backend='...'
    raised:" before the backend's own error)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    return f"{type(error).__name__}: " + " ".join(lines[:2] if lines[0].endswith(":") else lines[:1])


# ---------------------------------------------------------------- the command

def report(found: Comparison, steps: int, every: int) -> list[str]:
    """The losses by step, a column a way, then each way's tokens/s, the compiled ways' graphs, then the
    skipped and failed ways' reasons."""
    results = found.results
    width = max([12, *(len(name) + 2 for name in results)])
    logged_steps = [*range(0, steps, every)] + ([steps - 1] if (steps - 1) % every else [])
    row = lambda head, cells: f"{head:<9}" + "".join(f"{cell:>{width}}" for cell in cells)  # noqa: E731
    lines = [row("step", results)]
    lines += [row(str(step), (f"{r['losses'][i]:.4f}" for r in results.values())) for i, step in enumerate(logged_steps)]
    lines.append(row("tokens/s", (f"{r['tokens_per_s']:,.0f}" for r in results.values())))
    lines += [f"{name}: {r['graphs']} graphs compiled, {r['cudagraph_skips']} run without CUDA graphs"
              + (" (TORCH_LOGS=perf_hints says why)" if r["cudagraph_skips"] else "")
              for name, r in results.items() if "graphs" in r]
    lines += [f"{name}: skipped: {why}" for name, why in found.skipped.items()]
    lines += [f"{name}: failed: {why}" for name, why in found.failed.items()]
    return lines


def settings(args: argparse.Namespace, name: str) -> dict:
    """The batch, sequence, steps and learning rate of a run of TRAINED[name]: the flags', else its own."""
    return {key: TRAINED[name][key] if getattr(args, key) is None else getattr(args, key) for key in SETTINGS}


def source() -> dict:
    """The commit the tree is: $FLASHMOE_COMMIT where set (a copied tree's .git may be stale, as the grader's
    records say; then dirty is None), else git's HEAD and whether tracked files differ from it; None where
    neither is known."""
    if os.environ.get("FLASHMOE_COMMIT"):
        return dict(commit=os.environ["FLASHMOE_COMMIT"], dirty=None)

    def git(*args) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=DOCS.parent, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
    head = git("rev-parse", "--short", "HEAD")
    return dict(commit=head, dirty=None if head is None else bool(git("status", "--porcelain", "--untracked-files=no")))


def record(name: str, shape: dict, run_settings: dict, every: int, found: Comparison, gpu: str, argv: list[str]) -> dict:
    """A run as records.py describes it."""
    return dict(model=name, label=shape_label(shape), **run_settings, every=every, gpu=gpu, torch=torch.__version__,
                **source(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=shlex.join(["python", "-m", "stages.stage10_model.train", *argv]),
                ways=found.results, skipped=found.skipped, failed=found.failed)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stages.stage10_model.train",
                                     description="Stage 10's model trained four ways: the course's kernels and "
                                                 "PyTorch's, eager and under torch.compile with CUDA graphs.")
    parser.add_argument("--model", nargs="+", choices=list(TRAINED), default=["small"],
                        help="the models to train, one after the other")
    parser.add_argument("--steps", type=int, help="default: the model's (records.py's TRAINED), as the next three")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--every", type=int, default=10, help="the loss reported every this many steps")
    parser.add_argument("--json", type=Path, help="write each model's run into this records file (records.py)")
    args = parser.parse_args(argv)
    if min(v for v in (args.steps, args.batch, args.seq, args.every) if v is not None) < 1:
        parser.error("--steps, --batch, --seq and --every must be at least 1")
    return args


def run_model(name: str, args: argparse.Namespace, argv: list[str], tokens: torch.Tensor, device: torch.device,
              gpu: str) -> Comparison:
    """One model trained every way in bf16, its losses and tokens/s printed, and with --json its run recorded."""
    run = settings(args, name)
    shape = trained_shape(name, run["batch"], run["seq"])
    steps_batches = batches(tokens, run["batch"], run["seq"], run["steps"], SEED, device)
    print(f"{shape_label(shape)} bf16, {run['steps']} steps, AdamW lr {run['lr']:g}, on {gpu}, torch {torch.__version__}",
          flush=True)
    found = compare(ways(), shape, steps_batches, run["lr"], torch.bfloat16, args.every, functools.partial(print, flush=True))
    print("\n".join(report(found, run["steps"], args.every)), flush=True)
    if args.json:
        records.merge(args.json, record(name, shape, run, args.every, found, gpu, argv))
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if not torch.cuda.is_available():
        print("stages.stage10_model.train needs a CUDA GPU, and this machine shows none", file=sys.stderr)
        return 2
    device, tokens = torch.device("cuda"), tokens_of(course_text())
    found = [run_model(name, args, argv, tokens, device, torch.cuda.get_device_name(device)) for name in args.model]
    return 1 if any(f.failed for f in found) else 0


if __name__ == "__main__":
    raise SystemExit(main())
