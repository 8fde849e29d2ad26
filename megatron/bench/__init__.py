"""Benchmarks behind ``tools/bench_attention.py``, ``tools/bench_e2e.py``,
``tools/bench_fused_kernels.py``, ``tools/bench_fp8_linears.py`` and
``tools/bench_checkpoint.py``.

One module per concern:

* :mod:`~megatron.bench.flops`: FLOP counting of attention, and TFLOP/s per GPU (the whole
  model's count is :mod:`megatron.shapes.flops`).
* :mod:`~megatron.bench.models`: the models the benchmarks train (shapes from
  :data:`megatron.shapes.PRESETS`) and their ``pretrain_gpt.py`` flags.
* :mod:`~megatron.bench.timing`: device-aware timing (CUDA events or ``perf_counter``),
  peak memory, freeing memory between cases.
* :mod:`~megatron.bench.report`: run metadata (device, versions, date, command), JSON and
  markdown output.
* :mod:`~megatron.bench.native_cp`: the peer, PyTorch's native context parallel
  (``torch.distributed.tensor.experimental.context_parallel``), behind one small adapter that
  absorbs the differences between torch versions.
* :mod:`~megatron.bench.attention_bench`: the attention sweep (USP splits, the single-GPU
  kernel, the SDPA anchor, the native-CP peer) and its command line.
* :mod:`~megatron.bench.document_bench`: the packed-document attention sweep
  (``tools/bench_attention.py --docs``).
* :mod:`~megatron.bench.document_stream`: the document kernels on a stream of distinct
  samples (``--doc-kernels ... --doc-stream N``).
* :mod:`~megatron.bench.cli`: command-line pieces the tools share (lengths, splits, chunks).
* :mod:`~megatron.bench.e2e`: end-to-end training throughput through ``pretrain_gpt.py``
  and the longest-sequence search, one module per job (see its docstring).
* :mod:`~megatron.bench.hf_peer`: the end-to-end peers, Hugging Face transformers plain and
  with Liger's kernels, one process each.
* :mod:`~megatron.bench.ceiling`: the zero-overhead ceiling of a step (its matmuls and
  attention alone).
* :mod:`~megatron.bench.depth`: full-depth memory and time from two slices of the layers.
* :mod:`~megatron.bench.fused_kernels_bench`: the ``--fused-kernels`` implementations side by
  side.
* :mod:`~megatron.bench.fp8_linears_bench`: each linear layer of a model in float8 (this
  project's GEMMs, torchao's float8 linear compiled and eager) against bf16, with a per-kernel
  profile.
* :mod:`~megatron.bench.checkpoint_cost`: what checkpoint checksums cost at save and load.
* :mod:`~megatron.bench.trace_summary`: a summary of a ``--profile`` Chrome trace.

Nothing here runs at import time; benchmarks are never asserted in tests (the CPU smoke tests
only check that the tools run and write valid output).
"""
