"""Which path each CPU kernel took on this machine, for the one line the engine logs at start."""

from __future__ import annotations

from graphserve.engine.cpu import attention, linear, lora, ops, quant_linear
from graphserve.engine.cpu.build import ISA_ENV, cap_flags, requested_isa

KERNELS = {"attention": attention.LIBRARY, "float32 projections": linear.LIBRARY, "fused ops": ops.LIBRARY,
           "quantized projections": quant_linear.LIBRARY, "LoRA products": lora.LIBRARY}


def check_requested_isa() -> None:
    """Raises ValueError naming GRAPHSERVE_CPU_ISA when it holds no cap this machine knows."""
    cap_flags(requested_isa())


def describe() -> str:
    """e.g. "CPU kernels: attention AVX2, float32 projections AVX2, fused ops AVX2, quantized
    projections AVX-VNNI, LoRA products AVX2; threads OpenMP", with torch for any that could not be built
    here."""
    paths = [f"{name} {library.isa() or 'torch'}" for name, library in KERNELS.items()]
    threads = sorted({t for library in KERNELS.values() if (t := library.threads())})
    cap = f" ({ISA_ENV}={requested_isa()})" if requested_isa() else ""
    return f"CPU kernels{cap}: {', '.join(paths)}; threads {' / '.join(threads) or 'torch'}"
