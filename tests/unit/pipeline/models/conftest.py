"""The C loops as an AVX2-only CPU builds them, on whatever x86 CPU runs the tests."""

import platform

import pytest


@pytest.fixture
def avx2_loops(monkeypatch):
    """``native.library()`` built with ``-march=x86-64-v3`` (AVX2 and FMA: what a CPU without AVX-512, or
    a process with ``ATEN_CPU_CAPABILITY=avx2``, builds), and no bf16 instructions for oneDNN: the
    paths of an AVX2 node, run here. Skips off x86 or without a compiler."""
    from pipeline.models.kernels import native, packed

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the AVX2 build is an x86 one")
    lib = native.library("-march=x86-64-v3")
    if lib is None or not lib.has_openmp():
        pytest.skip("no C compiler with OpenMP here")
    assert lib.bf16_path() == 1 and not lib.has_bf16_dot() and not lib.has_vnni()
    monkeypatch.setattr(native, "library", lambda march=None: lib)
    monkeypatch.setattr(packed, "native_bf16", lambda: False)
    return lib
