"""CPU feature detection, with faked /proc/cpuinfo texts: the lossy variants are made only where the CPU runs
them fast, and the reason names the CPU and what it lacks."""

from __future__ import annotations

import pytest

from fx_lightning.machine import CpuInfo, cpu_info, parse_cpuinfo

ZEN1 = "flags\t\t: fpu sse2 avx avx2 fma"
ZEN4 = "flags\t\t: fpu avx2 fma avx512f avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"
ALDER_LAKE = "flags\t\t: avx2 fma avx_vnni"


def cpuinfo(flags: str, name: str = "AMD EPYC 7571", family: str = "23", model: str = "1") -> str:
    return (f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
            f"model name\t: {name}\n{flags}\n\nprocessor\t: 1\nmodel name\t: second\nflags\t\t: avx512_vnni\n")


@pytest.mark.parametrize("flags, int8, bf16", [
    (ZEN1, False, False), (ZEN4, True, True), (SAPPHIRE_RAPIDS, True, True), (ALDER_LAKE, True, False)])
def test_features_follow_the_flags(flags: str, int8: bool, bf16: bool) -> None:
    cpu = parse_cpuinfo(cpuinfo(flags))
    assert (cpu.int8_fast, cpu.bf16_fast) == (int8, bf16)
    assert (cpu.lacks("int8") is None) == int8 and (cpu.lacks("bf16") is None) == bf16


def test_only_the_first_processor_is_read_and_the_reason_names_the_cpu() -> None:
    cpu = parse_cpuinfo(cpuinfo(ZEN1))
    assert cpu.model == "AMD EPYC 7571" and (cpu.family, cpu.model_number) == ("23", "1")
    assert not cpu.int8_fast  # the second processor's avx512_vnni is not read
    reason = cpu.lacks("int8")
    assert reason is not None and "VNNI" in reason and "AMD EPYC 7571 (family 23 model 1; avx2 fma)" in reason
    assert "emulated" in (cpu.lacks("bf16") or "")


def test_unknown_flags_say_so() -> None:
    cpu = CpuInfo("arm64", frozenset({"default"}), known=False)
    assert not cpu.int8_fast and "flags unknown" in (cpu.lacks("int8") or "")


def test_this_machine_is_read() -> None:
    cpu = cpu_info()
    assert cpu.model and isinstance(cpu.flags, frozenset)
