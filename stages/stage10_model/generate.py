"""python -m stages.stage10_model.generate [--model NAME [NAME ...]] [--batch B [B ...]] [--prompt P] [--new N]
[--dtype DTYPE] [--repeat R] [--trained STEPS] [--transformers] [--json PATH]

Greedy generation with stage 10's model and the course's kernels, and (--transformers) the same weights in
Hugging Face's LlamaForCausalLM, generating with its static cache and compiled, timed beside it.

The model: stage 10's dense decoder (reference/model.py; small, medium or large) with train.py's seeded
initialization, its embedding [256, hidden] and its untied LM head [hidden, 256], then trained for --trained
steps (300 unless told) on the course's text as train.py's PyTorch way trains (fit), in bf16 (or fp16). Random
weights would do for timing, but their next-token logits sit within the dtype's rounding of one another, so
two correct generations part at the first near-tie; a trained model's next byte is mostly clear. The prompts:
B windows of P bytes of the course's text at offsets drawn by a seeded generator (no padding).

How the course generates (Generator):
  prefill   stage 10's forward over the prompts (stages/stage10_model: its kernels add_rmsnorm, rope_split,
            swiglu, cuBLAS's projections, ops.attention: stage 4 on sm_90a), each layer's K and V (after
            RoPE) written into a paged KV cache as the layer makes them; the LM head on the last position
            picks the first token.
  decode    each later token one decode step: the same forward on one token a sequence, its attention
            ops.decode_attention (stage 15) over the paged cache, the new K and V written first. The whole
            step (the embedding's row, RoPE's row for the position, the cache's rows, every layer, the LM
            head, the greedy pick) is captured once as a CUDA graph and replayed: its inputs and outputs are
            tensors at fixed addresses (the token, the position, the lengths, the step's index), updated in
            place on the GPU by the step itself, so the loop is N - 1 replays and no host synchronization;
            the tokens are read once, at the end.
The cache (KVCache): per layer K and V, [pages, PAGE_SIZE, KV heads, D] each, as reference/decode_attention.py
lays it out; one block table for the batch (block_table: sequence b's page i is page i·B + b), each
sequence given the pages for its prompt and all its new tokens up front.

How transformers generates (--transformers): reference/model.py's transformers_model, the same weights in
LlamaForCausalLM; generate(do_sample=False) with a StaticCache made once per batch and reset before each
call (transformers' documented way to reuse one, which keeps its tensors at one address for the CUDA
graphs); with a static cache on a GPU, generate compiles the decode step itself (torch.compile, its
CompileConfig's defaults: mode="reduce-overhead", CUDA graphs) and runs the prefill eagerly. The run
reports how many graphs Dynamo compiled and how many inductor ran without CUDA graphs (0 wanted).

What it measures. Each way generates once as a warm-up (kernels compiled, graphs captured, transformers'
decode step compiled), then `repeat` times timed; the medians reported. The prefill's time (to the first
token) apart from the decode's (the N - 1 later tokens): decode tokens/s = B·(N - 1) / decode seconds. For
transformers, the first call of a stopping criterion (after the prefill's token is picked) reads the clock,
the GPU synchronized: generate waits for the GPU at every step anyway. The tokens: transformers' first
COMPARED_STEPS generated tokens against the course's, per sequence: how many leading tokens agree, and where they part,
the course's top-2 logit margin there (random weights make near-ties; a tie within the dtype's rounding may
fall either way, and the sequences differ from there).

With --json, each run is written into PATH (results/generate/<gpu>.json holds a GPU's runs), in place of a
run of the same model, dtype, batch, prompt and new tokens; the record carries the commit, GPU, versions and
command as train.py's do. Refusals (sizes the kernels do not take, transformers missing) are one line, with
status 2; without a CUDA GPU the command says so in one line and exits with status 2; a transformers run
that fails is reported in one line (its traceback on stderr), the course's figures still recorded, status 1.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import math
import shlex
import statistics
import sys
import traceback
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from reference.decode_attention import PROBLEM as DECODE
from reference.decode_attention import pages_of
from reference.model import CONFIGS, DIMENSIONS, model_shape, rope_cos_sin, shape_label, transformers_model
from stages import arch_for, ops
from stages.ops.shared import load_kernels
from stages.stage10_model import STAGE, capture, causal_attention, check_widths, forward, records
from stages.stage10_model.train import SEED, batches, clock, compiled_counts, course_text, fresh_compiler, \
    initial_weights, next_batch, one_line, source, tokens_of, train, ways

PAGE_SIZE = 64        # tokens a page of the KV cache holds (stage 15's benchmarks')
COMPARED_STEPS = 32   # the first generated tokens compared with transformers'
REPEATS = 5           # timed generations after the warm-up (--repeat)
TRAINING = {k: records.TRAINED["small"][k] for k in ("batch", "seq", "lr")}  # fit's: train.py's small model's
TRAINED_STEPS = 300   # steps of fit before generating (--trained)
MODELS = tuple(name for name, c in CONFIGS.items() if not c["experts"])  # the dense models
DTYPES = ("bfloat16", "float16")
HEAD_DIMS = DECODE.parameters["D"]  # what ops.decode_attention (and ops.attention) take
SAME_RUN = ("model", "dtype", "batch", "prompt", "new")  # a new run replaces a recorded one that agrees on these
FOLDER = records.FOLDER.parent / "generate"


# ---------------------------------------------------------------- the paged KV cache

class KVCache(NamedTuple):
    kv: torch.Tensor     # [layers, 2 (K, V), pages, page_size, KV heads, D]
    table: torch.Tensor  # int32 [B, pages a sequence]: sequence b's pages in order
    page_size: int


def block_table(batch: int, max_len: int, page_size: int) -> torch.Tensor:
    """int32 [batch, pages_of(max_len)]: sequence b's page i is page i·batch + b, as a server hands pages out
    while the batch grows a page at a time in step, so that no sequence's pages lie side by side (batch > 1)."""
    pages = pages_of(max_len, page_size)
    return (torch.arange(pages)[None, :] * batch + torch.arange(batch)[:, None]).to(torch.int32)


def cache_rows(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """int64, positions' shape [B, n]: the row where token positions[b, j] of sequence b lies in a layer's K
    (or V) cache seen as [pages · page_size, KV, D]: page table[b, p // page_size], slot p % page_size."""
    return table.gather(1, positions // page_size).long() * page_size + positions % page_size


def allocate_cache(config: dict, batch: int, max_len: int, dtype, device, page_size: int = PAGE_SIZE) -> KVCache:
    """Every layer's K and V pages for `batch` sequences of up to max_len tokens (zeros), and their table."""
    table = block_table(batch, max_len, page_size).to(device)
    D = config["hidden"] // config["heads"]
    kv = torch.zeros(config["layers"], 2, table.numel(), page_size, config["kv_heads"], D, dtype=dtype, device=device)
    return KVCache(kv, table, page_size)


# ---------------------------------------------------------------- the course's generation

class Timing(NamedTuple):
    prefill_s: float  # the prompts to the first token
    decode_s: float   # the other new_tokens - 1 tokens


def check_request(config: dict, batch: int, prompt_len: int, new_tokens: int) -> None:
    """ValueError in one line where the kernels cannot generate this."""
    if config["experts"]:
        raise ValueError(f"generate runs the dense models ({', '.join(MODELS)}); this one has "
                         f"{config['experts']} experts")
    if min(batch, prompt_len, new_tokens) < 1:
        raise ValueError(f"batch, prompt length and new tokens must be at least 1; got {batch}, {prompt_len}, "
                         f"{new_tokens}")
    D = config["hidden"] // config["heads"]
    if D not in HEAD_DIMS:
        raise ValueError(f"the decode attention takes head dimensions {' or '.join(map(str, HEAD_DIMS))}; got {D}")
    check_widths(config)


def check_prompts(prompts: torch.Tensor, batch: int, prompt_len: int, vocab: int, device) -> None:
    """ValueError in one line unless prompts is int64 [batch, prompt_len] of tokens < vocab on `device`."""
    if not isinstance(prompts, torch.Tensor):
        raise ValueError(f"prompts must be an int64 tensor [{batch}, {prompt_len}]; got {type(prompts).__name__}")
    if prompts.dtype != torch.int64 or tuple(prompts.shape) != (batch, prompt_len) or prompts.device != device:
        raise ValueError(f"prompts must be int64 [{batch}, {prompt_len}] on {device}; got {prompts.dtype} "
                         f"{tuple(prompts.shape)} on {prompts.device}")
    low, high = int(prompts.min()), int(prompts.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"prompt tokens must lie in 0 .. {vocab - 1}; got {low} .. {high}")


class Generator:
    """Greedy generation of new_tokens for batch prompts of prompt_len tokens by stage 10's forward (the module
    docstring): `weights` the decoder's (reference/model.py's names, in the dtype) with "embedding" [vocab,
    hidden] and "lm_head" [hidden, vocab], `kernels` stage 10's (stage_kernels). After generate(prompts),
    `tokens` [new_tokens, B] holds each step's token and `margins` [new_tokens, B] the gap between its two
    largest logits (fp32). graphed=False runs each decode step eagerly (the same launches; on the CPU with
    PyTorch standing in for the kernels, the tests' way)."""

    def __init__(self, kernels, weights: dict, config: dict, batch: int, prompt_len: int, new_tokens: int,
                 graphed: bool = True, page_size: int = PAGE_SIZE):
        check_request(config, batch, prompt_len, new_tokens)
        self.kernels, self.config, self.graphed = kernels, config, graphed
        self.decoder = {n: w for n, w in weights.items() if n not in ("embedding", "lm_head")}
        self.embedding, self.lm_head = weights["embedding"], weights["lm_head"]
        self.prompt_len, self.new_tokens = prompt_len, new_tokens
        device, dtype = self.embedding.device, self.embedding.dtype
        max_len = prompt_len + new_tokens - 1  # the last token is picked, never fed back: its K and V never kept
        self.cache = allocate_cache(config, batch, max_len, dtype, device, page_size)
        self.cos, self.sin = rope_cos_sin(max_len, config["hidden"] // config["heads"], config["rope_theta"], dtype,
                                          device)
        # The decode step's state, read and updated in place by the step (and so by its graph's replays)
        self.token = torch.zeros(batch, dtype=torch.int64, device=device)   # each sequence's last token
        self.position = torch.zeros(1, dtype=torch.int64, device=device)    # where it lies (every sequence alike)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)        # the next row of tokens and margins
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(new_tokens, batch, dtype=torch.int64, device=device)
        self.margins = torch.zeros(new_tokens, batch, dtype=torch.float32, device=device)
        self.graph = None

    def generate(self, prompts: torch.Tensor) -> Timing:
        """new_tokens greedy tokens for each prompt (int64 [B, prompt_len]) into `tokens`; the prefill's and the
        decode's times, the GPU synchronized before each reading of the clock."""
        check_prompts(prompts, self.token.shape[0], self.prompt_len, self.embedding.shape[0], self.token.device)
        start = clock(self.token.device)
        self.prefill(prompts)
        prefilled = clock(self.token.device)
        for _ in range(self.new_tokens - 1):
            self.decode()
        return Timing(prefilled - start, clock(self.token.device) - prefilled)

    def prefill(self, prompts: torch.Tensor) -> None:
        """Stage 10's forward over the prompts, keeping every layer's K and V; the first token picked."""
        B, P = prompts.shape
        x = F.embedding(prompts, self.embedding)
        out = torch.empty_like(x)
        rows = cache_rows(self.cache.table, torch.arange(P, device=x.device).expand(B, P), self.cache.page_size)
        forward(self.kernels, x, self.decoder, self.config, out, (self.cos[:P], self.sin[:P]),
                functools.partial(self.prefill_attention, rows=rows.reshape(-1)))
        self.step.zero_()
        self.position.fill_(P)
        self.pick(out[:, -1])

    def decode(self) -> None:
        """One decode step: the graph's replay (captured on the first call), or the step itself."""
        if not self.graphed:
            return self.decode_step()
        if self.graph is None:
            self.graph = self.captured()
        self.graph.replay()

    def decode_step(self) -> None:
        """The token at `position` through the model, its K and V kept; the next token picked. What the graph
        captures: every input is a tensor this object holds, every index computed on the GPU."""
        B = self.token.shape[0]
        x = self.embedding.index_select(0, self.token).view(B, 1, -1)
        rope = self.cos.index_select(0, self.position), self.sin.index_select(0, self.position)  # [1, D]: S is 1
        self.seq_lens.copy_(self.position + 1)
        rows = cache_rows(self.cache.table, self.position.expand(B, 1), self.cache.page_size).view(-1)
        out = torch.empty_like(x)
        forward(self.kernels, x, self.decoder, self.config, out, rope,
                functools.partial(self.decode_attention, rows=rows))
        self.pick(out.view(B, -1))
        self.position.add_(1)

    def captured(self) -> torch.cuda.CUDAGraph:
        """The decode step as one CUDA graph. Its warm-up runs the step once: the state it advanced (token,
        position, step) is put back; what it wrote (a cache slot, a row of tokens and margins) the first
        replay writes again, the same."""
        state = (self.token, self.position, self.step)
        saved = [t.clone() for t in state]
        graph = capture(self.decode_step)
        for t, value in zip(state, saved):
            t.copy_(value)
        return graph

    def pick(self, last: torch.Tensor) -> None:
        """The greedy token of each sequence from its last hidden state [B, hidden]: the logits in the model's
        dtype, widened to fp32 (as transformers' generate reads them), their argmax (the first of equals)."""
        logits = (last @ self.lm_head).float()
        self.token.copy_(logits.argmax(-1))
        top = logits.topk(2, dim=-1).values
        self.tokens.index_copy_(0, self.step, self.token[None])
        self.margins.index_copy_(0, self.step, (top[:, 0] - top[:, 1])[None])
        self.step.add_(1)

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """k and v [B, KV, S, D] into the layer's cache at rows [B·S] (cache_rows of their positions)."""
        KV, D = k.shape[1], k.shape[3]
        for pages, new in zip(self.cache.kv[layer].view(2, -1, KV, D), (k, v)):
            pages.index_copy_(0, rows, new.transpose(1, 2).reshape(-1, KV, D))

    def prefill_attention(self, layer: int, q, k, v, rows: torch.Tensor) -> torch.Tensor:
        self.keep(layer, k, v, rows)
        return causal_attention(layer, q, k, v)

    def decode_attention(self, layer: int, q, k, v, rows: torch.Tensor) -> torch.Tensor:
        self.keep(layer, k, v, rows)
        k_cache, v_cache = self.cache.kv[layer]
        return ops.decode_attention(q, k_cache, v_cache, self.cache.table, self.seq_lens, 1.0 / math.sqrt(q.shape[-1]))


def stage_kernels(dtype: torch.dtype, head_dim: int, device: torch.device):
    """Stage 10's kernels (model.cu) for this dtype and head dimension on `device`'s GPU, loaded as stages.ops
    loads its stages'."""
    index = torch.cuda.current_device() if device.index is None else device.index
    arch = arch_for(torch.cuda.get_device_properties(index), STAGE.archs)
    return load_kernels(STAGE, arch, {"dtype": str(dtype).removeprefix("torch."), "D": head_dim}, index)


def model_weights(shape: dict, dtype: torch.dtype, device, trained_steps: int = 0) -> tuple[dict, dict]:
    """(weights, config): the model of `shape` (reference/model.py's model_shape) with train.py's initialization
    (seeded with its SEED: the decoder's, the embedding [256, hidden], the LM head [hidden, 256]), trained for
    `trained_steps` steps on the course's text (fit), cast to `dtype`; config its dimensions."""
    masters = initial_weights(shape, SEED, device)
    if trained_steps:
        fit(masters, shape, trained_steps, device)
    with torch.no_grad():
        weights = {n: w.detach().to(dtype) for n, w in masters.items()}
    return weights, {k: shape[k] for k in DIMENSIONS}


def fit(masters: dict, shape: dict, steps: int, device) -> None:
    """Trains `masters` in place as train.py's PyTorch way does (AdamW, bf16 on the GPU), TRAINING's batches of
    the course's text: a model whose next byte is often clear, unlike random weights' near-ties."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    steps_batches = batches(tokens_of(course_text()), TRAINING["batch"], TRAINING["seq"], steps, SEED, device)
    train(ways()["pytorch"], dict(shape, B=TRAINING["batch"], S=TRAINING["seq"]), steps_batches, TRAINING["lr"],
          dtype, every=steps, weights=masters)


def prompts_for(batch: int, prompt_len: int, device, seed: int = SEED) -> torch.Tensor:
    """int64 [batch, prompt_len]: windows of the course's text (one token a byte) at offsets drawn by a
    generator seeded with `seed`."""
    windows, _ = next_batch(tokens_of(course_text()), batch, prompt_len, torch.Generator().manual_seed(seed))
    return windows.to(device)


# ---------------------------------------------------------------- transformers' generation, and the comparison

def transformers_generate(model, cache, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, Timing]:
    """transformers' greedy generate of new_tokens for the prompts with this StaticCache (reset first):
    (the tokens [B, new_tokens], the prefill's time to the first token apart from the rest)."""
    import transformers

    marks = []

    class FirstToken(transformers.StoppingCriteria):
        """Never stops generation; its first call, once the prefill's token is picked, reads the clock."""

        def __call__(self, input_ids, scores, **kwargs):
            if not marks:
                marks.append(clock(input_ids.device))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    cache.reset()
    start = clock(prompts.device)
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), past_key_values=cache,
                             max_new_tokens=new_tokens, do_sample=False,
                             stopping_criteria=transformers.StoppingCriteriaList([FirstToken()]))
    end = clock(prompts.device)
    return out[:, prompts.shape[1]:], Timing(marks[0] - start, end - marks[0])


def agreement(ours: torch.Tensor, theirs: torch.Tensor, margins: torch.Tensor, steps: int) -> dict:
    """Over the first `steps` tokens of ours and theirs ([B, N] each; margins [B, N], ours's top-2 logit
    gaps): each sequence's leading run of equal tokens, how many sequences agree throughout, and for each
    that parts, our margin at the step where it does (a small one: a near-tie either side may break)."""
    equal = (ours[:, :steps] == theirs[:, :steps]).long()
    leading = equal.cumprod(dim=1).sum(dim=1).tolist()
    parted = {b: float(margins[b, n]) for b, n in enumerate(leading) if n < steps}
    return dict(steps=steps, sequences=len(leading), identical=len(leading) - len(parted), leading=leading,
                margins_where_parted=parted)


def rates(timings: list[Timing], batch: int, prompt_len: int, new_tokens: int) -> dict:
    """The medians of timed runs and their rates: prefill tokens/s over B·P, decode tokens/s over B·(N - 1)."""
    prefill_s = statistics.median(t.prefill_s for t in timings)
    decode_s = statistics.median(t.decode_s for t in timings)
    return dict(prefill_s=prefill_s, decode_s=decode_s, prefill_tokens_per_s=batch * prompt_len / prefill_s,
                decode_tokens_per_s=batch * (new_tokens - 1) / decode_s if new_tokens > 1 else None,
                runs=len(timings))


def timed(generate: Callable[[], Timing], repeat: int) -> list[Timing]:
    """generate() once to warm up, then `repeat` times: the timed runs' Timings."""
    generate()
    return [generate() for _ in range(repeat)]


# ---------------------------------------------------------------- the command

class Request(NamedTuple):
    model: str
    batch: int
    prompt: int
    new: int
    dtype: str
    repeat: int
    trained: int = 0  # steps of fit


def run_course(request: Request, weights: dict, config: dict, prompts: torch.Tensor) -> tuple:
    """(its rates, its tokens [B, N], its margins [B, N]): the course's generation, warmed up and timed."""
    D = config["hidden"] // config["heads"]
    kernels = stage_kernels(weights["norm"].dtype, D, prompts.device)
    generator = Generator(kernels, weights, config, request.batch, request.prompt, request.new)
    timings = timed(lambda: generator.generate(prompts), request.repeat)
    found = rates(timings, request.batch, request.prompt, request.new)
    return found, generator.tokens.t().cpu(), generator.margins.t().cpu()


def run_transformers(request: Request, weights: dict, config: dict, prompts: torch.Tensor) -> tuple:
    """(its rates and compiled_counts, its tokens [B, N]): transformers' generation, warmed up and timed, the
    compiler started afresh."""
    import transformers

    fresh_compiler()
    max_len = request.prompt + request.new
    model = transformers_model(weights, dict(config, S=max_len))
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
    tokens = []

    def generate() -> Timing:
        generated, timing = transformers_generate(model, cache, prompts, request.new)
        tokens.append(generated)
        return timing

    timings = timed(generate, request.repeat)
    return rates(timings, request.batch, request.prompt, request.new) | compiled_counts(), tokens[-1].cpu()


def run_request(request: Request, with_transformers: bool, device) -> dict:
    """One model at one batch: the course's figures, and transformers' with the tokens compared and the
    speedup (decode tokens/s, the course's over transformers'), or why that failed."""
    weights, config = model_weights(model_shape(request.model, 1, 1), getattr(torch, request.dtype), device,
                                    request.trained)
    prompts = prompts_for(request.batch, request.prompt, device)
    course, ours, margins = run_course(request, weights, config, prompts)
    found = dict(course=course)
    torch.cuda.empty_cache()  # the course's graph and cache freed
    if with_transformers:
        try:
            theirs, their_tokens = run_transformers(request, weights, config, prompts)
        except Exception as error:  # noqa: BLE001  (reported: the course's figures still stand)
            traceback.print_exc()
            return found | dict(failed=one_line(error))
        tokens = agreement(ours, their_tokens, margins, min(COMPARED_STEPS, request.new))
        found |= dict(transformers=theirs, tokens=tokens)
        if course["decode_tokens_per_s"] and theirs["decode_tokens_per_s"]:
            found["speedup"] = course["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
    return found


def report(request: Request, found: dict) -> list[str]:
    """The run's figures in lines: each way's prefill and decode, the tokens compared, the speedup."""
    def way(name: str, r: dict) -> str:
        step_ms = r["decode_s"] / max(1, request.new - 1) * 1e3
        decode = (f"decode {r['decode_tokens_per_s']:,.0f} tokens/s ({step_ms:.3f} ms a step)"
                  if r["decode_tokens_per_s"] else "no decode step")
        return f"{name:<13} prefill {r['prefill_s'] * 1e3:.2f} ms, {decode}"

    lines = [way("course", found["course"])]
    if "transformers" in found:
        theirs, tokens = found["transformers"], found["tokens"]
        lines.append(way("transformers", theirs) + f"; {theirs['graphs']} graphs compiled, "
                     f"{theirs['cudagraph_skips']} run without CUDA graphs")
        lines.append(f"first {tokens['steps']} tokens identical in {tokens['identical']} of {tokens['sequences']} "
                     f"sequences" + ("" if not tokens["margins_where_parted"] else
                                     "; where they part, the course's top-2 margins: " + ", ".join(
                                         f"sequence {b} at step {tokens['leading'][b]}: {m:.4f}"
                                         for b, m in tokens["margins_where_parted"].items())))
        if "speedup" in found:
            lines.append(f"course / transformers: {found['speedup']:.2f}x decode tokens/s")
    if "failed" in found:
        lines.append(f"transformers: failed: {found['failed']}")
    return lines


def record(request: Request, found: dict, gpu: str, argv: list[str]) -> dict:
    """A run as results/generate/<gpu>.json keeps it (records.merge's file: {"gpu": ..., "runs": [...]})."""
    try:
        import transformers
        version = transformers.__version__
    except ImportError:
        version = None
    return dict(model=request.model, label=shape_label(model_shape(request.model, request.batch, request.prompt)),
                dtype=request.dtype, batch=request.batch, prompt=request.prompt, new=request.new,
                trained=request.trained, page_size=PAGE_SIZE,
                repeat=request.repeat, gpu=gpu, torch=torch.__version__, transformers_version=version, **source(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=shlex.join(["python", "-m", "stages.stage10_model.generate", *argv]), **found)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stages.stage10_model.generate",
                                     description="Greedy generation with stage 10's model by the course's kernels "
                                                 "(prefill, then CUDA-graph decode steps over a paged KV cache), "
                                                 "and with --transformers beside transformers' compiled "
                                                 "static-cache generate.")
    parser.add_argument("--model", nargs="+", choices=MODELS, default=["small"], help="the models, one after the other")
    parser.add_argument("--batch", nargs="+", type=int, default=[1], help="the batch sizes, each model at each")
    parser.add_argument("--prompt", type=int, default=128, help="tokens in each prompt")
    parser.add_argument("--new", type=int, default=64, help="tokens generated for each prompt")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--repeat", type=int, default=REPEATS, help="timed generations after the warm-up")
    parser.add_argument("--trained", type=int, default=TRAINED_STEPS,
                        help="steps of training on the course's text before generating (0: random weights)")
    parser.add_argument("--transformers", action="store_true",
                        help="also transformers' generate on the same weights (static cache, compiled), compared")
    parser.add_argument("--json", type=Path, help=f"write each run into this records file ({FOLDER.name}/<gpu>.json)")
    args = parser.parse_args(argv)
    if min(*args.batch, args.prompt, args.new, args.repeat) < 1 or args.trained < 0:
        parser.error("--batch, --prompt, --new and --repeat must be at least 1, --trained at least 0")
    return args


def requests(args: argparse.Namespace) -> list[Request]:
    """Each model at each batch, in that order; ValueError in one line for a size the kernels do not take."""
    found = [Request(name, batch, args.prompt, args.new, args.dtype, args.repeat, args.trained)
             for name in args.model for batch in args.batch]
    for r in found:
        check_request({k: CONFIGS[r.model][k] for k in DIMENSIONS}, r.batch, r.prompt, r.new)
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    try:
        todo = requests(args)
        if args.transformers and importlib.util.find_spec("transformers") is None:
            raise ValueError("--transformers needs the transformers package, which is not installed here")
    except ValueError as refusal:
        print(f"stages.stage10_model.generate: {refusal}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("stages.stage10_model.generate needs a CUDA GPU, and this machine shows none", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    gpu, failed = torch.cuda.get_device_name(device), False
    for request in todo:
        print(f"{shape_label(model_shape(request.model, request.batch, request.prompt))}, {request.new} new tokens, "
              f"{request.dtype}, pages of {PAGE_SIZE}, on {gpu}, torch {torch.__version__}", flush=True)
        found = run_request(request, args.transformers, device)
        print("\n".join(report(request, found)), flush=True)
        failed |= "failed" in found
        if args.json:
            records.merge(args.json, record(request, found, gpu, argv), same=SAME_RUN)
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
