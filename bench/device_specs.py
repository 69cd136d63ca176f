"""Published peak figures of known TPU and GPU generations, looked up by JAX's device kind.

`lookup(kind)` takes `jax.devices()[0].device_kind` (e.g. "TPU v5 lite", "NVIDIA H100 80GB
HBM3") and returns the `DeviceSpec` of that chip, or None for a kind the table does not know
(the device check then reports its fractions as null, with the reason). Figures are per JAX
device (one chip; TPU v4 and v5p megacore chips are one device each), dense bfloat16 (no
sparsity), from the vendors' data sheets. Stdlib only: the device check's parent process
imports it without JAX.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceSpec:
    """One chip's published peaks: `name`; `hbm_gbps` memory bandwidth in GB/s (10^9 B/s);
    `bf16_tflops` dense bfloat16 peak in TFLOP/s (10^12); `hbm_gb` memory per device;
    `match`: lower-case substrings that must all occur in the device kind; `note`."""

    name: str
    hbm_gbps: float
    bf16_tflops: float
    hbm_gb: float
    match: tuple[str, ...]
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON-ready dict (without the match patterns)."""
        out = asdict(self)
        del out["match"]
        return out


# The first entry whose patterns all occur in the lower-cased kind wins: the more specific
# spellings come first (H100 PCIe before H100, v5 lite before v5).
SPECS: tuple[DeviceSpec, ...] = (
    DeviceSpec("TPU v4", 1200, 275, 32, ("tpu v4",)),
    DeviceSpec("TPU v5e", 819, 197, 16, ("tpu v5", "lite"), "device kind 'TPU v5 lite'"),
    DeviceSpec("TPU v5e", 819, 197, 16, ("tpu v5e",)),
    DeviceSpec("TPU v5p", 2765, 459, 95, ("tpu v5",), "device kind 'TPU v5' or 'TPU v5p'"),
    DeviceSpec("TPU v6e (Trillium)", 1640, 918, 32, ("tpu v6",),
               "device kind 'TPU v6 lite' or 'TPU v6e'"),
    DeviceSpec("TPU v7 (Ironwood)", 7370, 2307, 192, ("tpu7",),
               "per chip as announced; the kind string (e.g. 'TPU7x') is not yet seen here"),
    DeviceSpec("TPU v7 (Ironwood)", 7370, 2307, 192, ("tpu v7",),
               "per chip as announced; the kind string is not yet seen here"),
    DeviceSpec("NVIDIA GH200", 4000, 989, 96, ("gh200",), "HBM3 96 GB version"),
    DeviceSpec("NVIDIA H200", 4800, 989, 141, ("h200",)),
    DeviceSpec("NVIDIA H100 PCIe", 2000, 756, 80, ("h100", "pcie")),
    DeviceSpec("NVIDIA H100 NVL", 3900, 835, 94, ("h100", "nvl")),
    DeviceSpec("NVIDIA H100 SXM", 3350, 989, 80, ("h100",)),
    DeviceSpec("NVIDIA B200", 8000, 2250, 180, ("b200",)),
    DeviceSpec("NVIDIA A100 80GB PCIe", 1935, 312, 80, ("a100", "80gb", "pcie")),
    DeviceSpec("NVIDIA A100 80GB SXM", 2039, 312, 80, ("a100", "80gb")),
    DeviceSpec("NVIDIA A100 40GB", 1555, 312, 40, ("a100",)),
    DeviceSpec("NVIDIA L40S", 864, 362, 48, ("l40s",)),
    DeviceSpec("NVIDIA L4", 300, 121, 24, ("l4",)),
    DeviceSpec("NVIDIA A10", 600, 125, 24, ("a10",)),
    DeviceSpec("NVIDIA V100", 900, 125, 16, ("v100",),
               "no bfloat16 tensor cores: the peak is float16's"),
    DeviceSpec("NVIDIA T4", 320, 65, 16, ("t4",), "no bfloat16 tensor cores: float16's peak"),
)


def lookup(kind: str | None) -> DeviceSpec | None:
    """The spec of device kind `kind` (case-insensitive substring match), or None."""
    if not kind:
        return None
    low = kind.lower()
    if low.startswith("nvidia ") or "tpu" in low:
        for spec in SPECS:
            if all(m in low for m in spec.match):
                return spec
    return None


def unknown_reason(kind: str | None, backend: str | None) -> str:
    """Why fractions of peak are null for `kind` on `backend`."""
    if backend == "cpu":
        return "CPU backend: no bandwidth or FLOP/s figures in the table (bench/device_specs.py)"
    return (f"device kind {kind!r} is not in the table of known devices "
            f"(bench/device_specs.py): add its figures there")


def markdown_table() -> str:
    """The table of known devices as Markdown (one row per distinct name)."""
    rows = ["| device | HBM GB/s | bf16 TFLOP/s (dense) | memory GB | matched in device_kind |",
            "|---|---:|---:|---:|---|"]
    seen: dict[str, list[str]] = {}
    for spec in SPECS:
        seen.setdefault(spec.name, []).append(" + ".join(repr(m) for m in spec.match))
    for spec in SPECS:
        if spec.name in seen:
            rows.append(f"| {spec.name} | {spec.hbm_gbps:g} | {spec.bf16_tflops:g} | "
                        f"{spec.hbm_gb:g} | {' or '.join(seen.pop(spec.name))} |")
    return "\n".join(rows)
