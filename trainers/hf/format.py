"""What a Hugging Face Llama/Mixtral folder holds, in our terms: config.json <-> the `model` section, and
tensor names <-> our parameter names (the same names under `model.`, but Mixtral's experts are one tensor
per expert where ours are stacked: `experts.w1` (E, hidden, dim) is `experts.{e}.w1.weight`).

RoPE needs no permutation: our `rope_cos_sin`/`_rotate_half` use HF's non-interleaved layout (frequency i
rotates dims i and i + head_dim/2), so q_proj/k_proj are copied as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainers._base import ConfigError
from trainers.models.config import ModelConfig
from trainers.storage import check_location, describe_error, is_remote, location, read_bytes

__all__ = [
    "CONFIG_FILE",
    "expert_index",
    "hf_config",
    "hf_names",
    "inexact",
    "model_section_from_hf",
    "read_hf_config",
    "read_small",
    "unsupported",
]

CONFIG_FILE = "config.json"
_EXPERT_WEIGHTS = ("w1", "w2", "w3")  # Mixtral: w1 = gate, w3 = up, w2 = down (ours too)

# model.<key> <- config.json key; the keys that fix the shapes and the function computed.
_FROM_HF = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}
_MOE_FROM_HF = {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok"}
# Free with init_from: how long sequences may get (no weight depends on it), what only initialises or
# weighs losses, and how tokens are dropped while training.
_FREE = {"init_from", "max_seq_len", "init_std", "multiple_of"}
_MOE_FREE = {"aux_loss_coef", "z_loss_coef", "capacity_factor"}


# ------------------------------------------------------------------------------------------- config


def read_small(folder: Any, name: str, what: str = "model.init_from") -> bytes | None:
    """A small file of a model folder, local or in a bucket (config.json, the index, tokenizer.json); None
    when it is not there. A store's errors (no credentials, no permission) as one line naming `what`."""
    folder = location(folder)
    try:
        return read_bytes(folder / name)
    except Exception as e:  # noqa: BLE001  (a store's errors become one line; others are raised as they are)
        line = describe_error(e, f"{what}={folder}") if is_remote(folder) else None
        if line is None:
            raise
        raise ConfigError(line) from None


def read_hf_config(hf_dir: str | Path | Any) -> dict[str, Any]:
    """config.json of a Hugging Face model folder, with `rope_theta` where transformers 4.x put it."""
    where = f"model.init_from={hf_dir}"
    raw = read_small(hf_dir, CONFIG_FILE)
    if raw is None:
        check_location(location(hf_dir), "model.init_from", write=False)  # a missing bucket reads as no file
        raise ConfigError(
            f"{where}: no {CONFIG_FILE} there; fix: point it at a folder saved by transformers' "
            f"save_pretrained or `raytrain export` (config.json + *.safetensors)"
        )
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{where}: {CONFIG_FILE} is not JSON ({e}); fix: save the model again") from None
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # transformers 5 keeps it in rope_parameters
    return config


def unsupported(config: dict[str, Any], source: str) -> list[str]:
    """Why a config.json describes a model ours cannot compute (one line each); [] when it can."""
    problems = []
    kind = config.get("model_type")
    if kind not in ("llama", "mixtral"):
        problems.append(f"{source}: model_type={kind!r}; only llama and mixtral (the Llama form) load")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, ok) != ok:
            problems.append(f"{source}: {key}={config[key]!r}; our blocks compute {key}={ok!r}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append(f"{source}: RoPE scaling {rope!r}; only the plain RoPE (rope_type default) loads")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim")
    if head_dim is not None and heads and hidden and head_dim * heads != hidden:
        problems.append(f"{source}: head_dim={head_dim} is not hidden_size/num_attention_heads")
    if kind == "mixtral" and config.get("num_experts_per_tok") == 1:
        problems.append(
            f"{source}: num_experts_per_tok=1; Mixtral gives the one expert weight 1, ours keeps its "
            f"router probability (Switch)"
        )
    window = config.get("sliding_window")
    if window is not None:
        problems.append(f"{source}: sliding_window={window}; our attention sees the whole window")
    return problems


def model_section_from_hf(section: dict[str, Any]) -> dict[str, Any]:
    """The `model` section of a run with `init_from` set: every key that config.json fixes is filled in
    from it; a key the YAML gives must agree (one line per mismatch, naming the fix)."""
    hf_dir = location(section["init_from"])
    if not is_remote(hf_dir):
        hf_dir = hf_dir.expanduser().absolute()  # workers may run in other folders
    source = f"model.init_from={hf_dir}"
    config = read_hf_config(hf_dir)
    problems = unsupported(config, f"{source}: {CONFIG_FILE}")
    derived = _derived(config)
    out = {**section, "init_from": hf_dir}
    mismatches = [*problems, *_merge(out, derived, "model.", hf_dir)]
    if mismatches:
        raise ValueError("\n".join(mismatches))
    return out


def _derived(config: dict[str, Any]) -> dict[str, Any]:
    derived: dict[str, Any] = {ours: config[theirs] for ours, theirs in _FROM_HF.items() if theirs in config}
    derived.setdefault("n_kv_heads", config.get("num_attention_heads"))
    derived.setdefault("tie_embeddings", False)
    if "max_position_embeddings" in config:
        derived["max_seq_len"] = config["max_position_embeddings"]  # a default: the YAML may lower it
    if config.get("model_type") == "mixtral":
        derived["moe"] = {ours: config[theirs] for ours, theirs in _MOE_FROM_HF.items() if theirs in config}
        derived["moe"]["every"] = 1
    else:
        derived["moe"] = None
    return derived


def _merge(out: dict[str, Any], derived: dict[str, Any], prefix: str, hf_dir: Any) -> list[str]:
    """Fill `out` from `derived`; the mismatches between given and derived values, one line each."""
    theirs = {**_FROM_HF, **_MOE_FROM_HF}
    problems = []
    for key, value in derived.items():
        given = out.get(key)
        if key == "n_kv_heads" and given is None:
            given = out.get("n_heads", value)  # None = n_heads
        if key in out and isinstance(value, dict) and isinstance(given, dict):
            problems += _merge(given, value, f"{prefix}{key}.", hf_dir)
        elif key not in out or key in _FREE and given is None:
            out[key] = value
        elif key not in _FREE and given != value:
            told = {
                "every": "MoE in every block (Mixtral)",
                "moe": "model_type='mixtral' (MoE)" if value else "model_type='llama' (dense)",
            }.get(key, f"{theirs.get(key, key)}={value!r}")
            problems.append(
                f"{prefix}{key}={given!r} but {hf_dir}/{CONFIG_FILE} has {told}; fix: remove {prefix}{key} "
                f"from the YAML (init_from sets it) or set it to {value!r}"
            )
    return problems


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


# -------------------------------------------------------------------------------------------- names


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
