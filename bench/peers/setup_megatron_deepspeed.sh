#!/usr/bin/env bash
# Set up Megatron-DeepSpeed (microsoft/Megatron-DeepSpeed f4157bea) to run GPT pretraining on this CPU
# with gloo, OUTSIDE this repository, for bench/bench_vs_megatron_deepspeed.py. Steps (why: bench/peers/README.md):
#   1. its source tree in $MDS_DIR (from a git dir or an existing checkout), with the one source edit:
#      CoreAttention.forward's three .view( on query/key/value become .reshape( (non-contiguous on CPU);
#   2. a venv $MDS_VENV: by default it reuses the packages of $BASE_PYTHON (torch 2.13.0 CPU, deepspeed
#      0.19.8, transformers: this project's venv) through a .pth file and pip-installs the few it lacks;
#      with MDS_FULL_INSTALL=1 it pip-installs everything instead;
#   3. shims it needs on the current packages, inside that venv: a stub `torchvision` (training.py imports
#      vision code; PyPI torchvision does not load against CPU torch) and `deepspeed.compression.compress`
#      (gone in DeepSpeed 0.19; only its compression features need it, never called here),
#      and a wrapper of DeepSpeed 0.19's _save_moe_checkpoint (its MoE save reads `universal_checkpoint_info`
#      as a module attribute, a method in MDS's GPTModel, and refuses it in MDS's client state);
#   4. `make -C megatron/data` (its C++ dataset index helpers);
#   5. the one-off JIT build of DeepSpeed's shm comm op (~5 minutes) into $TORCH_EXTENSIONS_DIR.
# Usage: bash bench/peers/setup_megatron_deepspeed.sh   (env: MDS_GIT_DIR or MDS_SRC, MDS_DIR, MDS_VENV,
#        BASE_PYTHON, TORCH_EXTENSIONS_DIR). Running it twice is harmless.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
MDS_DIR=${MDS_DIR:-/work/mds_src}
MDS_VENV=${MDS_VENV:-/work/mds_venv}
MDS_GIT_DIR=${MDS_GIT_DIR:-/work/.mirror/microsoft+Megatron-DeepSpeed/repo}
BASE_PYTHON=${BASE_PYTHON:-$REPO/.venv/bin/python}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/work/mds_torch_extensions}

# 1. source tree
if [ ! -f "$MDS_DIR/pretrain_gpt.py" ]; then
    if [ -n "${MDS_SRC:-}" ]; then cp -r "$MDS_SRC" "$MDS_DIR"
    else mkdir -p "$MDS_DIR"; git --git-dir="$MDS_GIT_DIR" archive HEAD | tar -x -C "$MDS_DIR"; fi
fi
python3 - "$MDS_DIR/megatron/model/transformer.py" <<'PY'
import re, sys
path = sys.argv[1]
src = open(path).read()
for name in ("query_layer", "key_layer", "value_layer"):
    src = re.sub(rf"{name} = {name}\.view\(", f"{name} = {name}.reshape(", src, count=1)
open(path, "w").write(src)
PY

# 2. venv
if [ ! -x "$MDS_VENV/bin/python" ]; then "$BASE_PYTHON" -m venv --without-pip "$MDS_VENV" 2>/dev/null \
    || python3 -m venv --without-pip "$MDS_VENV"; fi
SITE=$("$MDS_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "${MDS_FULL_INSTALL:-0}" = 1 ]; then
    "$MDS_VENV/bin/python" -m ensurepip -q
    "$MDS_VENV/bin/python" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    "$MDS_VENV/bin/python" -m pip install -q deepspeed==0.19.8 transformers sentencepiece regex six pybind11 \
        nltk pillow tensorboard einops
else
    BASE_SITE=$("$BASE_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$BASE_SITE" > "$SITE/base_venv.pth"
    [ -d "$MDS_VENV/extra/nltk" ] || "$BASE_PYTHON" -m pip install -q --target "$MDS_VENV/extra" six nltk
    echo "$MDS_VENV/extra" > "$SITE/extra.pth"
fi

# 3. shims, inside the venv (never in the shared packages)
mkdir -p "$SITE/torchvision/transforms" "$SITE/torchvision/datasets"
cat > "$SITE/torchvision/__init__.py" <<'PY'
"""Stub torchvision for Megatron-DeepSpeed's text-only GPT runs: its training.py imports the vision code."""
def __getattr__(name):
    raise AttributeError(f"stub torchvision has no {name!r}: vision models are not supported here")
PY
for sub in transforms datasets; do cat > "$SITE/torchvision/$sub/__init__.py" <<'PY'
"""Stub: names resolve to placeholders that refuse to run."""
class _Unsupported:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("stub torchvision: vision models are not supported here")
def __getattr__(name):
    return _Unsupported
PY
done
cat > "$SITE/mds_compress_shim.py" <<'PY'
"""Provide deepspeed.compression.compress (gone in DeepSpeed 0.19) for Megatron-DeepSpeed's imports."""
import importlib.abc, importlib.util, sys

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "deepspeed.compression.compress" else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        def unsupported(*args, **kwargs):
            raise RuntimeError("DeepSpeed compression is not available in DeepSpeed >= 0.19")
        module.init_compression = module.redundancy_clean = unsupported

sys.meta_path.append(_Finder())
PY
echo "import mds_compress_shim" > "$SITE/mds_compress_shim.pth"
cat > "$SITE/mds_moe_save_shim.py" <<'PY'
"""Let DeepSpeed >= 0.19's MoE checkpoint save take Megatron-DeepSpeed's client state.

DeepSpeed 0.19's _save_moe_checkpoint reads `universal_checkpoint_info` as a dict attribute of the module
(Megatron-DeepSpeed's GPTModel has a method of that name: "TypeError: 'method' object is not iterable") and
refuses it as a client-state key (Megatron-DeepSpeed's checkpointing.py puts it there). The wrapper moves the
client state's dict onto the module for the call, so the saved state holds it as DeepSpeed < 0.19 saved it."""
import importlib.abc, importlib.util, sys

KEY = "universal_checkpoint_info"

def _patch(engine_module):
    engine = engine_module.DeepSpeedEngine
    original = engine._save_moe_checkpoint

    def _save_moe_checkpoint(self, save_dir, tag, client_state={}, *args, **kwargs):
        client_state = dict(client_state)
        info = client_state.pop(KEY, None)
        module = self.module
        had = KEY in vars(module)
        module.__dict__[KEY] = dict(info) if isinstance(info, dict) else None
        try:
            return original(self, save_dir, tag, client_state, *args, **kwargs)
        finally:
            if not had:
                module.__dict__.pop(KEY, None)

    engine._save_moe_checkpoint = _save_moe_checkpoint

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed.runtime.engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module):
            exec_module(module)
            _patch(module)
        loader.exec_module = patched
        return spec

sys.meta_path.insert(0, _Finder())
PY
echo "import mds_moe_save_shim" > "$SITE/mds_moe_save_shim.pth"

# 4. dataset helpers
PATH="$MDS_VENV/bin:$PATH" make -C "$MDS_DIR/megatron/data" >/dev/null

# 5. shm comm op (JIT, once)
DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 "$MDS_VENV/bin/python" -c \
    'from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder("ShareMemCommBuilder").load()'
echo "Megatron-DeepSpeed ready: --mds-dir $MDS_DIR --mds-python $MDS_VENV/bin/python" \
     "(TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR)"
