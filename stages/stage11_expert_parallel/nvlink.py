"""Dispatch and combine over NVLink by the course's own kernels (nvlink.cuh), as DeepEP does within a node.

Every rank maps the others' buffers (PyTorch's symmetric memory, without multicast), so a kernel stores each
token's row straight into the rank that owns its expert, at the row that rank's grouped GEMMs read:

  route     stage 7's router and stage 5's routing, unpadded                        parts.route
  plan      ep_plan: the counts into every peer's table, a flag each; from all      Peers.plan
            the tables, where each expert's rows start on its rank
  dispatch  ep_dispatch: each row stored into its k ranks' grouped rows; each       Peers.dispatch
            block counts its arrival on every peer; then the peers' counts awaited
  experts   stage 6's GEMMs on the grouped rows, into the results that peers read  parts.experts
  combine   a flag to every peer (results ready), theirs awaited; ep_combine       Peers.combine
            reads each token's k results where they were computed

The host never waits: no split sizes to read, nothing to regroup. `plan` is the same maths in PyTorch (the
CPU tests' transport and the GPU test's yardstick for ep_plan).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stages.common.hopper import sm_count
from stages.common.moe import MAX_EXPERTS
from stages.stage11_expert_parallel.dispatch import Parts, Routing

# nvlink.cuh's constants (the grader checks them against the kernels)
MAX_RANKS = 8
PEER_THREADS = 256
DISPATCH_THREADS = 256
TABLE, PLANNED = 0, MAX_RANKS * MAX_EXPERTS
ARRIVED, READY = PLANNED + MAX_RANKS, PLANNED + 2 * MAX_RANKS
TIMED_OUT = PLANNED + 3 * MAX_RANKS
CONTROL_INTS = TIMED_OUT + 1
GEOMETRY = {"MAX_RANKS": MAX_RANKS, "PEER_THREADS": PEER_THREADS, "DISPATCH_THREADS": DISPATCH_THREADS,
            "PLANNED": PLANNED, "ARRIVED": ARRIVED, "READY": READY, "TIMED_OUT": TIMED_OUT,
            "CONTROL_INTS": CONTROL_INTS}
KERNELS = {
    "ep_plan": "const int*, const long long*, int*, int, int, int, int, int, int*, int*",
    "ep_dispatch": "const elem_t*, const int*, const int*, const int*, const long long*, const long long*, int*, int, "
                   "int, int, int, int, int",
    "signal_and_wait": "const long long*, int*, int, int, int, int, int",
    "ep_combine": "const long long*, const int*, const int*, const float*, elem_t*, int, int, int",
}
DISPATCH_BLOCKS_PER_SM = 4  # 32 warps of stores in flight per SM
COMBINE_THREADS = 128


def plan(table: torch.Tensor, rank: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ep_plan's maths. table [R, E]: each rank's token-slots per expert. Returns shift [E] (a token-slot of
    expert e at row i of this rank's expert order lands at row i + shift[e] on e's rank: its segment's start,
    padded segments end to end, plus the rows of ranks before this one) and offsets [E_l + 1], this rank's
    own segments for its GEMMs; int32."""
    world, experts = table.shape
    counts = table.long()
    padded = (-(-counts.sum(0) // align) * align).view(world, experts // world)
    start = (padded.cumsum(1) - padded).flatten()
    first = counts[rank].cumsum(0) - counts[rank]
    shift = start + counts[:rank].sum(0) - first
    offsets = torch.cat([start.view_as(padded)[rank], padded[rank].sum().reshape(1)])
    return shift.int(), offsets.int()


def capacity(world: int, tokens: int, top_k: int, experts: int, align: int) -> int:
    """The grouped rows a rank may receive: every token-slot of every rank, each local segment padded."""
    return world * tokens * top_k + experts // world * (align - 1)


class Peers(abc.ABC):
    """The ranks' mapped buffers: `rows` [capacity, hidden], this rank's grouped rows, which every rank
    writes; `y`, the same shape, its experts' results, which every rank reads."""
    rows: torch.Tensor
    y: torch.Tensor

    @abc.abstractmethod
    def plan(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's counts [E] exchanged: (shift, offsets), as `plan`."""

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, routing: Routing, shift: torch.Tensor) -> torch.Tensor:
        """x's rows into their ranks' `rows`; once every rank's are in here, returns slot_row [T, k]: where
        each token-slot's row is on its rank."""

    @abc.abstractmethod
    def combine(self, routing: Routing, slot_row: torch.Tensor, out: torch.Tensor) -> None:
        """After the experts: this rank's results announced, the peers' awaited, out = Σ_j w_j · y[row_j]."""


# --8<-- [start:layer]
def layer(x: torch.Tensor, parts: Parts, peers: Peers, out: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """The expert-parallel layer over mapped buffers: out [T, hidden] and topk_ids [T, k] written, the host
    never waiting. Every rank of the group calls it alike."""
    routing = parts.route(x, topk_ids)
    shift, offsets = peers.plan(routing.counts)
    slot_row = peers.dispatch(x, routing, shift)
    parts.experts(peers.rows, offsets, slice(None), peers.y)
    peers.combine(routing, slot_row, out)
# --8<-- [end:layer]


@dataclass
class PeerBuffers:
    """This rank's rows, y and control (CONTROL_INTS ints: nvlink.cuh's table and flags), and each one's
    address on every rank, int64 [R] on the device; the calls made so far (the flags' epoch) and the dispatch's
    blocks, the same on every rank."""
    rows: torch.Tensor
    y: torch.Tensor
    control: torch.Tensor
    rows_peers: torch.Tensor
    y_peers: torch.Tensor
    control_peers: torch.Tensor
    rank: int
    world: int
    blocks: int
    epoch: int = 0

    def check(self) -> None:
        """RuntimeError if a kernel gave up waiting for a peer (it reads the device: a synchronization)."""
        if int(self.control[TIMED_OUT]):
            raise RuntimeError("stage 11 over NVLink: a peer's flag never came (a rank failed or fell 5 s behind)")


def symmetric_buffers(group, tokens: int, hidden: int, experts: int, top_k: int, align: int, dtype,
                      device: torch.device) -> PeerBuffers:
    """Buffers in PyTorch's symmetric memory, mapped by every rank of the group (a collective call), for up to
    `tokens` tokens on any rank."""
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world > MAX_RANKS or experts % world or hidden % 8:
        raise ValueError(f"NVLink dispatch takes at most {MAX_RANKS} ranks, experts a multiple of them and hidden "
                         f"of 8; got {world}, {experts}, {hidden}")
    agreed = torch.tensor([tokens, -sm_count(device) * DISPATCH_BLOCKS_PER_SM], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    rows = capacity(world, int(agreed[0]), top_k, experts, align)

    def mapped(shape, element):
        tensor = symm_mem.empty(shape, dtype=element, device=device)
        handle = symm_mem.rendezvous(tensor, group)
        return tensor, torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)

    (x_rows, rows_peers), (y, y_peers), (control, control_peers) = (
        mapped((rows, hidden), dtype), mapped((rows, hidden), dtype), mapped((CONTROL_INTS,), torch.int32))
    x_rows.normal_()  # padding rows are multiplied too: zeros slow the tensor cores (stage 7's gather)
    control.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # every rank's flags zeroed before any rank signals
    return PeerBuffers(x_rows, y, control, rows_peers, y_peers, control_peers, rank, world, -int(agreed[1]))


class KernelPeers(Peers):
    """nvlink.cuh's kernels on PeerBuffers."""

    def __init__(self, kernels, buffers: PeerBuffers, align: int):
        self.kernels, self.b, self.align = kernels, buffers, align
        self.rows, self.y = buffers.rows, buffers.y

    def plan(self, counts):
        b = self.b
        b.epoch += 1
        experts = counts.numel()
        shift = torch.empty(experts, dtype=torch.int32, device=counts.device)
        offsets = torch.empty(experts // b.world + 1, dtype=torch.int32, device=counts.device)
        self.kernels.ep_plan((1,), (PEER_THREADS,), counts, b.control_peers, b.control, b.rank, b.world, experts,
                             self.align, b.epoch, shift, offsets)
        return shift, offsets

    def dispatch(self, x, routing, shift):
        b, (tokens, top_k) = self.b, routing.ids.shape
        slot_row = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
        self.kernels.ep_dispatch((b.blocks,), (DISPATCH_THREADS,), x, routing.ids, routing.dest, shift, b.rows_peers,
                                 b.control_peers, slot_row, tokens, x.shape[1], top_k, shift.numel() // b.world,
                                 b.rank, b.world)
        self.kernels.signal_and_wait((1,), (PEER_THREADS,), b.control_peers, b.control, ARRIVED, b.rank, b.world, 0,
                                     b.epoch * b.blocks)
        return slot_row

    def combine(self, routing, slot_row, out):
        b, (tokens, hidden) = self.b, out.shape
        self.kernels.signal_and_wait((1,), (PEER_THREADS,), b.control_peers, b.control, READY, b.rank, b.world,
                                     b.epoch, b.epoch)
        local = routing.counts.numel() // b.world
        threads = min(COMBINE_THREADS, 32 * -(-hidden // 256))  # 8 columns a thread
        self.kernels.ep_combine((tokens,), (threads,), b.y_peers, routing.ids, slot_row, routing.weights, out,
                                routing.ids.shape[1], hidden, local)
