"""Where the fp32 masters and Adam moments live, and the AdamW that steps them.

One flat fp32 master per param group (this rank's partition). ``offload``:
  'none'  masters and moments beside the model on ``device``, stepped by the multi-tensor
          AdamW (one CUDA launch per group on a GPU; torch.optim.AdamW's math elsewhere);
  'cpu'   in host memory (pinned when ``device`` is a GPU), stepped by the C++ CPU Adam
          (megatron_zero.ops.cpu_adam.adamw_step_, PyTorch's same math where it is not built)
          in chunks of OFFLOAD_CHUNK_NUMEL elements, pipelined both ways as DeepSpeed's
          ZeRO-Offload does (its cpu_adam "step + copy"):

            copy stream:  grad 0 down | grad 1 down | grad 2 down | ...      w 0 up |      w 1 up | ...
            host:                     | Adam 0 (+cast) | Adam 1 (+cast) | Adam 2 (+cast) | ...

          the gradients are host tensors already where the ZeRO stage keeps them there
          (``host_grads``: zero/host_grads.py brings each reduced bucket down as it lands, so the
          device holds no fp32 gradient partition); otherwise
          every chunk's gradient is queued at once to come down into pinned host buffers on a
          side copy stream (device.copy_stream); the CPU steps chunk i as soon as its copy has
          landed, writing the new weights in the model dtype in the same pass (the C++ kernel's
          ``low_out``: bf16/fp16 halves the bytes that go up) into one of UPLOAD_SLOTS pinned chunk
          buffers, and queues that chunk's upload on the copy stream straight into ``weight_slices``
          (the stage's own device buffer for this rank's weights: the flat buffer's slice at stage
          1/2, the shard buffer at stage 3), so chunk i goes up while the CPU steps chunk i+1.
          In fp32 the pinned master chunk itself goes up (no cast, no slot). ``weights()`` then
          hands the stage those device tensors, the compute stream waiting for the last upload
          first: ``write_weights`` copies nothing from the host. A slot is written again only once
          its upload has finished (its event), a master chunk stepped again only once the previous
          step's uploads have (their events). Extra memory: UPLOAD_SLOTS pinned chunks of the model
          dtype on the host (none in fp32 with 'cpu'), nothing on the device (before, write_weights'
          ``.to()`` made a model-dtype copy of the partition there on every step). The host cast
          is the one the old path did too: a host->device ``.to(device, dtype)`` casts on the host
          before the copy; the kernel's cast rounds to nearest-even as torch's does (tests). With
          the device being the CPU there is no copy, no stream and no upload (the gradients are
          used in place, write_weights casts the masters), the same loop otherwise;
  'nvme'  in files under ``nvme_path`` (master, exp_avg, exp_avg_sq per group), paged
          into memory for the step and for ``state()`` (so checkpoints can save them),
          and dropped from memory afterwards; stepped and uploaded as 'cpu' (in fp32 through a
          pinned slot too: the paged-in master is not pinned and is dropped after the step).
The offloaded step runs on ``cpu_threads`` threads (--cpu-optimizer-threads; default
megatron_zero.ops.cpu_adam.default_offload_threads(), this rank's share of the node's cores).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Dict, List

import numpy as np
import torch

from ..distributed.device import HOST, copy_stream, host_empty, join_stream, on_stream, record_event, wait_event
from ..ops.cpu_adam import CPUAdamW, adamw_step_, default_offload_threads
from ..ops.fused_adam import MultiTensorAdamW

STATE_KEYS = ("exp_avg", "exp_avg_sq")
OFFLOAD_CHUNK_NUMEL = 1 << 23  # 32 MiB of fp32 per pipelined chunk
UPLOAD_SLOTS = 2  # pinned model-dtype chunk buffers the new weights go up through, in turn


class FlatAdamW:
    def __init__(self, masters: List[torch.Tensor], hparams: List[dict], offload: str = "none",
                 nvme_path: str | None = None, tag: str = "rank0", device: torch.device = HOST,
                 weight_slices: List[torch.Tensor] | None = None, cpu_threads: int | None = None,
                 host_grads: bool = False):
        if offload not in ("none", "cpu", "nvme"):
            raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {offload!r}")
        if cpu_threads is not None and (offload == "none" or cpu_threads < 1):
            raise ValueError(f"cpu_threads={cpu_threads} needs an offloaded optimizer and must be at least 1")
        self.cpu_threads = (cpu_threads or default_offload_threads()) if offload != "none" else None
        if offload == "nvme" and not nvme_path:
            raise ValueError("offload='nvme' needs nvme_path, a directory for the optimizer-state files")
        self.offload, self.device = offload, device
        self.home = HOST if offload != "none" else device  # where masters and moments live
        self.numels = [m.numel() for m in masters]
        self.params = [torch.nn.Parameter(self._at_home(m), requires_grad=True) for m in masters]
        # host buffers the device's gradients are copied into (offload from a GPU only; none where the stage
        # hands over host gradients, `host_grads`: zero/host_grads.py)
        self.grad_staging = [host_empty(n, torch.float32, device) if self.home != device and not host_grads else None
                             for n in self.numels]
        self.stream = copy_stream(device) if self.home != device else None
        self.chunk_numel = OFFLOAD_CHUNK_NUMEL
        if weight_slices is not None and (offload == "none" or [w.numel() for w in weight_slices] != self.numels):
            raise ValueError("weight_slices are for an offloaded optimizer and need one tensor of each "
                             f"partition's size {self.numels}")
        # stepped chunks' new weights go up into these (the stage's buffers, model dtype on the device)
        self.weight_slices = weight_slices
        self._slots: List[torch.Tensor | None] = [None] * UPLOAD_SLOTS
        self._uploads: List[object] = []  # the events of the last step's uploads, in chunk order
        groups = [dict(h, params=[p]) for h, p in zip(hparams, self.params)]
        self.opt = CPUAdamW(groups) if offload in ("cpu", "nvme") else MultiTensorAdamW(groups)
        self.steps = [0 for _ in masters]
        self.paths = None
        if offload == "nvme":
            os.makedirs(nvme_path, exist_ok=True)
            self.paths = [{k: os.path.join(nvme_path, f"{tag}_group{g}_{k}.bin")
                           for k in ("fp32",) + STATE_KEYS} for g in range(len(masters))]
            for g, p in enumerate(self.params):
                self._write(g, "fp32", p.data)
                for k in STATE_KEYS:
                    self._write(g, k, torch.zeros(self.numels[g], device=HOST))
            self._page_out()

    def _at_home(self, master: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of `master` where the optimizer keeps it (pinned host memory for offload from a GPU)."""
        if self.home == self.device:  # no offload, or offload with the CPU as the device
            return master.detach().to(self.home, torch.float32)
        return host_empty(master.numel(), torch.float32, self.device).copy_(master.detach().reshape(-1))

    @property
    def param_groups(self):
        return self.opt.param_groups

    # ---- nvme paging -----------------------------------------------------------
    def _write(self, g: int, key: str, t: torch.Tensor):
        with open(self.paths[g][key], "wb") as f:
            t.detach().float().contiguous().numpy().tofile(f)

    def _read(self, g: int, key: str) -> torch.Tensor:
        # a real read into memory, not a mapping: the file is rewritten while the tensor lives
        t = torch.from_numpy(np.fromfile(self.paths[g][key], dtype=np.float32))
        if t.numel() != self.numels[g]:
            raise RuntimeError(f"optimizer-state file {self.paths[g][key]} holds {t.numel()} values, "
                               f"expected {self.numels[g]}; it was changed outside this run")
        return t

    def _page_in(self):
        for g, p in enumerate(self.params):
            p.data = self._read(g, "fp32")
            if self.steps[g] > 0:
                self.opt.state[p] = {"step": torch.tensor(float(self.steps[g]), device=HOST),
                                     **{k: self._read(g, k) for k in STATE_KEYS}}

    def _page_out(self):
        for g, p in enumerate(self.params):
            self._write(g, "fp32", p.data)
            st = self.opt.state.pop(p, None)
            if st:
                for k in STATE_KEYS:
                    self._write(g, k, st[k])
            p.data = torch.empty(0, device=HOST)

    @contextmanager
    def paged(self):
        """Masters (and moments) in memory for the duration; for NVMe, written back after."""
        self._wait_uploads()  # the last step's uploads may still read the masters
        if self.offload != "nvme":
            yield self.params
            return
        self._page_in()
        try:
            yield self.params
        finally:
            self._page_out()

    # ---- stepping --------------------------------------------------------------
    def step(self, grads: List[torch.Tensor]):
        """One AdamW step of every group's master with its fp32 gradient partition (paged in)."""
        if self.offload == "none":
            for p, g in zip(self.params, grads):
                p.grad = g
            self.opt.step()
            for p in self.params:
                p.grad = None
        else:
            self._step_offloaded(grads)
        self.steps = [s + 1 for s in self.steps]

    def _chunks(self, numel: int):
        return [(o, min(self.chunk_numel, numel - o)) for o in range(0, numel, self.chunk_numel)]

    def _step_offloaded(self, grads: List[torch.Tensor]):
        """Queue every gradient chunk's copy down on the side stream, then step each chunk on the
        CPU as soon as its copy has landed (the CPU works while the copy engine brings the next);
        with weight_slices, queue each stepped chunk's upload at once (it goes up during the next)."""
        self._wait_uploads()  # the previous step's uploads read the masters and slots written now
        landed = []
        with on_stream(self.stream, self.device):  # after the work that produced the gradients
            for g, staging in zip(grads, self.grad_staging):
                if staging is None:  # the device is the CPU, or the gradient is in host memory: used in place
                    landed.append((g, [None] * len(self._chunks(g.numel()))))
                    continue
                events = []
                for o, n in self._chunks(g.numel()):
                    staging[o:o + n].copy_(g[o:o + n], non_blocking=True)
                    events.append(record_event(self.stream))
                landed.append((staging, events))
        for gi, (p, group, (host_grad, events)) in enumerate(zip(self.params, self.opt.param_groups, landed)):
            st = self.opt.state[p]
            if not st:  # torch.optim.AdamW's state keys, as CPUAdamW.step makes them
                st.update(step=torch.zeros((), device=HOST), exp_avg=torch.zeros_like(p.data),
                          exp_avg_sq=torch.zeros_like(p.data))
            st["step"] += 1
            beta1, beta2 = group["betas"]
            for (o, n), event in zip(self._chunks(p.numel()), events):
                wait_event(event)
                slot = self._slot(p.data, n)
                low = slot if slot is not None and slot.dtype != torch.float32 else None
                adamw_step_(p.data[o:o + n], host_grad[o:o + n], st["exp_avg"][o:o + n], st["exp_avg_sq"][o:o + n],
                            step=int(st["step"].item()), lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                            weight_decay=group["weight_decay"], fused=self.opt.fused, low_out=low,
                            threads=self.cpu_threads)
                if self.weight_slices is not None:
                    self._upload(p.data[o:o + n], slot, self.weight_slices[gi][o:o + n])

    def _slot(self, master: torch.Tensor, n: int) -> torch.Tensor | None:
        """The pinned buffer (n elements, model dtype) the next chunk's new weights go up from, once
        its last upload has finished; None where the pinned fp32 master chunk itself goes up."""
        if self.weight_slices is None:
            return None
        dtype = self.weight_slices[0].dtype
        if dtype == torch.float32 and master.is_pinned():
            return None
        k = len(self._uploads) % UPLOAD_SLOTS
        if len(self._uploads) >= UPLOAD_SLOTS:
            wait_event(self._uploads[-UPLOAD_SLOTS])  # the upload that read this slot last
        if self._slots[k] is None or self._slots[k].numel() < n or self._slots[k].dtype != dtype:
            self._slots[k] = host_empty(min(self.chunk_numel, max(self.numels)), dtype, self.device)
        return self._slots[k][:n]

    def _upload(self, master: torch.Tensor, slot: torch.Tensor | None, dest: torch.Tensor):
        """Queue the copy of a stepped chunk's new weights (slot, cast by the step; or the master) up
        into dest on the copy stream."""
        if slot is not None and slot.dtype == torch.float32:  # fp32 through a slot: the master is not pinned
            slot.copy_(master)
        with on_stream(self.stream, self.device):
            dest.copy_(master if slot is None else slot, non_blocking=True)
            self._uploads.append(record_event(self.stream))

    def _wait_uploads(self):
        for event in self._uploads:
            wait_event(event)
        self._uploads = []

    def weights(self) -> List[torch.Tensor]:
        """What the stage's ``write_weights`` publishes after a step: the masters, or the weight_slices
        the step uploaded them into (the device's current stream waits for the last upload first)."""
        if self.weight_slices is None:
            return self.params
        join_stream(self.stream, self.device)
        return self.weight_slices

    # ---- checkpoint views --------------------------------------------------------
    def state(self, g: int) -> Dict[str, torch.Tensor]:
        """{'step', 'exp_avg', 'exp_avg_sq'} of group g (zeros before the first step); call paged in."""
        p = self.params[g]
        st = self.opt.state.get(p, {})
        out = {"step": torch.tensor(float(self.steps[g]), device=HOST)}
        for k in STATE_KEYS:
            out[k] = st[k] if k in st else torch.zeros_like(p.data)
        return out

    def set_state(self, g: int, state: Dict[str, torch.Tensor], master: torch.Tensor):
        """Load group g's master and moments (full padded partition); call paged in."""
        p = self.params[g]
        p.data.copy_(master)
        step = int(float(state["step"]))
        self.steps[g] = step
        if step > 0:  # into the moments already held, where there are some: a load allocates nothing twice
            held = self.opt.state.get(p, {})
            self.opt.state[p] = {"step": torch.tensor(float(step), device=HOST),
                                 **{k: held[k].copy_(state[k].reshape(-1)) if k in held else
                                    state[k].detach().to(p.device, torch.float32, copy=True).reshape(-1)
                                    for k in STATE_KEYS}}
        else:
            self.opt.state.pop(p, None)

    def state_bytes(self) -> int:
        """Bytes of masters and moments held in memory right now."""
        total = sum(p.data.numel() * 4 for p in self.params)
        for st in self.opt.state.values():
            total += sum(v.numel() * v.element_size() for k, v in st.items() if k in STATE_KEYS)
        return total
