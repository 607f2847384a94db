"""pip install -e . : the megatron_zero package, its tools, and the csrc/ kernels.

Kernels are built ahead of time when torch and a compiler are present; when a
build fails the install still succeeds and megatron_zero.ops falls back to PyTorch.
"""
import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))
try:
    from extensions import build_ext_class, get_extensions  # csrc/extensions.py
except ImportError:  # csrc/ not built yet (fresh tree): install pure Python
    get_extensions, build_ext_class = (lambda: []), None

ext_modules = get_extensions()
cmdclass = {"build_ext": build_ext_class} if ext_modules and build_ext_class else {}

setup(
    name="megatron_zero",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT training with reshapable DeepSpeed-compatible checkpoints",
    packages=find_packages(include=["megatron_zero", "megatron_zero.*"]) + ["megatron_zero_tools"],
    package_dir={"megatron_zero_tools": "tools"},
    python_requires=">=3.10",
    # the torch range the code keeps to (public APIs present since 2.4; see README "Torch versions").
    # requirements.txt pins 2.13.0 for this machine's quick set-up; GPU images bring their own torch.
    install_requires=["torch>=2.4,<2.14", "numpy", "sentencepiece"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": [
        "megatron-zero-pretrain = megatron_zero.training:pretrain",
        "megatron-zero-ds-to-universal = megatron_zero_tools.ds_to_universal:main",
        "megatron-zero-zero-to-fp32 = megatron_zero_tools.zero_to_fp32:main",
        "megatron-zero-convert-to-hf = megatron_zero_tools.convert_to_hf:main",
        "megatron-zero-preprocess-data = megatron_zero_tools.preprocess_data:main",
        "megatron-zero-train-tokenizer = megatron_zero_tools.train_tokenizer:main",
        "megatron-zero-build-corpus = megatron_zero_tools.build_corpus:main",
        "megatron-zero-generate-text = megatron_zero_tools.generate_text:main",
    ]},
)
