"""Checkpoints are data, never code: a crafted `__reduce__` payload with a matching manifest is refused by
every reader (same-layout load, reshaped load, universal conversion, consolidation, HF export, the
zero_to_fp32.py copied into the checkpoint) with one sentence naming the refused global; nothing runs."""
import json
import os
import pickle
import subprocess
import sys
import types

import pytest
import torch

from megatron_zero.checkpoint import CheckpointError, save_checkpoint
from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict
from megatron_zero.checkpoint.export.hf.exporter import export_hf
from megatron_zero.checkpoint.storage.safe_pickle import RefusedGlobal, safe_load
from megatron_zero.checkpoint.storage.checksum import file_checksum
from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.testing.checkpoint_stage import build_stage, random_train_step
from megatron_zero.testing.multirank import run_ranks


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(tag_dir, name, marker):
    """Add a payload to file `name` and record the new file in the manifest (integrity, not authenticity)."""
    path = os.path.join(tag_dir, name)
    obj = torch.load(path, weights_only=False)
    obj["payload"] = Payload(marker)
    torch.save(obj, path)
    manifest_path = os.path.join(tag_dir, "manifest.json")
    manifest = json.load(open(manifest_path))
    manifest["files"][name].update(size=os.path.getsize(path), checksum=file_checksum(path))
    json.dump(manifest, open(manifest_path, "w"))
    return path


def _readers(save_dir, tmp):
    from megatron_zero.checkpoint.resume import resume_checkpoint
    tag_dir = os.path.join(save_dir, "global_step1")

    def load(zero):
        state, _, model, opt = build_stage(1, 1, zero)
        resume_checkpoint(save_dir, state, model, opt, log=lambda line: None)

    return {"same-layout load": lambda: load(1), "reshaped load": lambda: load(3),
            "universal conversion": lambda: convert_to_universal(tag_dir, os.path.join(tmp, "u"), merge_workers=1,
                                                                 progress=False),
            "consolidation": lambda: get_fp32_state_dict(tag_dir),
            "HF export": lambda: export_hf(tag_dir, os.path.join(tmp, "hf"), num_heads=4)}


def _refusals(save_dir, tmp):
    state, config, model, opt = build_stage(1, 1, 1)
    random_train_step(state, config, model, opt)
    save_checkpoint(save_dir, 1, state, model, opt, {"iteration": 1})
    marker = os.path.join(tmp, "payload_ran")
    path = _plant(os.path.join(save_dir, "global_step1"), "mp_rank_00_model_states.pt", marker)
    out = {}
    for name, read in _readers(save_dir, tmp).items():
        try:
            read()
            out[name] = "read without a word"
        except CheckpointError as e:
            out[name] = str(e)
    return out, path, os.path.exists(marker)


def test_a_reduce_payload_is_refused_by_every_reader(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    out, path, ran = run_ranks(_refusals, 1, save_dir, str(tmp_path), timeout=300)[0]
    assert not ran
    want = (f"the checkpoint file {path} refers to the global posix.system, which is not a type checkpoints hold; "
            "refused without loading it (checkpoints are data, never code)")
    assert out == {name: want for name in out}, out
    script = os.path.join(save_dir, "global_step1", "zero_to_fp32.py")  # the copy in the checkpoint, standalone
    done = subprocess.run([sys.executable, script, save_dir, str(tmp_path / "out.pt")], capture_output=True,
                          text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 2 and done.stderr.strip() == f"zero_to_fp32.py: error: {want}", done.stderr
    assert not os.path.exists(tmp_path / "payload_ran") and not os.path.exists(tmp_path / "out.pt")


class _Named(types.SimpleNamespace):
    """Pickled under the global name in NAMES[type] (pure-Python pickler, so no import of that name)."""


class _Pickler(pickle._Pickler):
    def save_global(self, obj, name=None):
        if obj in NAMES:
            self.write(pickle.GLOBAL + ("\n".join(NAMES[obj].rsplit(".", 1)) + "\n").encode())
            self.memoize(obj)
        else:
            super().save_global(obj, name)


class FragmentAddress(_Named):
    pass


class DynamicLossScaler(_Named):
    pass


class Evil(_Named):
    pass


NAMES = {FragmentAddress: "deepspeed.utils.tensor_fragment.fragment_address",
         DynamicLossScaler: "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", Evil: "subprocess.Popen"}
PICKLE = types.SimpleNamespace(Pickler=_Pickler, __name__="pickle")


def test_deepspeed_classes_load_as_plain_stand_ins(tmp_path):
    """DeepSpeed's fragment_address and loss scaler, pickled under their own names, load without deepspeed's
    code running (stand-ins carrying their attributes); any other name is refused, named."""
    obj = {"frag": FragmentAddress(numel=3, start=5), "scaler": DynamicLossScaler(cur_scale=2.0 ** 16),
           "t": torch.ones(2)}
    torch.save(obj, tmp_path / "ds.pt", pickle_module=PICKLE)
    got = safe_load(str(tmp_path / "ds.pt"))
    assert (got["frag"].numel, got["frag"].start, got["scaler"].cur_scale) == (3, 5, 2.0 ** 16)
    assert torch.equal(got["t"], torch.ones(2))
    torch.save({"x": Evil(a=1)}, tmp_path / "evil.pt", pickle_module=PICKLE)
    with pytest.raises(RefusedGlobal, match=r"refers to the global subprocess.Popen, which is not a type checkpoints "
                                            r"hold; refused without loading it"):
        safe_load(str(tmp_path / "evil.pt"))


def test_torch_2_4_allow_list_loads_the_same_and_is_restored(tmp_path, monkeypatch):
    """torch 2.4/2.5 take no (object, "module.name") pairs: the renamed stand-ins used there load DeepSpeed's
    names and numpy 1's `numpy.core` name for the rng state as the pairs do, refuse the rest, and leave
    torch's allow-list as it was. Forced here so the fallback runs on whichever torch the tests have."""
    import numpy as np
    from megatron_zero.checkpoint.storage import safe_pickle
    reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
    monkeypatch.setitem(NAMES, reconstruct, "numpy.core.multiarray._reconstruct")
    rng = np.random.RandomState(7).get_state()
    obj = {"frag": FragmentAddress(numel=3, start=5), "scaler": DynamicLossScaler(cur_scale=2.0 ** 16),
           "rng": rng, "args": types.SimpleNamespace(lr=0.5), "t": torch.arange(4.0)}
    torch.save(obj, tmp_path / "ds.pt", pickle_module=PICKLE)
    torch.save({"x": Evil(a=1)}, tmp_path / "evil.pt", pickle_module=PICKLE)
    before = set(torch.serialization.get_safe_globals())
    paths = [False] + [True] * safe_pickle._torch_takes_named_pairs()  # pairs only where this torch has them
    for pairs in paths:
        monkeypatch.setattr(safe_pickle, "_torch_takes_named_pairs", lambda pairs=pairs: pairs)
        got = safe_load(str(tmp_path / "ds.pt"))
        assert (got["frag"].numel, got["frag"].start, got["scaler"].cur_scale, got["args"].lr) == (3, 5, 2.0 ** 16, 0.5)
        assert got["rng"][0] == rng[0] and np.array_equal(got["rng"][1], rng[1]) and got["rng"][2:] == rng[2:]
        assert torch.equal(got["t"], torch.arange(4.0))
        with pytest.raises(RefusedGlobal, match=r"refers to the global subprocess.Popen, which is not a type"):
            safe_load(str(tmp_path / "evil.pt"))
        assert set(torch.serialization.get_safe_globals()) == before
