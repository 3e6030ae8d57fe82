"""Every architecture file of the installed mlx-lm, built from a tiny random config.

``TINY`` holds plausible small values for the field names mlx-lm's ModelArgs use (``from_dict`` keeps the
ones an architecture knows): hidden 64, 4 layers, 4 query / 2 KV heads of 16, 4 small experts (2 per
token), sliding windows of 8. ``ARCHS`` names every architecture with its overrides and the status the
library gives it (``EXPECT``); an architecture file missing from it is reported as unknown by
tests/test_architectures.py. ``CannotRun`` marks an architecture that mlx-lm itself does not run here,
``NoTinyConfig`` one the table has no tiny config for yet (skipped; the docs page lists both).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

VOCAB = 128
MAX_PARAMS = 3_000_000  # a table row that builds a real-sized model (defaults left in) is a table bug

TINY = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, layer_norm_eps=1e-5, layer_norm_epsilon=1e-5,
    norm_eps=1e-5, layernorm_epsilon=1e-5, max_position_embeddings=4096, rope_theta=10000.0,
    tie_word_embeddings=True, sliding_window=8, sliding_window_size=8, attention_window_size=8,
    # mixtures of experts
    num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_topk=2, moe_intermediate_size=32, expert_ffn_hidden_size=32, ffn_hidden_size=128,
    n_shared_experts=1, num_shared_experts=1, num_shared_expert=1, shared_expert_intermediate_size=32,
    shared_intermediate_size=32, norm_topk_prob=True, first_k_dense_replace=1, routed_scaling_factor=1.0,
    n_group=1, topk_group=1, moe_layer_freq=1, decoder_sparse_step=1, mlp_only_layers=[],
    # flags
    attention_bias=False, mlp_bias=False, use_bias=False, use_qkv_bias=False, use_conv_bias=False,
    conv_bias=False, use_qk_norm=False, qk_norm=False, post_norm=False, hidden_act="silu",
    partial_rotary_factor=0.5, rotary_pct=0.5, rotary_emb_base=10000.0, rotary_dim=8,
    # GPT-style and other field names of the same dimensions
    n_embd=64, n_layer=4, n_head=4, n_ctx=4096, n_positions=4096, n_inner=128, n_kv_heads=2, block_size=4096,
    d_model=64, n_layers=4, n_heads=4, num_layers=4, hidden_dim=64, num_kv_heads=2,
    # multi-head latent attention (MLA)
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    # scaled models (granite, minicpm)
    logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0, residual_multiplier=1.0,
    dim_model_base=64, scale_depth=1.0, scale_emb=1.0,
)

# What the library gives an architecture:
EVICTS = "evicts"  # full-attention layers evict, scored with the real queries through the tap
KEYS_AS_QUERIES = "keys as queries"  # evicts; the model bypasses mlx-lm's attention: keys stand in (warned)
REFUSED = "refused"  # for_model refuses in one line, before any work
EXPECT = (EVICTS, KEYS_AS_QUERIES, REFUSED)


@dataclass(frozen=True)
class CannotRun:
    """mlx-lm itself cannot run this architecture here (a Metal-only kernel, a missing package)."""
    reason: str


@dataclass(frozen=True)
class NoTinyConfig:
    """The table has no tiny config for this architecture yet (its ModelArgs need more than the overrides
    written so far): not tested, and the docs say so."""
    reason: str = "no tiny config in the test's table yet"


def _text(model_type: str, **kw) -> dict:
    return {**TINY, "model_type": model_type, **kw}


ROPE_PARAMETERS = {"rope_theta": 10000.0, "llama_4_scaling_beta": 0.0, "original_max_position_embeddings": 4096}
GEMMA4 = {"sliding_window_pattern": 2, "num_kv_shared_layers": 2, "vocab_size_per_layer_input": VOCAB,
          "hidden_size_per_layer_input": 16, "global_head_dim": 32}
KIMI_LINEAR = {"kda_layers": [1, 3], "num_heads": 4, "head_dim": 16}
ROPE_BY_LAYER_TYPE = {t: {"rope_type": "default", "rope_theta": 1e4} for t in ("full_attention", "sliding_attention")}
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# name -> (ModelArgs overrides, expected status), CannotRun or NoTinyConfig
ARCHS: dict = {
    "cohere": ({}, EVICTS),
    "cohere2": ({}, EVICTS),
    "deepseek": ({}, EVICTS),
    "deepseek_v3": ({}, EVICTS),
    "gemma": ({}, EVICTS),
    "gemma2": ({}, KEYS_AS_QUERIES),
    "glm": ({}, EVICTS),
    "glm4_moe_lite": ({}, EVICTS),
    "gpt_oss": ({}, EVICTS),
    "hunyuan_v1_dense": ({}, EVICTS),
    "internlm2": ({}, EVICTS),
    "internlm3": ({}, EVICTS),
    "iquestloopcoder": ({}, EVICTS),
    "laguna": ({}, EVICTS),
    "llama": ({}, EVICTS),
    "mimo": ({}, EVICTS),
    "mixtral": ({}, EVICTS),
    "muse_glimmer": ({}, EVICTS),
    "nanbeige": ({}, EVICTS),
    "nanochat": ({}, EVICTS),
    "olmo2": ({}, EVICTS),
    "olmo3": ({}, EVICTS),
    "olmoe": ({}, EVICTS),
    "phi": ({}, EVICTS),
    "phi3": ({}, EVICTS),
    "phimoe": ({}, EVICTS),
    "plamo3": ({}, REFUSED),
    "qwen2": ({}, EVICTS),
    "qwen2_vl": ({}, EVICTS),
    "qwen3": ({}, EVICTS),
    "qwen3_vl": ({}, EVICTS),
    "seed_oss": ({}, EVICTS),
    "smollm3": ({}, EVICTS),
    "starcoder2": ({}, EVICTS),
    "talkie": ({}, EVICTS),
    "telechat3": ({}, EVICTS),
    "Klear": ({}, EVICTS),
    "apertus": ({}, EVICTS),
    "bailing_moe": ({}, EVICTS),
    "dots1": ({}, EVICTS),
    "ernie4_5": ({}, EVICTS),
    "ernie4_5_moe": ({}, EVICTS),
    "exaone": ({}, EVICTS),
    "glm4": ({}, EVICTS),
    "gpt2": ({}, EVICTS),
    "gpt_bigcode": ({}, EVICTS),
    "gpt_neox": ({}, EVICTS),
    "granite": ({}, EVICTS),
    "granitemoe": ({}, EVICTS),
    "helium": ({}, EVICTS),
    "lille-130m": ({}, EVICTS),
    "minicpm": ({}, EVICTS),
    "minimax": ({}, EVICTS),
    "nemotron": ({}, EVICTS),
    "qwen2_moe": ({}, EVICTS),
    "qwen3_moe": ({}, EVICTS),
    "stablelm": ({}, EVICTS),
    "falcon_h1": ({}, EVICTS),
    "afm7": ({"num_kv_reuse_layers": 1, "num_heads": 4}, REFUSED),  # KV-reuse layers read another layer's rows
    "afmoe": ({"layer_types": MIXED}, EVICTS),
    "baichuan_m1": ({"sliding_window_layers": [0, 2], "conv_window": 2, "tie_word_embeddings": False}, EVICTS),
    "bailing_hybrid": ({"layer_group_size": 2, "group_norm_size": 1}, EVICTS),
    "bailing_moe_linear": ({"layer_group_size": 2, "group_norm_size": 1}, EVICTS),
    "dbrx": ({"ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
              "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0}}, EVICTS),
    "deepseek_v2": ({"rope_scaling": {"factor": 1.0, "original_max_position_embeddings": 4096}}, EVICTS),
    "exaone4": ({"rope_scaling": None, "sliding_window_pattern": "LLLG"}, EVICTS),
    "exaone_moe": ({"layer_types": MIXED, "is_moe_layer": [False, True, True, True]}, EVICTS),
    "gear": ({"layer_types": MIXED}, EVICTS),
    "gemma3": ({"text_config": _text("gemma3_text", sliding_window_pattern=2)}, EVICTS),
    "gemma3_text": ({"sliding_window_pattern": 2}, EVICTS),
    "glm4_moe": ({"rope_scaling": None}, EVICTS),
    "solar_open": ({}, EVICTS),  # its ModelArgs, glm4_moe's Model
    "granitemoehybrid": ({"layer_types": ["mamba", "attention", "mamba", "attention"], "mamba_n_heads": 4,
                          "mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 8, "mamba_d_conv": 2,
                          "mamba_n_groups": 1, "mamba_expand": 1, "mamba_chunk_size": 8, "mamba_conv_bias": True,
                          "position_embedding_type": "rope"}, EVICTS),
    "kimi_k25": ({"text_config": _text("kimi_k2")}, EVICTS),
    "kimi_linear": ({"linear_attn_config": KIMI_LINEAR,
                     "model_max_length": 4096}, EVICTS),
    "kimi_vl": ({"text_config": _text("deepseek_v3")}, EVICTS),
    "lfm2": ({"conv_L_cache": 3, "block_dim": 64, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
              "block_auto_adjust_ff_dim": False, "full_attn_idxs": [1, 3], "block_ff_dim": 128}, EVICTS),
    "lfm2-vl": ({"text_config": _text("lfm2", conv_L_cache=3, block_dim=64, block_multiple_of=16,
                                      block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                                      full_attn_idxs=[1, 3], block_ff_dim=128)}, EVICTS),
    "lfm2_moe": ({"use_expert_bias": False, "num_dense_layers": 1, "conv_L_cache": 3,
                  "full_attn_idxs": [1, 3]}, EVICTS),
    "llama4": ({"text_config": _text("llama4_text", intermediate_size_mlp=128, no_rope_layers=[1, 1, 1, 0],
                                     interleave_moe_layer_step=1, rope_scaling=None, num_experts_per_tok=1,
                                     attention_chunk_size=8)}, EVICTS),
    "llama4_text": ({"intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0], "attention_chunk_size": 8}, EVICTS),
    "mellum": ({"layer_types": MIXED, "rope_parameters": ROPE_BY_LAYER_TYPE}, EVICTS),
    "minicpm3": ({"rope_scaling": {}}, EVICTS),
    "mistral3": ({"text_config": _text("ministral3", rope_parameters=ROPE_PARAMETERS)}, EVICTS),
    "ministral3": ({"rope_parameters": ROPE_PARAMETERS}, EVICTS),
    "mistral4": ({"rope_parameters": ROPE_PARAMETERS}, EVICTS),
    "muse_spark": CannotRun("its attention runs a Metal kernel (no CPU path)"),
    "pixtral": ({"text_config": _text("llama")}, EVICTS),
    "qwen3_5": ({"text_config": _text("qwen3_5_text", full_attention_interval=2, linear_num_value_heads=2,
                                      linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                      linear_conv_kernel_dim=2)}, EVICTS),
    "qwen3_5_moe": ({"text_config": _text("qwen3_5_moe_text", full_attention_interval=2, linear_num_value_heads=2,
                                          linear_num_key_heads=2, linear_key_head_dim=16,
                                          linear_value_head_dim=16, linear_conv_kernel_dim=2)}, EVICTS),
    "qwen3_next": ({"full_attention_interval": 2, "linear_num_value_heads": 2, "linear_num_key_heads": 2,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 2}, EVICTS),
    "qwen3_vl_moe": ({"text_config": _text("qwen3_moe")}, EVICTS),
    "recurrent_gemma": ({"conv1d_width": 2, "logits_soft_cap": 30.0, "block_types": ["recurrent", "attention"],
                         "lru_width": 64}, REFUSED),  # local attention only (RotatingKVCache)
    "phi3small": CannotRun("mlx-lm's phi3small crashes the process on this CPU (segmentation fault, with "
                           "mlx-lm's own caches)"),
    "plamo": ({"n_shared_head": 2}, EVICTS),
    "qwen": ({"kv_channels": 16}, EVICTS),
    "bitnet": CannotRun("its BitLinear layers run a Metal kernel (no CPU path)"),
    "olmo": CannotRun("needs the ai2-olmo package"),
    "bailing_moe_v3": ({}, EVICTS),
    "deepseek_v32": ({"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8}, REFUSED),
    "deepseek_v41": ({"q_lora_rank": 48, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 16,
                      "index_topk": 8}, REFUSED),
    "gemma3n": ({"text_config": _text("gemma3n_text", num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB,
                                      rope_local_base_freq=10000.0, final_logit_softcapping=30.0, layer_types=MIXED,
                                      activation_sparsity_pattern=[0.0] * 4, hidden_size_per_layer_input=16,
                                      altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
                                      altup_active_idx=0, laurel_rank=8)}, REFUSED),
    # gemma4 as its smaller checkpoints: the last layers read the rows earlier layers returned
    "gemma4": ({"text_config": _text("gemma4_text", **GEMMA4)}, EVICTS),
    "gemma4_text": (GEMMA4, EVICTS),
    "glm_moe_dsa": ({"index_head_dim": 16, "index_n_heads": 2, "index_topk": 8, "topk_method": "noaux_tc",
                     "scoring_func": "sigmoid",
                     "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}, REFUSED),
    "gptj": ({}, EVICTS),
    "hunyuan": ({"use_mixed_mlp_moe": True, "use_cla": True, "cla_share_factor": 2,
                 "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}}, EVICTS),
    "jamba": ({"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2,
               "mamba_d_conv": 2, "mamba_d_state": 8, "mamba_expand": 1}, EVICTS),
    "kimi_k3": ({"text_config": _text("kimi_k3_text", hidden_act="situ", num_experts_per_token=2,
                                      linear_attn_config={**KIMI_LINEAR, "short_conv_kernel_size": 2})}, EVICTS),
    "longcat_flash": ({"attention_method": "MLA", "zero_expert_type": "identity", "zero_expert_num": 1,
                       "mla_scale_q_lora": True,
                       "mla_scale_kv_lora": True}, REFUSED),
    "longcat_flash_ngram": ({"zero_expert_num": 1, "mla_scale_q_lora": True, "mla_scale_kv_lora": True}, REFUSED),
    "mamba": ({"state_size": 8, "conv_kernel": 2, "time_step_rank": 4}, REFUSED),
    "mamba2": ({"num_heads": 4, "state_size": 8, "conv_kernel": 2, "n_groups": 1,
                "time_step_limit": (0.0, float("inf")),
                "time_step_rank": 4}, REFUSED),
    "mimo_v2_flash": ({"hybrid_layer_pattern": [0, 1, 0, 1], "add_swa_attention_sink_bias": False,
                       "add_full_attention_sink_bias": False, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                       "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
                       "swa_head_dim": 16, "swa_v_head_dim": 16, "moe_layer_freq": [0, 1, 1, 1]}, EVICTS),
    "minimax_m3_vl": ({"text_config": _text("minimax_m3", moe_layer_freq=[0, 1, 1, 1])}, EVICTS),
    "nemotron-nas": ({"block_configs": [{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}}] * 3
                      + [{"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}}]}, EVICTS),
    "nemotron_h": ({"mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 8,
                    "conv_kernel": 2,
                    "n_groups": 1, "hybrid_override_pattern": "M*M*", "time_step_limit": (0.0, float("inf"))}, EVICTS),
    "olmo_hybrid": ({"linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "linear_conv_kernel_dim": 2, "linear_allow_neg_eigval": False,
                     "layer_types": ["linear_attention", "full_attention"] * 2}, EVICTS),
    "openelm": ({"num_transformer_layers": 4, "model_dim": 64, "ffn_dim_divisor": 16, "num_query_heads": [4] * 4,
                 "num_kv_heads": [2] * 4, "ffn_multipliers": [2.0] * 4}, EVICTS),
    "phixtral": ({"num_vocab": VOCAB, "model_dim": 64, "num_heads": 4, "num_layers": 4, "rotary_dim": 8}, EVICTS),
    "plamo2": ({"hidden_size_per_head": 16, "mamba_d_state": 8, "mamba_num_heads": 4, "mamba_chunk_size": 8,
                "attention_window_size": 8, "full_attention_idx": [1, 3], "mamba_step": 2}, KEYS_AS_QUERIES),
    "rwkv7": ({"a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8, "decay_low_rank_dim": 8}, REFUSED),
    "spark2_5": ({"hidden_act": "gelu", "rope_parameters": ROPE_BY_LAYER_TYPE}, EVICTS),
    "step3p5": ({"num_attention_groups": 2, "moe_top_k": 2}, EVICTS),
    "youtu_llm": ({}, EVICTS),
    "prism_hadamard_qwen35": NoTinyConfig(),
}


# Configs beside an architecture's row that take another path through the library: id -> (architecture,
# overrides on top of its row, expected status). tests/test_architectures.py checks them as it checks the
# rows; the docs page lists architectures, not these.
VARIANTS: dict = {
    # MLA whose prefill query is as wide as the latent: told apart from the absorbed query by the call
    "deepseek_v3-nope-eq-rank": ("deepseek_v3", {"qk_nope_head_dim": 32}, EVICTS),
    "mistral4-nope-rope-eq-rank": ("mistral4", {"qk_nope_head_dim": 24}, EVICTS),
    # the rows above share KV across layers; these do not
    "gemma4_text-no-shared-kv": ("gemma4_text", {"num_kv_shared_layers": 0}, EVICTS),
    "hunyuan-no-cla": ("hunyuan", {"use_cla": False, "cla_share_factor": 1}, EVICTS),
}


def _module_names(src: str) -> set:
    """Names a module's source binds at its top level: classes (a dataclass ``ModelArgs`` without a base
    class too), functions, assignments and imports (a module that re-exports another's ``Model``)."""
    names = set()
    for node in ast.parse(src).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def architecture_files() -> list:
    """Names of the installed mlx-lm's model files: every module that binds ``Model`` and ``ModelArgs``,
    however it does (read from the source, so a file that cannot be imported here is listed too)."""
    import mlx_lm.models as models

    out = []
    for info in pkgutil.iter_modules(models.__path__):
        spec = importlib.util.find_spec(f"mlx_lm.models.{info.name}")
        src = open(spec.origin).read() if spec and spec.origin else ""
        if {"Model", "ModelArgs"} <= _module_names(src):
            out.append(info.name)
    return sorted(out)


def build(name: str, seed: int = 0, extra: dict | None = None):
    """The tiny random fp32 model of architecture ``name`` (a ``ARCHS`` row that is not CannotRun), with
    ``extra`` overrides on top of its row (a ``VARIANTS`` entry)."""
    overrides, _ = ARCHS[name]
    module = importlib.import_module(f"mlx_lm.models.{name}")
    args = module.ModelArgs.from_dict({**TINY, "model_type": name, **overrides, **(extra or {})})
    mx.random.seed(seed)
    model = module.Model(args)
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    if n > MAX_PARAMS:
        raise AssertionError(f"{name}: the tiny config builds {n:,} parameters: a default left in (add an override)")
    mx.eval(model.parameters())
    return model
