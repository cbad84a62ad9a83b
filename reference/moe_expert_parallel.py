"""The MoE layer with its experts sharded over the ranks of a process group: expert parallelism (stage 11).

The maths is moe_layer's, unchanged: out[t] = Σ_j w[t, j] · SwiGLU-FFN_{ids[t, j]}(x[t]). What changes is
where things are. In a world of R ranks (torch.distributed: NCCL on GPUs, gloo on the CPU), rank r holds
  x[tokens of r]             its share of the tokens, a contiguous block of rows (`shard`)
  W1[experts of r], W2[...]  E / R experts, r·E/R .. (r+1)·E/R - 1, contiguous: sorting token-slots by
                             expert sorts them by the rank that owns the expert
  Wr, bias                   the router, whole on every rank (each rank routes its own tokens)
and writes out and topk_ids for its own tokens. E must be a multiple of R.

The inputs of a shape are the gathered ones (make_inputs, moe_layer's), made alike on every rank from the
seed; `shard` keeps a rank's part. The exact reference is moe_layer's, on the gathered inputs and the
gathered outputs: the sharded layer must compute the layer. Without torchrun (the grader, one process),
`default_group` is a world of one rank, and the same code runs with every expert local.

Baselines: the same sharding in plain PyTorch (layer_expert_parallel: exchange the counts, all_to_all_single
with split sizes, torch._grouped_mm on the local experts, back the same way, as Megatron-LM's all-to-all
token dispatcher does); and, in a world of one, moe_layer's one-GPU layers. Work: the layer's flops; the
communication's bytes (`exchange_bytes`) are reported by the multi-GPU runner (stages/stage11_expert_parallel).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from reference import moe
from reference.moe_layer import MoeLayerProblem

TOKENS_PER_RANK = 4096  # stage 11's bars across GPUs: each rank brings 4096 tokens
BAR_CONFIGS = ("seed", "deepseek")


def shape_of(config: str, tokens: int) -> dict:
    """A shape of moe.CONFIGS[config] at `tokens` tokens (all ranks together)."""
    c = moe.CONFIGS[config]
    return dict(tokens=tokens, experts=c["experts"], top_k=c["top_k"], hidden=c["hidden"], inter=c["inter"])


def default_group(device: torch.device):
    """The default process group, started here if nothing has: from torchrun's environment where it set
    one (WORLD_SIZE), else a world of one rank, this process. NCCL on a GPU, gloo on the CPU."""
    if not dist.is_initialized():
        # NVLink SHARP (multicast) serves all-reduce and all-gather, not all-to-all; the machines this
        # course measures on keep it off, and so does every run here unless told otherwise.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        backend, on_gpu = ("nccl", {"device_id": device}) if device.type == "cuda" else ("gloo", {})
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, **on_gpu)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **on_gpu)
    return dist.group.WORLD


def token_rows(tokens: int, rank: int, world: int) -> slice:
    """Rank `rank`'s tokens: a contiguous block, the blocks as even as T allows."""
    return slice(tokens * rank // world, tokens * (rank + 1) // world)


def expert_rows(experts: int, rank: int, world: int) -> slice:
    if experts % world:
        raise ValueError(f"{experts} experts do not shard evenly over {world} ranks")
    local = experts // world
    return slice(rank * local, (rank + 1) * local)


def shard(inputs: dict, group, copy: bool = False) -> dict:
    """This rank's part of the gathered inputs, with the group: its tokens, its experts (with `copy`, copies,
    so that the gathered weights can be freed), the whole router."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = expert_rows(inputs["w1"].shape[0], rank, world)
    own = torch.clone if copy else (lambda t: t)
    return dict(inputs, x=inputs["x"][token_rows(inputs["x"].shape[0], rank, world)],
                w1=own(inputs["w1"][mine]), w2=own(inputs["w2"][mine]), group=group)


def exchange_bytes(rows: int, hidden: int, element_bytes: int = 2) -> float:
    """The bytes of `rows` token rows, as an all-to-all moves them (each way)."""
    return float(rows) * hidden * element_bytes


# ---------------------------------------------------------------- the baseline: the same sharding in PyTorch

def layer_expert_parallel(layer: dict, top_k: int, group) -> torch.Tensor:
    """The sharded layer in plain PyTorch, as Megatron-LM's all-to-all token dispatcher does it. `layer`:
    this rank's x and local experts w1, w2, the whole router wr, bias. Route; sort the token-slots by
    expert, hence by rank; all_to_all_single the counts, which the host reads (split sizes); all_to_all_single
    the rows; sort them by local expert; torch._grouped_mm; unsort, all_to_all_single back, weighted sum."""
    x, w1, w2 = layer["x"], layer["w1"], layer["w2"]
    world, local = dist.get_world_size(group), w1.shape[0]
    ids, weights, _ = moe.torch_routing(moe.router_logits(x, layer["wr"], layer.get("bias")), top_k)
    order, counts = moe.slots_by_expert(ids, world * local)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    by_source = received_counts.view(world, local)  # rows from each source rank for each local expert
    send_splits, receive_splits = torch.stack([counts.view(world, local).sum(1), by_source.sum(1)]).tolist()
    received = x.new_empty(sum(receive_splits), x.shape[1])
    dist.all_to_all_single(received, x[order // top_k], receive_splits, send_splits, group=group)
    # Received by source rank, then expert: a stable sort by expert puts each expert's rows together.
    expert_of_row = torch.arange(local, device=x.device).repeat(world).repeat_interleave(received_counts)
    by_expert = torch.argsort(expert_of_row, stable=True)
    y = torch.empty_like(received)
    y[by_expert] = moe.experts_grouped_mm(received[by_expert], w1, w2, torch.cumsum(by_source.sum(0), 0, dtype=torch.int32))
    returned = x.new_empty(order.numel(), x.shape[1])
    dist.all_to_all_single(returned, y, send_splits, receive_splits, group=group)
    return moe.combine_sorted(returned, order, weights)


# ---------------------------------------------------------------- the problem

class MoeExpertParallelProblem(MoeLayerProblem):
    """moe_layer's cases, inputs, outputs, reference and check; the launch gets the process group."""
    name = "moe_expert_parallel"

    def benchmarks(self) -> list[dict]:
        """One rank's share of the bars' configurations, timed in a world of one by the grader (the
        multi-GPU runner times R ranks at TOKENS_PER_RANK each)."""
        return [dict(shape_of(config, TOKENS_PER_RANK), dtype="bfloat16") for config in BAR_CONFIGS]

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        i = inputs
        group = i.get("group") or default_group(i["x"].device)
        stage.launch(kernels, i["x"], i["wr"], i["bias"], i["w1"], i["w2"], i["top_k"], outputs["out"],
                     outputs["topk_ids"], group)

    def baselines(self, inputs: dict) -> dict:
        """The same sharding in plain PyTorch ("ep_grouped_mm"); in a world of one, also moe_layer's
        one-GPU layers ("grouped_mm", "naive")."""
        group = inputs.get("group") or default_group(inputs["x"].device)
        layer, k = {n: inputs[n] for n in ("x", "wr", "bias", "w1", "w2")}, inputs["top_k"]
        found = moe.grouped_mm_baseline(lambda: layer_expert_parallel(layer, k, group), "ep_grouped_mm")
        return found | (super().baselines(inputs) if dist.get_world_size(group) == 1 else {})


PROBLEM = MoeExpertParallelProblem()
