"""The end-to-end benchmark's peers: the same model trained with Hugging Face transformers.

``tools/bench_e2e.py --peers hf,hf-liger`` runs this module once per peer and length, in a
process of its own (one GPU, so its memory is measured alone)::

    python -m megatron.bench.hf_peer --peer hf-liger --model llama-0.85b --seq-len 32768 \
        --iters 6 --warmup 3 --recompute none --out peer.json

It builds ``LlamaForCausalLM`` with the preset's shape (:data:`megatron.bench.models.MODELS`:
RMSNorm, SwiGLU, RoPE, GQA, untied embeddings, no biases), SDPA attention restricted to
the cuDNN backend on CUDA (the kernel USP uses), and trains it on random tokens the way a
Hugging Face user does on one GPU: bf16 weights, ``torch.optim.AdamW(fused=True)`` (so bf16
Adam states, and no float32 master copy: about 8.5 GiB less than mixed precision for the
0.85B model; :func:`optimizer_state_bytes` says how much), gradient clipping at 1.0, and
``gradient_checkpointing_enable()`` for full recompute. ``hf-liger`` first applies Liger's
Triton kernels (``apply_liger_kernel_to_llama``: RoPE, RMSNorm, SwiGLU and the fused linear
cross-entropy, so no full-sequence logits).

The FLOP count is this project's one count (:func:`megatron.shapes.dense_training_flops`
for batch 1 of ``--seq-len`` tokens), so MFU and TFLOP/s compare one to one. The JSON written to
``--out`` has the keys of :class:`PeerResult`; a peer whose packages are missing reports
``status = "missing"`` with the ``pip install`` line, an out-of-memory run ``status = "oom"``.
On the CPU (tests) the peer trains in float32 with PyTorch's SDPA, and ``hf-liger`` reports
``missing``: Liger's kernels need a CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence

from megatron.bench.models import MODELS
from megatron.shapes import dense_training_flops

PEERS = ("hf", "hf-liger")
PEER_INSTALL = "pip install -e .[peers]"   # transformers and liger-kernel (setup.py extras)


@dataclass
class PeerResult:
    """One peer run; per-iteration seconds in ``step_times_s`` (warm-up included)."""

    peer: str
    seq_len: int
    recompute: str
    status: str                     # ok | missing | oom | error
    note: Optional[str] = None
    iterations_measured: int = 0
    iter_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    peak_mem_gib: Optional[float] = None
    flops_per_iteration: Optional[float] = None
    peak_tflops: Optional[float] = None
    last_loss: Optional[float] = None
    optimizer_state_gib: Optional[float] = None
    versions: dict = field(default_factory=dict)
    step_times_s: List[float] = field(default_factory=list)


def missing_packages(peer: str, cuda: bool) -> Optional[str]:
    """Why ``peer`` cannot run here (a message with the install line), or None."""
    if importlib.util.find_spec("transformers") is None:
        return f"Hugging Face transformers is not installed: {PEER_INSTALL}"
    if peer == "hf-liger":
        if importlib.util.find_spec("liger_kernel") is None:
            return f"liger-kernel is not installed: {PEER_INSTALL}"
        if not cuda:
            return "Liger's Triton kernels need a CUDA GPU"
    return None


def llama_config(shape, seq_len: int):
    """``transformers.LlamaConfig`` of a :class:`megatron.shapes.ModelShape`.

    RoPE base 10000 and RMSNorm epsilon 1e-5: ``pretrain_gpt.py``'s defaults
    (``--rotary-base``, ``--norm-epsilon``), which the benchmark does not change.
    """
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups, head_dim=shape.head_dim,
        max_position_embeddings=seq_len, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        hidden_act="silu", use_cache=False, attn_implementation="sdpa")


def build_model(peer: str, shape, seq_len: int, device, dtype):
    """The peer's ``LlamaForCausalLM`` on ``device`` in ``dtype`` (Liger applied first)."""
    import torch
    from transformers import LlamaForCausalLM

    if peer == "hf-liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    config = llama_config(shape, seq_len)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (Adam's two moments, step counts)."""
    import torch

    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def _attention_context(cuda: bool):
    """SDPA restricted to the cuDNN backend on CUDA (USP's kernel), any backend on CPU."""
    import contextlib

    if not cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


def train(peer: str, shape, seq_len: int, iters: int, warmup: int, recompute: str,
          seed: int, peak_tflops: Optional[float]) -> PeerResult:
    """Train ``iters`` steps of batch 1 and time each; see the module docstring."""
    import torch

    cuda = torch.cuda.is_available()
    res = PeerResult(peer, seq_len, recompute, "ok")
    res.flops_per_iteration = dense_training_flops(shape, seq_len, 1)
    why = missing_packages(peer, cuda)
    if why:
        res.status, res.note = "missing", why
        return res
    res.versions = _versions(peer)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(seed)
    try:
        model = build_model(peer, shape, seq_len, device, dtype)
        if recompute == "full":
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                      fused=cuda)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for _ in range(iters):
            tokens = torch.randint(0, shape.vocab_size, (1, seq_len), generator=gen)
            tokens = tokens.to(device)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with _attention_context(cuda):
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            res.step_times_s.append(time.perf_counter() - start)
            res.last_loss = float(loss.detach())
        res.optimizer_state_gib = optimizer_state_bytes(optimizer) / 2**30
    except torch.cuda.OutOfMemoryError as exc:
        res.status, res.note = "oom", f"out of memory: {str(exc).splitlines()[0][:160]}"
    if cuda:
        res.peak_mem_gib = torch.cuda.max_memory_allocated(device) / 2**30
        if peak_tflops is None:
            from megatron.planner.hardware import peak_tflops_for_device

            peak_tflops = peak_tflops_for_device(torch.cuda.get_device_name(device))
    if res.status == "ok":
        _summarize(res, warmup, peak_tflops)
    return res


def _summarize(res: PeerResult, warmup: int, peak_tflops: Optional[float]) -> None:
    times = res.step_times_s[warmup:]
    if not times:
        res.status, res.note = "error", "no timed iterations after --warmup"
        return
    seconds = sum(times) / len(times)
    res.iterations_measured = len(times)
    res.iter_ms = 1e3 * seconds
    res.tokens_per_s = res.seq_len / seconds
    res.tflops_per_gpu = res.flops_per_iteration / seconds / 1e12
    res.peak_tflops = peak_tflops
    res.mfu = res.tflops_per_gpu / peak_tflops if peak_tflops else None
    if res.last_loss is not None and not math.isfinite(res.last_loss):
        res.status, res.note = "error", f"loss is {res.last_loss}"


def _versions(peer: str) -> dict:
    from importlib.metadata import version

    names = ["transformers"] + (["liger-kernel"] if peer == "hf-liger" else [])
    return {n: version(n) for n in names}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron.bench.hf_peer",
                                description="Train the benchmark model with Hugging Face "
                                            "transformers (a peer of tools/bench_e2e.py).")
    p.add_argument("--peer", required=True, choices=list(PEERS))
    p.add_argument("--model", default="llama-0.85b", choices=list(MODELS))
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--recompute", default="none", choices=["none", "full"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--out", required=True, help="JSON file for the result")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.iters <= ns.warmup or ns.warmup < 0 or ns.seq_len < 2:
        print(f"hf_peer: --iters {ns.iters} must exceed --warmup {ns.warmup} >= 0 and "
              f"--seq-len {ns.seq_len} must be >= 2", file=sys.stderr)
        return 2
    res = train(ns.peer, MODELS[ns.model].shape, ns.seq_len, ns.iters, ns.warmup, ns.recompute,
                ns.seed, ns.peak_tflops)
    with open(ns.out, "w") as f:
        json.dump(asdict(res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
