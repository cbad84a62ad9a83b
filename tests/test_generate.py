"""stages/stage10_model/generate.py: the paged cache's layout, the refusals, the greedy generation on the CPU
(stage 10's kernels and the ops replaced by PyTorch) against the reference model's full recompute, the
comparison's arithmetic, the records; on a GPU, the course's kernels and the decode step's CUDA graph."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import run_as_command
from reference import decode_attention as decode_problem
from reference.model import forward as reference_forward
from reference.model import model_shape
from stages import ops
from stages.ops import shared
from stages.stage10_model import generate as G
from stages.stage10_model import records
from stages.stage10_model.train import loss_function
from test_model import FakeKernels

# Two layers of head dim 64, GQA 2:1: small enough for the CPU and for a float64 recompute at every step.
TINY = model_shape("small", 1, 1, layers=2, hidden=256, heads=4, kv_heads=2, inter=512)


# ---------------------------------------------------------------- the paged KV cache

def test_each_sequence_gets_a_page_in_turn_so_none_lies_side_by_side():
    table = G.block_table(3, 130, 64)  # 130 tokens: 3 pages a sequence
    assert table.dtype == torch.int32 and table.tolist() == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert G.block_table(1, 64, 64).tolist() == [[0]] and G.block_table(2, 65, 64).tolist() == [[0, 2], [1, 3]]


def test_cache_rows_put_each_position_where_the_decode_problem_reads_it():
    """Tokens written at cache_rows of their positions come back in order from reference/decode_attention.py's
    gather of the pages (its layout: page table[b, p // page_size], slot p % page_size)."""
    B, KV, D, page_size, length = 3, 2, 8, 16, 40
    table = G.block_table(B, length, page_size)
    k_cache = torch.full((table.numel(), page_size, KV, D), float("nan"))
    keys = torch.randn(B, length, KV, D)
    rows = G.cache_rows(table, torch.arange(length).expand(B, length), page_size)
    assert rows.shape == (B, length) and rows.dtype == torch.int64 and len(set(rows.flatten().tolist())) == B * length
    k_cache.view(-1, KV, D)[rows.reshape(-1)] = keys.reshape(-1, KV, D)
    inputs = dict(q=torch.zeros(B, KV, 1, D), k_cache=k_cache, v_cache=k_cache, block_table=table,
                  seq_lens=torch.full((B,), length, dtype=torch.int32), max_len=length)
    gathered, _, _ = decode_problem.gathered(inputs)
    assert torch.equal(gathered, keys.transpose(1, 2))
    one = G.cache_rows(table, torch.full((B, 1), 17), page_size)  # a decode step's row: page 1, slot 1
    assert one.flatten().tolist() == [(B * 1 + b) * page_size + 1 for b in range(B)]


def test_the_cache_holds_every_layers_k_and_v_pages_for_the_prompt_and_the_new_tokens():
    config = {k: TINY[k] for k in G.DIMENSIONS}
    cache = G.allocate_cache(config, 2, 70, torch.float32, "cpu")
    assert cache.kv.shape == (2, 2, 4, 64, 2, 64) and cache.table.shape == (2, 2) and cache.page_size == 64
    assert cache.kv[1, 0].is_contiguous() and not cache.kv.any()


# ---------------------------------------------------------------- refusals

def config_of(**changes) -> dict:
    return {k: model_shape("small", 1, 1, **changes)[k] for k in G.DIMENSIONS}


@pytest.mark.parametrize("changes, sizes, words", [
    (dict(experts=8, top_k=2), (1, 8, 4), "dense models"),
    ({}, (0, 8, 4), "at least 1"), ({}, (1, 0, 4), "at least 1"), ({}, (1, 8, 0), "at least 1"),
    (dict(heads=8), (1, 8, 4), "head dimensions 64 or 128; got 96"),
    (dict(hidden=260, heads=4, kv_heads=4), (1, 8, 4), "head dimensions"),
    (dict(inter=1001), (1, 8, 4), "multiples of 8"),
])
def test_a_request_the_kernels_cannot_generate_is_refused_in_one_line(changes, sizes, words):
    with pytest.raises(ValueError, match=words) as refusal:
        G.check_request(config_of(**changes), *sizes)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("prompts, words", [
    (torch.zeros(2, 8, dtype=torch.int32), "int64"), (torch.zeros(3, 8, dtype=torch.int64), r"\[2, 8\]"),
    ([[1, 2]], "got list"), (torch.full((2, 8), 256), "0 .. 255; got 256 .. 256"),
    (torch.full((2, 8), -1), "got -1"),
])
def test_prompts_not_of_the_batch_the_generator_was_made_for_are_refused_in_one_line(prompts, words):
    with pytest.raises(ValueError, match=words) as refusal:
        G.check_prompts(prompts, 2, 8, 256, torch.device("cpu"))
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("argv, words", [
    (["--model", "moe"], "invalid choice"), (["--batch", "0"], "at least 1"), (["--new", "0"], "at least 1"),
    (["--dtype", "float32"], "invalid choice"),
])
def test_the_command_refuses_bad_arguments_with_argparse_s_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit:
        G.parse(argv)
    assert exit.value.code == 2 and words in capsys.readouterr().err.splitlines()[-1]


def test_a_model_the_kernels_cannot_take_or_transformers_missing_is_one_line_and_status_2(monkeypatch, capsys):
    monkeypatch.setitem(G.CONFIGS, "small", dict(G.CONFIGS["small"], heads=8))  # head dim 96
    assert G.main(["--model", "small"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "head dimensions 64 or 128; got 96" in err
    monkeypatch.undo()
    monkeypatch.setattr(G.importlib.util, "find_spec", lambda name: None)
    assert G.main(["--transformers"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the transformers package" in err


def test_without_cuda_the_command_says_so_in_one_line_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert G.main(["--model", "small"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err


def test_the_module_run_as_a_command_exits_2_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    status = run_as_command("stages.stage10_model.generate", "--new", "2")
    assert status == 2 and "needs a CUDA GPU" in capsys.readouterr().err


# ---------------------------------------------------------------- generation on the CPU, against the reference

def fake_attention(q, k, v, causal=False, scale=None):
    assert causal and q.is_contiguous() and k.is_contiguous()
    assert shared.strides_problem(dict(q=q, k=k, v=v)) is None  # v a view of the projection: the real op's rule
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def fake_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    """reference/decode_attention.py's attention over the pages, in q's dtype; the op's checks of its inputs."""
    assert q.shape[2] == 1 and q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_table.dtype == seq_lens.dtype == torch.int32
    inputs = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens, scale=scale,
                  max_len=block_table.shape[1] * k_cache.shape[1])
    k, v, visible = decode_problem.gathered(inputs)
    return decode_problem.attention_over(q, k, v, visible, scale)["o"]


@pytest.fixture
def on_cpu(monkeypatch):
    """The ops replaced by PyTorch, so that the generator's Python runs on the CPU with FakeKernels."""
    monkeypatch.setattr(ops, "attention", fake_attention)
    monkeypatch.setattr(ops, "decode_attention", fake_decode_attention)


def reference_tokens(weights: dict, config: dict, prompts: torch.Tensor, tokens: torch.Tensor) -> tuple:
    """(the greedy token, its top-2 margin), [B, N] each, of the reference model in float64 (exact), each step
    recomputed over the whole sequence so far: the prompts and `tokens`' earlier steps (the generator's own, so
    that a near-tie's flip does not carry on)."""
    picked, margins = [], []
    decoder = {n: w for n, w in weights.items() if n not in ("embedding", "lm_head")}
    for step in range(tokens.shape[1]):
        sequence = torch.cat([prompts, tokens[:, :step]], dim=1)
        x = F.embedding(sequence, weights["embedding"]).double()
        hidden = reference_forward(x, decoder, dict(config, B=x.shape[0], S=x.shape[1]), exact=True)
        logits = hidden[:, -1] @ weights["lm_head"].double()
        top = logits.topk(2, dim=-1)
        picked.append(top.indices[:, 0])
        margins.append(top.values[:, 0] - top.values[:, 1])
    return torch.stack(picked, 1), torch.stack(margins, 1)


@pytest.mark.parametrize("batch, prompt_len, new_tokens", [(2, 60, 8), (1, 5, 3), (3, 64, 1)])
def test_generation_with_pytorch_for_the_kernels_is_the_reference_model_s_greedy_recompute(
        on_cpu, batch, prompt_len, new_tokens):
    """fp32 on the CPU, each decode step eager: the prefill's and the decode steps' tokens equal the float64
    model's greedy choice recomputed over the whole sequence, their margins its margins; a prompt of 60 with 8
    new tokens crosses a page, so the decode steps read keys from two pages of each sequence."""
    weights, config = G.model_weights(TINY, torch.float32, "cpu")
    prompts = G.prompts_for(batch, prompt_len, "cpu")
    generator = G.Generator(FakeKernels(), weights, config, batch, prompt_len, new_tokens, graphed=False)
    timing = generator.generate(prompts)
    assert timing.prefill_s > 0 and timing.decode_s >= 0
    ours, margins = generator.tokens.t(), generator.margins.t()
    expected, expected_margins = reference_tokens(weights, config, prompts, ours)
    assert expected_margins.min() > 1e-3  # no near-tie in these seeded weights: fp32 must agree exactly
    assert torch.equal(ours, expected)
    torch.testing.assert_close(margins.double(), expected_margins, rtol=1e-3, atol=1e-4)
    assert len(set(ours.flatten().tolist())) > 1 or new_tokens == 1  # not one token over and over
    again = G.Generator(FakeKernels(), weights, config, batch, prompt_len, new_tokens, graphed=False)
    again.generate(prompts)
    generator.generate(prompts)  # a second call starts afresh
    assert torch.equal(generator.tokens, again.tokens)


def test_the_cache_holds_the_models_keys_after_rope_at_their_positions(on_cpu):
    """After generation, layer 0's cached K of every fed token is its RMSNorm'd embedding through Wk, turned by
    RoPE at its position (the reference's), read back through the block table."""
    from reference.model import apply_rope, rms_norm, rope_cos_sin
    weights, config = G.model_weights(TINY, torch.float32, "cpu")
    B, P, N = 2, 62, 5
    prompts = G.prompts_for(B, P, "cpu")
    generator = G.Generator(FakeKernels(), weights, config, B, P, N, graphed=False)
    generator.generate(prompts)
    fed = torch.cat([prompts, generator.tokens.t()[:, :-1]], dim=1)  # the last token is never fed back
    H, KV, D = config["heads"], config["kv_heads"], config["hidden"] // config["heads"]
    a = rms_norm(F.embedding(fed, weights["embedding"]), weights["attn_norm"][0], config["eps"])
    k = (a @ weights["wqkv"][0][:, H * D:(H + KV) * D]).view(B, P + N - 1, KV, D).transpose(1, 2)
    cos, sin = rope_cos_sin(P + N - 1, D, config["rope_theta"], torch.float32, "cpu")
    rows = G.cache_rows(generator.cache.table, torch.arange(P + N - 1).expand(B, -1), 64)
    cached = generator.cache.kv[0, 0].view(-1, KV, D)[rows].transpose(1, 2)
    torch.testing.assert_close(cached, apply_rope(k, cos, sin), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the comparison, the report, the records

def test_the_prompts_are_windows_of_the_course_s_text():
    text = bytes(G.course_text())
    prompts = G.prompts_for(3, 40, "cpu")
    assert prompts.shape == (3, 40) and prompts.dtype == torch.int64
    assert all(bytes(row.tolist()) in text for row in prompts)
    assert not torch.equal(prompts[0], prompts[1])


def test_fit_trains_the_masters_in_place_and_lowers_the_loss_on_the_course_s_text(monkeypatch):
    """A few steps of train.py's PyTorch way (fp32 on the CPU, the small model's learning rate): every weight
    moves, and the cross-entropy of the first batch falls."""
    monkeypatch.setitem(G.TRAINING, "batch", 2)
    monkeypatch.setitem(G.TRAINING, "seq", 32)
    masters = G.initial_weights(TINY, G.SEED, "cpu")
    before = {name: w.detach().clone() for name, w in masters.items()}
    first = G.batches(G.tokens_of(G.course_text()), 2, 32, 1, G.SEED, "cpu")[0]
    loss = loss_function(G.ways()["pytorch"], dict(TINY, B=2, S=32), torch.float32)
    start = float(loss(masters, *first)[0].detach())
    G.fit(masters, TINY, 8, "cpu")
    assert all(not torch.equal(before[name], w) for name, w in masters.items())
    assert float(loss(masters, *first)[0].detach()) < start


def test_agreement_counts_the_leading_equal_tokens_and_gives_the_margin_where_a_sequence_parts():
    ours = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    theirs = torch.tensor([[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]])
    margins = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.01, 0.5, 0.5], [0.002, 0.5, 0.5, 0.5]])
    found = G.agreement(ours, theirs, margins, 4)
    assert found == dict(steps=4, sequences=3, identical=1, leading=[4, 1, 0],
                         margins_where_parted={1: pytest.approx(0.01), 2: pytest.approx(0.002)})
    assert G.agreement(ours, theirs, margins, 1)["identical"] == 2  # sequence 1 parts at step 1: after the first


def test_rates_are_the_medians_over_the_prompt_tokens_and_the_decode_steps():
    timings = [G.Timing(0.010, 0.63), G.Timing(0.030, 0.70), G.Timing(0.020, 0.65)]
    found = G.rates(timings, batch=4, prompt_len=128, new_tokens=64)
    assert found == dict(prefill_s=0.020, decode_s=0.65, prefill_tokens_per_s=pytest.approx(4 * 128 / 0.020),
                         decode_tokens_per_s=pytest.approx(4 * 63 / 0.65), runs=3)
    assert G.rates(timings, 4, 128, 1)["decode_tokens_per_s"] is None


def test_a_run_is_reported_and_recorded_with_its_source_and_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMOE_COMMIT", "abc1234")
    request = G.Request("small", 32, 128, 64, "bfloat16", 5)
    way = dict(prefill_s=0.01, decode_s=0.5, prefill_tokens_per_s=409600.0, decode_tokens_per_s=4032.0, runs=5)
    found = dict(course=way, transformers=dict(way, decode_tokens_per_s=3000.0, graphs=1, cudagraph_skips=0),
                 tokens=dict(steps=32, sequences=32, identical=31, leading=[32] * 31 + [7],
                             margins_where_parted={31: 0.0078}), speedup=4032.0 / 3000.0)
    lines = G.report(request, found)
    assert lines[0].startswith("course") and "4,032 tokens/s" in lines[0] and "(7.937 ms a step)" in lines[0]
    assert "1 graphs compiled, 0 run without CUDA graphs" in lines[1]
    assert "identical in 31 of 32 sequences" in lines[2] and "sequence 31 at step 7: 0.0078" in lines[2]
    assert lines[3] == "course / transformers: 1.34x decode tokens/s"
    run = G.record(request, found, "NVIDIA H200", ["--model", "small", "--batch", "32"])
    assert run["commit"] == "abc1234" and run["gpu"] == "NVIDIA H200" and run["page_size"] == G.PAGE_SIZE
    assert run["command"] == "python -m stages.stage10_model.generate --model small --batch 32"
    assert run["label"].startswith("small L12 hidden768") and run["speedup"] == found["speedup"]
    path = tmp_path / "h200.json"
    records.merge(path, run, same=G.SAME_RUN)
    records.merge(path, dict(run, batch=1), same=G.SAME_RUN)
    records.merge(path, dict(run, speedup=2.0), same=G.SAME_RUN)  # the same run again: replaced
    saved = json.loads(path.read_text())
    assert saved["gpu"] == "NVIDIA H200"
    assert [(r["batch"], r["speedup"]) for r in saved["runs"]] == [(1, run["speedup"]), (32, 2.0)]


def test_a_failed_transformers_run_is_reported_in_its_line():
    request = G.Request("small", 1, 128, 64, "bfloat16", 5)
    way = dict(prefill_s=0.01, decode_s=0.5, prefill_tokens_per_s=12800.0, decode_tokens_per_s=126.0, runs=5)
    lines = G.report(request, dict(course=way, failed="RuntimeError: boom"))
    assert lines[-1] == "transformers: failed: RuntimeError: boom"


def test_transformers_generate_on_the_same_weights_gives_the_course_s_tokens_on_the_cpu(on_cpu):
    """Where transformers is installed: its LlamaForCausalLM with these weights (reference/model.py's mapping,
    the embedding and the LM head too), generating greedily with a StaticCache (fp32, on the CPU: not compiled),
    gives the tokens of the course's generator with PyTorch for the kernels, every one of the new tokens (no
    stop at an end-of-sequence token), twice from the same cache."""
    transformers = pytest.importorskip("transformers")
    weights, config = G.model_weights(TINY, torch.float32, "cpu")
    B, P, N = 2, 60, 8
    prompts = G.prompts_for(B, P, "cpu")
    generator = G.Generator(FakeKernels(), weights, config, B, P, N, graphed=False)
    generator.generate(prompts)
    model = G.transformers_model(weights, dict(config, S=P + N))
    cache = transformers.StaticCache(config=model.config, max_cache_len=P + N)
    for _ in range(2):
        theirs, timing = G.transformers_generate(model, cache, prompts, N)
        assert torch.equal(theirs, generator.tokens.t()) and timing.prefill_s > 0 and timing.decode_s > 0


# ---------------------------------------------------------------- on the GPU

@pytest.mark.gpu
def test_the_course_s_generation_is_the_reference_model_s_greedy_recompute_on_the_gpu():
    """bf16, stage 10's kernels, ops.attention for the prefill, ops.decode_attention in the decode step's CUDA
    graph: each step's token is the float64 model's greedy choice over the sequence so far, wherever that
    choice is clear by more than bf16's error in the logits (MARGIN); most steps are. The same tokens again
    from a second call (the graph replayed on fresh state), and from the decode steps run without the graph."""
    margin = 0.1  # the logits' error: a bf16 model's hidden state, ~1% off, through the LM head, ~0.02
    device = torch.device("cuda")
    weights, config = G.model_weights(TINY, torch.bfloat16, device)
    B, P, N = 3, 60, 10
    prompts = G.prompts_for(B, P, device)
    kernels = G.stage_kernels(torch.bfloat16, 64, device)
    generator = G.Generator(kernels, weights, config, B, P, N)
    generator.generate(prompts)
    ours = generator.tokens.t().clone()
    expected, margins = reference_tokens(weights, config, prompts, ours)
    clear = margins > margin
    assert clear.float().mean() > 0.5, f"too few clear steps to compare: {clear.sum()} of {clear.numel()}"
    assert torch.equal(ours[clear], expected[clear]), f"ours {ours.tolist()}, the reference's {expected.tolist()}"
    generator.generate(prompts)
    assert generator.graph is not None and torch.equal(generator.tokens.t(), ours)
    eager = G.Generator(kernels, weights, config, B, P, N, graphed=False)
    eager.generate(prompts)
    assert torch.equal(eager.tokens.t(), ours)
    torch.testing.assert_close(eager.margins, generator.margins)
