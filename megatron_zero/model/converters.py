"""The model-converter protocol: what a feature that changes a built model stage implements, and the container.

torchtitan's ModelConverter protocol (`convert` and `post_optimizer_hook`, a container applying them in order)
with the hooks a feature here needs besides: the weights ZeRO gathers in another format than the training dtype
(`weight_gather`), and training state the feature keeps outside the model's state dict, saved as its own entry of
the checkpoint's model-states file (`state_key`, `state_dict`, `load_state_dict`, `starts_fresh`). zero/ and
checkpoint/ reach a feature only through these hooks; none of them knows which features there are.

A converter changes modules in place and keeps every parameter object and name (the optimizer, ZeRO's
partitions and hooks, and the checkpoint's names are built from them next, so a converted model saves and
loads as the unconverted one). Who implements it: FP8 (`fp8/convert.py`: the linear layers' FP8 matmuls, the
FP8 weight gather, delayed scaling's state), the output loss (`model/output_loss_converter.py`: fused by
vocabulary chunks or the whole logits), the compile of each transformer layer (`compile/layers.py`), applied in
that order (megatron_zero/model_converters.py builds a run's): the compile last, after the converters that change
what a layer computes. They are the one place the trainer changes a built model.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import torch


class ModelConverter:
    """One feature's converter: `convert` is its own; each hook's default does nothing."""

    name = ""
    state_key: Optional[str] = None  # the model-states file's entry `state_dict` fills (None: it keeps no state)

    def convert(self, model: torch.nn.Module) -> Optional[str]:
        """Change `model` in place, keeping every parameter object and name; -> a line for the log, or None."""
        raise NotImplementedError

    def __call__(self, model: torch.nn.Module) -> Optional[str]:
        """`convert`, for a converter applied on its own (a test, a benchmark)."""
        return self.convert(model)

    def weight_gather(self, model: torch.nn.Module, dp_group, device: torch.device, experts: Optional[bool] = None):
        """What ZeRO gathers over `dp_group` of the converted weights in another format than the training dtype
        (the interface of fp8/param_gather.Float8ParamGather), or None: ZeRO gathers them as any other weight.
        `experts` True / False: the MoE experts' weights only (over expert-DP) / the others only; None: all."""
        return None

    def post_optimizer_hook(self, model: torch.nn.Module) -> None:
        """After every optimizer step: a skipped one too, and each run of a step the re-run machine repeats
        (reliability/rerun.py), as the expert bias's update (moe/expert_bias.py)."""

    def state_dict(self, model: torch.nn.Module, dp_group) -> Optional[object]:
        """This rank's training state kept outside the model's state dict, for the model-states file under
        `state_key` (the file of DP rank 0, ZeRO-3: of every DP rank), or None. Called on every rank, so it may be
        collective over `dp_group`."""
        return None

    def load_state_dict(self, model: torch.nn.Module, saved: Optional[object], optimizer) -> Optional[str]:
        """Restore what `state_dict` saved (None: the checkpoint holds no such entry) into a model loaded on the
        layout it was saved on, its optimizer's state loaded; -> None, or the line saying what starts fresh."""
        return None

    def starts_fresh(self, model: torch.nn.Module, why: str) -> Optional[str]:
        """The line for a load that cannot restore this converter's state (`why`: the reason), or None."""
        return None


class ModelConverters:
    """A run's converters, in the order they apply; every hook asks each of them in that order."""

    def __init__(self, converters: Sequence[ModelConverter] = ()):
        self.converters = tuple(converters)
        keys = [c.state_key for c in self.converters if c.state_key is not None]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two model converters save under one model-states entry: {keys}")

    def __iter__(self) -> Iterator[ModelConverter]:
        return iter(self.converters)

    @property
    def names(self) -> List[str]:
        return [c.name for c in self.converters]

    def convert(self, model: torch.nn.Module) -> List[str]:
        """Apply each converter in turn, in place; their log lines."""
        return [line for c in self.converters if (line := c.convert(model))]

    def weight_gather(self, model: torch.nn.Module, dp_group, device: torch.device, experts: Optional[bool] = None):
        gathers = [(c.name, g) for c in self.converters
                   if (g := c.weight_gather(model, dp_group, device, experts)) is not None]
        if len(gathers) > 1:
            raise ValueError(f"one weight gather in another format per model; {[n for n, _ in gathers]} each ask for one")
        return gathers[0][1] if gathers else None

    def post_optimizer_hook(self, model: torch.nn.Module) -> None:
        for c in self.converters:
            c.post_optimizer_hook(model)

    @property
    def state_keys(self) -> frozenset:
        """The model-states entries these converters save (not the client state)."""
        return frozenset(c.state_key for c in self.converters if c.state_key is not None)

    def state_dict(self, model: torch.nn.Module, dp_group) -> dict:
        """{state_key: state} of the converters that keep state; collective where one of them is."""
        states = {c.state_key: c.state_dict(model, dp_group) for c in self.converters if c.state_key is not None}
        return {k: v for k, v in states.items() if v is not None}

    def load_state_dict(self, model: torch.nn.Module, states: dict, optimizer) -> List[str]:
        """Each converter's entry of a model-states file restored; the lines saying what starts fresh."""
        return [line for c in self.converters
                if (line := c.load_state_dict(model, states.get(c.state_key) if c.state_key else None, optimizer))]

    def starts_fresh(self, model: torch.nn.Module, why: str) -> List[str]:
        return [line for c in self.converters if (line := c.starts_fresh(model, why))]


NO_CONVERTERS = ModelConverters()
