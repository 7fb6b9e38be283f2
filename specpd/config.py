"""Frozen configuration dataclasses. Derived values are properties, never mutated fields."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): a token's K and V are one latent row, `latent_dim` wide
    (the normed c_kv of kv_lora_rank, then the RoPE'd shared key k_pe), expanded per head by kv_b_proj."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden (V2-Lite); else q_a_proj -> norm -> q_b_proj
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the RoPE dims come in (x0, x1), (x2, x3) pairs (HF apply_rotary_pos_emb_interleave)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts (DeepSeek-V3, GLM-4.5): layer i is MoE when i >= first_k_dense_replace and
    i % moe_layer_freq == 0, a dense MLP of intermediate_size before."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str = "sigmoid"  # sigmoid | softmax
    # noaux_tc: e_score_correction_bias steers the choice (groups scored by their top-2 sum), never the weights;
    # group_limited_greedy: groups scored by their best expert; greedy: no groups
    topk_method: str = "noaux_tc"
    moe_layer_freq: int = 1

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


MOE_MODEL_TYPES = ("deepseek_v3", "glm4_moe")  # ModelConfig.architecture of the MoE families (specpd/model/moe_lm.py)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family / Qwen2 / Qwen3 decoder, or of a DeepSeek-V3 / GLM-4.5 MoE (`mla`, `moe`),
    read from an HF config.json dict."""

    architecture: str  # "llama" | "qwen2" | "qwen3" | "deepseek_v3" | "glm4_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen dict items
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v bias
    qk_norm: bool = False  # qwen3: per-head RMSNorm on q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # the MoE families (None / 1.0 / 0 for the dense ones). MLA: num_kv_heads is 1 (the latent row every head reads)
    # and head_dim the q/k head dim (nope + rope)
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    partial_rotary_factor: float = 1.0  # GLM-4.5: RoPE on the first half of each head's dims
    num_nextn_predict_layers: int = 0  # MTP layers the checkpoint ships after its decoder layers

    @property
    def rope_dim(self) -> int:
        """The dims of a head RoPE rotates."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type in MOE_MODEL_TYPES:
            return _moe_family(cls, cfg, model_type)
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r} (supported: llama, mistral, qwen2, qwen3)")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=tuple(sorted(_hashable(scaling).items())) if scaling else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _moe_family(cls, cfg: dict[str, Any], model_type: str) -> ModelConfig:
    """DeepSeek-V3 (MLA) and GLM-4.5 (GQA, partial RoPE, q/k norm) MoE configs, HF's names and defaults."""
    num_heads = cfg["num_attention_heads"]
    mla = None
    if model_type == "deepseek_v3":
        mla = MLAConfig(kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg.get("q_lora_rank"),
                        qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                        v_head_dim=cfg["v_head_dim"], rope_interleave=bool(cfg.get("rope_interleave", True)))
    moe = MoEConfig(num_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"], n_shared_experts=cfg.get("n_shared_experts") or 0,
                    n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                    first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                    scoring_func=cfg.get("scoring_func", "sigmoid"), topk_method=cfg.get("topk_method", "noaux_tc"),
                    moe_layer_freq=cfg.get("moe_layer_freq", 1))
    if moe.scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"unsupported MoE scoring_func {moe.scoring_func!r} (supported: sigmoid, softmax)")
    if moe.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise ValueError(f"unsupported MoE topk_method {moe.topk_method!r} "
                         f"(supported: noaux_tc, greedy, group_limited_greedy)")
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    eos = cfg.get("eos_token_id")
    return cls(
        architecture=model_type, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=1 if mla else cfg.get("num_key_value_heads") or num_heads,
        head_dim=mla.qk_head_dim if mla else cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rope_scaling=tuple(sorted(_hashable(scaling).items())) if scaling else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
        mla=mla, moe=moe,
        partial_rotary_factor=float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def _hashable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    kv_cache_memory_mb: int = 512  # memory budget for the page pool
    num_pages: int | None = None  # overrides the budget when set
    # prefix caching (specpd/kv/radix.py): finished and preempted requests leave their full pages in a radix
    # tree; a new request reuses its longest cached prefix (--disable-prefix-caching turns it off)
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per step (decode + prefill chunks)
    max_running_requests: int = 64
    chunked_prefill_size: int = 512  # largest prefill chunk one request may take in a step


SPEC_ALGORITHMS = ("none", "eagle", "eagle3", "mtp", "ngram", "replay")
MODEL_FREE_ALGORITHMS = ("ngram", "replay")  # no draft model, no draft KV, nothing for P to run
EAGLE_FAMILY = ("eagle", "eagle3", "mtp")  # a draft model over the target's hidden states; hybrid by default
DRAFT_MODES = ("both", "decode-only")  # SpecConfig.draft_mode (PD serving)
# (num_steps, topk, num_draft_tokens) when the user gives none of them: the shapes evals/spec_tuning.py
# chose on training-split prompts at the served thread count (spec_tuning*.json, docs/results.md); adaptive
# speculation then trims each round per request. "hybrid" is the EAGLE family's default (the head's tree with
# n-gram candidates merged); the head alone (--no-spec-ngram) takes its own shape; eagle, with no shipped head,
# a chain of 4.
DRAFT_QUANTIZATIONS = ("auto", "none", "int8")
DEFAULT_SHAPES = {"ngram": (6, 2, 12), "eagle": (4, 1, 5), "eagle3": (2, 4, 5), "mtp": (3, 4, 8),
                  "hybrid": (2, 4, 6), "replay": (4, 1, 5)}
# n-gram drafting alone on a CPU without AMX (AVX512-BF16 / AVX2): there a b1 forward streams the weights while a
# few-row one multiplies them, so each verify row costs compute (spec_round_cost.json) and a chain of 8 at min
# match 1 beats a tree; with AMX a row is nearly free and DEFAULT_SHAPES["ngram"]'s tree stays
NGRAM_SHAPE_ROWS_COST = (8, 1, 9)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding. topk == 1 drafts a chain; topk > 1 an EAGLE-2 style tree."""

    speculative_algorithm: str = "none"  # none | eagle | eagle3 | mtp | ngram | replay (tests/benchmarks)
    draft_model: str | None = None
    spec_num_steps: int | None = None  # draft depth S (default: DEFAULT_SHAPES)
    spec_topk: int | None = None  # K
    spec_num_draft_tokens: int | None = None  # T, root included; default S + 1 for a chain, 8 for a tree
    # PD only: where the draft extend over the prompt runs. "both": P runs it and hands D the draft KV,
    # first-round top-k and draft hidden; "decode-only": P hands D the target hidden states and D runs it.
    draft_mode: str = "both"
    # adaptive speculation (specpd/spec/policy.py): each round, per request, the draft depth
    # (0 = a plain decode step) that maximises expected committed tokens per second
    spec_adaptive: bool = True
    # test-only: a fixed cost table instead of the startup measurement, and no engine-wide or online
    # learning, so a request's rounds depend on its own history alone (PD and unified then agree)
    spec_adaptive_pinned: bool = False
    # n-gram drafting (specpd/spec/draft/ngram.py): the algorithm "ngram", or merged into an EAGLE-family
    # tree (hybrid); contexts of min..max match tokens; a store of recent outputs shared across requests
    # bounded to spec_ngram_store_tokens tokens (0: off). spec_ngram None (the default): hybrid for an
    # EAGLE-family algorithm, the best configuration measured (docs/results.md, spec_workloads.json); False:
    # the draft model alone
    spec_ngram: bool | None = None
    # None: 1 for the n-gram drafter alone (a one-token match still drafts; the policy prices its weaker guesses),
    # 2 merged into a head's tree (the head drafts where only one token matches; 1 read no faster there)
    spec_ngram_min_match: int | None = None
    spec_ngram_max_match: int = 8
    spec_ngram_store_tokens: int = 65536
    # the draft model's linears on CPU (specpd/model/quant.py, quantize_draft): "auto" quantizes them to int8
    # (Q8_0 blocks) when the target runs quantized, "int8" always, "none" never. A draft's weights are read every
    # draft forward, and only acceptance depends on their precision: the target's verify keeps output exact
    spec_draft_quantization: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm != "none"

    @property
    def model_free(self) -> bool:
        return self.speculative_algorithm in MODEL_FREE_ALGORITHMS

    @property
    def hybrid(self) -> bool:
        """n-gram candidates merged into the draft model's tree (--spec-ngram; on by default for EAGLE-family)."""
        if self.spec_ngram is None:
            return self.speculative_algorithm in EAGLE_FAMILY
        return self.spec_ngram

    @property
    def ngram_min_match(self) -> int:
        if self.spec_ngram_min_match is not None:
            return self.spec_ngram_min_match
        return 2 if self.hybrid else 1

    @property
    def _shape(self) -> tuple[int, int, int]:
        if self.speculative_algorithm == "ngram":
            from specpd import machine
            return DEFAULT_SHAPES["ngram"] if machine.isa() == "amx" else NGRAM_SHAPE_ROWS_COST
        return DEFAULT_SHAPES.get("hybrid" if self.hybrid else self.speculative_algorithm, (4, 1, 5))

    @property
    def num_steps(self) -> int:
        return self.spec_num_steps if self.spec_num_steps is not None else self._shape[0]

    @property
    def topk(self) -> int:
        if self.spec_topk is not None:
            return self.spec_topk
        return self._shape[1] if self.spec_num_steps is None else 1

    @property
    def num_draft_tokens(self) -> int:
        if self.spec_num_draft_tokens is not None:
            return self.spec_num_draft_tokens
        if self.spec_num_steps is None and self.spec_topk is None:
            return self._shape[2]
        return self.num_steps + 1 if self.topk == 1 else 8

    def validate(self) -> "SpecConfig":
        if self.speculative_algorithm not in SPEC_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {SPEC_ALGORITHMS}, got {self.speculative_algorithm!r}")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        if self.num_steps < 1 or self.topk < 1:
            raise ValueError("spec_num_steps and spec_topk must be >= 1")
        if not 2 <= self.num_draft_tokens:
            raise ValueError(f"spec_num_draft_tokens must be >= 2, got {self.num_draft_tokens}")
        if self.topk == 1 and self.num_draft_tokens > self.num_steps + 1:
            raise ValueError(f"a chain of {self.num_steps} steps has at most {self.num_steps + 1} tokens, "
                             f"got spec_num_draft_tokens={self.num_draft_tokens}")
        if self.spec_ngram and self.speculative_algorithm not in EAGLE_FAMILY:
            raise ValueError(f"spec_ngram merges n-gram candidates into an EAGLE-family tree; "
                             f"speculative_algorithm is {self.speculative_algorithm!r} (use 'ngram' alone)")
        if not 1 <= self.ngram_min_match <= self.spec_ngram_max_match:
            raise ValueError(f"need 1 <= spec_ngram_min_match <= spec_ngram_max_match, got "
                             f"{self.ngram_min_match} and {self.spec_ngram_max_match}")
        if self.spec_ngram_store_tokens < 0:
            raise ValueError(f"spec_ngram_store_tokens must be >= 0, got {self.spec_ngram_store_tokens}")
        if self.spec_draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"spec_draft_quantization must be one of {DRAFT_QUANTIZATIONS}, "
                             f"got {self.spec_draft_quantization!r}")
        return self


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    # auto: bfloat16 where the CPU computes it natively (AMX / AVX512-BF16), else float32 (specpd.machine)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    # auto: cpu (the fused C kernel) on a CPU with a C compiler, else torch; on a GPU triton with CUDA graphs (it
    # plans into their static buffers and has tree masks), without them flashinfer where installed, else triton
    attention_backend: str = "auto"  # auto | cpu | torch | triton | flashinfer
    seed: int = 0
    max_model_len: int | None = None  # defaults to the model's context length
    # weights of the decoder's linears and the LM head (specpd.model.quant): auto | gguf | int8 | int4 | none;
    # auto: gguf (the file's Q4_0 / Q4_1 / Q8_0 blocks as they are) for a GGUF, none (dense) for an HF directory
    quantization: str = "auto"
    num_threads: int | None = None  # torch.set_num_threads for this process; None: OMP_NUM_THREADS, else its cores
    # tensor-parallel ranks (specpd/model/tp.py): one process each, heads and MLP split, KV sharded by head;
    # --num-threads is then per rank (default: the cores / tp_size)
    tp_size: int = 1
    # CUDA graphs (specpd/model/cuda_graphs.py): decode, verify and draft forwards of up to cuda_graph_max_bs
    # requests replayed from graphs captured per batch-size bucket; None: on for a CUDA device at TP 1, else off
    cuda_graphs: bool | None = None
    cuda_graph_max_bs: int = 64
    # test-only: the graphs' padded static-buffer path run eagerly, without capture (what a CPU can check)
    cuda_graph_eager: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def resolved(self) -> "EngineConfig":
        """This config with every 'auto' decided for this machine (specpd.machine); explicit values stay."""
        from dataclasses import replace

        from specpd import machine
        dtype = machine.default_dtype(self.device) if self.dtype == "auto" else self.dtype
        backend = self.attention_backend
        if backend == "auto":
            gpu_graphs = self.graphs and self.device != "cpu"
            backend = "triton" if gpu_graphs else machine.default_attention_backend(self.device)
        return replace(self, dtype=dtype, attention_backend=backend)

    @property
    def graphs(self) -> bool:
        """--cuda-graphs if given, else on for a CUDA device at tensor-parallel size 1 (where the attention backend
        plans into static buffers: specpd/model/cuda_graphs.py `graphs_on`)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return self.device.startswith("cuda") and self.tp_size == 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = ({g.name: getattr(value, g.name) for g in fields(value)}
                           if hasattr(value, "__dataclass_fields__") else value)
        return out
