"""The engines evals/peers.py serves, one server at a time: specpd and its peers (`make peers`).

  specpd    `specpd serve --model default` plus only what a user types for the config (and `--dtype` only
            where specpd's default dtype is not the cell's)
  vllm      vLLM's CPU build (.peers/vllm), `python -m vllm.entrypoints.openai.api_server` on an HF directory
            made from specpd's converted copy of the default GGUF (`hf_dir`), EAGLE-3 with specpd's shipped
            head as is; env LD_PRELOAD=libiomp5, VLLM_CPU_KVCACHE_SPACE=2, VLLM_CPU_OMP_THREADS_BIND=0-1
  llamacpp  llama.cpp's server from the xllamacpp wheel (.peers/llamacpp, AVX2 build) on the GGUF itself
            (Q4_1 weights: its dtype cell is `q4_1`), run by evals/peers_llamacpp.py; n-gram: ngram-simple
            looking up 3 tokens, drafting 5 (EAGLE-3 there needs a GGUF head: not run)

A server is a process group of its own (vLLM forks an engine core), killed whole when its cell is done.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from evals.harness.servers import (ServerStartError, free_port, group_stats, start_group, stop_group,
                                   wait_healthy)

EVALS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(EVALS_DIR)
PEERS_DIR = os.path.join(REPO, ".peers")
EAGLE3_HEAD = os.path.join(REPO, "specpd", "spec", "draft", "heads", "smollm2-135m-instruct-eagle3")
HF_DIR_FORMAT = 1  # bump when what hf_dir writes changes

VLLM_SPEC = {"eagle3": {"method": "eagle3", "model": EAGLE3_HEAD, "num_speculative_tokens": 3},
             "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 8}}
SPECPD_SPEC = {"plain": [], "eagle3": ["--speculative-algorithm", "eagle3", "--draft-model", "default"],
               "ngram": ["--speculative-algorithm", "ngram"]}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


# -- the HF directory vLLM loads ---------------------------------------------------------------------
def hf_dir() -> str:
    """config.json, fp32 model.safetensors (specpd's converted copy, hard-linked: HF names and q/k layout,
    which specpd's tests hold equal to HF transformers), tokenizer.json and tokenizer_config.json (chat template, bos/eos)
    of the default model, under $SPECPD_CACHE/peers/; made once per converted copy."""
    from safetensors.torch import save_file

    from specpd.model.default import cache_root, ensure_default_model
    from specpd.model.gguf_cache import converted_dir
    from specpd.model.loader import load_checkpoint
    gguf = ensure_default_model()
    where = os.path.join(cache_root(), "peers", f"{os.path.basename(converted_dir(gguf))}-hf{HF_DIR_FORMAT}")
    if os.path.isfile(os.path.join(where, "model.safetensors")):
        return where
    ckpt = load_checkpoint("default")
    state = ckpt.tokenizer.to_state()
    config = {**ckpt.hf_config, "torch_dtype": "float32"}
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": state["chat_template"],
                  "add_bos_token": state["add_bos_token"], "add_eos_token": False,
                  "model_max_length": config["max_position_embeddings"], "clean_up_tokenization_spaces": False,
                  **{k: v for k, v in state["special_tokens"].items() if v is not None}}
    os.makedirs(os.path.dirname(where), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(where), prefix=".hf-")
    os.chmod(tmp, 0o755)
    for name, obj in (("config.json", config), ("tokenizer_config.json", tok_config),
                      ("generation_config.json", {"bos_token_id": config["bos_token_id"],
                                                  "eos_token_id": state["eos_token_ids"]})):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
    with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(state["backend"])
    converted = os.path.join(converted_dir(gguf), "model.safetensors")  # load_checkpoint made it
    try:
        os.link(converted, os.path.join(tmp, "model.safetensors"))  # the same bytes: no second 0.5 GB
    except OSError:
        save_file({k: v.contiguous() for k, v in ckpt.weights.items()}, os.path.join(tmp, "model.safetensors"))
    try:
        os.rename(tmp, where)
    except OSError:  # another process made it first
        subprocess.run(["rm", "-rf", tmp], check=False)
    return where


# Model shapes beside the default model: random weights (a step's speed does not depend on their values) on
# SmolLM2's tokenizer, so every engine reads the same prompt tokens
SHAPES = {"llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,  # Llama-3.2-1B
                       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 500000.0,
                       "tie_word_embeddings": True, "rope_scaling": None}}


def random_hf_dir(shape: str) -> str:
    """hf_dir()'s tokenizer files with `shape`'s config and random fp32 weights (seed 0, std 0.02, norms 1), under
    $SPECPD_CACHE/peers/; made once."""
    import torch
    from safetensors.torch import save_file

    from specpd.model.default import cache_root
    where = os.path.join(cache_root(), "peers", f"random-{shape}-hf{HF_DIR_FORMAT}")
    if os.path.isfile(os.path.join(where, "model.safetensors")):
        return where
    base = hf_dir()
    with open(os.path.join(base, "config.json")) as f:
        config = {**json.load(f), **SHAPES[shape]}
    h, inter, kv = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"] * config["head_dim"]
    gen = torch.Generator().manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=gen) * 0.02
    weights = {"model.embed_tokens.weight": rand(config["vocab_size"], h), "model.norm.weight": torch.ones(h)}
    for i in range(config["num_hidden_layers"]):
        at = f"model.layers.{i}"
        weights.update({f"{at}.input_layernorm.weight": torch.ones(h), f"{at}.post_attention_layernorm.weight":
                        torch.ones(h), f"{at}.self_attn.q_proj.weight": rand(config["num_attention_heads"] *
                        config["head_dim"], h), f"{at}.self_attn.k_proj.weight": rand(kv, h),
                        f"{at}.self_attn.v_proj.weight": rand(kv, h), f"{at}.self_attn.o_proj.weight": rand(h, h),
                        f"{at}.mlp.gate_proj.weight": rand(inter, h), f"{at}.mlp.up_proj.weight": rand(inter, h),
                        f"{at}.mlp.down_proj.weight": rand(h, inter)})
    tmp = tempfile.mkdtemp(dir=os.path.dirname(where), prefix=".hf-")
    os.chmod(tmp, 0o755)
    for name in os.listdir(base):
        if name not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(base, name), tmp)
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    save_file(weights, os.path.join(tmp, "model.safetensors"))
    del weights
    os.rename(tmp, where)
    return where


def weight_bytes(model_dir: str) -> int:
    """Bytes one decode step reads at fp32: every decoder linear and the LM head (the embedding rows are few)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    q = c["num_attention_heads"] * c.get("head_dim", h // c["num_attention_heads"])
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * c["intermediate_size"]
    return 4 * (c["num_hidden_layers"] * per_layer + c["vocab_size"] * h)


# -- what runs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerSpec:
    engine: str          # specpd | vllm | llamacpp
    config: str          # plain | eagle3 | ngram
    dtype: str           # bf16 | fp32 | q4_1
    cmd: tuple[str, ...]  # without the port: `port_args(port)` is appended
    env: tuple[tuple[str, str], ...] = ()
    port_flag: str = "--port"
    notes: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return f"{self.engine}/{self.config}/{self.dtype}"


def peer_unavailable(engine: str) -> str | None:
    """None when `make peers` installed `engine`, else why not (the bench records it and skips the peer)."""
    if engine == "specpd":
        return None
    if os.path.isfile(os.path.join(PEERS_DIR, engine, ".installed")):
        return None
    failed = os.path.join(PEERS_DIR, f"{engine}.failed")
    if os.path.isfile(failed):
        with open(failed, encoding="utf-8", errors="replace") as f:
            return f"`make peers` could not install it: {f.read()[-600:].strip()}"
    return "not installed: run `make peers`"


def specpd_spec(config: str, dtype: str, default_dtype: str, model: str = "default",
                quantization: str | None = None) -> ServerSpec:
    """`quantization`: a --quantization flag beside the user's default (the server's config reads e.g. plain-int8)."""
    dtype_args = [] if DTYPES[dtype] == default_dtype else ["--dtype", DTYPES[dtype]]
    quant_args = ["--quantization", quantization] if quantization else []
    return ServerSpec("specpd", config + (f"-{quantization}" if quantization else ""), dtype,
                      (sys.executable, "-m", "specpd", "serve", "--model", model, *SPECPD_SPEC[config], *dtype_args,
                       *quant_args))


def vllm_spec(config: str, dtype: str, model_dir: str, max_num_seqs: int) -> ServerSpec:
    venv = os.path.join(PEERS_DIR, "vllm")
    cmd = [os.path.join(venv, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "default", "--host", "127.0.0.1", "--dtype", DTYPES[dtype],
           "--max-num-seqs", str(max_num_seqs)]
    if config in VLLM_SPEC:
        cmd += ["--speculative-config", json.dumps(VLLM_SPEC[config])]
    env = {"LD_PRELOAD": os.path.join(venv, "lib", "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    return ServerSpec("vllm", config, dtype, tuple(cmd), tuple(env.items()))


def llamacpp_spec(config: str, gguf: str, parallel: int) -> ServerSpec:
    python = os.path.join(PEERS_DIR, "llamacpp", "bin", "python")
    cmd = [python, os.path.join(EVALS_DIR, "peers_llamacpp.py"), "--model", gguf, "--parallel", str(parallel)]
    if config == "ngram":  # vLLM's draft length; llama.cpp's default lookup of 12 tokens drafted nothing on chat
        cmd += ["--spec-type", "ngram-simple", "--ngram-size-n", "3", "--ngram-size-m", "5"]
    return ServerSpec("llamacpp", config, "q4_1", tuple(cmd))


def unsupported(engine: str, config: str, dtype: str) -> str | None:
    """Why a cell does not exist for this engine (recorded), or None."""
    if engine == "llamacpp" and config == "eagle3":
        return "llama.cpp's EAGLE-3 needs the head as a GGUF; specpd's head ships as safetensors only"
    if engine == "llamacpp" and dtype != "q4_1":
        return "llama.cpp runs the GGUF's Q4_1 weights as they are (dtype cell q4_1)"
    return None


# -- processes ---------------------------------------------------------------------------------------
ServerFailed = ServerStartError  # a server exited or was not healthy in time; the message ends with its log's tail


@dataclass
class Running:
    spec: ServerSpec
    proc: subprocess.Popen
    base: str
    log_path: str
    startup_s: float = 0.0


@contextlib.contextmanager
def serve(spec: ServerSpec, timeout_s: float = 900):
    """Start `spec` (a session of its own), yield a Running once /health answers 200, then kill the group."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix=f"peers-{spec.engine}-", suffix=".log", delete=False)
    proc = start_group([*spec.cmd, spec.port_flag, str(port)], log, env=dict(spec.env))
    run = Running(spec, proc, f"http://127.0.0.1:{port}", log.name)
    try:
        run.startup_s = wait_healthy(proc, run.base, timeout_s, spec.name, log.name)
        yield run
    finally:
        stop(proc)
        log.close()
        os.unlink(log.name)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after 20 s."""
    stop_group(proc, signal.SIGTERM, grace_s=20)


def log_tail(path: str, n: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of every live process in process group `pgid`, from /proc."""
    return sum(int(f[11]) + int(f[12]) for f in group_stats(pgid)) / os.sysconf("SC_CLK_TCK")


def idle_cpu_share(run: Running, seconds: float = 5.0) -> float:
    """The share of one core the server burns while it serves nothing (vLLM's CPU worker may spin)."""
    c0 = group_cpu_s(run.proc.pid)
    time.sleep(seconds)
    return (group_cpu_s(run.proc.pid) - c0) / seconds


# -- what each engine reports ------------------------------------------------------------------------
def get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def prometheus_counters(base: str, names: tuple[str, ...]) -> dict[str, float]:
    """parse_prometheus of base/metrics ({} when it does not answer)."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
            return parse_prometheus(resp.read().decode(), names)
    except OSError:
        return {}


def parse_prometheus(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of every sample of each metric in `names` (any labels) in a Prometheus text exposition."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


VLLM_SPEC_COUNTERS = ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total",
                      "vllm:spec_decode_num_draft_tokens_total")


def vllm_tau(before: dict, after: dict) -> dict | None:
    """τ = 1 + accepted / drafts over a cell (a draft = one verify of one request)."""
    drafts = after.get(VLLM_SPEC_COUNTERS[1], 0) - before.get(VLLM_SPEC_COUNTERS[1], 0)
    if not drafts:
        return None
    accepted = after[VLLM_SPEC_COUNTERS[0]] - before.get(VLLM_SPEC_COUNTERS[0], 0)
    draft_tokens = after.get(VLLM_SPEC_COUNTERS[2], 0) - before.get(VLLM_SPEC_COUNTERS[2], 0)
    return {"tau": 1 + accepted / drafts, "drafts": drafts, "accepted": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None}


def specpd_counters(info: dict | None) -> tuple[float, float, int, int]:
    """(committed tokens, verify rounds, request rounds the adaptive policy planned, of them at depth 0) since the
    server started, from its /server_info."""
    info = info or {}
    rounds = (int(info.get("spec_rounds") or 0), int(info.get("spec_rounds_off") or 0))
    if not info.get("spec_verify_count"):
        return 0.0, 0.0, *rounds
    return info["spec_accept_length"] * info["spec_verify_count"], float(info["spec_verify_count"]), *rounds
