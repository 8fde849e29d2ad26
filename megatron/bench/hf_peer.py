"""The end-to-end benchmark's peers: the same model trained with Hugging Face transformers.

``tools/bench_e2e.py --peers hf,hf-liger`` runs this module once per peer and length, in a
process of its own (one GPU, so its memory is measured alone)::

    python -m megatron.bench.hf_peer --peer hf-liger --model llama-0.85b --seq-len 32768 \
        --iters 6 --warmup 3 --recompute none --out peer.json

It builds ``LlamaForCausalLM`` with the preset's shape (:data:`megatron.bench.models.MODELS`:
RMSNorm, SwiGLU, RoPE, GQA, untied embeddings, no biases; ``--num-layers N``: its first N
layers, the slice ``tools/bench_e2e.py --num-layers`` trains), SDPA attention restricted to
the cuDNN backend on CUDA (the kernel USP uses), and trains it on random tokens the way a
Hugging Face user does on one GPU: bf16 weights, ``torch.optim.AdamW(fused=True)`` (so bf16
Adam states, and no float32 master copy: about 8.5 GiB less than mixed precision for the
0.85B model; :func:`optimizer_state_bytes` says how much), gradient clipping at 1.0, and
``gradient_checkpointing_enable()`` for full recompute. ``hf-liger`` first applies Liger's
Triton kernels (``apply_liger_kernel_to_llama``: RoPE, RMSNorm, SwiGLU and the fused linear
cross-entropy, so no full-sequence logits).

Packed documents (``--documents FILE.npz``, written by ``tools/bench_e2e.py --docs``: the
token sequences its run trains, ``tokens`` and ``position_ids`` ``[n, S]`` restarting after each
end-of-document id ``eod``): step ``i`` trains sequence ``i mod n`` with those ``position_ids``
and no ``attention_mask``, the public way to pack sequences in transformers 5: its mask
builder (``transformers.masking_utils``) finds the documents where the position ids do not
step by one and, for ``sdpa``, passes SDPA a dense ``[S, S]`` boolean mask of them (the K/V
heads then repeated to the query heads: transformers uses SDPA's GQA only without a mask).
The SDPA backend is the first of cuDNN, memory-efficient and math that takes such a mask on
this GPU; ``attention_path`` records what ran. Labels after an end-of-document token are
ignored (``--eod-mask-loss``), and the FLOPs count the documents' pairs.

The FLOP count is this project's one count (:func:`megatron.shapes.dense_training_flops`
for batch 1 of ``--seq-len`` tokens), so MFU and TFLOP/s compare one to one. The JSON written to
``--out`` has the keys of :class:`PeerResult`; a peer whose packages are missing reports
``status = "missing"`` with the ``pip install`` line, an out-of-memory run ``status = "oom"``.
On the CPU (tests) the peer trains in float32 with PyTorch's SDPA, and ``hf-liger`` reports
``missing``: Liger's kernels need a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from typing import List, Optional, Sequence

import numpy as np

from megatron.bench.models import MODELS
from megatron.planner.hardware import peak_tflops_for_device
from megatron.shapes import dense_training_flops, document_pairs, training_flops

PEERS = ("hf", "hf-liger")
PEER_INSTALL = "pip install -e .[peers]"   # transformers and liger-kernel (setup.py extras)
DEFAULT_ROPE_BASE = 10000.0                # pretrain_gpt.py's --rotary-base default


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
    num_layers: Optional[int] = None        # of the model trained (--num-layers: a slice)
    optimizer_state_gib: Optional[float] = None
    attention_path: Optional[str] = None    # how transformers ran attention
    flops_count: str = "dense causal"       # or "useful (documents)" (--documents)
    attention_pairs: Optional[float] = None      # --documents: mean of the measured steps
    documents_per_iteration: Optional[float] = None
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


def llama_config(shape, seq_len: int, rope_base: float = DEFAULT_ROPE_BASE):
    """``transformers.LlamaConfig`` of a :class:`megatron.shapes.ModelShape`.

    RoPE base ``rope_base``: the preset's (:attr:`megatron.bench.models.BenchModel.rotary_base`,
    500000 for ``llama3-8b``), else ``pretrain_gpt.py``'s default 10000; RMSNorm epsilon 1e-5,
    ``pretrain_gpt.py``'s default (``--norm-epsilon``), which the benchmark does not change.
    """
    from transformers import LlamaConfig  # optional: transformers

    return LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups, head_dim=shape.head_dim,
        max_position_embeddings=seq_len, rms_norm_eps=1e-5, rope_theta=rope_base,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        hidden_act="silu", use_cache=False, attn_implementation="sdpa")


def build_model(peer: str, shape, seq_len: int, device, dtype,
                rope_base: float = DEFAULT_ROPE_BASE):
    """The peer's ``LlamaForCausalLM`` on ``device`` in ``dtype`` (Liger applied first)."""
    import torch  # torch-free module
    from transformers import LlamaForCausalLM  # optional: transformers

    if peer == "hf-liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # optional: liger-kernel

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    config = llama_config(shape, seq_len, rope_base)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (Adam's two moments, step counts)."""
    import torch  # torch-free module

    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def _attention_context(cuda: bool, backend=None):
    """SDPA restricted to ``backend`` (default cuDNN, USP's kernel) on CUDA, any on CPU."""
    if not cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel  # torch-free module

    return sdpa_kernel([backend or SDPBackend.CUDNN_ATTENTION])


@dataclass
class PackedDocuments:
    """Token sequences of packed documents (module docstring): ``[n, S]`` each."""

    tokens: "object"
    position_ids: "object"
    eod: int

    @classmethod
    def load(cls, path: str) -> "PackedDocuments":
        with np.load(path) as f:
            return cls(f["tokens"], f["position_ids"], int(f["eod"]))

    def step(self, i: int, device):
        """Step ``i``'s ``input_ids``, ``position_ids`` and ``labels`` ``[1, S]`` (-100 after
        an end-of-document token: megatron's ``--eod-mask-loss``)."""
        import torch  # torch-free module

        row = i % self.tokens.shape[0]
        tokens = torch.as_tensor(self.tokens[row:row + 1], dtype=torch.long)
        labels = tokens.clone()
        labels[:, 1:][tokens[:, :-1] == self.eod] = -100
        pos = torch.as_tensor(self.position_ids[row:row + 1], dtype=torch.long)
        return tokens.to(device), pos.to(device), labels.to(device)

    def lengths(self, i: int):
        """Documents of step ``i`` as transformers finds them: a new one wherever the position
        id does not step by one."""
        pos = np.asarray(self.position_ids[i % self.position_ids.shape[0]], dtype=np.int64)
        # transformers.masking_utils.find_packed_sequence_indices's rule, in numpy
        return np.bincount(np.cumsum(np.diff(pos, prepend=pos[0] - 1) != 1))


def packed_attention_path(docs: PackedDocuments, shape, cuda: bool, dtype):
    """(label, SDPA backend or None) for the packed sequences: whether transformers sees
    documents in the position ids, and the first SDPA backend taking a dense boolean mask
    at this model's heads (probed on a short sequence)."""
    import torch  # torch-free module
    from transformers.masking_utils import find_packed_sequence_indices  # optional: transformers

    packed = find_packed_sequence_indices(torch.as_tensor(docs.position_ids[:1])) is not None
    mask = "[S, S] document mask from position_ids" if packed else "causal (one document)"
    if not cuda:
        return f"sdpa (CPU), {mask}", None
    if not packed:
        return f"sdpa cuDNN, {mask}", None
    from torch.nn.attention import SDPBackend  # torch-free module

    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        if _takes_mask(backend, shape, dtype):
            return f"sdpa {backend.name.lower()}, {mask}", backend
    return f"sdpa (no backend took the mask), {mask}", None


def _takes_mask(backend, shape, dtype, probe_len: int = 256) -> bool:
    import torch  # torch-free module
    import torch.nn.functional as F  # torch-free module

    q = torch.randn(1, shape.num_attention_heads, probe_len, shape.head_dim, device="cuda",
                    dtype=dtype)
    mask = torch.ones(probe_len, probe_len, device="cuda", dtype=torch.bool).tril()[None, None]
    try:
        with _attention_context(True, backend):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return True
    except RuntimeError:
        return False


def train(peer: str, shape, seq_len: int, iters: int, warmup: int, recompute: str,
          seed: int, peak_tflops: Optional[float],
          documents: Optional[PackedDocuments] = None,
          rope_base: float = DEFAULT_ROPE_BASE) -> PeerResult:
    """Train ``iters`` steps of batch 1 and time each; see the module docstring."""
    import torch  # torch-free module

    cuda = torch.cuda.is_available()
    res = PeerResult(peer, seq_len, recompute, "ok", num_layers=shape.num_layers)
    res.flops_per_iteration = dense_training_flops(shape, seq_len, 1)
    why = missing_packages(peer, cuda)
    if why:
        res.status, res.note = "missing", why
        return res
    res.versions = _versions(peer)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = None
    if documents is None:
        res.attention_path = f"sdpa {'cuDNN' if cuda else '(CPU)'}, causal"
    else:
        res.attention_path, backend = packed_attention_path(documents, shape, cuda, dtype)
    torch.manual_seed(seed)
    try:
        model = build_model(peer, shape, seq_len, device, dtype, rope_base)
        if recompute == "full":
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                      fused=cuda)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for i in range(iters):
            if documents is None:
                tokens = torch.randint(0, shape.vocab_size, (1, seq_len), generator=gen)
                tokens, positions, labels = tokens.to(device), None, tokens.to(device)
            else:
                tokens, positions, labels = documents.step(i, device)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with _attention_context(cuda, backend):
                loss = model(input_ids=tokens, position_ids=positions, labels=labels).loss
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
            peak_tflops = peak_tflops_for_device(torch.cuda.get_device_name(device))
    if res.status == "ok" and documents is not None:
        _count_documents(res, shape, documents, warmup)
    if res.status == "ok":
        _summarize(res, warmup, peak_tflops)
    return res


def _count_documents(res: PeerResult, shape, documents: PackedDocuments, warmup: int) -> None:
    """FLOPs per iteration from the documents of the measured steps (their mean)."""
    steps = range(warmup, len(res.step_times_s))
    if not steps:
        return
    lengths = [documents.lengths(i) for i in steps]
    pairs = [document_pairs(x) for x in lengths]
    res.flops_count = "useful (documents)"
    res.attention_pairs = sum(pairs) / len(pairs)
    res.documents_per_iteration = sum(x.size for x in lengths) / len(lengths)
    res.flops_per_iteration = sum(training_flops(shape, res.seq_len, p)
                                  for p in pairs) / len(pairs)


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
    names = ["transformers"] + (["liger-kernel"] if peer == "hf-liger" else [])
    return {n: version(n) for n in names}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron.bench.hf_peer",
                                description="Train the benchmark model with Hugging Face "
                                            "transformers (a peer of tools/bench_e2e.py).")
    p.add_argument("--peer", required=True, choices=list(PEERS))
    p.add_argument("--model", default="llama-0.85b", choices=list(MODELS))
    p.add_argument("--num-layers", type=int, default=None,
                   help="train the first N of the preset's layers (tools/bench_e2e.py "
                        "--num-layers)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--recompute", default="none", choices=["none", "full"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--out", required=True, help="JSON file for the result")
    p.add_argument("--documents", default=None,
                   help="packed documents (.npz: tokens, position_ids [n, S], eod) to train "
                        "on instead of random dense sequences")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.iters <= ns.warmup or ns.warmup < 0 or ns.seq_len < 2:
        print(f"hf_peer: --iters {ns.iters} must exceed --warmup {ns.warmup} >= 0 and "
              f"--seq-len {ns.seq_len} must be >= 2", file=sys.stderr)
        return 2
    model = MODELS[ns.model]
    if ns.num_layers is not None and not 1 <= ns.num_layers <= model.shape.num_layers:
        print(f"hf_peer: --num-layers {ns.num_layers}: a slice of {ns.model} has 1 to "
              f"{model.shape.num_layers} layers", file=sys.stderr)
        return 2
    documents = PackedDocuments.load(ns.documents) if ns.documents else None
    if documents is not None and documents.tokens.shape[1] != ns.seq_len:
        print(f"hf_peer: --documents {ns.documents} holds sequences of "
              f"{documents.tokens.shape[1]} tokens, not --seq-len {ns.seq_len}", file=sys.stderr)
        return 2
    res = train(ns.peer, model.sliced(ns.num_layers).shape, ns.seq_len, ns.iters, ns.warmup,
                ns.recompute, ns.seed, ns.peak_tflops, documents,
                rope_base=float(model.rotary_base or DEFAULT_ROPE_BASE))
    with open(ns.out, "w") as f:
        json.dump(asdict(res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
