"""Training: ``pretrain_gpt.py``'s run, from the command line to the last checkpoint.

At this level: :mod:`.loop` (the pretraining loop, :func:`pretrain`), :mod:`.initialize`
(start-up in the order that keeps bad input away from collectives), :mod:`.launch` (torchrun
with the first failed worker's exit status), :mod:`.process_guard` (nothing a rank starts
outlives it) and :mod:`.cpu_shims` (CPU stand-ins for megatron-core's CUDA-only places).

One subpackage per subsystem: :mod:`.cli` (flags, their checks, the run config), :mod:`.data`
(tokenizers, datasets, the micro-batch), :mod:`.model` (the GPT model and its layer spec),
:mod:`.optim` (gradient norm, clipping, the CPU-offloaded optimizer), :mod:`.checkpoint`
(save, load, checksums) and :mod:`.observe` (metrics, console, profiling).
"""
