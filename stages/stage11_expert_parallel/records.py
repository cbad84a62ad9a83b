"""Stage 11's multi-GPU records, results/expert-parallel/<gpu>x<N>.json: what the runner measured on N GPUs of
one machine (`torchrun ... -m stages.stage11_expert_parallel --json PATH`), and the Markdown tables the runner
prints and the lesson shows of them. Plain JSON and text: the docs' hook can load this file by itself."""
from __future__ import annotations

import json
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[2] / "results" / "expert-parallel"
UNPIPELINED = "counts"  # the variant the others' speed-ups are over: NCCL, the counts' exchange, one piece
FIELDS = ("gpu", "world", "torch", "nccl", "commit", "head_start_ms", "configs")


def record(configs: list[dict], **environment) -> dict:
    """A record: the environment (FIELDS but configs) and each configuration's figures (the runner's measure)."""
    found = dict(environment, configs=configs)
    missing = set(FIELDS) - set(found)
    if missing:
        raise ValueError(f"a stage 11 record needs {sorted(missing)}")
    return found


def load(folder: Path = FOLDER) -> list[dict]:
    """Every record in the folder, by file name."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]


def failed(value) -> bool:
    return isinstance(value, dict) and "error" in value


def gb_per_s(nbytes: float, ms: float) -> float:
    return nbytes / ms / 1e6


def config_tables(c: dict) -> list[str]:
    """One configuration's tables: the variants, the phases, what a pipeline pays."""
    s, world, tokens = c["shape"], c["world"], c["tokens_per_rank"]
    one_gpu = c["one_gpu_stage7_ms"]
    lines = [f"**{c['config']}**: hidden {s['hidden']}, inter {s['inter']}, {s['experts']} experts, top-{s['top_k']}, "
             f"{world} × {tokens} tokens, bf16; one GPU's stage 7 on {tokens} tokens: {one_gpu:.3f} ms", "",
             f"| variant | ms | × {world} × one GPU's stage 7 | speed-up over {UNPIPELINED} "
             "| outputs against stage 7 |",
             "|---|--:|--:|--:|---|"]
    base = c["layer_ms"].get(UNPIPELINED)
    for name, ms in {**c["layer_ms"], "plain PyTorch": c["torch_expert_parallel_ms"]}.items():
        if failed(ms):
            lines.append(f"| {name} | failed: {ms['error']} | | | |")
            continue
        speedup = f"{base / ms:.2f}" if isinstance(base, float) else ""
        lines.append(f"| {name} | {ms:.3f} | {one_gpu / ms:.2f} | {speedup} | {outcome(c['correctness'].get(name))} |")
    return lines + [""] + phase_table(c) + [""] + cost_table(c)


def outcome(found: dict | None) -> str:
    if not found or failed(found):
        return ""
    text = f"ids {'equal' if found['ids_equal'] else 'differ'}, {found['out_differ']} of {found['elements']} differ"
    if "check" in found:
        verdicts = (f"{o} {'passed' if v['passed'] else 'FAILED'}" for o, v in found["check"].items())
        text += "; check " + ", ".join(verdicts)
    return text


def phase_table(c: dict) -> list[str]:
    """The un-pipelined layer's phases by transport, then each transport's transfers alone where measured,
    and dispatch + combine against all_to_all_single."""
    nbytes, a2a = c["bytes_per_rank"], c["all_to_all"]
    a2a_rate = gb_per_s(a2a["bytes_per_rank"], a2a["ms"])
    names = list(next(p for p in c["phases_ms"].values() if not failed(p)))
    lines = [f"| ms | {' | '.join(names)} | dispatch + combine GB/s | × all_to_all_single ({a2a_rate:.0f} GB/s) |",
             "|---|" + "--:|" * (len(names) + 2)]
    rows = list(c["phases_ms"].items())
    rows += [(f"{t}, each transfer alone", p) for t, p in c.get("transfers_ms", {}).items()]
    for transport, p in rows:
        if failed(p):
            lines.append(f"| {transport} | failed: {p['error']} |")
            continue
        both = gb_per_s(2 * nbytes, p["dispatch"] + p["combine"])
        cells = " | ".join(f"{p[n]:.3f}" if n in p else "" for n in names)
        lines.append(f"| {transport} | {cells} | {both:.0f} | {both / a2a_rate:.2f} |")
    return lines


def cost_table(c: dict) -> list[str]:
    """The experts' GEMMs alone, as the pipeline cuts them."""
    found = c["costs_ms"]
    return [f"| experts' GEMMs | {' | '.join(found)} |", "|---|" + "--:|" * len(found),
            f"| ms | {' | '.join(f'{ms:.3f}' for ms in found.values())} |"]


def tables(rec: dict) -> str:
    """A record's tables, in Markdown."""
    lines = [f"{rec['world']} × {rec['gpu']}, torch {rec['torch']}, NCCL {rec['nccl']}, commit {rec['commit']}; "
             f"each run begun {rec['head_start_ms']:.2f} ms behind a GPU wait", ""]
    for c in rec["configs"]:
        lines += config_tables(c) + [""]
    return "\n".join(lines)


def lesson_tables(folder: Path = FOLDER) -> str:
    """Every record's tables under a heading of its own: what the lesson shows."""
    found = load(folder)
    if not found:
        return "Not measured yet."
    return "\n\n".join(f"#### {rec['world']} × {rec['gpu']}\n\n{tables(rec)}" for rec in found)
