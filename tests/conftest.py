"""Test-wide environment: set before numpy/torch/triton are imported anywhere."""
import ctypes
import ctypes.util
import gc
import os

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
# no collapse onto huge pages after start-up in the suite's engines and servers (specpd/machine.py): a thread
# compacting memory beside a test's timings would be another test's noise; tests/test_machine.py turns it on
os.environ.setdefault("SPECPD_HUGE_PAGES_LATER", "0")
# nor at start-up: on a box whose memory is fragmented each huge page waits on compaction, and the suite builds
# hundreds of engines and servers (0.5-1 s each); tests/test_machine.py turns them on to test them
os.environ.setdefault("SPECPD_HUGE_PAGES", "0")
# `--dtype auto` (the default) is bfloat16 on a CPU with AMX / AVX512-BF16: the suite's references are fp32 (HF
# transformers, the unified engine), so the suite pins what auto means; tests of the machine default clear it
os.environ.setdefault("SPECPD_AUTO_DTYPE", "float32")
# `--quantization auto` (the default) serves a GGUF's quantized blocks (specpd/model/quant.py), whose activations
# are quantized to int8: the suite's references are dense fp32, so it pins auto to dense; tests/model/test_quant.py
# and tests/model/test_quant_engine.py run the GGUF's blocks (and speculation on them) explicitly
os.environ.setdefault("SPECPD_AUTO_QUANTIZATION", "none")

# The Triton kernels run on the host under the interpreter only where no CUDA device is: on a GPU machine they are
# compiled for it and tests/gpu runs them there (the interpreter is read when the kernels are defined, so one
# process has one mode). The check asks NVML, so it does not initialize CUDA in a process that forks later.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
import torch  # noqa: E402  (after the thread settings above; torch does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "triton_interpreter: runs Triton kernels on CPU tensors (TRITON_INTERPRET=1)")


def pytest_collection_modifyitems(config, items):
    """Without the interpreter (a CUDA machine) a Triton kernel cannot take CPU tensors: those tests skip, and
    tests/gpu runs the same cases on the device."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (set where no CUDA device is); "
                                   "tests/gpu runs these kernels on the device")
    for item in items:
        if item.get_closest_marker("triton_interpreter"):
            item.add_marker(skip)


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


@pytest.fixture(autouse=True)
def _return_freed_memory():
    """After each test, hand the heap its engines freed back to the system: glibc keeps freed memory in per-thread
    arenas (every engine runs threads of its own), so a test worker that builds engine after engine grows by
    what it once held, not what it holds, and two such workers outgrew a 24 GiB box."""
    yield
    gc.collect()
    _LIBC.malloc_trim(0)
