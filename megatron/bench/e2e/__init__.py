"""End-to-end training throughput through ``pretrain_gpt.py``, and the longest trainable sequence.

For each sequence length and U x R split, :func:`run_training` launches
``python -m torch.distributed.run --nproc-per-node N pretrain_gpt.py ...`` on synthetic tokens
(``--mock-data``) for ``--iters`` iterations, reads the per-iteration metrics file the
training loop writes (``--metrics-file``, JSONL, :mod:`megatron.training.observe.metrics`), drops the
first ``--warmup`` iterations and reports, over the rest:

* ``iter_ms``: mean iteration time (the loop's ``step_time_s``), and ``iter_ms_each`` the
  measured iterations one by one (their spread says how far one run's mean can be trusted);
  with ``--docs``, ``steady_iterations`` and ``iter_ms_steady``: those of the measured
  iterations that ran no attention shape batched for the first time (the loop's
  ``new_plan_shapes``: on CUDA a new shape builds a cuDNN plan) and their mean;
* ``tokens_per_s = global_batch * S / iter_time``;
* ``tflops_per_gpu = model FLOPs per iteration / iter_time / GPUs`` and
  ``mfu = tflops_per_gpu / peak``, the peak being ``--peak-tflops`` or else the one the
  training loop took from its device table (989 TFLOP/s dense bf16 on H100/H200 SXM); n/a on
  the CPU;
* ``peak_mem_gib``: peak ``torch.cuda.max_memory_allocated`` of the logging rank;
* ``peak_host_gib``: peak resident memory (RSS) of the logging rank's process, which holds the
  pinned buffers of ``--recompute-cpu-offload`` and the CPU state of
  ``--optimizer-cpu-offload``.

Model FLOPs are the one count, :func:`megatron.shapes.dense_training_flops` (the training
loop's too; the formula is in :mod:`megatron.shapes.flops`): Megatron-LM's
``num_floating_point_operations`` with causal attention at half; recomputation is not
counted. For the Llama-style 0.85B model this is ``6*N*S + 6*S^2*L*q`` per sequence with
``N = 786,956,288`` parameters taking part in matmuls and ``q`` = heads x head dim.

Activation recompute (``--recompute``): ``none``, ``full`` (megatron's
``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``),
``selective`` (``--recompute-granularity selective --recompute-modules mlp``: the MLP is
recomputed, the attention output kept, so no second attention forward), ``lean``
(``--recompute-granularity selective --recompute-modules layernorm swiglu``: only the norm
outputs and the SwiGLU product are recomputed, no matmul), or ``auto``: no
recompute first, and full recompute if that runs out of memory (both outcomes are
recorded).

``--find-max-seq`` doubles the sequence length from ``--start-seq`` (full recompute, or
``--recompute selective``; ``--iters`` iterations each) until a run fails, and reports the
longest that trained with its MFU and GPU / host peaks; an out-of-memory failure ends the
search, any other failure is reported as an error. ``--num-layers N`` runs a slice of the
preset's layers (for :mod:`megatron.bench.depth`, which extrapolates memory and time to full
depth from two slices); the peers and the ceiling then time the same slice.

Models (:data:`megatron.bench.models.MODELS`, shapes from :data:`megatron.shapes.PRESETS`):
``llama-0.85b``, ``llama3-8b`` (RoPE base 500000, output layer and loss in chunks of 2048
tokens, whose logits take 2048 * 128256 * 10 bytes = 2.4 GiB) and ``tiny`` (CPU smoke runs).

Peers (``--peers hf,hf-liger``): after this project's runs of a length, the same model is
trained with Hugging Face transformers, plain and with Liger's kernels
(:mod:`megatron.bench.hf_peer`, one GPU, a process each, the same tokens per step and the same
FLOP count), at the recompute setting this project's run of that length ended with (``auto``:
none, then full if that runs out of memory; ``selective`` has no Hugging Face equivalent and
is compared with the peer's ``none``). The report gives each peer's tokens/s, MFU and peak
memory and the ratio of this project's per-GPU tokens/s to the peer's. A peer whose package
is missing is reported as ``missing`` with the install line (``pip install -e .[peers]``).

Rounds (``--rounds N``): each length's runs and its peers' are repeated N times, alternating
(ours, peers, ours, peers, ...), so that a drift of the machine over minutes (clocks, heat)
lands on both sides; each row records its round, ratios are taken within a round, and the
report adds, per length, the ratio of the mean tokens/s over the rounds with the range of the
per-round ratios (run-to-run noise of one run's mean is ~1-3 % on the H200 at 32K).

Ceiling (``--ceiling``, default on CUDA): :mod:`megatron.bench.ceiling` times the step's
matmuls and attention alone for each length, in a process of its own before the training
runs; one-GPU rows then show the ceiling MFU and the share of it reached. Those runs train
one iteration more than ``--iters``, profiled and not timed, and the share counts the GEMMs at
the lower of the ceiling's time and that iteration's (:func:`.ceilings.apply_ceiling`).

Packed documents (``--docs MIX``, :mod:`.documents`): the runs train with
``--reset-attention-mask --reset-position-ids --eod-mask-loss`` on megatron-core's mock
documents (``mock``) or on a dataset of the mix written under ``--log-dir`` (``fixed:N``,
``uniform:N``, ``lognormal``, ``corpus``: :func:`megatron.bench.document_bench.mix_lengths`).
FLOPs then count the attention pairs of the documents each measured iteration trained
(``flops_count = "useful (documents)"``, the sum of ``n^2/2``; the samples are rebuilt from the
run's own arguments, so the count is exact), the ceiling times those documents at the fastest
single-GPU document kernel, and the peers train the same sequences with position ids restarting
per document (``attention_path`` says how transformers ran attention).

Each run's full log and metrics file stay under ``--log-dir``.

Modules, one job each: :mod:`.config` (the flags parsed, a run, a report row),
:mod:`.command` (one run's ``pretrain_gpt.py`` command), :mod:`.launch` (running it and
classifying how it ended), :mod:`.summary` (a run's report row), :mod:`.peers` (the Hugging
Face peers), :mod:`.pairing` (ratios against the peers, per round and over rounds),
:mod:`.ceilings` (the zero-overhead ceiling per length), :mod:`.documents` (``--docs``: the
data and the trained documents), :mod:`.sweep` (the order of the
runs), :mod:`.output` (console lines and markdown) and :mod:`.cli` (``tools/bench_e2e.py``).
"""
