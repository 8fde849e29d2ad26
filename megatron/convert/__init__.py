"""Pretrained models in and out: Hugging Face checkpoints <-> this project's checkpoints.

:mod:`~megatron.convert.hf_config` maps a ``config.json`` onto the model flags of
``pretrain_gpt.py`` (and back), refusing what the model here cannot run;
:mod:`~megatron.convert.hf_weights` maps the tensors (fused QKV and FC1, vocabulary padding,
tensor-parallel shards); :mod:`~megatron.convert.checkpoint_io` reads and writes both formats
on disk. The command line is ``tools/convert_hf.py``. This package sits above
``megatron.training`` (it builds the model to write its checkpoint); nothing in training
imports it.
"""
