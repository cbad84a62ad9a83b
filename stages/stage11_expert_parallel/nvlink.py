"""Dispatch and combine over NVLink by the course's own kernels (nvlink.cuh), as DeepEP does within a node.

Every rank maps the others' buffers (PyTorch's symmetric memory, without multicast), so a kernel stores each
token's row straight into the rank that owns its expert, at the row that rank's grouped GEMMs read, and each
result straight back into the rank the row came from:

  route     stage 7's router and stage 5's routing, unpadded                        parts.route
  plan      ep_plan: the counts into every peer's table, a flag each; from all      Peers.plan
            the tables, where each expert's rows start on its rank
  dispatch  ep_dispatch: each row stored into its k ranks' grouped rows, with its   Peers.dispatch
            origin; each block counts its arrival on every peer
  experts   stage 6's GEMMs on the grouped rows, once every peer's rows are in      parts.experts
  return    ep_return: each result stored into the rank it came from, at its slot   Peers.give_back
  combine   every peer's returns awaited; stage 5's weighted sum, local             Peers.combine

The host never waits: no split sizes to read, nothing to regroup. `layer` can cut the local experts into
pieces (as dispatch.py does for NCCL): piece p + 1's rows travel while piece p's GEMMs run, and piece p's
results travel back while piece p + 1's run, on a second stream and the SMs the GEMMs spare. `plan` is
ep_plan's maths in PyTorch (the CPU tests' transport and the GPU test's yardstick).
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stages.common.hopper import sm_count
from stages.common.launcher import param_struct
from stages.common.moe import MAX_EXPERTS
from stages.stage5_moe_routing import combine as weighted_sum
from stages.stage11_expert_parallel.dispatch import Parts, Routing

# nvlink.cuh's constants (the grader checks them against the kernels)
MAX_RANKS = 8
PEER_THREADS = 256
COPY_THREADS = 1024
RETURN_LOADS = 4
TABLE, PLANNED = 0, MAX_RANKS * MAX_EXPERTS
ARRIVED, RETURNED = PLANNED + MAX_RANKS, PLANNED + 2 * MAX_RANKS
TIMED_OUT = PLANNED + 3 * MAX_RANKS
CONTROL_INTS = TIMED_OUT + 1
GEOMETRY = {"MAX_RANKS": MAX_RANKS, "PEER_THREADS": PEER_THREADS, "COPY_THREADS": COPY_THREADS,
            "RETURN_LOADS": RETURN_LOADS,
            "PLANNED": PLANNED, "ARRIVED": ARRIVED, "RETURNED": RETURNED, "TIMED_OUT": TIMED_OUT,
            "CONTROL_INTS": CONTROL_INTS}
# The copy kernels' parameters, as nvlink.cuh's structs hold them (the grader checks the layouts against them).
EpPlanParams = param_struct("EpPlanParams", [
    ("counts", "const int*"), ("control_peers", "const long long*"), ("control", "int*"), ("rank", "int"),
    ("world", "int"), ("experts", "int"), ("align", "int"), ("pieces", "int"), ("piece_rows", "int"),
    ("epoch", "int"), ("shift", "int*"), ("offsets", "int*"), ("filled", "int*")])
EpDispatchParams = param_struct("EpDispatchParams", [
    ("x", "const elem_t*"), ("topk_ids", "const int*"), ("dest", "const int*"), ("shift", "const int*"),
    ("rows_peers", "const long long*"), ("origin_peers", "const long long*"), ("control_peers", "const long long*"),
    ("tokens", "int"), ("hidden", "int"), ("top_k", "int"), ("local", "int"), ("first", "int"), ("last", "int"),
    ("slots", "int"), ("rank", "int"), ("world", "int")])
EpReturnParams = param_struct("EpReturnParams", [
    ("y", "const elem_t*"), ("offsets", "const int*"), ("filled", "const int*"), ("origin", "const int*"),
    ("returned_peers", "const long long*"), ("control_peers", "const long long*"), ("hidden", "int"),
    ("experts", "int"), ("slots", "int"), ("rank", "int"), ("world", "int")])
PARAM_STRUCTS = (EpPlanParams, EpDispatchParams, EpReturnParams)
KERNELS = {
    "ep_plan": "const EpPlanParams",
    "ep_dispatch": "const EpDispatchParams",
    "ep_return": "const EpReturnParams",
    "wait_for_peers": "int*, int, int, int",
}


def piece_experts(local: int, pieces: int, p: int) -> slice:
    """Piece p's local experts (ep_plan's bounds)."""
    return slice(local * p // pieces, local * (p + 1) // pieces)


def piece_rows(world: int, tokens: int, top_k: int, local: int, align: int, pieces: int) -> int:
    """The grouped rows a piece's region holds: every token-slot of every rank, its experts' segments padded."""
    return world * tokens * top_k + -(-local // pieces) * (align - 1)


def grouped_rows(world: int, tokens: int, top_k: int, local: int, align: int, pieces: int) -> int:
    """The grouped rows a rank holds for the layer in any number of pieces up to `pieces` (Plan.region: the
    rows over the pieces)."""
    return max(n * piece_rows(world, tokens, top_k, local, align, n) for n in range(1, pieces + 1))


@dataclass
class Plan:
    """Where the rows go (ep_plan's outputs) and the regions they go in."""
    shift: torch.Tensor    # [E] a token-slot of expert e at row i of this rank's expert order: row i + shift[e]
    offsets: torch.Tensor  # [E_l + pieces] each piece's segments, from 0: piece p's at lo + p .. hi + p
    filled: torch.Tensor   # [E_l] each local expert's real rows
    pieces: int
    region: int            # the rows of a piece's region: piece p's start at row p · region

    def piece(self, p: int) -> tuple[slice, slice, torch.Tensor]:
        """Piece p's local experts, grouped rows and segment offsets."""
        experts = piece_experts(self.filled.numel(), self.pieces, p)
        return (experts, slice(p * self.region, (p + 1) * self.region),
                self.offsets[experts.start + p:experts.stop + p + 1])


def plan(table: torch.Tensor, rank: int, align: int, pieces: int = 1, region: int = 0) -> Plan:
    """ep_plan's maths. table [R, E]: each rank's token-slots per expert; int32 outputs."""
    world, experts = table.shape
    local = experts // world
    counts = table.long()
    padded = (-(-counts.sum(0) // align) * align).view(world, local)
    start, offsets = torch.empty_like(padded), []
    for p in range(pieces):
        cut = piece_experts(local, pieces, p)
        ends = padded[:, cut].cumsum(1)
        start[:, cut] = p * region + ends - padded[:, cut]
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), ends[rank]]))
    first = counts[rank].cumsum(0) - counts[rank]
    shift = start.flatten() + counts[:rank].sum(0) - first
    filled = counts.sum(0).view(world, local)[rank]
    return Plan(shift.int(), torch.cat(offsets).int(), filled.int(), pieces, region)


class Peers(abc.ABC):
    """The ranks' mapped buffers: `rows`, this rank's grouped rows, which every rank writes; `y`, its
    experts' results; `returned` [token-slots, hidden], the results of this rank's token-slots, which every
    rank writes. The counts a wait takes are the blocks launched so far, the same on every rank."""
    rows: torch.Tensor
    y: torch.Tensor

    @abc.abstractmethod
    def plan(self, counts: torch.Tensor, pieces: int) -> Plan:
        """Every rank's counts [E] exchanged: the Plan, as `plan`."""

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, routing: Routing, plan: Plan, p: int, sms: int = 0) -> int:
        """The rows of x's token-slots whose experts are piece p's on their way into their ranks' `rows`, on
        `sms` SMs (0: all); returns the count to wait for (wait_dispatched) before the piece's GEMMs."""

    @abc.abstractmethod
    def wait_dispatched(self, count: int) -> None:
        """Every peer's rows of the pieces dispatched up to `count` are in."""

    @abc.abstractmethod
    def give_back(self, plan: Plan, p: int, sms: int = 0) -> None:
        """Piece p's results (y) on their way back into the ranks their rows came from."""

    @abc.abstractmethod
    def combine(self, routing: Routing, out: torch.Tensor) -> None:
        """Every peer's results awaited; out = Σ_j w_j · returned[slot j]."""


# --8<-- [start:layer]
def layer(x: torch.Tensor, parts: Parts, peers: Peers, out: torch.Tensor, topk_ids: torch.Tensor, pieces: int = 1,
          side=None) -> None:
    """The expert-parallel layer over mapped buffers: out [T, hidden] and topk_ids [T, k] written, the host
    never waiting. Every rank of the group calls it alike. With pieces > 1, the transfers beside the GEMMs
    run on `side` (a second stream; None: one after the other) on the SMs the GEMMs spare (parts.spare_sms)."""
    routing = parts.route(x, topk_ids)
    plan = peers.plan(routing.counts, pieces)
    arrived = [peers.dispatch(x, routing, plan, 0)]
    with beside(side):
        arrived += [peers.dispatch(x, routing, plan, p, parts.spare_sms) for p in range(1, pieces)]
    for p in range(pieces):
        experts, rows, offsets = plan.piece(p)
        peers.wait_dispatched(arrived[p])
        parts.experts(peers.rows[rows], offsets, experts, peers.y[rows])
        if p < pieces - 1:
            with beside(side):
                peers.give_back(plan, p, parts.spare_sms)
    peers.give_back(plan, pieces - 1)
    join(side)
    peers.combine(routing, out)
# --8<-- [end:layer]


def beside(side):
    """Work on `side` after what the current stream holds so far; with None, on the current stream."""
    if side is None:
        return contextlib.nullcontext()
    side.wait_stream(torch.cuda.current_stream(side.device))
    return torch.cuda.stream(side)


def join(side) -> None:
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device):
    """The second stream the pieces' transfers run on, made once per GPU; None on the CPU."""
    if device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@dataclass
class PeerBuffers:
    """This rank's rows, origin (each grouped row's rank · slots + token-slot), returned and control
    (CONTROL_INTS ints: nvlink.cuh's table and flags), each one's address on every rank (int64 [R] on the
    device), and y, its own; `slots` token-slots at most on any rank, room for the layer in up to `pieces`
    pieces (Plan), a full copy's blocks (an SM each, the same on every rank); the calls so far (the epoch)
    and the blocks launched so far by each kind of copy."""
    rows: torch.Tensor
    origin: torch.Tensor
    returned: torch.Tensor
    control: torch.Tensor
    y: torch.Tensor
    rows_peers: torch.Tensor
    origin_peers: torch.Tensor
    returned_peers: torch.Tensor
    control_peers: torch.Tensor
    rank: int
    world: int
    slots: int
    pieces: int
    blocks: int
    epoch: int = 0
    dispatched: int = 0
    given_back: int = 0

    def check(self) -> None:
        """RuntimeError if a kernel gave up waiting for a peer (it reads the device: a synchronization)."""
        if int(self.control[TIMED_OUT]):
            raise RuntimeError("stage 11 over NVLink: a peer's flag never came (a rank failed or fell 5 s behind)")


def symmetric_buffers(group, tokens: int, hidden: int, experts: int, top_k: int, align: int, dtype,
                      device: torch.device, pieces: int = 1) -> PeerBuffers:
    """Buffers in PyTorch's symmetric memory, mapped by every rank of the group (a collective call), for up to
    `tokens` tokens on any rank and the layer in up to `pieces` pieces."""
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world > MAX_RANKS or experts % world or hidden % 8 or not 1 <= pieces <= experts // world:
        raise ValueError(f"NVLink dispatch takes at most {MAX_RANKS} ranks, experts a multiple of them, hidden of 8 "
                         f"and at most a piece per local expert; got {world}, {experts}, {hidden}, {pieces}")
    agreed = torch.tensor([tokens, -sm_count(device)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    slots = int(agreed[0]) * top_k
    capacity = grouped_rows(world, int(agreed[0]), top_k, experts // world, align, pieces)

    def mapped(shape, element):
        tensor = symm_mem.empty(shape, dtype=element, device=device)
        handle = symm_mem.rendezvous(tensor, group)
        return tensor, torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)

    (rows, rows_peers), (origin, origin_peers), (returned, returned_peers), (control, control_peers) = (
        mapped((capacity, hidden), dtype), mapped((capacity,), torch.int32), mapped((slots, hidden), dtype),
        mapped((CONTROL_INTS,), torch.int32))
    rows.normal_()  # padding rows are multiplied too: zeros slow the tensor cores (stage 7's gather)
    control.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # every rank's flags zeroed before any rank signals
    return PeerBuffers(rows, origin, returned, control, torch.empty_like(rows), rows_peers, origin_peers,
                       returned_peers, control_peers, rank, world, slots, pieces, -int(agreed[1]))


class KernelPeers(Peers):
    """nvlink.cuh's kernels on PeerBuffers."""

    def __init__(self, kernels, buffers: PeerBuffers, align: int):
        self.kernels, self.b, self.align = kernels, buffers, align
        self.rows, self.y = buffers.rows, buffers.y

    def plan(self, counts, pieces):
        b = self.b
        if pieces > b.pieces:
            raise ValueError(f"these buffers hold the layer in at most {b.pieces} pieces; asked for {pieces}")
        b.epoch += 1
        experts, device = counts.numel(), counts.device
        region = b.rows.shape[0] // pieces  # at least piece_rows(..., pieces): see grouped_rows
        shift, offsets, filled = (torch.empty(n, dtype=torch.int32, device=device)
                                  for n in (experts, experts // b.world + pieces, experts // b.world))
        self.kernels.ep_plan((1,), (PEER_THREADS,),
                             EpPlanParams(counts=counts, control_peers=b.control_peers, control=b.control, rank=b.rank,
                                          world=b.world, experts=experts, align=self.align, pieces=pieces,
                                          piece_rows=region, epoch=b.epoch, shift=shift, offsets=offsets,
                                          filled=filled))
        return Plan(shift, offsets, filled, pieces, region)

    def dispatch(self, x, routing, plan, p, sms=0):
        b, (tokens, top_k) = self.b, routing.ids.shape
        experts, grid = plan.piece(p)[0], sms or b.blocks
        self.kernels.ep_dispatch((grid,), (COPY_THREADS,),
                                 EpDispatchParams(x=x, topk_ids=routing.ids, dest=routing.dest, shift=plan.shift,
                                                  rows_peers=b.rows_peers, origin_peers=b.origin_peers,
                                                  control_peers=b.control_peers, tokens=tokens, hidden=x.shape[1],
                                                  top_k=top_k, local=plan.filled.numel(), first=experts.start,
                                                  last=experts.stop, slots=b.slots, rank=b.rank, world=b.world))
        b.dispatched += grid
        return b.dispatched

    def wait_dispatched(self, count):
        self.kernels.wait_for_peers((1,), (PEER_THREADS,), self.b.control, ARRIVED, self.b.world, count)

    def give_back(self, plan, p, sms=0):
        b = self.b
        experts, rows, offsets = plan.piece(p)
        grid = sms or b.blocks
        self.kernels.ep_return((grid,), (COPY_THREADS,),
                               EpReturnParams(y=b.y[rows], offsets=offsets, filled=plan.filled[experts],
                                              origin=b.origin[rows], returned_peers=b.returned_peers,
                                              control_peers=b.control_peers, hidden=b.y.shape[1],
                                              experts=experts.stop - experts.start, slots=b.slots, rank=b.rank,
                                              world=b.world))
        b.given_back += grid

    def combine(self, routing, out):
        b, (tokens, top_k) = self.b, routing.ids.shape
        self.kernels.wait_for_peers((1,), (PEER_THREADS,), b.control, RETURNED, b.world, b.given_back)
        slot = torch.arange(tokens * top_k, dtype=torch.int32, device=out.device).view(tokens, top_k)
        weighted_sum(self.kernels, b.returned, slot, routing.weights, out, top_k)
