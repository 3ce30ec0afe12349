"""Start a run from a Hugging Face folder (`model.init_from`): each rank reads only what it holds.

The model is built on the meta device, sharded while still meta, then only this rank's shards are allocated
(`Engine.materialize`); `load_pretrained` fills each with its rows of the HF tensor (the experts of an expert
shard). A local file is read with the safetensors library (memory-mapped); in a bucket (s3://, gs://),
which that library cannot read, `SafetensorsFile` reads the format itself, by range GETs of those rows.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainers._base import ConfigError
from trainers.hf.format import expert_index, hf_names, read_small
from trainers.sections.model import ModelConfig
from trainers.storage import fs_and_path, local_path, location, one_line_errors

__all__ = [
    "SAFETENSORS_DTYPES",
    "PretrainedWeights",
    "SafetensorsFile",
    "check_pretrained",
    "clean_fqn",
    "load_pretrained",
    "materialize",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Wrappers applied from outside add these to parameter names; checkpoints and HF names have none.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
# Tensors some savers add that are not weights (old Llama checkpoints saved RoPE's inverse frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors' dtype names (the format's spec); export writes F32/BF16 with the same table.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit on the JSON header


def clean_fqn(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name.removeprefix("module.")  # DistributedDataParallel's


class SafetensorsFile:
    """One .safetensors file in a bucket: the header read once (two ranged reads), then each tensor or a range
    of its rows (dim 0, contiguous in the file) by one ranged read of exactly its bytes."""

    def __init__(self, path: Any, where: str):
        self.path, self.where = location(path), where
        self._fs, self._file = fs_and_path(self.path)
        size = struct.unpack("<Q", self._cat(0, 8))[0]
        if not 0 < size <= _MAX_HEADER:
            self._refuse(f"a header of {size} bytes")
        try:
            header = json.loads(self._cat(8, 8 + size))
        except ValueError as e:
            self._refuse(f"its header is not JSON ({e})")
        header.pop("__metadata__", None)
        self.header: dict[str, dict[str, Any]] = header
        self._data = 8 + size

    def keys(self) -> list[str]:
        return sorted(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        entry = self.header[name]
        dtype, shape = SAFETENSORS_DTYPES.get(entry["dtype"]), list(entry["shape"])
        start, end = entry["data_offsets"]
        if dtype is None or end - start != math.prod(shape) * dtype.itemsize:
            self._refuse(f"{name} is {entry['dtype']} {shape} in {end - start} bytes")
        if rows is not None:
            row = (end - start) // max(shape[0], 1)  # bytes per row
            start, end, shape[0] = start + rows[0] * row, start + rows[1] * row, rows[1] - rows[0]
        out = torch.empty(shape, dtype=dtype)
        if end > start:  # the bytes straight into the tensor's storage (any dtype, bf16 too, as uint8)
            out.reshape(-1).view(torch.uint8).numpy()[:] = memoryview(self._cat(self._data + start, self._data + end))
        return out

    def _cat(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file: one ranged read; a store's errors as one line (a missing file
        stays FileNotFoundError: the caller knows why it was expected)."""
        with one_line_errors(self.path, self.where, keep=(FileNotFoundError,)):
            data = self._fs.cat_file(self._file, start=start, end=end)
        if len(data) != end - start:
            self._refuse(f"{end - start} bytes expected at offset {start}, {len(data)} there (a cut file?)")
        return data

    def _refuse(self, what: str) -> NoReturn:
        raise ConfigError(
            f"{self.where}: {self.path.name} is not a safetensors file as the format has it ({what}); fix: "
            f"save the model again (save_pretrained's default, or `raytrain export`)"
        )


class _LocalSafetensors:
    """A local .safetensors file through the safetensors library (the same interface as SafetensorsFile)."""

    def __init__(self, path: Path):
        if not Path(path).is_file():
            raise FileNotFoundError(path)
        self._file = safe_open(path, "pt")

    def keys(self) -> list[str]:
        return sorted(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if rows is None:
            return self._file.get_tensor(name)
        return self._file.get_slice(name)[rows[0] : rows[1]]


def _safetensors(path: Any, where: str) -> SafetensorsFile | _LocalSafetensors:
    local = local_path(path)  # a local file: memory-mapped by the safetensors library
    return SafetensorsFile(path, where) if local is None else _LocalSafetensors(local)


class PretrainedWeights:
    """The safetensors files of an HF folder (one file, or shards listed by model.safetensors.index.json),
    opened lazily; `read` returns a whole tensor or a range of its rows, as stored (any dtype)."""

    def __init__(self, hf_dir: str | Path | Any):
        self.dir = location(hf_dir)
        self.where = f"model.init_from={self.dir}"
        self._open: dict[str, SafetensorsFile | _LocalSafetensors] = {}
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = read_small(self.dir, INDEX_FILE)
        if index is not None:
            return json.loads(index)["weight_map"]
        try:
            single = self._open[SINGLE_FILE] = _safetensors(self.dir / SINGLE_FILE, self.where)
        except FileNotFoundError:
            raise ConfigError(
                f"{self.where}: no {SINGLE_FILE} or {INDEX_FILE} there; fix: save the model with "
                f"safetensors (save_pretrained's default) or point init_from at such a folder"
            ) from None
        return {name: SINGLE_FILE for name in single.keys()}

    def _opened(self, file: str) -> SafetensorsFile | _LocalSafetensors:
        if file not in self._open:
            try:
                self._open[file] = _safetensors(self.dir / file, self.where)
            except FileNotFoundError:
                raise ConfigError(
                    f"{self.where}: {file} is not there, though {INDEX_FILE} lists it; fix: copy the whole "
                    f"folder (every *.safetensors file) or point init_from at a complete one"
                ) from None
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._opened(self.weight_map[name]).shape(name)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self._opened(self.weight_map[name]).read(name, rows)

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


@torch.no_grad()
def materialize(roots: list[nn.Module], device: torch.device | str) -> None:
    """Allocate the (meta) storage of every module under `roots` on `device`, zeroed (uninitialised memory
    may hold denormals: 2.5x slower CPU steps), and compute the RoPE tables of each Transformer among them."""
    from trainers.models import Transformer

    for root in roots:
        root.to_empty(device=device)
        for tensor in [*root.parameters(), *root.buffers()]:
            tensor.zero_()
    for root in roots:
        for m in root.modules():
            if isinstance(m, Transformer):
                m.init_rope(device)


@torch.no_grad()
def load_pretrained(model: nn.Module, hf_dir: str | Path) -> int:
    """Copy into each parameter of `model` (materialised; plain tensors or DTensor shards) its part of
    the HF tensor; returns the number of bytes read."""
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
    local, placements = param.to_local(), param.placements
    if len(placements) == 1 and isinstance(placements[0], Replicate):
        return local, (0, param.shape[0])
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise NotImplementedError(f"loading into a DTensor placed {placements} (a 1-D Shard(0) mesh expected)")
    n, k = param.shape[0], param.device_mesh.size()
    start = min(param.device_mesh.get_local_rank() * math.ceil(n / k), n)
    return local, (start, start + local.shape[0])


def check_init_from(cfg: ModelConfig, data_dir: str | Path) -> None:
    """Before any worker starts: the folder's tensors fit the model, and the data was tokenized with the
    folder's tokenizer (when it has one: the same vocabulary, merges and special tokens)."""
    check_pretrained(cfg)
    text = read_small(cfg.init_from, "tokenizer.json")
    if text is None:
        return  # nothing to compare; check_inputs still checks the data's vocabulary fits the model
    from tokenizers import Tokenizer as HFTokenizer

    from trainers.data.tokenizer import load_tokenizer

    ours = _vocabulary(json.loads(load_tokenizer(data_dir).to_hf().to_str()))
    theirs = _vocabulary(json.loads(HFTokenizer.from_str(text.decode()).to_str()))
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
