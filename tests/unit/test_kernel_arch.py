"""KVGEN_KERNEL_ARCH: the kernels built for an older instruction set than the machine's own, and
targets that cannot run here refused with an error that names the variable."""

from __future__ import annotations

import platform

import pytest

from kvgen.kernels import build

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or build.load() is None,
                                reason="x86 targets, with gcc")  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_targets():
    build._target_isa.cache_clear()
    yield
    build._target_isa.cache_clear()


def test_an_avx2_target_builds_other_flags_and_another_library(monkeypatch: pytest.MonkeyPatch) -> None:
    native_path = build.library_path()
    monkeypatch.setenv("KVGEN_KERNEL_ARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in build.kernel_flags() and "-march=native" not in build.kernel_flags()
    assert {"avx2", "fma", "f16c"} <= build.kernel_isa() and "avx512f" not in build.kernel_isa()
    assert build.library_path() != native_path
    monkeypatch.setenv("KVGEN_KERNEL_ARCH", "native")
    assert build.kernel_flags() == (*build.FLAGS, *build.tuning_flags()) and build.library_path() == native_path


def test_a_target_this_cpu_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "_cpu_flags", lambda: "flags : fpu sse2 avx avx2 fma f16c")  # an AVX2-only CPU
    monkeypatch.setenv("KVGEN_KERNEL_ARCH", "x86-64-v4")
    with pytest.raises(ValueError, match=r"KVGEN_KERNEL_ARCH='x86-64-v4' needs avx512bw, avx512f, avx512vl, which this CPU lacks"):
        build.kernel_flags()
    with pytest.raises(ValueError, match="KVGEN_KERNEL_ARCH"):
        build.library_path()


def test_an_unknown_target_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGEN_KERNEL_ARCH", "no-such-cpu")
    with pytest.raises(ValueError, match="KVGEN_KERNEL_ARCH='no-such-cpu' is not a target the C compiler knows"):
        build.kernel_flags()


def test_amd_cpus_build_the_int8_attention_without_its_prefetch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "cpu_vendor", lambda: "AuthenticAMD")
    assert "-DCODES_PREFETCH_BYTES=0" in build.kernel_flags()
    monkeypatch.setattr(build, "cpu_vendor", lambda: "GenuineIntel")
    assert not any(flag.startswith("-DCODES_PREFETCH_BYTES") for flag in build.kernel_flags())
