"""What the planner knows about a cluster: kernel rates, memory and links, with provenance.

Units used everywhere in the planner: bandwidths in GB/s (1e9 bytes/s) **per GPU**,
kernel rates in TFLOP/s (1e12 FLOP/s) per GPU, memory in GiB (2**30 bytes), latencies in
microseconds.

Link figures are bus bandwidths, i.e. the bytes a rank actually puts on the wire per
second, so that ``time = latency + bytes_crossing / bandwidth``:

* ``all_to_all_gbps``: for an all-to-all of ``S`` bytes per rank over ``n`` ranks,
  ``S*(n-1)/n / time`` (NCCL-tests' "busbw"; its "algbw" is ``S/time``, larger by
  ``n/(n-1)``).
* ``p2p_gbps``: bytes a rank sends per second to its ring neighbour while every rank
  sends and receives at once (one direction).
* ``collective_gbps``: ring all-gather / reduce-scatter busbw, ``S*(n-1)/n / time`` for
  ``S`` bytes of output per rank; an all-reduce moves twice that.

A node may have nested link levels (``intra_node``, innermost first): e.g. PCIe machines
where pairs of GPUs share a switch and everything else crosses the host bridge. A group
whose ranks all lie in one domain of a level uses that level's links (see
:func:`peers_per_level`).

Every figure carries its provenance in :attr:`HardwareSpec.sources`, one of
``"datasheet ..."`` (public datasheet times a stated efficiency), ``"measured ..."``
(the measured 2xH200 anchors) or ``"calibration <file>"`` (written by
``tools/bench_links.py`` / ``tools/bench_attention.py``, read with
:func:`load_calibration`). The calibration schema is documented in ``docs/planner.md``.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from megatron.planner.errors import PlannerError

CALIBRATION_SCHEMA = "megatron-usp-calibration/1"

# Devices by name: dense (no sparsity) bf16 tensor-core peak in TFLOP/s from the vendors'
# datasheets, and the planner preset that describes the device (None: no preset). Matched in
# order against the lower-cased ``torch.cuda.get_device_name()``: variants first. The one
# device table: the MFU denominator (megatron/training/observe/metrics.py), the presets' peaks below
# and ``--ulysses-degree auto``'s preset all read it.
DEVICE_TABLE: Tuple[Tuple[str, float, Optional[str]], ...] = (
    ("h100 pcie", 756.0, "h100"),
    ("h100 nvl", 835.0, "h100"),
    ("h200 nvl", 835.0, "h200"),
    ("h800 pcie", 756.0, "h100"),
    ("gh200", 989.0, "h200"),
    ("h200", 989.0, "h200"),
    ("h100", 989.0, "h100"),
    ("h800", 989.0, "h100"),
    ("h20", 148.0, None),
    ("gb200", 2500.0, None),
    ("b200", 2250.0, None),
    ("b100", 1750.0, None),
    ("a100", 312.0, "a100"),
    ("a800", 312.0, "a800"),
    ("l40s", 362.0, None),
    ("l40", 181.0, None),
    ("l20", 119.5, "l20"),
    ("rtx 4090", 165.2, None),
    ("a10", 125.0, None),
    ("mi325x", 1307.4, None),
    ("mi300x", 1307.4, None),
)


def _device_row(device_name: Optional[str]) -> Optional[Tuple[str, float, Optional[str]]]:
    if not device_name:
        return None
    low = device_name.lower()
    return next((row for row in DEVICE_TABLE if row[0] in low), None)


def peak_tflops_for_device(device_name: Optional[str]) -> Optional[float]:
    """Dense bf16 peak of a device named like ``torch.cuda.get_device_name()``; None if
    unknown (pass ``--peak-tflops``) or for the CPU."""
    row = _device_row(device_name)
    return row[1] if row else None


def preset_for_device(device_name: Optional[str]) -> Optional[str]:
    """The planner preset for a CUDA device name, or None."""
    row = _device_row(device_name)
    return row[2] if row else None

# ----------------------------------------------------------------------------- links


@dataclass(frozen=True)
class LinkLevel:
    """One level of interconnect, as seen by one GPU.

    Attributes:
        name: e.g. "NVLink", "PCIe switch", "InfiniBand".
        all_to_all_gbps / p2p_gbps / collective_gbps: bus bandwidths (see module doc).
        latency_us: fixed cost per collective or per ring step.
        span: GPUs per domain of this level inside a node (0 = the whole node).
            Ignored for the inter-node level.
    """

    name: str
    all_to_all_gbps: float
    p2p_gbps: float
    collective_gbps: float
    latency_us: float
    span: int = 0

    def __post_init__(self) -> None:
        for key in ("all_to_all_gbps", "p2p_gbps", "collective_gbps"):
            if not getattr(self, key) > 0:
                raise PlannerError(f"link {self.name!r}: {key} must be > 0")
        if self.latency_us < 0 or self.span < 0:
            raise PlannerError(f"link {self.name!r}: latency_us and span must be >= 0")

    def describe(self) -> str:
        return (
            f"{self.name}: all-to-all {self.all_to_all_gbps:.0f}, p2p {self.p2p_gbps:.0f}, "
            f"all-gather {self.collective_gbps:.0f} GB/s per GPU, {self.latency_us:.0f} us"
        )


# ----------------------------------------------------------------------------- GPU


@dataclass(frozen=True)
class HardwareSpec:
    """A GPU type and its interconnect.

    Attributes:
        name: preset or user label.
        gpu_memory_gib: memory per GPU as ``nvidia-smi`` reports it, in GiB.
        peak_tflops: datasheet dense bf16 rate (the MFU denominator only).
        matmul_tflops: achieved bf16 GEMM rate used for every projection and MLP.
        attention_tflops: ``((kernel_tokens, TFLOP/s), ...)`` for causal attention
            forward+backward, FLOPs counted as ``3.5 * 4*b*a*S^2*d/2`` (forward
            ``2*b*S^2*h``, backward 2.5x forward); interpolated in ``log(S)``.
        hbm_gbps: device-memory copy rate (read + write bytes per second), used for
            the memory-bound elementwise work and the optimizer step.
        intra_node: link levels inside a node, innermost first; the last spans the node.
        inter_node: the per-GPU share of the network between nodes.
        sources: provenance label per field name.
    """

    name: str
    gpu_memory_gib: float
    peak_tflops: float
    matmul_tflops: float
    attention_tflops: Tuple[Tuple[int, float], ...]
    hbm_gbps: float
    intra_node: Tuple[LinkLevel, ...]
    inter_node: LinkLevel
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("gpu_memory_gib", "peak_tflops", "matmul_tflops", "hbm_gbps"):
            if not getattr(self, key) > 0:
                raise PlannerError(f"hardware {self.name!r}: {key} must be > 0")
        if not self.attention_tflops:
            raise PlannerError(f"hardware {self.name!r}: attention_tflops is empty")
        if not self.intra_node:
            raise PlannerError(f"hardware {self.name!r}: needs at least one intra-node level")

    # ------------------------------------------------------------------ kernels
    def attention_rate_tflops(self, kernel_tokens: float) -> float:
        """Causal fwd+bwd attention rate for a kernel over ``kernel_tokens`` tokens.

        Linear interpolation in ``log(tokens)`` between table points, clamped at the
        ends (short kernels run below the table's first rate, so clamping there is
        optimistic; the tables start at 1K tokens).
        """
        table = sorted(self.attention_tflops)
        seqs = [s for s, _ in table]
        if kernel_tokens <= seqs[0]:
            return table[0][1]
        if kernel_tokens >= seqs[-1]:
            return table[-1][1]
        i = bisect.bisect_right(seqs, kernel_tokens)
        (s0, r0), (s1, r1) = table[i - 1], table[i]
        w = (math.log(kernel_tokens) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return r0 + w * (r1 - r0)

    # ------------------------------------------------------------------ links
    def level_domains(self, gpus_per_node: int) -> List[Tuple[LinkLevel, float]]:
        """``[(level, domain_size_in_ranks), ...]`` innermost first, inter-node last
        (domain size ``inf``)."""
        out: List[Tuple[LinkLevel, float]] = []
        for lvl in self.intra_node:
            span = lvl.span if lvl.span else gpus_per_node
            out.append((lvl, float(min(span, gpus_per_node))))
        out[-1] = (out[-1][0], float(gpus_per_node))
        out.append((self.inter_node, math.inf))
        return out

    def describe(self) -> List[str]:
        """Figures with numbered provenance footnotes ([1] datasheet ..., [2] measured ...)."""
        notes: List[str] = []

        def ref(key: str) -> str:
            label = self.sources.get(key, "unspecified")
            if label not in notes:
                notes.append(label)
            return f"[{notes.index(label) + 1}]"

        lines = [
            f"hardware {self.name}",
            f"  memory {self.gpu_memory_gib:.1f} GiB/GPU {ref('gpu_memory_gib')}; "
            f"matmul {self.matmul_tflops:.0f} TFLOP/s {ref('matmul_tflops')}; "
            f"peak {self.peak_tflops:.0f} {ref('peak_tflops')}; "
            f"HBM copy {self.hbm_gbps:.0f} GB/s {ref('hbm_gbps')}",
            "  attention (causal fwd+bwd) "
            + ", ".join(f"{s // 1024}K:{r:.0f}" for s, r in sorted(self.attention_tflops))
            + f" TFLOP/s {ref('attention_tflops')}",
        ]
        for lvl in self.intra_node:
            lines.append(f"  intra-node {lvl.describe()} {ref('intra_node')}")
        lines.append(f"  inter-node {self.inter_node.describe()} {ref('inter_node')}")
        lines += [f"  [{i + 1}] {label}" for i, label in enumerate(notes)]
        return lines


def peers_per_level(
    hw: HardwareSpec, gpus_per_node: int, stride: int, size: int
) -> List[Tuple[LinkLevel, int]]:
    """How many of a rank's ``size - 1`` group peers each link level reaches.

    A group of ``size`` ranks ``base + j*stride`` (grid order puts every group of an
    axis at a fixed stride) lies in aligned blocks of ``stride*size`` ranks. The member
    ``j = 0`` shares a level-``i`` domain of ``D_i`` ranks with the ``min(size,
    ceil(D_i / stride))`` members that fall in its first ``D_i`` ranks; peers reached
    first at level ``i`` are those not already inside level ``i-1``. Levels reaching no
    peer are left out. Assumes domains are aligned to the blocks (true when the sizes
    are powers of two or divide one another).
    """
    if size <= 1:
        return []
    out: List[Tuple[LinkLevel, int]] = []
    inside = 1
    for lvl, domain in hw.level_domains(gpus_per_node):
        reach = size if math.isinf(domain) else min(size, max(1, math.ceil(domain / stride)))
        if reach > inside:
            out.append((lvl, reach - inside))
            inside = reach
        if inside == size:
            break
    return out


def bottleneck_level(hw: HardwareSpec, gpus_per_node: int, stride: int, size: int) -> Optional[LinkLevel]:
    """The slowest level a group uses: ring and tree collectives run in lock-step, so
    the outermost level any member pair crosses sets the pace. None for a group of 1."""
    per = peers_per_level(hw, gpus_per_node, stride, size)
    return per[-1][0] if per else None


# ----------------------------------------------------------------------------- presets

# Default fractions of datasheet peaks that real kernels and NCCL reach, used only for
# the "datasheet" presets. Where a measured anchor exists the fraction matches it:
# on 2xH200, GEMM 780/989 = 0.79 (taken as 0.75 for other chips), cuDNN causal
# attention fwd+bwd ~557/989 = 0.56 at 32K, NCCL all-to-all busbw 254/450 = 0.57 and
# send/recv 302/450 = 0.67 over NVLink (between only 2 GPUs; 8-GPU NVSwitch all-to-all
# reaches more, so 0.65), device copy 4.1/4.8 = 0.85.
MATMUL_EFFICIENCY = 0.75
ATTENTION_EFFICIENCY_AT_32K = 0.56
HBM_EFFICIENCY = 0.85
LINK_EFFICIENCY = {  # (all-to-all, p2p, all-gather) fraction of per-direction line rate
    "nvlink": (0.65, 0.70, 0.80),
    "pcie": (0.70, 0.80, 0.80),
    "network": (0.80, 0.85, 0.85),
}
LINK_LATENCY_US = {"nvlink": 10.0, "pcie": 15.0, "network": 25.0}

# Shape of attention efficiency against kernel length: eff(S) = e * S / (S + S_HALF).
# S_HALF = 640 tokens reproduces the measured H200 cuDNN rise from 8K to 32K (519 -> 557
# TFLOP/s, -7%: the curve gives -5.5%); beyond 32K the curve is flat within 2%, as
# measured (555 at 64K, 544 at 128K).
ATTENTION_S_HALF = 640.0
_ATTENTION_TABLE_POINTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288)


def datasheet_attention_table(peak_tflops: float) -> Tuple[Tuple[int, float], ...]:
    """Attention rate table from a datasheet peak and the assumed efficiency curve."""
    e = ATTENTION_EFFICIENCY_AT_32K * (32768 + ATTENTION_S_HALF) / 32768
    return tuple((s, peak_tflops * e * s / (s + ATTENTION_S_HALF)) for s in _ATTENTION_TABLE_POINTS)


def datasheet_link(
    name: str, kind: str, line_rate_gbps: float, span: int = 0
) -> LinkLevel:
    """A link level from a per-direction line rate (GB/s per GPU) and the default
    efficiencies of its kind ("nvlink", "pcie", "network")."""
    ea, ep, ec = LINK_EFFICIENCY[kind]
    return LinkLevel(
        name=name,
        all_to_all_gbps=line_rate_gbps * ea,
        p2p_gbps=line_rate_gbps * ep,
        collective_gbps=line_rate_gbps * ec,
        latency_us=LINK_LATENCY_US[kind],
        span=span,
    )


def _datasheet_gpu(
    name: str,
    memory_gib: float,
    peak_tflops: float,
    hbm_tbps: float,
    intra: Sequence[LinkLevel],
    inter: LinkLevel,
    note: str,
) -> HardwareSpec:
    label = f"datasheet: {note}"
    kinds = "; ".join(f"{k} {a:.2f}/{p:.2f}/{c:.2f}" for k, (a, p, c) in LINK_EFFICIENCY.items())
    eff = (
        f"datasheet: {note}; assumed efficiency x{MATMUL_EFFICIENCY} GEMM, "
        f"x{ATTENTION_EFFICIENCY_AT_32K} attention at 32K, x{HBM_EFFICIENCY} HBM copy, "
        f"links a2a/p2p/all-gather {kinds}"
    )
    return HardwareSpec(
        name=name,
        gpu_memory_gib=memory_gib,
        peak_tflops=peak_tflops,
        matmul_tflops=peak_tflops * MATMUL_EFFICIENCY,
        attention_tflops=datasheet_attention_table(peak_tflops),
        hbm_gbps=hbm_tbps * 1000 * HBM_EFFICIENCY,
        intra_node=tuple(intra),
        inter_node=inter,
        sources={
            "gpu_memory_gib": label,
            "peak_tflops": label,
            "matmul_tflops": eff,
            "attention_tflops": eff,
            "hbm_gbps": eff,
            "intra_node": eff,
            "inter_node": eff,
        },
    )


def _h200_measured() -> HardwareSpec:
    """The 2xH200 anchors (docs/planner.md, measured anchors); inter-node from the
    H200 datasheet since only one node was measured."""
    label = "measured (2xH200 NVLink, torch 2.11 cu130, cuDNN 9.19, 2026-11-30)"
    ds = HARDWARE_PRESETS["h200"]
    return HardwareSpec(
        name="h200-measured",
        gpu_memory_gib=139.8,
        peak_tflops=ds.peak_tflops,
        matmul_tflops=780.0,
        attention_tflops=((8192, 519.0), (32768, 557.0), (65536, 555.0), (131072, 544.0)),
        hbm_gbps=4100.0,
        intra_node=(
            LinkLevel(
                name="NVLink (NV18)",
                # NCCL all-to-all algbw 509 GB/s between 2 GPUs -> busbw 509*(2-1)/2.
                all_to_all_gbps=509.0 / 2,
                p2p_gbps=302.0,
                # all-gather was not measured; ring all-gather runs on the same
                # send/recv path, so the p2p figure is used.
                collective_gbps=302.0,
                latency_us=LINK_LATENCY_US["nvlink"],
            ),
        ),
        inter_node=ds.inter_node,
        sources={
            "gpu_memory_gib": label,
            "peak_tflops": ds.sources["peak_tflops"],
            "matmul_tflops": label,
            "attention_tflops": label + " (SDPA cuDNN backend)",
            "hbm_gbps": label + " (device copy)",
            "intra_node": label + " (all-gather assumed = p2p)",
            "inter_node": ds.sources["inter_node"],
        },
    )


def _build_presets() -> Dict[str, HardwareSpec]:
    nv = datasheet_link
    presets = {
        # H100 SXM5 80GB: 989 dense bf16 TFLOP/s, 3.35 TB/s HBM3, NVLink4 900 GB/s
        # (450 per direction), one 400 Gb/s NDR NIC per GPU (50 GB/s).
        "h100": _datasheet_gpu(
            "h100", 79.6, peak_tflops_for_device("h100"), 3.35,
            [nv("NVLink4", "nvlink", 450.0)], nv("InfiniBand NDR 400G/GPU", "network", 50.0),
            "H100 SXM5 80GB, NVLink4 450 GB/s/dir, NDR 400 Gb/s per GPU",
        ),
        # H200 SXM 141GB: same compute and NVLink as H100, 4.8 TB/s HBM3e.
        "h200": _datasheet_gpu(
            "h200", 139.8, peak_tflops_for_device("h200"), 4.8,
            [nv("NVLink4", "nvlink", 450.0)], nv("InfiniBand NDR 400G/GPU", "network", 50.0),
            "H200 SXM 141GB, NVLink4 450 GB/s/dir, NDR 400 Gb/s per GPU",
        ),
        # A100 SXM4 80GB: 312 bf16 TFLOP/s, 2.04 TB/s, NVLink3 600 GB/s (300/dir),
        # HDR 200 Gb/s per GPU (25 GB/s).
        "a100": _datasheet_gpu(
            "a100", 80.0, peak_tflops_for_device("a100"), 2.039,
            [nv("NVLink3", "nvlink", 300.0)], nv("InfiniBand HDR 200G/GPU", "network", 25.0),
            "A100 SXM4 80GB, NVLink3 300 GB/s/dir, HDR 200 Gb/s per GPU",
        ),
        # A800 SXM4 80GB: the A100 with NVLink cut to 400 GB/s (200/dir).
        "a800": _datasheet_gpu(
            "a800", 80.0, peak_tflops_for_device("a800"), 2.039,
            [nv("NVLink3 (A800, 400 GB/s)", "nvlink", 200.0)],
            nv("InfiniBand HDR 200G/GPU", "network", 25.0),
            "A800 SXM4 80GB, NVLink 200 GB/s/dir, HDR 200 Gb/s per GPU",
        ),
        # L20 48GB PCIe: 119.5 dense bf16 TFLOP/s, 864 GB/s GDDR6, PCIe Gen4 x16
        # (32 GB/s/dir). Assumed typical dual-socket 8-GPU server: two GPUs per PCIe
        # switch (32 GB/s between them), two switches per socket, each switch on one x16
        # uplink the pair shares (16 GB/s/GPU across switches); GPU peer-to-peer does not
        # cross the CPU interconnect, so NCCL stages cross-socket traffic through host
        # memory: two copies over the shared uplink, ~8 GB/s/GPU. 2x100 GbE per node
        # (25 GB/s / 8 GPUs = 3.1 GB/s/GPU).
        "l20": _datasheet_gpu(
            "l20", 45.0, peak_tflops_for_device("l20"), 0.864,
            [
                nv("PCIe Gen4 switch (GPU pair)", "pcie", 32.0, span=2),
                nv("PCIe switch uplinks (socket)", "pcie", 16.0, span=4),
                nv("host memory across sockets", "pcie", 8.0),
            ],
            nv("RoCE 2x100GbE per node", "network", 3.125),
            "L20 48GB PCIe Gen4; assumed 2 GPUs per PCIe switch, 2 switches per socket, "
            "cross-socket via host memory, 2x100GbE per node",
        ),
    }
    return presets


HARDWARE_PRESETS: Dict[str, HardwareSpec] = _build_presets()
HARDWARE_PRESETS["h200-measured"] = _h200_measured()


def get_hardware(name_or_spec: Union[str, HardwareSpec]) -> HardwareSpec:
    """A preset by name (case-insensitive), or the spec itself."""
    if isinstance(name_or_spec, HardwareSpec):
        return name_or_spec
    key = str(name_or_spec).strip().lower()
    if key not in HARDWARE_PRESETS:
        raise PlannerError(
            f"--hardware {name_or_spec!r} is not a preset; presets: {sorted(HARDWARE_PRESETS)} "
            f"(or start from one and add --calibration FILE written by tools/bench_links.py)"
        )
    return HARDWARE_PRESETS[key]


def with_overrides(
    hw: HardwareSpec,
    gpu_memory_gib: Optional[float] = None,
    intra_node_gbps: Optional[float] = None,
    inter_node_gbps: Optional[float] = None,
    label: str = "command line",
) -> HardwareSpec:
    """Replace memory and/or link bandwidths (all three kinds of a level at once; every
    intra-node level when ``intra_node_gbps`` is given, so the node becomes flat)."""
    sources = dict(hw.sources)
    if gpu_memory_gib is not None:
        if gpu_memory_gib <= 0:
            raise PlannerError(f"--gpu-memory {gpu_memory_gib} must be > 0 (GiB per GPU)")
        hw = replace(hw, gpu_memory_gib=float(gpu_memory_gib))
        sources["gpu_memory_gib"] = label
    if intra_node_gbps is not None:
        if intra_node_gbps <= 0:
            raise PlannerError(f"--intra-node-bw {intra_node_gbps} must be > 0 (GB/s per GPU)")
        base = hw.intra_node[-1]
        lvl = replace(base, name=f"{base.name} @{intra_node_gbps:g} GB/s", span=0,
                      all_to_all_gbps=intra_node_gbps, p2p_gbps=intra_node_gbps,
                      collective_gbps=intra_node_gbps)
        hw = replace(hw, intra_node=(lvl,))
        sources["intra_node"] = label
    if inter_node_gbps is not None:
        if inter_node_gbps <= 0:
            raise PlannerError(f"--inter-node-bw {inter_node_gbps} must be > 0 (GB/s per GPU)")
        base = hw.inter_node
        hw = replace(hw, inter_node=replace(
            base, name=f"{base.name} @{inter_node_gbps:g} GB/s", all_to_all_gbps=inter_node_gbps,
            p2p_gbps=inter_node_gbps, collective_gbps=inter_node_gbps))
        sources["inter_node"] = label
    return replace(hw, sources=sources)


# ----------------------------------------------------------------------------- calibration


@dataclass
class LinkCalibration:
    """Measured figures of one link level (any may be missing in a partial file)."""

    all_to_all_gbps: Optional[float] = None
    p2p_gbps: Optional[float] = None
    collective_gbps: Optional[float] = None
    latency_us: Optional[float] = None
    group_size: Optional[int] = None


@dataclass
class Calibration:
    """Contents of one or more calibration files (schema ``megatron-usp-calibration/1``).

    Field names are those of the JSON file; see ``docs/planner.md``. ``sources`` maps
    each field that was set to the file it came from.
    """

    device_name: Optional[str] = None
    gpu_memory_gib: Optional[float] = None
    matmul_tflops: Optional[float] = None
    hbm_gbps: Optional[float] = None
    attention_tflops: Dict[int, float] = field(default_factory=dict)
    intra_node: Optional[LinkCalibration] = None
    inter_node: Optional[LinkCalibration] = None
    sources: Dict[str, str] = field(default_factory=dict)


_TOP_KEYS = {"schema", "source", "device_name", "gpu_memory_gib", "matmul_tflops",
             "hbm_gbps", "attention_tflops", "links", "notes"}
_LINK_KEYS = {"all_to_all_gbps", "p2p_gbps", "collective_gbps", "latency_us", "group_size"}


def _positive(path: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlannerError(f"calibration {path}: {key}={value!r} must be a number > 0")
    return float(value)


def _parse_link(path: str, name: str, data: Any) -> LinkCalibration:
    if not isinstance(data, dict):
        raise PlannerError(f"calibration {path}: links.{name} must be an object")
    unknown = sorted(set(data) - _LINK_KEYS)
    if unknown:
        raise PlannerError(
            f"calibration {path}: links.{name} has unknown field(s) {unknown}; allowed: "
            f"{sorted(_LINK_KEYS)}"
        )
    out = LinkCalibration()
    for key in ("all_to_all_gbps", "p2p_gbps", "collective_gbps"):
        if key in data:
            setattr(out, key, _positive(path, f"links.{name}.{key}", data[key]))
    if "latency_us" in data:
        lat = data["latency_us"]
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or lat < 0:
            raise PlannerError(f"calibration {path}: links.{name}.latency_us must be >= 0")
        out.latency_us = float(lat)
    if "group_size" in data:
        out.group_size = int(data["group_size"])
    return out


def parse_calibration(data: Any, path: str = "<dict>") -> Calibration:
    """Validate one calibration document and return its contents."""
    if not isinstance(data, dict):
        raise PlannerError(f"calibration {path}: top level must be a JSON object")
    if data.get("schema") != CALIBRATION_SCHEMA:
        raise PlannerError(
            f"calibration {path}: schema is {data.get('schema')!r}, expected "
            f"{CALIBRATION_SCHEMA!r}"
        )
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise PlannerError(
            f"calibration {path}: unknown field(s) {unknown}; allowed: {sorted(_TOP_KEYS)}"
        )
    label = f"calibration {path}" + (f" ({data['source']})" if data.get("source") else "")
    cal = Calibration()
    if data.get("device_name"):
        cal.device_name = str(data["device_name"])
    for key in ("gpu_memory_gib", "matmul_tflops", "hbm_gbps"):
        if key in data:
            setattr(cal, key, _positive(path, key, data[key]))
            cal.sources[key] = label
    att = data.get("attention_tflops", {})
    if not isinstance(att, dict):
        raise PlannerError(f"calibration {path}: attention_tflops must map sequence length to "
                           f"TFLOP/s, e.g. {{\"32768\": 557.0}}")
    for seq, rate in att.items():
        try:
            s = int(seq)
        except (TypeError, ValueError):
            raise PlannerError(f"calibration {path}: attention_tflops key {seq!r} is not a "
                               f"sequence length") from None
        cal.attention_tflops[s] = _positive(path, f"attention_tflops[{seq}]", rate)
    if att:
        cal.sources["attention_tflops"] = label
    links = data.get("links", {})
    if not isinstance(links, dict) or set(links) - {"intra_node", "inter_node"}:
        raise PlannerError(f"calibration {path}: links must be an object with keys "
                           f"'intra_node' and/or 'inter_node'")
    for name in ("intra_node", "inter_node"):
        if name in links:
            setattr(cal, name, _parse_link(path, name, links[name]))
            cal.sources[name] = label
    return cal


def attention_bench_mask_problem(config: Dict[str, Any]) -> Optional[str]:
    """Why a ``tools/bench_attention.py`` file's timings are not the dense causal attention
    the planner models (a sliding window, packed documents, a full mask), or None."""
    if config.get("causal") is False:
        return "timed without the causal mask; rerun tools/bench_attention.py causal"
    if config.get("window"):
        return (f"timed with --window {config['window']} (sliding-window attention), not the "
                f"dense causal kernel the planner's rates are; rerun tools/bench_attention.py "
                f"without --window")
    if config.get("docs"):
        return (f"timed on packed documents (--docs {','.join(map(str, config['docs']))}), not "
                f"the dense causal kernel the planner's rates are; rerun "
                f"tools/bench_attention.py without --docs")
    return None


def calibration_from_attention_bench(data: Dict[str, Any], path: str) -> Calibration:
    """The kernel part of a ``tools/bench_attention.py`` results file.

    Its ``single-gpu-kernel`` cases (the local kernel USP uses, on the whole sequence,
    one GPU) give ``attention_tflops`` by sequence length; FLOPs are counted the same way
    (forward ``4*b*h*S^2*d``, half when causal, forward+backward 3.5x). The device's name
    and memory come from the file's metadata.
    """
    problem = attention_bench_mask_problem(data.get("config") or {})
    if problem:
        raise PlannerError(f"calibration {path}: {problem}")
    meta = data.get("metadata") or {}
    device = meta.get("device") or {}
    label = (f"calibration {path} (bench_attention single-gpu-kernel"
             f"{', ' + str(device.get('name')) if device.get('name') else ''}"
             f"{', ' + str(meta.get('date_utc')) if meta.get('date_utc') else ''})")
    cal = Calibration()
    for res in data.get("results") or []:
        if (isinstance(res, dict) and res.get("method") == "single-gpu-kernel"
                and res.get("status") == "ok" and res.get("fwd_bwd_tflops_per_gpu")):
            cal.attention_tflops[int(res["seq_len"])] = _positive(
                path, f"results[seq_len={res['seq_len']}].fwd_bwd_tflops_per_gpu",
                res["fwd_bwd_tflops_per_gpu"])
    if not cal.attention_tflops:
        raise PlannerError(f"calibration {path}: no successful single-gpu-kernel case to take "
                           f"attention rates from (run tools/bench_attention.py with the "
                           f"single-GPU kernel enabled)")
    cal.sources["attention_tflops"] = label
    if device.get("type") == "cuda":
        cal.device_name = device.get("name")
        if device.get("memory_gib"):
            cal.gpu_memory_gib = _positive(path, "metadata.device.memory_gib", device["memory_gib"])
            cal.sources["gpu_memory_gib"] = label
    return cal


def _merge_link(old: Optional[LinkCalibration], new: LinkCalibration) -> LinkCalibration:
    if old is None:
        return new
    merged = LinkCalibration(**vars(old))
    for key, value in vars(new).items():
        if value is not None:
            setattr(merged, key, value)
    return merged


def read_json(path: str, flag: str) -> Any:
    """The JSON document at ``path``; PlannerError naming ``flag`` if unreadable or invalid."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise PlannerError(f"{flag} {path}: cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{flag} {path}: not valid JSON ({exc})") from None


def load_calibration(paths: Union[str, Iterable[str]]) -> Calibration:
    """Read one or several calibration files and merge them, later files winning.

    Files may be partial: ``tools/bench_links.py`` writes the ``links`` section (and the
    GEMM and copy rates); a ``tools/bench_attention.py`` results file (``"tool":
    "bench_attention"``) is read as its ``attention_tflops`` table
    (:func:`calibration_from_attention_bench`); attention tables merge point by point.
    """
    if isinstance(paths, str):
        paths = [paths]
    merged = Calibration()
    for path in paths:
        data = read_json(path, "--calibration")
        if isinstance(data, dict) and data.get("tool") == "bench_attention":
            cal = calibration_from_attention_bench(data, path)
        else:
            cal = parse_calibration(data, path)
        for key in ("device_name", "gpu_memory_gib", "matmul_tflops", "hbm_gbps"):
            if getattr(cal, key) is not None:
                setattr(merged, key, getattr(cal, key))
        merged.attention_tflops.update(cal.attention_tflops)
        for name in ("intra_node", "inter_node"):
            if getattr(cal, name) is not None:
                setattr(merged, name, _merge_link(getattr(merged, name), getattr(cal, name)))
        merged.sources.update(cal.sources)
    return merged


def _calibrated_level(base: LinkLevel, cal: LinkCalibration) -> LinkLevel:
    return replace(
        base,
        name=f"{base.name} (calibrated)",
        all_to_all_gbps=cal.all_to_all_gbps or base.all_to_all_gbps,
        p2p_gbps=cal.p2p_gbps or base.p2p_gbps,
        collective_gbps=cal.collective_gbps or cal.p2p_gbps or base.collective_gbps,
        latency_us=base.latency_us if cal.latency_us is None else cal.latency_us,
        span=0,
    )


def apply_calibration(hw: HardwareSpec, cal: Calibration) -> HardwareSpec:
    """``hw`` with every field the calibration measured replaced (provenance updated).

    A measured attention table replaces the preset's whole table. A measured intra-node
    link replaces every intra-node level (the benchmark measured the node as one flat
    level).
    """
    sources = dict(hw.sources)
    changes: Dict[str, Any] = {}
    for key in ("gpu_memory_gib", "matmul_tflops", "hbm_gbps"):
        if getattr(cal, key) is not None:
            changes[key] = getattr(cal, key)
            sources[key] = cal.sources.get(key, "calibration")
    if cal.attention_tflops:
        changes["attention_tflops"] = tuple(sorted(cal.attention_tflops.items()))
        sources["attention_tflops"] = cal.sources.get("attention_tflops", "calibration")
    if cal.intra_node is not None:
        changes["intra_node"] = (_calibrated_level(hw.intra_node[-1], cal.intra_node),)
        sources["intra_node"] = cal.sources.get("intra_node", "calibration")
    if cal.inter_node is not None:
        changes["inter_node"] = _calibrated_level(hw.inter_node, cal.inter_node)
        sources["inter_node"] = cal.sources.get("inter_node", "calibration")
    name = hw.name + ("+calibrated" if changes and not hw.name.endswith("+calibrated") else "")
    return replace(hw, name=name, sources=sources, **changes)
