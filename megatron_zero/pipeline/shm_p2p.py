"""Pipeline sends and receives through the host's shared memory, for pipeline groups on one host (gloo).

gloo moves a stage's activation (1 MiB in bench/bench_vs_megatron_deepspeed.py's model) through TCP loopback
and its own I/O threads, several wake-ups per transfer on each side. Here each ordered pair of neighbouring
ranks src -> dst has a channel: a file in /dev/shm of NSLOTS slots, a data FIFO on which src writes one
byte per chunk it put in a slot, and an ack FIFO on which dst writes one byte per chunk it copied out.
A message goes in slot-sized chunks; chunk k of a channel takes slot k % NSLOTS, written only once fewer
than NSLOTS chunks are unacknowledged. Messages arrive in the order they were sent, as gloo's sends between
one pair under one tag do, so the ring of two stages (prev and next the same rank) stays matched by p2p.py's
fixed order. The FIFO reads and writes are the memory barriers between the copies.

`exchange` runs one batch of sends and receives (p2p.py's batch_isend_irecv) together: it moves every chunk
it can and, where none can move, waits for any FIFO it needs (shm_comm.wait_readable: blocking in the
kernel up to the process group's timeout), so two stages sending to each other never deadlock.
`connect` sets the channels up collectively over the pipeline group, only where every rank of it runs on
this host, on gloo, with shared memory on (--no-shared-memory-all-reduce turns it off) and host tensors;
elsewhere it returns None and p2p.py uses torch.distributed. The files and FIFOs are unlinked once both
ends have opened them, so nothing is left behind, even by a crash.
"""
from __future__ import annotations

import os
import uuid
from collections import deque
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..distributed import shm_comm

NSLOTS = 4
_WAKE = bytes([1])


class _Channel:
    """One direction between two ranks: the slots, both FIFOs, and this end's counts."""

    def __init__(self, path: str, slot_bytes: int, sending: bool):
        self.slot_bytes, self.sending = slot_bytes, sending
        self._map = shm_comm.map_shared_file(path, NSLOTS * slot_bytes)
        self.slots = torch.frombuffer(self._map, dtype=torch.uint8).view(NSLOTS, slot_bytes)
        data, ack = (os.open(path + suffix, os.O_RDWR | os.O_NONBLOCK) for suffix in (".data", ".ack"))
        self.wait_fd, self.post_fd = (ack, data) if sending else (data, ack)
        self.moved = 0      # chunks written (sending end) or copied out (receiving end)
        self.signalled = 0  # wake-ups read: acks (sending end) or chunks announced (receiving end)

    def ready(self) -> bool:
        """Whether a chunk can move now: a free slot to write, or a written slot to read."""
        if self._ready():
            return True
        try:
            self.signalled += len(os.read(self.wait_fd, 4096))
        except BlockingIOError:
            pass
        return self._ready()

    def _ready(self) -> bool:
        return self.moved - self.signalled < NSLOTS if self.sending else self.signalled > self.moved

    def move(self, data: torch.Tensor, offset: int) -> int:
        """Move the chunk of `data` (bytes) at `offset` through the next slot; returns the chunk's size."""
        n = min(self.slot_bytes, data.numel() - offset)
        slot = self.slots[self.moved % NSLOTS, :n]
        if self.sending:
            slot.copy_(data[offset:offset + n])
        else:
            data[offset:offset + n].copy_(slot)
        os.write(self.post_fd, _WAKE)
        self.moved += 1
        return n

    def close(self) -> None:
        del self.slots
        self._map.close()
        os.close(self.wait_fd)
        os.close(self.post_fd)


class SharedMemoryP2P:
    """This rank's channels to and from its neighbours (see the module docstring)."""

    def __init__(self, outgoing: dict, incoming: dict, name: str, peers: dict):
        self.outgoing, self.incoming, self.name, self.peers = outgoing, incoming, name, peers

    def exchange(self, sends: List[Tuple[torch.Tensor, int]], recvs: List[Tuple[torch.Tensor, int]]) -> None:
        """Send each (tensor, global rank) of `sends` and fill each of `recvs`, in order per peer."""
        queues = {}
        for table, ops in ((self.outgoing, sends), (self.incoming, recvs)):
            for tensor, peer in ops:
                queues.setdefault(table[peer], deque()).append([tensor.reshape(-1).view(torch.uint8), 0])
        while queues:
            moved = False
            for channel, queue in list(queues.items()):
                while queue and channel.ready():
                    transfer = queue[0]
                    transfer[1] += channel.move(*transfer)
                    moved = True
                    if transfer[1] == transfer[0].numel():
                        queue.popleft()
                if not queue:
                    del queues[channel]
            if queues and not moved:
                shm_comm.wait_readable([c.wait_fd for c in queues],
                                       f"pipeline p2p through shared memory: a neighbouring stage in {self.name}",
                                       self.peers)

    def close(self) -> None:
        for channel in (*self.outgoing.values(), *self.incoming.values()):
            channel.close()
        self.outgoing, self.incoming = {}, {}
        shm_comm.close_watch(self.peers)


def connect(group, neighbours: Iterable[Optional[int]], message_bytes: int,
            host_tensors: bool) -> Optional[SharedMemoryP2P]:
    """Collective over the pipeline `group`: channels to and from each neighbour (global ranks, None for
    none; every neighbour has this rank as its neighbour too), slots of up to shm_comm.SLOT_BYTES."""
    if dist.get_world_size(group) < 2 or not shm_comm.same_host_gloo(group, host_tensors):
        return None
    me = dist.get_rank()
    peers = sorted({n for n in neighbours if n is not None and n != me})
    prefixes = [None] * dist.get_world_size(group)
    dist.all_gather_object(prefixes, os.path.join(shm_comm.SHM_DIR, f"megatron_zero_p2p_{uuid.uuid4().hex}"),
                           group=group)
    mine = prefixes[dist.get_rank(group)]
    slot_bytes = max(1, min(message_bytes, shm_comm.SLOT_BYTES))
    for peer in peers:  # this rank creates the channels it receives on
        shm_comm.create_shared_file(f"{mine}.from{peer}", NSLOTS * slot_bytes)
        for suffix in (".data", ".ack"):
            os.mkfifo(f"{mine}.from{peer}{suffix}", 0o600)
    dist.barrier(group=group)
    incoming = {peer: _Channel(f"{mine}.from{peer}", slot_bytes, sending=False) for peer in peers}
    outgoing = {peer: _Channel(f"{prefixes[dist.get_group_rank(group, peer)]}.from{me}", slot_bytes, sending=True)
                for peer in peers}
    dist.barrier(group=group)
    for peer in peers:
        for suffix in ("", ".data", ".ack"):
            os.unlink(f"{mine}.from{peer}{suffix}")
    p2p = SharedMemoryP2P(outgoing, incoming, shm_comm.group_name(group), shm_comm.watch_peers(group, peers))
    shm_comm.register(p2p)
    return p2p
