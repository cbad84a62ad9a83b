"""Expert parallelism's dispatch and combine: plain functions on tensors and a torch.distributed group.

Device-agnostic: NCCL on GPUs, gloo on the CPU (where the tests run them). What is particular to a device
comes in a `Parts`: the routing, the experts' grouped GEMMs, the weighted sum and the regroup index, the
course's kernels on a GPU (this stage's __init__), PyTorch in the CPU tests.

Rank r of R owns experts r·E_l .. (r+1)·E_l - 1 (E_l = E / R), so the token-slots in expert order, as stage 5
sorts them, are in rank order too: the rows for rank 0, then those for rank 1, and so on.

  route      each token's k experts; its token-slots in expert order                 parts.route
  plan       how many rows go to, and come from, each rank: NCCL takes these split   exchange_counts or
             sizes on the host, so the host waits here, once per layer call          fixed_capacity
  send       all_to_all_single of the rows, asynchronous
  compute    the received rows regrouped by local expert, the grouped GEMMs, the results put back in the
             received order
  send_back  all_to_all_single back, the split sizes swapped
  combine    out[t] = Σ_j w[t, j] · returned[row of (t, j)]                           parts.weighted_sum

`layer` runs them on `chunks` pieces of the tokens: every piece's rows are sent at once, and each piece
computes as soon as its own rows are in, while the next pieces' rows still travel (NCCL runs on a stream of
its own; Work.wait() makes the compute stream wait for it, not the host).
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference.moe import expert_offsets


@dataclass
class Routing:
    """One piece's routing, as stage 5 leaves it without padding."""
    ids: torch.Tensor           # [T, k] each token-slot's expert
    weights: torch.Tensor       # [T, k] fp32, its weight
    counts: torch.Tensor        # [E] int32, each expert's token-slots
    source_token: torch.Tensor  # [T·k] the token of each token-slot, in expert order
    dest: torch.Tensor          # [T, k] each token-slot's row in that order


@dataclass
class Exchange:
    """One piece's traffic on this rank: the rows it sends, and what it receives."""
    send_token: torch.Tensor    # [rows sent] the token each row sent holds: the rows for rank 0 first
    send_splits: list[int]      # rows sent to each rank
    recv_splits: list[int]      # rows received from each rank
    recv_counts: torch.Tensor   # [R, E_l] int32: rows from each rank for each local expert, as received
    grouped_rows: int           # rows of the grouped GEMMs' input: each expert's, padded to Parts.align
    row_of_slot: torch.Tensor   # [T, k] where each token-slot's result is among the rows sent back

    @property
    def received_rows(self) -> int:
        return sum(self.recv_splits)


class Parts(abc.ABC):
    """What the device computes. `align`: each expert's rows are padded to a multiple of it (the GEMM's tile)."""
    align: int = 1

    @abc.abstractmethod
    def route(self, x: torch.Tensor, topk_ids: torch.Tensor) -> Routing:
        """x's tokens routed over all E experts, without padding; topk_ids [T, k] written."""

    @abc.abstractmethod
    def experts(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The local experts' SwiGLU FFN on rows grouped by expert, expert e's at offsets[e] .. offsets[e+1]."""

    @abc.abstractmethod
    def weighted_sum(self, returned: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor,
                     out: torch.Tensor) -> None:
        """out[t] = Σ_j weights[t, j] · returned[row_of_slot[t, j]]."""

    def regroup_index(self, exchange: Exchange) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return regroup_index(exchange.recv_counts, exchange.received_rows, exchange.grouped_rows, self.align)


# ---------------------------------------------------------------- the plan: split sizes

# --8<-- [start:plan]
def exchange_counts(routings: list[Routing], group, align: int) -> list[Exchange]:
    """The exact plan. One all_to_all_single of the counts tells every rank how many rows each rank sends it,
    for each piece and each of its experts; the host then reads every piece's split sizes in one wait."""
    world = dist.get_world_size(group)
    counts = torch.stack([r.counts for r in routings])                          # [pieces, E]
    pieces, experts = counts.shape
    sent = counts.view(pieces, world, experts // world).transpose(0, 1).contiguous()  # [rank to, piece, E_l]
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)                        # [rank from, piece, E_l]
    received = received.transpose(0, 1).contiguous()
    on_host = torch.stack([sent.transpose(0, 1), received]).cpu()               # the host's one wait
    return [Exchange(r.source_token, on_host[0, p].sum(1).tolist(), on_host[1, p].sum(1).tolist(), received[p],
                     int(expert_offsets(on_host[1, p].sum(0), align)[-1]), r.dest)
            for p, r in enumerate(routings)]


def fixed_capacity(routings: list[Routing], group, align: int) -> list[Exchange]:
    """Every (rank, expert) bucket padded to one capacity: the largest bucket of any rank and piece, found by
    one all_reduce (the host's one wait), rounded up so that an expert's R buckets fill whole GEMM tiles.
    Nothing is dropped, so the result stays exact (a capacity factor, as GShard's, would drop what overflows);
    every rank sends E_l · capacity rows to each rank, and no counts travel. The padding rows are the price:
    sent, computed on and sent back for nothing."""
    world = dist.get_world_size(group)
    largest = torch.stack([r.counts.max() for r in routings]).max().reshape(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    step = align // math.gcd(align, world)
    capacity = -(-int(largest) // step) * step
    return [capacity_exchange(r, capacity, world) for r in routings]
# --8<-- [end:plan]


def capacity_exchange(routing: Routing, capacity: int, world: int) -> Exchange:
    """Row e·capacity + c of what this rank sends holds expert e's token-slot c; a padding row repeats the
    bucket's last token-slot (an empty bucket's, the slot before it), so that no row is made of zeros."""
    counts, ids, device = routing.counts.long(), routing.ids.long(), routing.counts.device
    experts = counts.numel()
    first = torch.cumsum(counts, 0) - counts  # each expert's first token-slot in expert order
    position = torch.arange(capacity, device=device)
    slot = (first[:, None] + torch.minimum(position, counts[:, None] - 1)).clamp(min=0)
    splits = world * [experts // world * capacity]
    recv_counts = torch.full((world, experts // world), capacity, dtype=torch.int32, device=device)
    row_of_slot = (ids * capacity + routing.dest.long() - first[ids]).to(routing.dest.dtype)
    return Exchange(routing.source_token[slot.flatten()], splits, splits, recv_counts, experts * capacity, row_of_slot)


# ---------------------------------------------------------------- the rows' journey

@dataclass
class InFlight:
    """An all_to_all_single under way: its output, valid after wait(); its input kept alive until then."""
    output: torch.Tensor
    work: dist.Work
    input: torch.Tensor

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.output


def all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> InFlight:
    output = rows.new_empty(sum(out_splits), rows.shape[1])
    work = dist.all_to_all_single(output, rows, out_splits, in_splits, group=group, async_op=True)
    return InFlight(output, work, rows)


def send(x: torch.Tensor, exchange: Exchange, group) -> InFlight:
    """The rows for every rank, gathered from x in rank order, on their way."""
    return all_to_all(x.index_select(0, exchange.send_token), exchange.recv_splits, exchange.send_splits, group)


def compute(received: torch.Tensor, exchange: Exchange, parts: Parts) -> torch.Tensor:
    """The local experts on the received rows: regrouped by expert, the grouped GEMMs, back in received order."""
    if not exchange.received_rows:
        return received  # no token chose this rank's experts
    offsets, source_row, grouped_row = parts.regroup_index(exchange)
    return parts.experts(received.index_select(0, source_row), offsets).index_select(0, grouped_row)


def send_back(y: torch.Tensor, exchange: Exchange, group) -> InFlight:
    return all_to_all(y, exchange.send_splits, exchange.recv_splits, group)


def regroup_index(recv_counts: torch.Tensor, received_rows: int, grouped_rows: int,
                  align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the received rows go for the grouped GEMMs, in PyTorch (on a GPU, expert_parallel.cu's
    regroup_index). Rows arrive by source rank, then local expert; the GEMMs want each expert's rows together
    (by source rank within it), each segment padded to a multiple of `align`. Returns the segments' offsets
    [E_l+1] int32; source_row [grouped_rows], the received row each grouped row copies (a padding row: its
    segment's last, as stage 7's gather); grouped_row [received_rows], where each received row went."""
    ranks, local = recv_counts.shape
    counts, device = recv_counts.long(), recv_counts.device
    offsets = expert_offsets(counts.sum(0), align)
    flat = counts.flatten()  # buckets (rank, expert) in received order
    received_start = torch.cumsum(flat, 0) - flat
    grouped_start = (offsets[:-1].long() + torch.cumsum(counts, 0) - counts).flatten()
    bucket = torch.repeat_interleave(torch.arange(ranks * local, device=device), flat, output_size=received_rows)
    row = torch.arange(received_rows, device=device)
    grouped_row = grouped_start[bucket] + row - received_start[bucket]
    source_row = torch.full((grouped_rows,), -1, dtype=torch.long, device=device)
    source_row[grouped_row] = row
    # A padding row copies the nearest real row above it: every non-empty segment starts with one.
    grouped = torch.arange(grouped_rows, device=device)
    nearest = torch.cummax(torch.where(source_row >= 0, grouped, 0), 0).values
    return offsets, source_row[nearest], grouped_row


# ---------------------------------------------------------------- the layer

# --8<-- [start:layer]
def layer(x: torch.Tensor, parts: Parts, group, out: torch.Tensor, topk_ids: torch.Tensor, *, chunks: int = 1,
          capacity: bool = False) -> None:
    """The expert-parallel layer on this rank's tokens x: out [T, hidden] and topk_ids [T, k] written. Every
    rank of the group calls it alike (the collectives pair up), each with at least `chunks` tokens.
    capacity: the fixed-capacity plan, else the counts' exchange."""
    if not 1 <= chunks <= x.shape[0]:
        raise ValueError(f"chunks must be from 1 to the rank's {x.shape[0]} tokens; got {chunks}")
    pieces, outs, chosen = (t.tensor_split(chunks) for t in (x, out, topk_ids))
    routings = [parts.route(piece, ids) for piece, ids in zip(pieces, chosen)]
    exchanges = (fixed_capacity if capacity else exchange_counts)(routings, group, parts.align)
    sent = [send(piece, exchange, group) for piece, exchange in zip(pieces, exchanges)]
    back = [send_back(compute(rows.wait(), exchange, parts), exchange, group) for rows, exchange in zip(sent, exchanges)]
    for rows, routing, exchange, piece in zip(back, routings, exchanges, outs):
        parts.weighted_sum(rows.wait(), exchange.row_of_slot, routing.weights, piece)
# --8<-- [end:layer]
