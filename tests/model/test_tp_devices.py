"""Tensor parallelism's device and collective selection (specpd/model/tp.py), checkable without a GPU: NCCL for the
all-reduces on CUDA with a GPU per rank, gloo on a CPU and for the control messages, inputs on the host between
ranks, and a GPU count short of --tp-size refused at start-up naming both numbers."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from specpd.attention.metadata import AttentionMetadata
from specpd.config import CacheConfig, EngineConfig
from specpd.engine.llm_engine import LLMEngine
from specpd.model import tp
from tests.model.hf_models import save_tiny_model


def test_collective_backend_and_rank_devices():
    assert tp.collective_backend("cuda") == "nccl" and tp.collective_backend("cuda:1") == "nccl"
    assert tp.collective_backend("cpu") == "gloo"
    assert tp.rank_device("cuda", 2) == torch.device("cuda", 2)
    assert tp.rank_device("cpu", 3) == torch.device("cpu")


def test_a_gpu_per_rank():
    tp.check_devices("cuda", 2, gpus=2)
    tp.check_devices("cpu", 4, gpus=0)
    tp.check_devices("cuda", 1, gpus=0)  # TP 1 has no group
    with pytest.raises(ValueError, match="--tp-size 4 on --device cuda needs a GPU per rank; this machine has 2"):
        tp.check_devices("cuda", 4, gpus=2)


def test_cpu_group_is_gloo_for_both():
    store = dist.HashStore()
    group = tp.TPGroup(store, 0, 1, "cpu")
    assert group.backend == "gloo" and group.collectives is group.group
    x = torch.arange(4, dtype=torch.bfloat16)
    assert torch.equal(group.all_reduce(x), torch.arange(4, dtype=torch.bfloat16))


def test_forward_inputs_cross_on_the_host():
    meta = AttentionMetadata.build([2, 1], [5, 3], [[1, 2], [3]], 4, tree_masks=[torch.ones(2, 2).bool().tril(), None])
    wired = tp._wire_meta(dataclasses.replace(meta, plan=object()))
    assert wired.plan is None and all(not t.is_cuda for t in (wired.qo_indptr, wired.page_table, wired.tree_mask))
    back = tp._on_device(wired, torch.device("cpu"))
    assert back.page_table.tolist() == meta.page_table.tolist() and back.q_lens_host == [2, 1]


def test_tp_on_cuda_without_gpus_is_refused_at_start(tmp_path):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per rank")
    save_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="--tp-size 2 on --device cuda needs a GPU per rank"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", tp_size=2, cache=CacheConfig(num_pages=8)))
