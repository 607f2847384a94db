"""All-reduce through the host's shared memory, for gloo groups whose ranks all run on one host.

gloo moves a tensor between processes on one host through TCP loopback and its own threads: a 1 MiB
all-reduce of two ranks took 2.7 ms against this path's 0.24 ms on the 2-core benchmark machine
(bench/bench_shm_all_reduce.py), and tensor parallelism does four per layer and micro-batch.
Here the ranks of a group map one file in /dev/shm instead, holding two sets (even and odd rounds)
of one SLOT_BYTES slot per rank, and each rank reads wake-ups from its own FIFO. Both are unlinked as
soon as every rank has opened them, so nothing is left behind, even by a crash.
Round k of a group (one chunk of one all-reduce):

    copy my chunk into my slot of set k % 2; write one byte to every other rank's FIFO
    read one byte per other rank from my FIFO (blocking in the kernel: no spinning on a busy CPU)
    reduce the set's slots in rank order into my tensor (every rank gets the same bits)

A rank that has arrived at round k-1 has finished reading round k-2, so set k % 2 is free when round
k starts; the pipe's write and read are the memory barriers. `all_gather` (1-D, equal sizes: the ZeRO
weight gather; `all_gather_into_tensor` in place) runs the same rounds, each rank copying every slot out;
`reduce_scatter_tensor` too, each rank summing only its own chunk of the slots (ZeRO's gradient buckets). For tensors outside host memory, for ops
other than SUM and MAX, for one-rank groups, for groups spread over hosts or not on gloo, and after
`set_shared_memory_comm(False)` (--no-shared-memory-all-reduce), `all_reduce` is torch.distributed's.
A wait gives up after the process group's timeout (`set_timeout`: --distributed-timeout-minutes, set by
distributed.init_distributed) with a DistBackendError naming the group, as torch.distributed's own would.
A wait also watches the other ranks' processes (a pidfd each, `watch_peers`): one that exits, killed or
not, ends the wait with a DistBackendError naming its global rank within EXIT_GRACE_S (a wake-up written
just before that exit is still read), instead of the full timeout.
Waiting blocks at once. Polling first (DeepSpeed's shm op spins) measured slower on the loaded 2-core
machine (bench/bench_shm_all_reduce.py, load 16): a poller that shares a core with the rank it waits for
holds that core until its time slice ends; with a 200 us poll a 1 MiB pipeline swap took 2.1 ms against
0.27-0.45 ms without, and a 1 MiB all-reduce 0.42 ms against 0.26 ms.
The choice is made once per group, collectively, at its first all-reduce; callers use `all_reduce`
where every rank of the group calls it in the same order (the tensor-parallel mappings, ZeRO's
blocking gradient reduce-scatters and weight all-gathers), never from a background thread.
"""
from __future__ import annotations

import mmap
import os
import select
import socket
import uuid
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import reduce_scatter

SLOT_BYTES = 4 << 20
SHM_DIR = "/dev/shm"

_timeout_s = 600.0  # the process group's timeout (set_timeout)
_enabled = True
_by_group = {}  # process group -> SharedMemoryAllReduce, or None where gloo's own is used
_resources = []  # other users' shared memory (pipeline/shm_p2p.py), closed with the groups


def set_shared_memory_comm(enabled: bool) -> None:
    """Whether groups not yet set up may use shared memory (--no-shared-memory-all-reduce turns it off)."""
    global _enabled
    _enabled = enabled


def set_timeout(seconds: float) -> None:
    """How long a wait for the other ranks may take before it fails (--distributed-timeout-minutes)."""
    global _timeout_s
    _timeout_s = seconds


def group_name(group) -> str:
    return f"the process group of global ranks {dist.get_process_group_ranks(group)}"


EXIT_GRACE_S = 1.0  # how long a wait still looks for a wake-up once a peer's process has exited


def wait_readable(fds: List[int], what: str, peers: Optional[Dict[int, Tuple[int, int]]] = None) -> List[int]:
    """The FIFOs of `fds` with wake-ups to read, waited for in the kernel up to the timeout; past it a
    DistBackendError saying `what` (who did not arrive). `peers` (watch_peers): a peer whose process exits
    while none of `fds` is readable ends the wait at once with a DistBackendError naming that rank."""
    ready = select.select(list(fds) + list(peers or ()), [], [], _timeout_s)[0]
    wake = [fd for fd in ready if fd in fds]
    if wake:
        return wake
    if ready:  # a peer exited; a wake-up it (or another rank) wrote just before may still be on its way
        wake = select.select(fds, [], [], EXIT_GRACE_S)[0]
        if wake:
            return wake
        rank, pid = min(peers[fd] for fd in ready)
        raise dist.DistBackendError(f"{what} will not arrive: global rank {rank} (process {pid}) has exited")
    raise dist.DistBackendError(f"{what} did not arrive within {_timeout_s:.0f} s "
                                f"(--distributed-timeout-minutes)")


def watch_peers(group, peers: Optional[Iterable[int]] = None) -> Dict[int, Tuple[int, int]]:
    """Collective over `group` (its ranks on this host): {pidfd: (global rank, pid)} of `peers` (global ranks;
    None: every other rank of the group). A pidfd turns readable when its process exits, so a wait that
    selects on it learns of a killed peer at once; none where the kernel has no pidfd_open (the timeout)."""
    pids = [None] * dist.get_world_size(group)
    dist.all_gather_object(pids, os.getpid(), group=group)
    me = dist.get_rank()
    watched = {}
    for global_rank, pid in zip(dist.get_process_group_ranks(group), pids):
        if global_rank != me and (peers is None or global_rank in peers) and hasattr(os, "pidfd_open"):
            try:
                watched[os.pidfd_open(pid)] = (global_rank, pid)
            except OSError:  # gone already, or another PID namespace: the timeout stays the bound
                pass
    return watched


def close_watch(peers: Dict[int, Tuple[int, int]]) -> None:
    for fd in peers:
        os.close(fd)
    peers.clear()


def create_shared_file(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)
    os.close(fd)


def map_shared_file(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def same_host_gloo(group, usable: bool = True) -> bool:
    """Collective over `group`: whether its ranks (two or more) all run on this host, on gloo, with
    shared memory enabled, /dev/shm present and `usable` true on every one. A fake group (the planner's,
    planning/fake_rank.py) has no other rank to ask: never."""
    if dist.get_backend(group) == "fake":
        return False
    here = (socket.gethostname(),
            usable and _enabled and os.path.isdir(SHM_DIR) and dist.get_backend(group) == "gloo")
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, here, group=group)
    return len(everyone) > 1 and len({h for h, _ in everyone}) == 1 and all(ok for _, ok in everyone)


def register(resource) -> None:
    """Have release_groups close `resource` (anything else holding mapped memory, FIFOs and a group)."""
    _resources.append(resource)


class SharedMemoryAllReduce:
    """One group's mapped slots and wake-up FIFOs (see the module docstring)."""

    def __init__(self, group, size: int, rank: int):
        self.size, self.rank, self.round = size, rank, 0
        self.name = group_name(group)
        prefix = [os.path.join(SHM_DIR, f"megatron_zero_allreduce_{uuid.uuid4().hex}") if rank == 0 else None]
        dist.broadcast_object_list(prefix, src=dist.get_global_rank(group, 0), group=group)
        data_path, fifo = prefix[0], [f"{prefix[0]}.{r}" for r in range(size)]
        total = 2 * size * SLOT_BYTES
        if rank == 0:
            create_shared_file(data_path, total)
        os.mkfifo(fifo[rank], 0o600)
        dist.barrier(group=group)
        self._map = map_shared_file(data_path, total)
        # O_RDWR: opening a FIFO so never blocks waiting for the other end
        self._fifos = [os.open(path, os.O_RDWR) for path in fifo]
        self._wake = bytes([1])
        dist.barrier(group=group)
        os.unlink(fifo[rank])
        if rank == 0:
            os.unlink(data_path)
        self.slots = torch.frombuffer(self._map, dtype=torch.uint8).view(2, size, SLOT_BYTES)
        self._peers = watch_peers(group)

    def close(self) -> None:
        del self.slots
        self._map.close()
        for fd in self._fifos:
            os.close(fd)
        self._fifos = []
        close_watch(self._peers)

    def _next_round(self) -> torch.Tensor:
        """The slot set of the next round, [size, SLOT_BYTES]."""
        self.round += 1
        return self.slots[self.round % 2]

    def _wake_peers(self):
        """Tell every other rank my slot of this round is written."""
        for r, fd in enumerate(self._fifos):
            if r != self.rank:
                os.write(fd, self._wake)

    def _wait_for_peers(self):
        """Return once every other rank has written its slot of this round."""
        fd, missing = self._fifos[self.rank], self.size - 1
        while missing:
            wait_readable([fd], f"shared-memory collective round {self.round}: a rank of {self.name}", self._peers)
            missing -= len(os.read(fd, missing))

    def _rounds(self, mine: torch.Tensor):
        """Per slot-sized chunk of `mine` (1-D): write it into my slot, wait for every rank to write
        theirs; yield (start, numel, every rank's chunk as a view of its slot, in rank order)."""
        step = SLOT_BYTES // mine.element_size()
        for begin in range(0, mine.numel(), step):
            chunk = mine[begin:begin + step]
            slots = self._next_round()
            views = [slots[r, :chunk.numel() * mine.element_size()].view(mine.dtype) for r in range(self.size)]
            views[self.rank].copy_(chunk)
            self._wake_peers()
            self._wait_for_peers()
            yield begin, chunk.numel(), views

    def all_reduce(self, x: torch.Tensor, op) -> None:
        flat = x.view(-1)
        for begin, n, parts in self._rounds(flat):
            _combine(flat[begin:begin + n], parts, op)

    def start_all_reduce(self, x: torch.Tensor) -> "_Pending":
        """The first half of a SUM all-reduce of `x` (at most one slot): publish my part and return;
        the handle's wait() waits for the others and sums. Nothing else may use the group in between."""
        if x.numel() * x.element_size() > SLOT_BYTES:
            return _Pending(lambda: self.all_reduce(x, dist.ReduceOp.SUM))
        flat = x.view(-1)
        slots = self._next_round()
        parts = [slots[r, :flat.numel() * x.element_size()].view(x.dtype) for r in range(self.size)]
        parts[self.rank].copy_(flat)
        self._wake_peers()

        def finish():
            self._wait_for_peers()
            _combine(flat, parts, dist.ReduceOp.SUM)
        return _Pending(finish)

    def all_gather(self, outs: List[torch.Tensor], mine: torch.Tensor) -> None:
        for begin, n, parts in self._rounds(mine):
            for out, part in zip(outs, parts):
                out[begin:begin + n].copy_(part)

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out = the sum over ranks of their x's chunk `rank` (x: size equal chunks of out's numel). Every rank
        publishes all of x, as for an all-reduce, but sums only its own chunk."""
        flat, mine = x.view(-1), out.view(-1)
        lo, hi = self.rank * mine.numel(), (self.rank + 1) * mine.numel()
        for begin, n, parts in self._rounds(flat):
            a, b = max(begin, lo), min(begin + n, hi)
            if a < b:
                _combine(mine[a - lo:b - lo], [p[a - begin:b - begin] for p in parts], dist.ReduceOp.SUM)


def _combine(out: torch.Tensor, parts: List[torch.Tensor], op) -> None:
    """out = parts[0] op parts[1] op ... in rank order (SUM or MAX)."""
    combine = torch.add if op == dist.ReduceOp.SUM else torch.maximum
    combine(parts[0], parts[1], out=out)
    for p in parts[2:]:
        combine(out, p, out=out)


class _Pending:
    """A started all-reduce; wait() completes it (torch.distributed's Work has the same method)."""

    def __init__(self, finish):
        self.wait = finish


def release_groups() -> None:
    """Forget every group's shared memory (unmap it, close the FIFOs; the registered resources' too) and
    the group handles with it, so torch.distributed's teardown can free the groups
    (distributed.shutdown_distributed calls this)."""
    for shm in _by_group.values():
        if shm is not None:
            shm.close()
    _by_group.clear()
    for resource in _resources:
        resource.close()
    _resources.clear()


def _for_group(group):
    if group not in _by_group:
        _by_group[group] = (SharedMemoryAllReduce(group, dist.get_world_size(group), dist.get_rank(group))
                            if same_host_gloo(group) else None)
    return _by_group[group]


def _in_host_memory(*tensors) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """In-place all-reduce of `x` over `group` (SUM or MAX through shared memory where it applies)."""
    if _in_host_memory(x) and op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        shm = _for_group(group)
        if shm is not None:
            return shm.all_reduce(x, op)
    dist.all_reduce(x, op=op, group=group)


def all_reduce_async(x: torch.Tensor, group):
    """Start an in-place SUM all-reduce of `x` over `group`; returns a handle whose wait() completes it.
    Until then `x` must not be touched and the group not used again (through shared memory: my part
    is published at once, the wait for the others and the sum happen in wait(); else gloo's async op)."""
    if _in_host_memory(x):
        shm = _for_group(group)
        if shm is not None:
            return shm.start_all_reduce(x)
    return dist.all_reduce(x, group=group, async_op=True)


def reduce_scatter_tensor(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """dist.reduce_scatter_tensor(out, x, group), SUM (through shared memory where it applies)."""
    if _in_host_memory(out, x):
        shm = _for_group(group)
        if shm is not None:
            return shm.reduce_scatter(out, x)
    reduce_scatter.reduce_scatter_tensor(out.view(-1), x.view(-1), group=group)  # 1-D: gloo checks dim 0


def all_gather_into_tensor(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    """dist.all_gather_into_tensor(out, mine, group), `mine` possibly this rank's chunk of `out` (in place;
    through shared memory where it applies)."""
    if _in_host_memory(out, mine):
        shm = _for_group(group)
        if shm is not None:
            return shm.all_gather(list(out.view(-1).chunk(dist.get_world_size(group))), mine.view(-1))
    reduce_scatter.all_gather_into_tensor(out.view(-1), mine.view(-1), group=group)


def all_gather(outs: List[torch.Tensor], mine: torch.Tensor, group) -> None:
    """dist.all_gather(outs, mine, group) for 1-D tensors of one size (through shared memory where it applies)."""
    if _in_host_memory(mine, *outs) and mine.dim() == 1 and all(o.shape == mine.shape for o in outs):
        shm = _for_group(group)
        if shm is not None:
            return shm.all_gather(outs, mine)
    dist.all_gather(outs, mine, group=group)
