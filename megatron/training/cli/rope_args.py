"""RoPE-scaling flags (context extension), Megatron-LM's names, and their start-up check.

``--use-rope-scaling`` / ``--rope-scaling-factor`` (llama3), ``--rotary-seq-len-interpolation-
factor`` (linear position interpolation) and ``--position-embedding-type yarn`` with the
``--yarn-*`` flags; what each does: :mod:`megatron.shapes.rope`. At most one kind per run.
No torch here (``--help`` imports none).
"""

from __future__ import annotations

from megatron.shapes.rope import LLAMA3_DEFAULT_FACTOR, YARN_DEFAULTS, RopeScaling
from megatron.training.cli.errors import ArgumentsError

_YARN_FLAGS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
               "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim")


def add_rope_args(group) -> None:
    """The RoPE-scaling flags (the model group)."""
    group.add_argument("--use-rope-scaling", action="store_true",
                       help="Llama 3.1's RoPE scaling (llama3: low / high frequency factors 1 "
                            "and 4 over an original context of 8192)")
    group.add_argument("--rope-scaling-factor", type=float, default=None,
                       help=f"with --use-rope-scaling: its factor (default "
                            f"{LLAMA3_DEFAULT_FACTOR:g})")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                       help="linear position interpolation: RoPE positions divided by this "
                            "factor (>= 1)")
    group.add_argument("--yarn-rotary-scaling-factor", type=float, default=None,
                       help="with --position-embedding-type yarn: the YaRN factor (>= 1)")
    group.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                       help="with --position-embedding-type yarn: the context the model was "
                            "trained for before the extension")
    for name, what in (("beta-fast", "beta_fast"), ("beta-slow", "beta_slow"),
                       ("mscale", "mscale"), ("mscale-all-dim", "mscale_all_dim")):
        group.add_argument(f"--yarn-{name}", type=float, default=None,
                           help=f"with --position-embedding-type yarn: YaRN's {what} "
                                f"(default {YARN_DEFAULTS[what]:g})")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_yarn(args) -> None:
    for name in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings"):
        if getattr(args, name) is None:
            example = "4" if name == "yarn_rotary_scaling_factor" else "4096"
            raise ArgumentsError(f"--position-embedding-type yarn needs {_flag(name)}, e.g. "
                                 f"{_flag(name)} {example}")
    if not args.yarn_rotary_scaling_factor >= 1:
        raise ArgumentsError(f"--yarn-rotary-scaling-factor {args.yarn_rotary_scaling_factor} "
                             f"must be >= 1, e.g. --yarn-rotary-scaling-factor 4")
    if args.yarn_original_max_position_embeddings < 1:
        raise ArgumentsError(f"--yarn-original-max-position-embeddings "
                             f"{args.yarn_original_max_position_embeddings} must be >= 1, e.g. "
                             f"--yarn-original-max-position-embeddings 4096")
    for name in ("yarn_beta_fast", "yarn_beta_slow"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ArgumentsError(f"{_flag(name)} {value} must be > 0, e.g. {_flag(name)} "
                                 f"{YARN_DEFAULTS[name[5:]]:g}")
    for name in ("yarn_mscale", "yarn_mscale_all_dim"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            raise ArgumentsError(f"{_flag(name)} {value} must be >= 0, e.g. {_flag(name)} "
                                 f"{YARN_DEFAULTS[name[5:]]:g}")
    if args.rotary_percent != 1.0:
        # megatron-core's YarnRotaryEmbedding rotates the whole head dimension.
        raise ArgumentsError(f"--rotary-percent {args.rotary_percent} with "
                             f"--position-embedding-type yarn: YaRN rotates the whole head; "
                             f"pass --rotary-percent 1.0")


def _check_rope_kind(args, kind: str) -> None:
    """``--use-rope-scaling`` / ``--rotary-seq-len-interpolation-factor`` belong to plain
    RoPE and exclude one another."""
    flag = ("--use-rope-scaling" if kind == "llama3"
            else "--rotary-seq-len-interpolation-factor")
    if args.position_embedding_type != "rope":
        raise ArgumentsError(f"{flag} scales RoPE; it needs --position-embedding-type rope "
                             f"(not {args.position_embedding_type})")
    if args.use_rope_scaling and args.rotary_seq_len_interpolation_factor is not None:
        raise ArgumentsError("--use-rope-scaling and --rotary-seq-len-interpolation-factor "
                             "exclude one another; keep one")
    name = "rope_scaling_factor" if kind == "llama3" else "rotary_seq_len_interpolation_factor"
    value = getattr(args, name)
    if value is not None and not value >= 1:
        raise ArgumentsError(f"{_flag(name)} {value} must be >= 1, e.g. {_flag(name)} "
                             f"{'8' if kind == 'llama3' else '4'}")


def rope_scaling_from_args(args) -> RopeScaling:
    """The run's :class:`~megatron.shapes.rope.RopeScaling`; raises ``ArgumentsError`` in
    one line naming the flag for a flag without its kind, two kinds at once, or a value out
    of range."""
    yarn = args.position_embedding_type == "yarn"
    if not yarn:
        stray = [n for n in _YARN_FLAGS if getattr(args, n) is not None]
        if stray:
            raise ArgumentsError(f"{_flag(stray[0])} has no effect without "
                                 f"--position-embedding-type yarn; add it or drop the flag")
    if args.rope_scaling_factor is not None and not args.use_rope_scaling:
        raise ArgumentsError(f"--rope-scaling-factor {args.rope_scaling_factor} has no effect "
                             f"without --use-rope-scaling; add --use-rope-scaling or drop it")
    if yarn:
        for flag, on in (("--use-rope-scaling", args.use_rope_scaling),
                         ("--rotary-seq-len-interpolation-factor",
                          args.rotary_seq_len_interpolation_factor is not None)):
            if on:
                raise ArgumentsError(f"{flag} with --position-embedding-type yarn: YaRN is "
                                     f"the scaling already; drop {flag}")
        _check_yarn(args)
    elif args.use_rope_scaling:
        _check_rope_kind(args, "llama3")
    elif args.rotary_seq_len_interpolation_factor is not None:
        _check_rope_kind(args, "linear")
    return RopeScaling.from_flag_values(vars(args))


__all__ = ["add_rope_args", "rope_scaling_from_args"]
