"""specpd.machine: the cores a cluster's children share, and the defaults the machine implies."""
import pytest

from specpd.machine import default_dtype, default_threads, isa, split_cores, usable_cores


@pytest.mark.parametrize("cores,p,d,want", [
    (2, 1, 1, ([1], [1])),  # this project's box: one thread each
    (1, 1, 1, ([1], [1])),  # fewer cores than servers: never zero threads
    (3, 1, 1, ([1], [2])),  # the remainder goes to decode first
    (8, 1, 2, ([2], [3, 3])),
    (7, 2, 2, ([2, 1], [2, 2])),
    (16, 1, 1, ([8], [8])),
])
def test_split_cores(cores, p, d, want):
    prefill, decode = split_cores(cores, p, d)
    assert (prefill, decode) == want
    assert sum(prefill) + sum(decode) == max(cores, p + d)


def test_machine_defaults_are_consistent(monkeypatch):
    assert usable_cores() >= 1
    assert isa() in ("amx", "avx512_bf16", "avx512", "avx2", "other")
    monkeypatch.delenv("SPECPD_AUTO_DTYPE", raising=False)  # (the suite pins it: tests/conftest.py)
    assert default_dtype("cpu") == ("bfloat16" if isa() in ("amx", "avx512_bf16") else "float32")
    monkeypatch.setenv("SPECPD_AUTO_DTYPE", "float16")
    assert default_dtype("cpu") == "float16"


@pytest.mark.parametrize("env,want", [("1", 1), ("3", 3), (None, None), ("", None), ("0", None), ("two", None)])
def test_default_threads_follow_omp_num_threads_where_it_is_a_positive_number(monkeypatch, env, want):
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert default_threads() == (want or usable_cores())
