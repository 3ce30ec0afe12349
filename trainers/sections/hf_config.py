"""config.json of a Hugging Face Llama/Mixtral folder (local or in a bucket), read into our `model` section:
the keys it fixes, the models ours cannot compute, the mismatches with the YAML (one line each). Below
`trainers.sections.model`, which fills itself from here; writing config.json is `trainers.hf.format`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainers._base import ConfigError
from trainers.storage import absolute, check_location, location, one_line_errors, read_bytes

__all__ = ["CONFIG_FILE", "model_section_from_hf", "read_hf_config", "read_small", "unsupported"]

CONFIG_FILE = "config.json"

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


def read_small(folder: Any, name: str) -> bytes | None:
    """A small file of a model folder, local or in a bucket (config.json, the index, tokenizer.json); None
    when it is not there. A store's errors (no credentials, no permission) as one line naming init_from."""
    folder = location(folder)
    with one_line_errors(folder, f"model.init_from={folder}"):
        return read_bytes(folder / name)


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
    hf_dir = absolute(location(section["init_from"]).expanduser())  # workers may run in other folders
    config = read_hf_config(hf_dir)
    out = {**section, "init_from": hf_dir}
    problems = unsupported(config, f"model.init_from={hf_dir}: {CONFIG_FILE}")
    problems += _merge(out, _derived(config), "model.", hf_dir)
    if problems:
        raise ValueError("\n".join(problems))
    return out


def _derived(config: dict[str, Any]) -> dict[str, Any]:
    derived: dict[str, Any] = {ours: config[theirs] for ours, theirs in _FROM_HF.items() if theirs in config}
    derived.setdefault("n_kv_heads", config.get("num_attention_heads"))
    derived.setdefault("tie_embeddings", False)
    if "max_position_embeddings" in config:
        derived["max_seq_len"] = config["max_position_embeddings"]  # a default: the YAML may lower it
    moe = {ours: config[theirs] for ours, theirs in _MOE_FROM_HF.items() if theirs in config}
    derived["moe"] = {**moe, "every": 1} if config.get("model_type") == "mixtral" else None
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
