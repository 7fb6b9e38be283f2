"""Run SGLang's real benchmark client (sglang.benchmark.serving, unmodified) without its server runtime.

sglang/__init__.py and sglang.srt pull in the whole server (torchvision, triton kernels, ...); the client
needs two names from sglang.srt, so those two modules are stubbed with the same definitions and the package
__init__ is skipped. Everything under sglang.benchmark runs as shipped.
Usage: python tests/server/sglang_bench_client.py --backend sglang-oai --base-url URL [bench_serving args...]
(`pip install --no-deps sglang` plus the client's own imports: msgspec orjson pybase64 psutil IPython
traitlets datasets multiprocess pandas pyarrow dill xxhash)
"""
import importlib.util
import os
import sys
import types

root = os.path.dirname(importlib.util.find_spec("sglang").origin)
pkg = types.ModuleType("sglang"); pkg.__path__ = [root]; sys.modules["sglang"] = pkg
for name in ("sglang.srt", "sglang.srt.disaggregation", "sglang.srt.utils"):
    m = types.ModuleType(name); m.__path__ = []; sys.modules[name] = m
dis = types.ModuleType("sglang.srt.disaggregation.utils"); dis.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # as in sglang
sys.modules[dis.__name__] = dis
net = types.ModuleType("sglang.srt.utils.network")
net.resolve_base_url = lambda base_url, host, port: base_url or f"http://{host}:{port}"
net.resolve_host_port = lambda base_url, host, port: base_url or f"{host}:{port}"
sys.modules[net.__name__] = net

from sglang.benchmark.serving import cli_main  # noqa: E402

sys.argv[0] = "sglang.benchmark.serving"
cli_main()
