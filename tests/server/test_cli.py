"""The `specpd` command: flag generation (no model) and `generate --json` end to end."""
import json
import os
import subprocess
import sys

import pytest

from specpd import machine
from specpd.config import (DEFAULT_SHAPES, NGRAM_SHAPE_ROWS_COST, CacheConfig, EngineConfig, SchedulerConfig,
                           SpecConfig)
from specpd.server.cli import build_parser, config_from_args, ready_message

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_engine_flags_come_from_the_config_fields():
    args = build_parser().parse_args(["serve", "--page-size", "32", "--kv-cache-memory-mb", "99",
                                      "--max-num-batched-tokens", "128", "--max-running-requests", "4",
                                      "--chunked-prefill-size", "64", "--dtype", "bfloat16",
                                      "--attention-backend", "triton", "--max-model-len", "512", "--seed", "7"])
    assert config_from_args(args) == EngineConfig(
        dtype="bfloat16", attention_backend="triton", seed=7, max_model_len=512,
        cache=CacheConfig(page_size=32, kv_cache_memory_mb=99),
        scheduler=SchedulerConfig(max_num_batched_tokens=128, max_running_requests=4, chunked_prefill_size=64))
    defaults = build_parser().parse_args(["serve"])
    assert config_from_args(defaults) == EngineConfig()
    assert (defaults.host, defaults.port, defaults.role) == ("127.0.0.1", 8000, "unified")


def test_ready_message_is_a_curl_line():
    msg = ready_message("0.0.0.0", 8000, "default")
    curl = msg.splitlines()[-1]
    assert curl.startswith("curl http://127.0.0.1:8000/v1/chat/completions ")
    assert json.loads(curl.split(" -d ", 1)[1].strip("'"))["model"] == "default"


def test_generate_json():
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "specpd", "generate", "--model", "default", "--prompt", "The capital of France is",
           "--max-new-tokens", "4", "--temperature", "0", "--kv-cache-memory-mb", "32", "--max-model-len", "256",
           "--json"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    out = json.loads(lines[0])
    assert out["completion_tokens"] == len(out["token_ids"]) == 4 and out["finish_reason"] == "length"
    assert "Paris" in out["text"] and out["prompt_tokens"] > 0
    assert out["ttft_s"] > 0 and out["tokens_per_s"] > 0 and out["e2e_s"] >= out["ttft_s"]


def test_prefix_caching_is_on_by_default_and_every_anchor_spelling_turns_it_off():
    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve"])).cache.enable_prefix_caching is True
    for flag in ("--disable-prefix-caching", "--disable-radix-cache", "--no-enable-prefix-caching"):
        assert config_from_args(parser.parse_args(["serve", flag])).cache.enable_prefix_caching is False, flag


def test_an_eagle_family_head_merges_ngrams_by_default_and_no_spec_ngram_runs_it_alone():
    """`--speculative-algorithm eagle3` is the hybrid (the best measured); --no-spec-ngram the head alone."""
    def spec(*flags):
        return config_from_args(build_parser().parse_args(["serve", *flags])).spec.validate()

    for alg in ("eagle", "eagle3", "mtp"):
        shipped = spec("--speculative-algorithm", alg, "--draft-model", "default")
        assert shipped.hybrid and (shipped.num_steps, shipped.topk, shipped.num_draft_tokens) == DEFAULT_SHAPES["hybrid"]
        alone = spec("--speculative-algorithm", alg, "--draft-model", "default", "--no-spec-ngram")
        assert not alone.hybrid and (alone.num_steps, alone.topk, alone.num_draft_tokens) == DEFAULT_SHAPES[alg]
    assert not spec("--speculative-algorithm", "ngram").hybrid  # n-grams alone: nothing to merge into
    assert not spec().hybrid
    with pytest.raises(ValueError, match="spec_ngram merges"):
        spec("--speculative-algorithm", "ngram", "--spec-ngram")


def test_draft_quantization_flag():
    """--spec-draft-quantization: auto (the draft follows a quantized target into int8 blocks), int8, none."""
    def spec(*flags):
        return config_from_args(build_parser().parse_args(["serve", *flags])).spec.validate()

    assert spec().spec_draft_quantization == "auto"
    assert spec("--spec-draft-quantization", "none").spec_draft_quantization == "none"
    with pytest.raises(SystemExit):
        spec("--spec-draft-quantization", "int4")
    with pytest.raises(ValueError, match="spec_draft_quantization"):
        SpecConfig("eagle3", draft_model="default", spec_draft_quantization="int4").validate()


def test_ngram_defaults_follow_the_machine_and_flags_win():
    """n-grams alone: a chain of 8 at min match 1 where verify rows cost compute (no AMX), the tree with AMX;
    merged into a head's tree: min match 2. Every explicit flag wins."""
    def spec(*flags):
        return config_from_args(build_parser().parse_args(["serve", *flags])).spec.validate()

    alone = spec("--speculative-algorithm", "ngram")
    shape = DEFAULT_SHAPES["ngram"] if machine.isa() == "amx" else NGRAM_SHAPE_ROWS_COST
    assert (alone.num_steps, alone.topk, alone.num_draft_tokens) == shape and alone.ngram_min_match == 1
    assert spec("--speculative-algorithm", "eagle3", "--draft-model", "default").ngram_min_match == 2
    given = spec("--speculative-algorithm", "ngram", "--spec-ngram-min-match", "3", "--spec-num-steps", "4",
                 "--spec-topk", "2", "--spec-num-draft-tokens", "7")
    assert (given.num_steps, given.topk, given.num_draft_tokens, given.ngram_min_match) == (4, 2, 7, 3)
    with pytest.raises(ValueError, match="spec_ngram_min_match"):
        spec("--speculative-algorithm", "ngram", "--spec-ngram-min-match", "9")


def test_free_port_draws_outside_the_ephemeral_range_and_never_twice():
    """free_port: bindable, below the kernel's ephemeral range (which outgoing connections and port-0 binds
    draw from), and not one this process already handed out."""
    import socket

    from specpd.server.launch import _ephemeral_low, free_port
    ports = [free_port() for _ in range(100)]
    assert len(set(ports)) == 100 and all(1024 <= p < _ephemeral_low() for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
