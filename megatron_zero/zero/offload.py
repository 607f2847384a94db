"""Where the fp32 masters and Adam moments live, and the AdamW that steps them.

One flat fp32 master per param group (this rank's partition). ``offload``:
  'none'  masters and moments beside the model on ``device``, stepped by the multi-tensor
          AdamW (one CUDA launch per group on a GPU; torch.optim.AdamW's math elsewhere);
  'cpu'   in host memory (pinned when ``device`` is a GPU), stepped by the C++ CPU Adam
          (megatron_zero.ops.cpu_adam.adamw_step_, PyTorch's same math where it is not built)
          in chunks of OFFLOAD_CHUNK_NUMEL elements, pipelined as DeepSpeed's ZeRO-Offload
          does: every chunk's gradient is queued to come down into pinned host buffers on a
          side copy stream (device.copy_stream) at once, and the CPU steps chunk i as soon
          as its copy has landed while the copy engine brings the following ones, so the
          device->host traffic overlaps the CPU's Adam instead of preceding it; the updated
          masters go back up in the stage's ``write_weights`` (non-blocking copies from pinned
          memory, queued on the compute stream). With the device being the CPU there is no
          copy and no stream (the gradients are used in place), the same loop otherwise;
  'nvme'  in files under ``nvme_path`` (master, exp_avg, exp_avg_sq per group), paged
          into memory for the step and for ``state()`` (so checkpoints can save them),
          and dropped from memory afterwards.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Dict, List

import numpy as np
import torch

from ..device import HOST, copy_stream, host_empty, on_stream, record_event, wait_event
from ..ops.cpu_adam import CPUAdamW, adamw_step_
from ..ops.fused_adam import MultiTensorAdamW

STATE_KEYS = ("exp_avg", "exp_avg_sq")
OFFLOAD_CHUNK_NUMEL = 1 << 23  # 32 MiB of fp32 per pipelined chunk


class FlatAdamW:
    def __init__(self, masters: List[torch.Tensor], hparams: List[dict], offload: str = "none",
                 nvme_path: str | None = None, tag: str = "rank0", device: torch.device = HOST):
        if offload not in ("none", "cpu", "nvme"):
            raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {offload!r}")
        if offload == "nvme" and not nvme_path:
            raise ValueError("offload='nvme' needs nvme_path, a directory for the optimizer-state files")
        self.offload, self.device = offload, device
        self.home = HOST if offload != "none" else device  # where masters and moments live
        self.numels = [m.numel() for m in masters]
        self.params = [torch.nn.Parameter(self._at_home(m), requires_grad=True) for m in masters]
        # host buffers the device's gradients are copied into (offload from a GPU only)
        self.grad_staging = [host_empty(n, torch.float32, device) if self.home != device else None
                             for n in self.numels]
        self.stream = copy_stream(device) if self.home != device else None
        self.chunk_numel = OFFLOAD_CHUNK_NUMEL
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
        CPU as soon as its copy has landed (the CPU works while the copy engine brings the next)."""
        landed = []
        with on_stream(self.stream, self.device):  # after the work that produced the gradients
            for g, staging in zip(grads, self.grad_staging):
                if staging is None:  # the device is the CPU: the gradient is used in place
                    landed.append((g, [None] * len(self._chunks(g.numel()))))
                    continue
                events = []
                for o, n in self._chunks(g.numel()):
                    staging[o:o + n].copy_(g[o:o + n], non_blocking=True)
                    events.append(record_event(self.stream))
                landed.append((staging, events))
        for p, group, (host_grad, events) in zip(self.params, self.opt.param_groups, landed):
            st = self.opt.state[p]
            if not st:  # torch.optim.AdamW's state keys, as CPUAdamW.step makes them
                st.update(step=torch.zeros((), device=HOST), exp_avg=torch.zeros_like(p.data),
                          exp_avg_sq=torch.zeros_like(p.data))
            st["step"] += 1
            beta1, beta2 = group["betas"]
            for (o, n), event in zip(self._chunks(p.numel()), events):
                wait_event(event)
                adamw_step_(p.data[o:o + n], host_grad[o:o + n], st["exp_avg"][o:o + n], st["exp_avg_sq"][o:o + n],
                            step=int(st["step"].item()), lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                            weight_decay=group["weight_decay"], fused=self.opt.fused)

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
