"""Find a checkpoint on disk (or in the Hugging Face hub) and read its config and tensors.

Everything here is format-agnostic: the target and draft loaders decide what the tensors mean.
"""
from __future__ import annotations

import functools
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from common.errors import CheckpointError

if TYPE_CHECKING:   # torch is imported where tensors are made: finding and reading configs needs none
    import torch

# what a hub checkpoint needs: configs, weights, tokenizer files and chat templates
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def local(name_or_path: str | os.PathLike, role: str) -> Path | None:
    """A local folder (or, for a target, a ``.gguf`` file) as is; None for a hub id 'org/name';
    anything else refused in one line. Nothing is downloaded, so every path of a command is
    checked, in the order given, before a download starts."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf" and role == "target"):
        return path
    if path.exists():
        expected = "a checkpoint folder or a .gguf file" if role == "target" else "a checkpoint folder"
        raise CheckpointError(f"--{role} {path}: expected {expected}, got a file")
    if not _is_hub_id(str(name_or_path)):
        raise CheckpointError(f"--{role} {name_or_path}: no such folder (and not a hub id 'org/name')")
    return None


def resolve(name_or_path: str | os.PathLike, role: str) -> Path:
    """``local``'s folder or file; otherwise a hub id 'org/name', from the local Hugging Face
    cache when it is there, else downloaded into it (as ``from_pretrained`` does).
    ``HF_HUB_OFFLINE=1`` is honoured by ``huggingface_hub`` itself: only the cache is used."""
    path = local(name_or_path, role)
    if path is not None:
        return path
    text = str(name_or_path)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(text, allow_patterns=HUB_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(f"--{role} {text}: neither a local folder nor a hub id in the local "
                                  f"cache (HF_HUB_OFFLINE is set, so nothing is downloaded)") from None
    try:
        return Path(snapshot_download(text, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        raise CheckpointError(f"--{role} {text}: neither a local folder nor a hub id in the local "
                              f"cache, and the hub download failed ({type(err).__name__}: "
                              f"{one_line(err)})") from None


def _is_hub_id(text: str) -> bool:
    """Whether ``text`` reads as a hub id 'org/name' rather than as a path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def one_line(err: Exception) -> str:
    """An error's message on one line (libraries' messages often span several)."""
    return " ".join(str(err).split())


def hf_location(path: Path) -> tuple[Path, dict]:
    """Where ``transformers`` loads a checkpoint from: a directory, or a GGUF file's folder plus
    ``gguf_file=`` (``transformers`` de-quantizes GGUF weights; it needs ``gguf``)."""
    if path.suffix == ".gguf":
        return path.parent, {"gguf_file": path.name}
    return path, {}


def file_stamp(path: Path) -> tuple[int, int]:
    """``path``'s modification time and size: what a per-process cache of something read from the
    file is keyed by beside the path, so that a rewritten file is read again."""
    status = path.stat()
    return status.st_mtime_ns, status.st_size


def gguf_reader(path: Path):
    """``gguf``'s reader of the file at ``path``, made once per process and version of the file:
    it parses every metadata field (the vocabulary's strings one by one, seconds for a 49k-token
    file), and a build reads the file's header for its config, its matrices' types, its tokenizer,
    its blocks and a draft's shared embeddings. The tensors' data are views of the file, mapped."""
    return _gguf_reader(path.resolve(), file_stamp(path))


@functools.lru_cache(maxsize=1)   # a build reads one GGUF file
def _gguf_reader(path: Path, stamp: tuple[int, int]):
    from gguf import GGUFReader

    return GGUFReader(path)


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (every checkpoint needs a config.json)")
    return read_json(path)


def read_json(path: Path) -> dict:
    """A JSON object from ``path``, or a ``CheckpointError`` naming the file."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level")
    return config


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files: the shards named by ``model.safetensors.index.json``, else every
    ``*.safetensors`` file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: expected a JSON object with a 'weight_map'") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard(s) that are missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights found")
    return files


def load_tensors(directory: Path, strip_prefix: str = "", only: frozenset[str] | None = None,
                 skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint in one dict, with ``strip_prefix`` removed from their names;
    with ``only``, just those (named without the prefix); names starting with a ``skip`` prefix
    are never read.

    ``safe_open`` maps the file, and the mapped pages it reads count as this process's memory until
    it is closed: it is reopened for each tensor, so a checkpoint is held once (as tensors), not
    twice."""
    return {key: read_tensor(*where) for key, where in
            stored_tensors(directory, strip_prefix, only, skip).items()}


def stored_tensors(directory: Path, strip_prefix: str = "", only: frozenset[str] | None = None,
                   skip: tuple[str, ...] = ()) -> dict[str, tuple[Path, str]]:
    """Where ``load_tensors`` reads each tensor: its name (as ``load_tensors`` gives it) -> (file,
    name in the file). Only the files' headers are read."""
    stored = {}
    for file in safetensors_files(directory):
        try:
            with safe_open(file, framework="pt") as f:
                names = list(f.keys())
        except SafetensorError as err:
            raise _unreadable(file, err) from None
        for name in names:
            if name.startswith(skip):
                continue
            key = name[len(strip_prefix):] if name.startswith(strip_prefix) else name
            if only is None or key in only:
                stored[key] = (file, name)
    return stored


def read_tensor(file: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of the safetensors ``file``, read now (the file mapped only meanwhile)."""
    try:
        with safe_open(file, framework="pt") as f:
            return f.get_tensor(name)
    except SafetensorError as err:
        raise _unreadable(file, err) from None


def stored_shape(file: Path, name: str) -> list[int]:
    """Tensor ``name``'s shape as the safetensors ``file``'s header gives it."""
    with safe_open(file, framework="pt") as f:
        return f.get_slice(name).get_shape()


def _unreadable(file: Path, err: Exception) -> CheckpointError:
    return CheckpointError(f"{file}: not a readable safetensors file, truncated or damaged ({one_line(err)})")


def check_layer_count(tensors: dict[str, torch.Tensor], num_layers: int, where: str) -> None:
    """The weights hold decoder layers ``layers.0 .. layers.{num_layers - 1}``, no more and no fewer:
    checked before the module is built (a wrong count in ``where``, the config's field, would
    otherwise build that many layers, or silently leave the extra ones out)."""
    found = {int(name.split(".")[1]) for name in tensors
             if name.startswith("layers.") and name.split(".")[1].isdigit()}
    if found != set(range(num_layers)):
        held = f"layers.0 .. layers.{max(found)}" if found else "none"
        raise CheckpointError(f"{where} = {num_layers}, but the weights hold {len(found)} decoder "
                              f"layers ({held})")


def write_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write a ``.safetensors`` file as any other file is written, so the user's umask decides who
    may read it (safetensors' ``save_file`` makes it readable by its owner only)."""
    from safetensors.torch import save

    path.write_bytes(save(tensors, metadata={"format": "pt"}))


def match_config_mode(directory: Path) -> None:
    """Give the ``.safetensors`` files that ``save_pretrained`` / ``save_torch_state_dict`` wrote the
    mode the user's umask gave ``config.json`` beside them (safetensors' ``save_file`` makes them
    readable by their owner only)."""
    mode = stat.S_IMODE((directory / "config.json").stat().st_mode)
    for file in directory.glob("*.safetensors"):
        file.chmod(mode)


def build_module(factory, tensors: dict[str, torch.Tensor], directory: Path, dtype: torch.dtype):
    """``factory()`` built without allocating weights, then given the checkpoint's tensors (cast to
    ``dtype``; integer tables such as ``d2t`` keep theirs). Missing tensors are an error naming
    them.

    ``tensors`` is consumed: each source tensor is let go as soon as its cast is made, so loading
    peaks near one copy of the weights rather than the checkpoint's plus the module's. Names that
    hold the same tensor (tied embeddings) get the same cast tensor."""
    import torch

    with torch.device("meta"):
        module = factory()
    expected = module.state_dict()
    missing = [name for name in expected if name not in tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"{directory}: missing tensor(s) {shown} (expected from config.json)")
    for name, meta in expected.items():
        if tensors[name].shape != meta.shape:
            raise CheckpointError(f"{directory}: tensor {name} has shape {list(tensors[name].shape)}, "
                                  f"expected {list(meta.shape)} from config.json")
    first_name: dict[int, str] = {}   # while every source is alive, ids tell tied names apart
    tied_to = {name: first_name.setdefault(id(tensors[name]), name) for name in expected}
    state = {}
    for name in expected:
        tensor = tensors.pop(name)
        if tied_to[name] != name:
            state[name] = state[tied_to[name]]
        else:
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    module.load_state_dict(state, assign=True)
    return module.eval().requires_grad_(False)
