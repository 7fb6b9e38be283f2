"""Test-wide environment: set before numpy/torch/triton are imported anywhere."""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
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
