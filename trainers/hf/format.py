"""A Hugging Face Llama/Mixtral folder in our terms: config.json written from a `ModelConfig` (reading it is
`trainers.sections.hf_config`'s), and tensor names (ours under `model.`, but Mixtral has one tensor per
expert where ours are stacked: `experts.w1` (E, hidden, dim) is `experts.{e}.w1.weight`).

RoPE needs no permutation: `rope_cos_sin` uses HF's non-interleaved layout, so q_proj/k_proj copy as they are.
"""

from __future__ import annotations

from typing import Any

from trainers.sections.hf_config import CONFIG_FILE, model_section_from_hf, read_small
from trainers.sections.model import ModelConfig

__all__ = [
    "CONFIG_FILE",
    "expert_index",
    "hf_config",
    "hf_names",
    "inexact",
    "model_section_from_hf",
    "read_small",
]

_EXPERT_WEIGHTS = ("w1", "w2", "w3")  # Mixtral: w1 = gate, w3 = up, w2 = down (ours too)


def hf_config(cfg: ModelConfig, dtype: str, eos_id: int | None, bos_id: int | None) -> dict[str, Any]:
    """config.json for `cfg` (LlamaForCausalLM, or MixtralForCausalLM with `moe`); `dtype` float32 or
    bfloat16. rope_theta is written both where transformers 4.x and 5 read it."""
    config: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if cfg.moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if cfg.moe else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if cfg.moe:
        config.update(
            num_local_experts=cfg.moe.num_experts,
            num_experts_per_tok=cfg.moe.top_k,
            router_aux_loss_coef=cfg.moe.aux_loss_coef,
            output_router_logits=False,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    return config


def inexact(cfg: ModelConfig) -> tuple[list[str], list[str]]:
    """(what no HF class can hold, what the HF class computes differently), one line each."""
    refused, differs = [], []
    if cfg.moe is not None and cfg.moe.every > 1:
        refused.append(
            f"model.moe.every={cfg.moe.every}: MixtralForCausalLM has experts in every block; no "
            f"Llama/Mixtral class holds MoE in every {cfg.moe.every}th block only"
        )
    if cfg.moe is not None and cfg.moe.capacity_factor is not None:
        differs.append(
            f"model.moe.capacity_factor={cfg.moe.capacity_factor}: Mixtral has no expert capacity (it runs "
            f"dropless), so its outputs differ wherever this model dropped tokens"
        )
    if cfg.moe is not None and cfg.moe.top_k == 1:
        differs.append(
            "model.moe.top_k=1: Mixtral renormalises the top-k weights (one expert gets weight 1), this model "
            "scales the expert by its router probability"
        )
    return refused, differs


def hf_names(fqn: str, num_experts: int | None = None) -> list[str]:
    """The HF tensor name(s) of our parameter `fqn`: one, or one per expert for stacked expert weights."""
    if expert_index(fqn) is None:
        return [fqn if fqn == "lm_head.weight" else f"model.{fqn}"]
    stem, weight = fqn.rsplit(".", 1)
    return [f"model.{stem}.{e}.{weight}.weight" for e in range(num_experts or 0)]


def expert_index(fqn: str) -> str | None:
    """'w1'/'w2'/'w3' for a stacked expert weight (`...block_sparse_moe.experts.w1`), else None."""
    stem, _, last = fqn.rpartition(".")
    return last if stem.endswith("block_sparse_moe.experts") and last in _EXPERT_WEIGHTS else None
