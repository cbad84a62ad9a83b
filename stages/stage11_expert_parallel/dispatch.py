"""Expert parallelism's dispatch and combine: plain functions on tensors and a torch.distributed group.

Device-agnostic: NCCL on GPUs, gloo on the CPU (where the tests run them). What is particular to a device
comes in a `Parts`: the routing, the experts' grouped GEMMs, the weighted sum and the regroup index, the
course's kernels on a GPU (this stage's __init__), PyTorch in the CPU tests.

Rank r of R owns experts r·E_l .. (r+1)·E_l - 1 (E_l = E / R), so the token-slots in expert order, as stage 5
sorts them, are in rank order too: the rows for rank 0, then those for rank 1, and so on.

  route      each token's k experts; its token-slots in expert order                 parts.route
  plan       how many rows go to, and come from, each rank for each expert: NCCL     exchange_counts or
             takes split sizes on the host, so the host waits here, once per call    fixed_capacity
  send       all_to_all_single of the rows, asynchronous
  compute    the received rows regrouped by local expert, the grouped GEMMs, the results put back in the
             received order
  send_back  all_to_all_single back, the split sizes swapped
  combine    out[t] = Σ_j w[t, j] · returned[row of (t, j)]                           parts.weighted_sum

`layer` can cut the traffic into pieces by expert (`split`): piece p carries, on every rank, the rows of
local experts p·E_l/n .. (p+1)·E_l/n - 1. Every piece's rows are sent at once; each piece computes as soon as
its own rows are in, while the next pieces' rows still travel, and its results go back while the next piece
computes (NCCL runs on a stream of its own; Work.wait() makes the compute stream wait for it, not the host).
Pieces by expert, not by token: each expert's weights are still read once per call, and each GEMM keeps its
rows per expert (a piece of the tokens would read every weight again for fewer rows).
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from reference.moe import expert_offsets


@dataclass
class Routing:
    """This rank's routing, as stage 5 leaves it without padding."""
    ids: torch.Tensor           # [T, k] each token-slot's expert
    weights: torch.Tensor       # [T, k] fp32, its weight
    counts: torch.Tensor        # [E] int32, each expert's token-slots
    source_token: torch.Tensor  # [T·k] the token of each token-slot, in expert order
    dest: torch.Tensor          # [T, k] each token-slot's row in that order


@dataclass
class Exchange:
    """This rank's traffic: the rows it sends, by destination rank then local expert, and the host's counts."""
    send_token: torch.Tensor    # [rows sent] the token each row sent holds
    sent: np.ndarray            # [R, E_l] rows sent to each rank for each of its local experts
    received: np.ndarray        # [R, E_l] rows received from each rank for each local expert of this rank
    row_of_slot: torch.Tensor   # [T, k] where each token-slot's row is among the rows sent (and sent back)


@dataclass
class Piece:
    """The traffic of some local experts (the same on every rank)."""
    experts: slice              # the local experts
    send_token: torch.Tensor    # [rows sent] by destination rank, then expert
    send_splits: list[int]      # rows sent to each rank
    recv_splits: list[int]      # rows received from each rank
    recv_counts: torch.Tensor   # [R, experts] int32 on the device: rows from each rank for each expert
    grouped_rows: int           # rows of the grouped GEMMs' input: each expert's, padded to Parts.align

    @property
    def received_rows(self) -> int:
        return sum(self.recv_splits)


class Parts(abc.ABC):
    """What the device computes. `align`: each expert's rows are padded to a multiple of it (the GEMM's tile);
    `spare_sms`: SMs the GEMMs leave to transfers that run beside them."""
    align: int = 1
    spare_sms: int = 0

    @abc.abstractmethod
    def route(self, x: torch.Tensor, topk_ids: torch.Tensor) -> Routing:
        """x's tokens routed over all E experts, without padding; topk_ids [T, k] written."""

    @abc.abstractmethod
    def experts(self, rows: torch.Tensor, offsets: torch.Tensor, experts: slice, y: torch.Tensor) -> None:
        """y = the SwiGLU FFN of local experts[experts] on rows grouped by expert: the i-th of them at
        offsets[i] .. offsets[i+1]; rows past offsets[-1] are neither read nor written."""

    @abc.abstractmethod
    def weighted_sum(self, returned: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor,
                     out: torch.Tensor) -> None:
        """out[t] = Σ_j weights[t, j] · returned[row_of_slot[t, j]]."""

    def regroup_index(self, piece: Piece) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return regroup_index(piece.recv_counts, piece.received_rows, piece.grouped_rows, self.align)


# ---------------------------------------------------------------- the plan: split sizes

# --8<-- [start:plan]
def exchange_counts(routing: Routing, group, align: int) -> Exchange:
    """The exact plan. One all_to_all_single of the counts tells every rank how many rows each rank sends it
    for each of its experts; the host reads them in one wait."""
    world = dist.get_world_size(group)
    sent = routing.counts.view(world, -1)            # [rank to, E_l]
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)  # [rank from, E_l]
    on_host = torch.stack([sent, received]).cpu().numpy()  # the host's one wait
    return Exchange(routing.source_token, on_host[0], on_host[1], routing.dest)


def fixed_capacity(routing: Routing, group, align: int) -> Exchange:
    """Every (rank, expert) bucket padded to one capacity: the largest bucket of any rank, found by one
    all_reduce (the host's one wait), rounded up so that an expert's R buckets fill whole GEMM tiles.
    Nothing is dropped, so the result stays exact (a capacity factor, as GShard's, would drop what overflows);
    every rank sends E_l · capacity rows to each rank, and no counts travel. The padding rows are the price:
    sent, computed on and sent back for nothing."""
    world = dist.get_world_size(group)
    largest = routing.counts.max().reshape(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    step = align // math.gcd(align, world)
    capacity = -(-int(largest) // step) * step
    return capacity_exchange(routing, capacity, world)
# --8<-- [end:plan]


def capacity_exchange(routing: Routing, capacity: int, world: int) -> Exchange:
    """Row e·capacity + c of what this rank sends holds expert e's token-slot c; a padding row repeats the
    bucket's last token-slot (an empty bucket's, the slot before it), so that no row is made of zeros."""
    counts, ids, device = routing.counts.long(), routing.ids.long(), routing.counts.device
    experts = counts.numel()
    first = torch.cumsum(counts, 0) - counts  # each expert's first token-slot in expert order
    position = torch.arange(capacity, device=device)
    slot = (first[:, None] + torch.minimum(position, counts[:, None] - 1)).clamp(min=0)
    buckets = np.full((world, experts // world), capacity)
    row_of_slot = (ids * capacity + routing.dest.long() - first[ids]).to(routing.dest.dtype)
    return Exchange(routing.source_token[slot.flatten()], buckets, buckets, row_of_slot)


# --8<-- [start:split]
def split(exchange: Exchange, ids: torch.Tensor, pieces: int, align: int) -> tuple[list[Piece], torch.Tensor]:
    """The traffic in `pieces` pieces by local expert, and where each token-slot's row is among the rows
    sent back once the pieces are laid end to end (piece by piece, each by rank, then expert)."""
    world, local = exchange.sent.shape
    if not 1 <= pieces <= local:
        raise ValueError(f"pieces must be from 1 to the {local} experts of a rank; got {pieces}")
    starts = np.cumsum(exchange.sent.ravel()) - exchange.sent.ravel()  # each bucket's first row as planned
    moved = np.empty_like(starts)                                       # and once in pieces
    found, at = [], 0
    bounds = [local * p // pieces for p in range(pieces + 1)]
    device = ids.device
    for lo, hi in zip(bounds, bounds[1:]):
        sent, received = exchange.sent[:, lo:hi], exchange.received[:, lo:hi]
        rows = [slice(starts[d * local + lo], starts[d * local + lo] + sent[d].sum()) for d in range(world)]
        for d in range(world):
            moved[d * local + lo:d * local + hi] = at + np.cumsum(sent[d]) - sent[d]
            at += sent[d].sum()
        send_token = torch.cat([exchange.send_token[r] for r in rows]) if pieces > 1 else exchange.send_token
        grouped = int(np.sum(-(-received.sum(0) // align) * align))
        found.append(Piece(slice(lo, hi), send_token, sent.sum(1).tolist(), received.sum(1).tolist(),
                           torch.as_tensor(received, dtype=torch.int32).to(device), grouped))
    if pieces == 1:
        return found, exchange.row_of_slot
    shift = torch.as_tensor(moved - starts).to(device)
    return found, (exchange.row_of_slot + shift[ids.long()]).to(exchange.row_of_slot.dtype)
# --8<-- [end:split]


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


def all_to_all(rows: torch.Tensor, output: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group) -> InFlight:
    work = dist.all_to_all_single(output, rows, out_splits, in_splits, group=group, async_op=True)
    return InFlight(output, work, rows)


def send(x: torch.Tensor, piece: Piece, group) -> InFlight:
    """The piece's rows for every rank, gathered from x in rank order, on their way."""
    output = x.new_empty(piece.received_rows, x.shape[1])
    return all_to_all(x.index_select(0, piece.send_token), output, piece.recv_splits, piece.send_splits, group)


def compute(received: torch.Tensor, piece: Piece, parts: Parts) -> torch.Tensor:
    """The piece's experts on the received rows: regrouped by expert, the grouped GEMMs, back in received order."""
    if not piece.received_rows:
        return received  # no token chose these experts
    offsets, source_row, grouped_row = parts.regroup_index(piece)
    grouped = received.index_select(0, source_row)
    y = torch.empty_like(grouped)
    parts.experts(grouped, offsets, piece.experts, y)
    return y.index_select(0, grouped_row)


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
def layer(x: torch.Tensor, parts: Parts, group, out: torch.Tensor, topk_ids: torch.Tensor, *, pieces: int = 1,
          capacity: bool = False) -> None:
    """The expert-parallel layer on this rank's tokens x: out [T, hidden] and topk_ids [T, k] written. Every
    rank of the group calls it alike (the collectives pair up). capacity: the fixed-capacity plan, else the
    counts' exchange; pieces: the traffic cut by expert into that many pieces, overlapped (`split`)."""
    routing = parts.route(x, topk_ids)
    exchange = (fixed_capacity if capacity else exchange_counts)(routing, group, parts.align)
    cut, row_of_slot = split(exchange, routing.ids, pieces, parts.align)
    sent = [send(x, piece, group) for piece in cut]
    returned = x.new_empty(exchange.send_token.numel(), x.shape[1])
    back, at = [], 0
    for piece, rows in zip(cut, sent):
        n = piece.send_token.numel()
        y = compute(rows.wait(), piece, parts)
        back.append(all_to_all(y, returned[at:at + n], piece.send_splits, piece.recv_splits, group))
        at += n
    for rows in back:
        rows.wait()
    parts.weighted_sum(returned, row_of_slot, routing.weights, out)
# --8<-- [end:layer]
