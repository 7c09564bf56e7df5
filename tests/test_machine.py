"""CPU feature detection, with faked /proc/cpuinfo texts: each lossy variant is made only where the CPU has the
flags it declares (``Variant.native_flags``), and the reason names the CPU and what it lacks."""

from __future__ import annotations

import pytest

from fx_lightning.common.machine import CpuInfo, cpu_info, parse_cpuinfo
from fx_lightning.variants import BF16, INT8

ZEN1 = "flags\t\t: fpu sse2 avx avx2 fma"
SANDY_BRIDGE = "flags\t\t: fpu sse2 sse4_2 avx"  # no AVX2: no SIMD integer dot products
ZEN4 = "flags\t\t: fpu avx2 fma avx512f avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"
ALDER_LAKE = "flags\t\t: avx2 fma avx_vnni"


def cpuinfo(flags: str, name: str = "AMD EPYC 7571", family: str = "23", model: str = "1") -> str:
    return (f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
            f"model name\t: {name}\n{flags}\n\nprocessor\t: 1\nmodel name\t: second\nflags\t\t: avx512_vnni\n")


@pytest.mark.parametrize("flags, int8, bf16", [
    (SANDY_BRIDGE, False, False), (ZEN1, True, False), (ZEN4, True, True), (SAPPHIRE_RAPIDS, True, True),
    (ALDER_LAKE, True, False)])
def test_features_follow_the_flags(flags: str, int8: bool, bf16: bool) -> None:
    cpu = parse_cpuinfo(cpuinfo(flags))
    assert (INT8.lacks(cpu) is None, BF16.lacks(cpu) is None) == (int8, bf16)


def test_only_the_first_processor_is_read_and_the_reason_names_the_cpu() -> None:
    cpu = parse_cpuinfo(cpuinfo(SANDY_BRIDGE, name="Intel Xeon E5-2670", family="6", model="45"))
    assert cpu.model == "Intel Xeon E5-2670" and (cpu.family, cpu.model_number) == ("6", "45")
    assert "avx512_vnni" not in cpu.flags  # the second processor's is not read
    reason = INT8.lacks(cpu)
    assert reason == ("this CPU has no AVX2, VNNI or AMX-INT8 (Intel Xeon E5-2670 (family 6 model 45; no AVX2)): "
                      "int8 would run without SIMD integer dot products")
    assert (BF16.lacks(cpu) or "").endswith("bf16 would run emulated")


def test_unknown_flags_say_so() -> None:
    cpu = CpuInfo("arm64", frozenset({"default"}), known=False)
    assert "(arm64 (flags unknown))" in (INT8.lacks(cpu) or "")


def test_this_machine_is_read() -> None:
    cpu = cpu_info()
    assert cpu.model and isinstance(cpu.flags, frozenset)
