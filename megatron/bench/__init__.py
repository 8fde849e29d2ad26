"""Benchmark helpers behind ``tools/bench_attention.py`` and ``tools/bench_e2e.py``.

One module per concern:

* :mod:`~megatron.bench.flops`: FLOP counting (attention; the whole GPT model the way
  Megatron-LM counts it) and MFU.
* :mod:`~megatron.bench.timing`: device-aware timing (CUDA events or ``perf_counter``),
  peak memory, freeing memory between cases.
* :mod:`~megatron.bench.report`: run metadata (device, versions, date, command), JSON and
  markdown output.
* :mod:`~megatron.bench.native_cp`: the peer, PyTorch's native context parallel
  (``torch.distributed.tensor.experimental.context_parallel``), behind one small adapter that
  absorbs the differences between torch versions.
* :mod:`~megatron.bench.attention_bench`: the attention sweep (USP splits, the single-GPU
  kernel, the SDPA anchor, the native-CP peer) and its command line.
* :mod:`~megatron.bench.e2e`: end-to-end training throughput through ``pretrain_gpt.py``
  and the longest-sequence search, and its command line.

Nothing here runs at import time; benchmarks are never asserted in tests (the CPU smoke tests
only check that the tools run and write valid output).
"""
