"""Does an imported checkpoint train at the speed of a from-scratch model of its shape?

Two commands for ``benchmarks/imported_model.sh``:

* ``python -m megatron.bench.imported build --shape llama3.2-1b --out DIR`` writes a Hugging
  Face model of a named shape with random weights (transformers' ``LlamaConfig``, nothing
  downloaded) and prints its vocabulary size, for ``tools/convert_hf.py import``.
* ``python -m megatron.bench.imported compare --imported A.jsonl --scratch B.jsonl --warmup N
  [--out R.json]`` reads the ``--metrics-file`` of the two runs and prints, leaving out the
  first ``N`` iterations, the median tokens/s, the peak device memory and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Dict, List, Optional

# Llama-3.2-1B's published config.json (hidden 2048, 16 layers, 32 query / 8 KV heads of 64,
# SwiGLU 8192, 128256 tokens, tied embeddings, llama3 RoPE scaling 32 over 8192 positions),
# and a tiny model of the same kind for a CPU check of the recipe.
SHAPES: Dict[str, dict] = {
    "llama3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
        rope_theta=500000.0, max_position_embeddings=65536, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
}


def build(shape: str, out_dir: str, seed: int = 0) -> int:
    """Write a random bf16 model of ``shape`` to ``out_dir``; its vocabulary size."""
    import torch  # optional: torch and transformers only for building
    import transformers  # optional: torch and transformers only for building

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SHAPES[shape], torch_dtype="bfloat16")
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    return config.vocab_size


def _train_records(path: str, warmup: int) -> List[dict]:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [r for r in records if r.get("kind") == "train" and r["iteration"] > warmup]
    if not train:
        raise SystemExit(f"{path}: no training iteration after the first {warmup}")
    return train


def summarise(path: str, warmup: int) -> dict:
    """Median tokens/s and step time, and the largest device memory, after ``warmup``; the
    run's layout and arguments as its metrics file recorded them."""
    train = _train_records(path, warmup)
    with open(path) as f:
        run = next((r for r in map(json.loads, f) if r.get("kind") == "run"), {})
    return dict(layout=run.get("layout"), args=run.get("args"), iterations=len(train),
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in train),
                step_time_s=statistics.median(r["step_time_s"] for r in train),
                mem_gib=max(r["mem_gib"] for r in train))


def compare(imported: str, scratch: str, warmup: int) -> dict:
    """Both runs' summaries and the imported run's ratios to the from-scratch one."""
    a, b = summarise(imported, warmup), summarise(scratch, warmup)
    return dict(imported=a, scratch=b,
                tokens_per_s_ratio=a["tokens_per_s"] / b["tokens_per_s"],
                mem_ratio=a["mem_gib"] / b["mem_gib"])


def markdown(result: dict) -> str:
    rows = ["| run | tokens/s | step s | peak GiB |", "| --- | --- | --- | --- |"]
    for name in ("imported", "scratch"):
        r = result[name]
        rows.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['step_time_s']:.3f} | "
                    f"{r['mem_gib']:.2f} |")
    rows.append(f"\nimported / scratch: tokens/s {result['tokens_per_s_ratio']:.3f}x, "
                f"memory {result['mem_ratio']:.3f}x")
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write a random Hugging Face model of a named shape")
    b.add_argument("--shape", choices=sorted(SHAPES), default="llama3.2-1b")
    b.add_argument("--out", required=True)
    b.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare", help="tokens/s and memory of the two runs' metrics files")
    c.add_argument("--imported", required=True)
    c.add_argument("--scratch", required=True)
    c.add_argument("--warmup", type=int, default=2)
    c.add_argument("--out", default=None, help="JSON file for the result")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build(args.shape, args.out, args.seed))
        return 0
    result = compare(args.imported, args.scratch, args.warmup)
    if args.out:
        import torch  # optional: torch only for the device description

        from megatron.bench.report import run_metadata, write_json  # torch at import

        device = torch.device("cuda") if torch.cuda.is_available() else None
        write_json(args.out, {"tool": "bench imported", **result,
                              "metadata": run_metadata(sys.argv, device, 1)})
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
