"""pip install . : the megatron_zero package, its tools, its dependencies, and the csrc/ kernels.

Kernels are built ahead of time when torch and a compiler are present at build time. A plain
`pip install .` builds in an isolated environment that has no torch, so it installs no kernels;
`pip install --no-build-isolation .` (what scripts/setup_env.sh runs) builds them against the
installed torch. When a build fails, or is skipped, the install still succeeds and megatron_zero.ops
falls back to PyTorch; pip shows a build's own output only with -v, so the training log's first lines
say which kernels are in use and why the others are not (megatron_zero.ops.kernel_report).
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
    # the torch range the code keeps to (public APIs present since 2.4; see README "Torch versions");
    # CI tests the pins in requirements.txt (torch 2.13.0), and GPU images bring their own torch
    install_requires=["torch>=2.4,<2.14", "numpy>=1.24", "sentencepiece>=0.1.99", "tensorboard>=2.10",
                      "crc32c>=2.3", "safetensors>=0.4,<1", "tokenizers>=0.20,<1"],
    extras_require={
        "wandb": ["wandb>=0.16"],
        "tiktoken": ["tiktoken>=0.7"],  # --tokenizer-type TikTokenizer
        "fp8": ["torchao>=0.18"],  # --fp8-format: torchao's float8 training (docs/fp8.md)
        "plot": ["matplotlib>=3.5"],  # tools/plot_loss.py, the loss curve scripts/demo.sh draws
        "test": ["pytest>=7", "ruff>=0.5", "deepspeed>=0.16", "megatron-core>=0.10", "transformers>=4.40",
                 "wandb>=0.16", "tiktoken>=0.7", "matplotlib>=3.5", "torchao>=0.18"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": [
        "megatron-zero-pretrain = megatron_zero.training.trainer:pretrain",
        "megatron-zero-ds-to-universal = megatron_zero_tools.ds_to_universal:main",
        "megatron-zero-zero-to-fp32 = megatron_zero_tools.zero_to_fp32:main",
        "megatron-zero-convert-to-hf = megatron_zero_tools.convert_to_hf:main",
        "megatron-zero-convert-from-hf = megatron_zero_tools.convert_from_hf:main",
        "megatron-zero-preprocess-data = megatron_zero_tools.preprocess_data:main",
        "megatron-zero-train-tokenizer = megatron_zero_tools.train_tokenizer:main",
        "megatron-zero-build-corpus = megatron_zero_tools.build_corpus:main",
        "megatron-zero-generate-text = megatron_zero_tools.generate_text:main",
    ]},
)
