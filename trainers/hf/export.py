"""`raytrain export`: a checkpoint of any engine and layout -> a folder that transformers'
`AutoModelForCausalLM` loads as LlamaForCausalLM or MixtralForCausalLM, on one CPU process.

Memory holds one parameter at a time (a stacked expert weight is one): a DCP checkpoint is read one
parameter per `dcp.load`, and each safetensors file is streamed tensor by tensor after a header planned from
the shapes. DeepSpeed's `zero_to_fp32` reassembles a ZeRO checkpoint (stages 1-2: all fp32 weights at once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import math
import os
import shutil
import struct
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from trainers._base import ConfigError, parse_bytes
from trainers.checkpoint import Checkpointer, is_complete
from trainers.checkpoint_files import (
    DCP_METADATA,
    DCP_MODEL_PREFIX,
    DEEPSPEED_MODEL_STATES,
    DEEPSPEED_TAG,
    TRAINER_STATE,
)
from trainers.hf.format import CONFIG_FILE, expert_index, hf_config, hf_names, inexact
from trainers.hf.pretrained import INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE, clean_fqn
from trainers.preflight import require_deepspeed
from trainers.run_dir import CONFIG, RunDir
from trainers.sections.model import ModelConfig
from trainers.storage import (
    cache_root,
    check_location,
    is_uri,
    local_folder,
    location,
    occupied,
    write_folder,
    write_json_atomic,
)

__all__ = ["DTYPES", "ExportResult", "export", "parse_size", "resolve_checkpoint"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SAFETENSORS_DTYPE = {torch_dtype: name for name, torch_dtype in SAFETENSORS_DTYPES.items()}
_HF_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
DEFAULT_MAX_SHARD = 5 * 10**9  # transformers' save_pretrained default max_shard_size, "5GB"


@dataclass
class ExportResult:
    out_dir: Path
    checkpoint: Path
    architecture: str
    files: list[str]
    tensors: int
    bytes: int
    notes: list[str] = field(default_factory=list)  # what is not exact, what was not written


def export(
    source: str | Path,
    out_dir: str | Path,
    dtype: str = "fp32",
    max_shard_size: int = DEFAULT_MAX_SHARD,
    allow_inexact: bool = False,
) -> ExportResult:
    """Write the newest complete checkpoint of run dir `source` (or the checkpoint `source`) to `out_dir`
    (created atomically, via a temp folder beside it). Either may be in a bucket (s3://, gs://)."""
    if is_uri(str(out_dir)) or is_uri(str(source)):
        return _export_remote(source, out_dir, dtype, max_shard_size, allow_inexact)
    out_dir, torch_dtype = Path(out_dir), DTYPES[dtype]
    _check_out_dir(out_dir)
    checkpoint = resolve_checkpoint(Path(source))
    problem = Checkpointer.verify(checkpoint)  # the sizes and sha256 its COMMITTED lists
    if problem is not None:
        raise ConfigError(f"{checkpoint} is damaged: {problem}; fix: export an earlier checkpoints/step_* folder")
    cfg, data_path = _run_model(checkpoint)
    refused, differs = inexact(cfg)
    if refused:
        raise ConfigError(f"cannot export {checkpoint}: {refused[0]}")
    if differs and not allow_inexact:
        raise ConfigError(
            f"export of {checkpoint} would not be exact: {differs[0]}; fix: --allow-inexact writes it anyway"
        )
    reader = open_checkpoint(checkpoint)
    _check_tensors(reader.shapes(), cfg, checkpoint)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        files, total = _write_weights(tmp, reader, torch_dtype, max_shard_size)
        tokenizer, notes = _write_tokenizer(tmp, data_path, checkpoint, cfg)
        eos = tokenizer.eos_id if tokenizer is not None else None
        write_json_atomic(tmp / CONFIG_FILE, hf_config(cfg, _HF_DTYPE[torch_dtype], eos, None), indent=2)
        write_json_atomic(tmp / "generation_config.json", {"eos_token_id": eos, "pad_token_id": eos}, indent=2)
        if out_dir.exists():
            out_dir.rmdir()  # _check_out_dir: empty
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    arch = hf_config(cfg, "float32", None, None)["architectures"][0]
    size = sum((out_dir / f).stat().st_size for f in files)
    return ExportResult(out_dir, checkpoint, arch, files, total, size, differs + notes)


def _export_remote(source, out_dir, dtype, max_shard_size, allow_inexact) -> ExportResult:
    """A bucket's checkpoint is copied into a local temp folder first (checking every sha256 in COMMITTED
    reads it all anyway); a bucket's OUT_DIR gets the folder written locally, then uploaded with config.json
    last: readers look for config.json first, so one that finds it finds every other file."""
    src, dest = location(source), location(out_dir)
    check_location(src, "RUN_DIR_OR_CHECKPOINT", write=False)
    check_location(dest, "OUT_DIR", write=True)
    _check_out_dir(dest)
    with tempfile.TemporaryDirectory(prefix="raytrain-export-") as tmp:
        checkpoint = resolve_checkpoint(src)
        # A bucket's is downloaded, laid out as a run dir: the checkpoint beside the run's config.yaml.
        run = RunDir(Path(tmp) / "run")
        local = local_folder(checkpoint, run.checkpoints / checkpoint.name)
        local_folder(checkpoint.parent.parent, run.root, names=[CONFIG])
        with write_folder(dest, last=CONFIG_FILE) as out:
            result = export(local, out, dtype, max_shard_size, allow_inexact)
        return dataclasses.replace(result, out_dir=dest, checkpoint=checkpoint)


def resolve_checkpoint(source: Path) -> Path:
    """`source` if it is a complete checkpoint, else the newest complete one of run dir `source`."""
    if is_complete(source):
        return source
    latest = Checkpointer(RunDir(source).checkpoints, keep=1).latest()
    if latest is None:
        raise ConfigError(
            f"{source} is neither a complete checkpoint (step_XXXXXXXX with COMMITTED) nor a run dir holding "
            f"one; fix: pass a run dir or one of its checkpoints/step_XXXXXXXX folders"
        )
    return latest


def _run_model(checkpoint: Path) -> tuple[ModelConfig, Path | None]:
    """The model section the checkpoint was saved with (its trainer_state.json, else the run dir's
    config.yaml, checked against the keys the checkpoint recorded), and the data path (of the tokenizer)."""
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    config = RunDir(checkpoint.parent.parent).config
    raw = (yaml.safe_load(config.read_text()) or {}) if config.is_file() else {}
    model = state.get("model") or raw.get("model")
    if model is None:
        raise ConfigError(f"{checkpoint} records no model section and {config} is missing; fix: export from a run dir")
    # Without init_from: the derived keys are all there, and the folder it names may be gone.
    cfg = ModelConfig.model_validate({k: v for k, v in model.items() if k != "init_from"})
    dumped = {"model": cfg.model_dump(mode="json")}
    for key, value in (state.get("compat") or {}).items():
        ours = _lookup(dumped, key)
        if key.startswith("model.") and ours != value:
            raise ConfigError(
                f"{config} has {key}={ours!r} but {checkpoint} was saved with {value!r}; fix: export a "
                f"checkpoint of the run that config describes"
            )
    data = state.get("data_path") or (raw.get("data") or {}).get("path")
    return cfg, location(data) if data else None


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


class _DCPReader:
    """A torch.distributed.checkpoint folder: the model's tensors under `app.model.`, read one by one."""

    def __init__(self, path: Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = path
        meta = self._meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        self._keys = {k.removeprefix(DCP_MODEL_PREFIX): k for k in meta if k.startswith(DCP_MODEL_PREFIX)}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {fqn: tuple(self._meta[key].size) for fqn, key in self._keys.items()}

    def read(self, fqn: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        key = self._keys[fqn]
        meta = self._meta[key]
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({key: tensor}, checkpoint_id=str(self.path), no_dist=True)
        return tensor


class _DeepSpeedReader:
    """The deepspeed engine's checkpoint (`<step>/deepspeed/`): fp32 weights from the ZeRO partitions, or
    the module's own state without ZeRO (stage 0)."""

    def __init__(self, path: Path):
        tag_dir = path / DEEPSPEED_TAG
        if any(tag_dir.glob("*_optim_states.pt")):
            require_deepspeed(f"{path}: a DeepSpeed ZeRO checkpoint")
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            with contextlib.redirect_stdout(io.StringIO()):  # it prints progress
                state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG, lazy_mode=True)
        else:
            # Our own run's file (a run dir is trusted input, README: Trust); mmap: tensors read on use.
            state = torch.load(tag_dir / DEEPSPEED_MODEL_STATES, mmap=True, weights_only=False)["module"]
        self._state = {clean_fqn(k): v for k, v in state.items()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self._state.items()}

    def read(self, fqn: str) -> torch.Tensor:
        return self._state[fqn].contiguous().float()


def open_checkpoint(path: Path) -> _DCPReader | _DeepSpeedReader:
    if (path / DCP_METADATA).is_file():
        return _DCPReader(path)
    if (path / DEEPSPEED_TAG).is_dir():
        return _DeepSpeedReader(path)
    raise ConfigError(f"{path}: neither a DCP (.metadata) nor a deepspeed checkpoint; fix: pass a run's checkpoint")


def _check_tensors(found: dict[str, tuple[int, ...]], cfg: ModelConfig, checkpoint: Path) -> None:
    from trainers.models import build_model

    want = {n: tuple(p.shape) for n, p in build_model(cfg, device="meta").named_parameters()}
    if found != want:
        odd = sorted(set(found) ^ set(want)) or [n for n in want if found[n] != want[n]]
        raise ConfigError(
            f"{checkpoint}: its tensors do not match the run's model section (e.g. {odd[0]}); fix: export a "
            f"checkpoint of the run whose config.yaml lies beside it"
        )


@dataclass
class _Entry:
    name: str  # HF name
    fqn: str  # our parameter
    expert: int | None  # index into a stacked expert weight
    shape: tuple[int, ...]


def _plan(reader: Any, max_shard_size: int, itemsize: int) -> list[list[_Entry]]:
    """HF tensors in the model's parameter order, cut into files of at most `max_shard_size` bytes (a
    tensor larger than that gets a file of its own, as transformers does)."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for fqn, shape in reader.shapes().items():
        for e, name in enumerate(hf_names(fqn, shape[0])):
            expert = e if expert_index(fqn) else None
            entry = _Entry(name, fqn, expert, shape[1:] if expert is not None else shape)
            nbytes = itemsize * math.prod(entry.shape)
            if shards[-1] and size + nbytes > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += nbytes
    return shards


def _write_weights(
    folder: Path, reader: Any, dtype: torch.dtype, max_shard_size: int
) -> tuple[list[str], int]:
    shards = _plan(reader, max_shard_size, dtype.itemsize)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    tensors = _tensors(reader, [e for s in shards for e in s], dtype)
    for name, entries in zip(names, shards):
        _write_safetensors(folder / name, entries, dtype, tensors)
    if len(shards) > 1:
        total = dtype.itemsize * sum(math.prod(e.shape) for s in shards for e in s)
        weight_map = {e.name: n for n, s in zip(names, shards) for e in s}
        write_json_atomic(folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    return names, sum(len(s) for s in shards)


def _tensors(reader: Any, entries: list[_Entry], dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The tensor of each entry in turn, reading each of our parameters once (an entry of a stacked expert
    weight is one expert of it)."""
    for fqn, group in itertools.groupby(entries, key=lambda e: e.fqn):
        value = reader.read(fqn).to(dtype)
        for e in group:
            yield (value if e.expert is None else value[e.expert]).contiguous()
        del value  # dropped before the next parameter is read


def _write_safetensors(
    path: Path, entries: list[_Entry], dtype: torch.dtype, tensors: Iterator[torch.Tensor]
) -> None:
    """The safetensors format written tensor by tensor: an 8-byte header length, a JSON header (padded
    to 8 bytes) of names, dtypes, shapes and byte ranges, then the bytes in that order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        end = offset + dtype.itemsize * math.prod(e.shape)
        header[e.name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(e.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e, value in zip(entries, tensors):
            assert tuple(value.shape) == e.shape and value.dtype == dtype, (e.name, value.shape)
            f.write(value.view(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def _write_tokenizer(folder: Path, data_path: Path | None, checkpoint: Path, cfg: ModelConfig):
    """The run's tokenizer (from its data folder's manifest), if that folder is still there and is the
    one the checkpoint was trained on. Returns (tokenizer or None, notes)."""
    from trainers.data.manifest import read_manifest
    from trainers.data.tokenizer import load_tokenizer, save_hf

    if data_path is None or not (data_path / "manifest.json").is_file():
        return None, [f"no tokenizer written: the run's data.path={data_path} is not there to read it from"]
    # A bucket's manifest and tokenizer file, copied to read them as local files.
    cache = cache_root() / "data-meta" / hashlib.sha256(str(data_path).encode()).hexdigest()[:16]
    entry = read_manifest(data_path)["tokenizer"]
    data_path = local_folder(data_path, cache, names=filter(None, ["manifest.json", entry.get("file")]))
    saved = json.loads((checkpoint / TRAINER_STATE).read_text()).get("compat") or {}
    for key in ("kind", "vocab_size", "eos_id"):
        if f"tokenizer.{key}" in saved and saved[f"tokenizer.{key}"] != entry.get(key):
            return None, [
                f"no tokenizer written: data.path={data_path} now holds another tokenizer ({key} "
                f"{entry.get(key)!r}, the checkpoint was trained with {saved[f'tokenizer.{key}']!r})"
            ]
    tok = load_tokenizer(data_path)
    save_hf(tok, folder, cfg.max_seq_len)
    return tok, []


def _check_out_dir(out_dir: Path | Any) -> None:
    if occupied(out_dir):
        raise ConfigError(f"{out_dir} exists and is not empty; fix: choose a new OUT_DIR or remove it")


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' -> bytes (transformers' max_shard_size spelling)."""
    return parse_bytes(text, "--max-shard-size")
