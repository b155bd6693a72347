"""What CPU a measurement ran on: model, the instruction sets that decide which kernels
run, cache sizes, and the settings that hold libraries to a narrower instruction set.

Performance figures (``speculative profile``, ``speculative bench``) carry this, because
the machines this project runs on differ (AVX2-only and AVX-512 x86-64 CPUs alike) and
the same command gives other numbers on another CPU.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The instruction-set flags (as /proc/cpuinfo spells them) that select kernels here.
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "avx_ne_convert",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
# Environment variables that narrow what a library (or this project) may use.
ISA_SETTINGS = (
    "ONEDNN_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "SPECULATIVE_KERNEL_ISA",
    "SPECULATIVE_TORCH_LINEAR",
    "SPECULATIVE_HUGE_PAGES",
)


@dataclass(frozen=True)
class CpuInfo:
    """One machine's CPU, as far as the kernels care."""

    model: str  # e.g. "AMD EPYC 7B13"
    vendor: str  # e.g. "AuthenticAMD"
    family: str  # vendor family number ("" when unknown)
    logical_cpus: int  # CPUs this process may run on
    isa: tuple[str, ...]  # the flags of ISA_FLAGS this CPU has
    caches: dict[str, str] = field(default_factory=dict)  # "L1d"/"L2"/"L3" -> size per instance
    torch_capability: str = ""  # the ATen kernels in use ("AVX2", "AVX512", ...)
    settings: dict[str, str] = field(default_factory=dict)  # ISA_SETTINGS that are set

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["isa"] = list(self.isa)
        return data

    def summary(self) -> str:
        """One line: model, ISA flags, caches, torch's kernels and any ISA limits."""
        caches = ", ".join(f"{level} {size}" for level, size in self.caches.items())
        family = f" (family {self.family})" if self.family else ""
        parts = [
            f"{self.model}{family}, {self.logical_cpus} CPUs",
            " ".join(self.isa) or "no AVX2",
            caches or "caches unknown",
            f"torch {self.torch_capability or '?'}",
        ]
        if self.settings:
            parts.append(" ".join(f"{k}={v}" for k, v in self.settings.items()))
        return " · ".join(parts)


def affinity_cpus() -> int | None:
    """CPUs this process may run on, where the OS says (None elsewhere)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo"), sysfs: Path | None = None) -> CpuInfo:
    """Describe this machine's CPU (Linux; elsewhere the fields it cannot read are empty)."""
    fields = _first_processor(cpuinfo)
    flags = set(fields.get("flags", "").split())
    sysfs = sysfs or Path("/sys/devices/system/cpu/cpu0/cache")
    return CpuInfo(
        model=fields.get("model name") or _platform_processor(),
        vendor=fields.get("vendor_id", ""),
        family=fields.get("cpu family", ""),
        logical_cpus=affinity_cpus() or 0,
        isa=tuple(flag for flag in ISA_FLAGS if flag in flags),
        caches=_caches(sysfs),
        torch_capability=_torch_capability(),
        settings={k: os.environ[k] for k in ISA_SETTINGS if os.environ.get(k)},
    )


def _first_processor(path: Path) -> dict[str, str]:
    """The ``key: value`` lines of the first processor block of /proc/cpuinfo."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def _caches(folder: Path) -> dict[str, str]:
    """{"L1d": "48K", "L2": "1024K", "L3": "32768K"} from sysfs (per cache instance)."""
    caches: dict[str, str] = {}
    for index in sorted(folder.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        name = f"L{level}" + ("d" if kind == "Data" else "")
        caches.setdefault(name, size)
    return caches


def _platform_processor() -> str:
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def _torch_capability() -> str:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError):
        return ""
