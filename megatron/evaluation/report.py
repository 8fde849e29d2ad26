"""The result of :func:`megatron.evaluation.run.evaluate` as markdown tables.

Perplexity: one row per position bucket. Passkey: one row per length, one column per depth,
each cell the accuracy over the trials. Positions and lengths past the model's trained
context (``max_position_embeddings``) are marked with ``*``.
"""

from __future__ import annotations

from typing import Dict, List


def _past(n: int, trained: int) -> str:
    return "*" if trained and n > trained else ""


def perplexity_table(ppl: Dict, trained: int) -> List[str]:
    rows = [f"Perplexity by position ({ppl['windows']} windows of {ppl['length']} tokens)", "",
            "| positions | tokens | loss | perplexity |", "| --- | --- | --- | --- |"]
    for b in ppl["buckets"]:
        rows.append(f"| {b['start']}-{b['end'] - 1}{_past(b['end'], trained)} | {b['tokens']} "
                    f"| {b['nll']:.4f} | {b['ppl']:.2f} |")
    return rows


def passkey_table(result: Dict, trained: int) -> List[str]:
    cells = result["cells"]
    depths = sorted({c["depth"] for c in cells})
    lengths = sorted({c["length"] for c in cells})
    by = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    rows = [f"Passkey retrieval accuracy ({result['trials']} keys per cell; rows: prompt "
            f"tokens, columns: depth of the key)", "",
            "| length | " + " | ".join(f"{d:g}" for d in depths) + " | mean |",
            "| --- |" + " --- |" * (len(depths) + 1)]
    for n in lengths:
        accs = [by[(n, d)] for d in depths]
        rows.append(f"| {n}{_past(n, trained)} | " + " | ".join(f"{a:.2f}" for a in accs)
                    + f" | {sum(accs) / len(accs):.2f} |")
    return rows


def markdown(result: Dict) -> str:
    """Both tables (those present), headed by the model and its trained context."""
    model = result["model"]
    trained = model.get("max_position_embeddings") or 0
    where = f", {model['layout']}" if "layout" in model else ""
    lines = [f"### {result['label']} ({model['backend']}{where})", "",
             f"Trained context: {trained} tokens (`*`: past it)." if trained else "", ""]
    if "perplexity" in result:
        lines += perplexity_table(result["perplexity"], trained) + [""]
    if "passkey" in result:
        lines += passkey_table(result["passkey"], trained) + [""]
    return "\n".join(lines)
