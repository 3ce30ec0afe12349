"""Start a run from a Hugging Face folder (`model.init_from`): each rank reads only what it holds.

The model is built on the meta device; an engine that shards (FSDP, pipeline, experts) shards it while it
is still meta and then allocates only this rank's shards (`Engine.materialize`); `load_pretrained` fills
every parameter with its part of the HF tensor, read by `safe_open` slices (rows of a dim-0 shard, the
experts of an expert shard), so no rank ever holds a whole tensor it does not own. Engines that keep the
whole model on every rank (none, ddp, deepspeed) get it materialised and filled before they wrap it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainers._base import ConfigError
from trainers.hf.format import expert_index, hf_names
from trainers.models.config import ModelConfig

__all__ = ["PretrainedWeights", "check_pretrained", "clean_fqn", "load_pretrained", "materialize"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Wrappers applied from outside add these to parameter names; checkpoints and HF names have none.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
# Tensors some savers add that are not weights (old Llama checkpoints saved RoPE's inverse frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def clean_fqn(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name.removeprefix("module.")  # DistributedDataParallel's


class PretrainedWeights:
    """The safetensors files of an HF folder (one file, or shards listed by model.safetensors.index.json),
    opened lazily; `read` returns a whole tensor or a range of its rows, as stored (any dtype)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.weight_map = self._weight_map()
        self._open: dict[str, object] = {}

    def _weight_map(self) -> dict[str, str]:
        index, single = self.dir / INDEX_FILE, self.dir / SINGLE_FILE
        if index.is_file():
            return json.loads(index.read_text())["weight_map"]
        if single.is_file():
            with safe_open(single, "pt") as f:
                return {name: SINGLE_FILE for name in f.keys()}
        raise ConfigError(
            f"model.init_from={self.dir}: no {SINGLE_FILE} or {INDEX_FILE} there; fix: save the model with "
            f"safetensors (save_pretrained's default) or point init_from at such a folder"
        )

    def _file(self, name: str):
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(self.dir / file, "pt")
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if rows is None:
            return self._file(name).get_tensor(name)
        return self._file(name).get_slice(name)[rows[0] : rows[1]]

    def close(self) -> None:
        self._open.clear()


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a folder for `cfg` must hold (from a meta-device build)."""
    from trainers.models import build_model

    out = {}
    for fqn, p in build_model(cfg, device="meta").named_parameters():
        shape = tuple(p.shape[1:]) if expert_index(fqn) else tuple(p.shape)
        for name in hf_names(fqn, p.shape[0]):
            out[name] = shape
    return out


def check_pretrained(cfg: ModelConfig) -> None:
    """Before any worker starts: the folder's tensors are exactly the model's, with the model's shapes."""
    weights = PretrainedWeights(cfg.init_from)
    expected = expected_tensors(cfg)
    found = {n for n in weights.weight_map if not n.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_embeddings:
        found.discard("lm_head.weight")  # a tied model's head is its embedding
    where = f"model.init_from={cfg.init_from}"
    missing, extra = sorted(set(expected) - found), sorted(found - set(expected))
    if missing or extra:
        told = "; ".join(
            f"{what} {len(names)}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for what, names in (("missing", missing), ("unexpected", extra))
            if names
        )
        raise ConfigError(
            f"{where}: its tensors are not those of the model config.json describes ({told}); fix: use a "
            f"Llama/Mixtral folder saved by transformers or `raytrain export`"
        )
    for name, shape in expected.items():
        if weights.shape(name) != shape:
            raise ConfigError(
                f"{where}: {name} has shape {list(weights.shape(name))}, config.json implies {list(shape)}; "
                f"fix: the folder's weights and config.json disagree, save the model again"
            )


def materialize(roots: list[nn.Module], device: torch.device | str) -> None:
    """Allocate the (meta) storage of every module under `roots` on `device`, uninitialised, and compute
    the RoPE tables of every Transformer among them."""
    from trainers.models import Transformer

    for root in roots:
        root.to_empty(device=device)
    for root in roots:
        for m in root.modules():
            if isinstance(m, Transformer):
                m.init_rope(device)


@torch.no_grad()
def load_pretrained(model: nn.Module, hf_dir: str | Path) -> int:
    """Copy into each parameter of `model` (materialised; plain tensors or DTensor shards) its part of
    the HF tensor; returns the number of bytes read. Every parameter must be found."""
    weights = PretrainedWeights(hf_dir)
    read = 0
    try:
        for name, param in model.named_parameters():
            fqn = clean_fqn(name)
            local, rows = _local_part(param)
            if local.numel() == 0:
                continue
            value = _read(weights, fqn, rows, param.shape[0])
            local.copy_(value.view(local.shape))
            read += value.numel() * value.element_size()
    finally:
        weights.close()
    return read


def _read(weights: PretrainedWeights, fqn: str, rows: tuple[int, int], dim0: int) -> torch.Tensor:
    if expert_index(fqn) is None:
        (name,) = hf_names(fqn)
        return weights.read(name, None if rows == (0, dim0) else rows)
    names = hf_names(fqn, dim0)[rows[0] : rows[1]]  # rows of a stacked expert weight are experts
    return torch.stack([weights.read(n) for n in names])


def _local_part(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """This rank's tensor of `param` and the rows [start, stop) of the whole tensor it holds (dim 0).
    DTensors here are 1-D meshes sharded on dim 0 (FSDP2, expert parallelism) with torch.chunk's split."""
    if not isinstance(param, DTensor):
        return param.data, (0, param.shape[0])
    local = param.to_local()
    placements = param.placements
    if len(placements) != 1 or not isinstance(placements[0], (Shard, Replicate)):
        raise NotImplementedError(f"loading into a DTensor placed {placements} (a 1-D Shard(0) mesh expected)")
    if isinstance(placements[0], Replicate):
        return local, (0, param.shape[0])
    if placements[0].dim != 0:
        raise NotImplementedError(f"loading into a DTensor sharded on dim {placements[0].dim}")
    n, k = param.shape[0], param.device_mesh.size()
    start = min(param.device_mesh.get_local_rank() * math.ceil(n / k), n)
    return local, (start, start + local.shape[0])


def check_init_from(cfg: ModelConfig, data_dir: str | Path) -> None:
    """Before any worker starts: the folder's tensors fit the model, and the data was tokenized with the
    folder's tokenizer (when it has one: the same vocabulary, merges and special tokens)."""
    check_pretrained(cfg)
    path = Path(cfg.init_from) / "tokenizer.json"
    if not path.is_file():
        return  # nothing to compare; check_inputs still checks the data's vocabulary fits the model
    from tokenizers import Tokenizer as HFTokenizer

    from trainers.data.tokenizer import load_tokenizer

    ours = _vocabulary(json.loads(load_tokenizer(data_dir).to_hf().to_str()))
    theirs = _vocabulary(json.loads(HFTokenizer.from_file(str(path)).to_str()))
    if ours != theirs:
        raise ConfigError(
            f"data.path={data_dir} was tokenized with another vocabulary than model.init_from="
            f"{cfg.init_from} ({_first_difference(ours, theirs)}); fix: raytrain data prepare --tokenizer "
            f"{cfg.init_from} --output NEW_DATA_DIR (then data.path=NEW_DATA_DIR)"
        )


def _vocabulary(tokenizer_json: dict) -> dict:
    """What decides the ids of a text: the model (vocabulary, merges), the added tokens, the splitting."""
    added = sorted((t["id"], t["content"], t.get("special", False)) for t in tokenizer_json.get("added_tokens", []))
    keys = ("model", "normalizer", "pre_tokenizer")
    return {"added_tokens": added, **{k: tokenizer_json.get(k) for k in keys}}


def _first_difference(ours: dict, theirs: dict) -> str:
    vocab_a = (ours["model"] or {}).get("vocab") or {}
    vocab_b = (theirs["model"] or {}).get("vocab") or {}
    if isinstance(vocab_a, dict) and isinstance(vocab_b, dict) and vocab_a != vocab_b:
        diff = sorted(set(vocab_a.items()) ^ set(vocab_b.items()), key=lambda kv: kv[1])
        return f"{len(vocab_a)} vs {len(vocab_b)} tokens; first difference at id {diff[0][1]}"
    key = next(k for k in ours if ours[k] != theirs[k])
    return f"their {key} differ"
