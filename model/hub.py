"""Where a checkpoint directory comes from: a local directory as given, or a hub id fetched with
``huggingface_hub`` at a revision (a branch, tag or commit): its json files, then the safetensors
files its index names (or ``model.safetensors``) and no others.

A hub revision with PyTorch ``.bin`` weights only (Pythia's training checkpoints) is converted
once to safetensors outside the hub cache (``converted_root``), so that ``model.checkpoint``'s
safetensors reader is the only one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

from common.cli import UserError
from model.checkpoint import INDEX_FILE, SINGLE_FILE

BIN_FILE = "pytorch_model.bin"  # what transformers wrote before safetensors
BIN_INDEX_FILE = "pytorch_model.bin.index.json"

logger = logging.getLogger(__name__)


def resolve_model_dir(model_path: str, revision: str | None = None) -> str:
    """A local checkpoint directory; a hub id is downloaded (its json files and the safetensors
    files its index names: ``_weight_files``) at
    ``revision`` (a branch, tag or commit; Pythia's training checkpoints are revisions such as
    ``step143000``), else the hub's default branch. A local directory has no revisions, so a
    revision with one is a mistake, not ignored.

    A revision without safetensors (Pythia's step branches hold ``pytorch_model.bin``, possibly
    sharded) is fetched as PyTorch weights and converted once to safetensors (``_converted``), as
    ``Checkpoint`` reads only those; the directory returned is then the converted one."""
    if os.path.isdir(model_path):
        if revision is not None:
            raise UserError(f"--model_revision applies to a hub id, not the local directory "
                            f"{model_path!r}")
        return model_path
    if os.path.exists(model_path) or model_path.startswith((".", "/", "~")):
        raise UserError(f"--model_path {model_path!r} is not a checkpoint directory")
    snapshot = _download(model_path, revision, ["*.json"])
    commit = os.path.basename(os.path.normpath(snapshot))  # the weights fetched at the config's commit
    snapshot = _download(model_path, commit, ["*.json", *_weight_files(snapshot)])
    if any(name.endswith(".safetensors") for name in os.listdir(snapshot)):
        return snapshot
    return _converted(model_path, revision, snapshot)


def _weight_files(snapshot: str) -> list[str]:
    """The safetensors files ``model.checkpoint.Checkpoint`` reads from a snapshot holding its json
    files: those ``model.safetensors.index.json`` names, else ``model.safetensors``. Only these are
    fetched: Mistral's repositories also hold ``consolidated.safetensors``, a second copy of the
    weights in mistral-inference's names, which a ``*.safetensors`` pattern would fetch too."""
    index = os.path.join(snapshot, INDEX_FILE)
    if not os.path.exists(index):
        return [SINGLE_FILE]
    try:
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{index} is not a safetensors index (a weight_map of tensor names to files): "
                        f"{type(e).__name__}: {e}") from None


def converted_root() -> str:
    """Where PyTorch-only revisions are kept once converted to safetensors: ``converted/`` under
    ``$ACTX_CACHE_DIR``, else ``$XDG_CACHE_HOME/activation-extraction``, else
    ``~/.cache/activation-extraction``. Outside the hub cache: the hub client owns that one
    (its snapshots hold only links to the files it downloaded)."""
    root = os.environ.get("ACTX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "activation-extraction")
    return os.path.join(root, "converted")


def _download(model_path: str, revision: str | None, allow_patterns: list[str]) -> str:
    """The snapshot directory (``.../snapshots/<commit>``) of ``model_path`` at ``revision``,
    holding the files matching ``allow_patterns``."""
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model_path, revision=revision, allow_patterns=allow_patterns)
    except Exception as e:
        raise UserError(f"cannot fetch model {model_path!r}{_at(revision)} from the hub: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _at(revision: str | None) -> str:
    return f" at revision {revision!r}" if revision is not None else ""


def _converted(model_path: str, revision: str | None, snapshot: str) -> str:
    """The safetensors conversion of the snapshot's PyTorch weights, made once per commit in
    ``converted_root()/<org>--<name>/<commit>`` with the snapshot's json files beside it.

    The commit (the snapshot folder's name) pins what is converted: the weights are fetched at
    that commit, not at ``revision`` again (a branch may move in between), and a directory made
    for a commit is never stale. The conversion is written to a temporary directory renamed into
    place when complete, so an interrupted one leaves no directory that would be taken as done.
    Each ``pytorch_model[-k-of-n].bin`` becomes ``model[-k-of-n].safetensors`` (a sharded index
    ``model.safetensors.index.json`` with shards), one shard in memory at a time."""
    commit = os.path.basename(os.path.normpath(snapshot))
    final = os.path.join(converted_root(), model_path.replace("/", "--"), commit)
    if os.path.isdir(final):
        return final
    snapshot = _download(model_path, commit, ["*.json", "pytorch_model*.bin"])
    if os.path.exists(os.path.join(snapshot, BIN_INDEX_FILE)):
        with open(os.path.join(snapshot, BIN_INDEX_FILE)) as f:
            sources = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(snapshot, BIN_FILE)):
        sources = [BIN_FILE]
    else:
        raise UserError(f"model {model_path!r}{_at(revision)} holds neither safetensors nor PyTorch "
                        f"{BIN_FILE} weights (snapshot {snapshot})")
    try:
        import torch
        from safetensors.torch import save_file
    except ImportError:
        raise UserError(f"model {model_path!r}{_at(revision)} holds only PyTorch .bin weights; converting "
                        f"them to safetensors needs torch (CPU): pip install torch --index-url "
                        f"https://download.pytorch.org/whl/cpu") from None
    logger.info("converting %s%s (%d PyTorch weight file(s)) to safetensors in %s",
                model_path, _at(revision), len(sources), final)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=f".{commit}.partial-", dir=os.path.dirname(final))
    try:
        os.chmod(temporary, 0o755)  # mkdtemp's 0o700 would stay on the renamed directory
        weight_map, total_size = {}, 0
        for source in sources:
            target = SINGLE_FILE if source == BIN_FILE else _safetensors_name(source)
            tensors = _loaded(torch, os.path.join(snapshot, source))
            save_file(tensors, os.path.join(temporary, target), metadata={"format": "pt"})
            weight_map.update({name: target for name in tensors})
            total_size += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        if sources != [BIN_FILE]:
            with open(os.path.join(temporary, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
        for name in sorted(os.listdir(snapshot)):
            if name.endswith(".json") and name != BIN_INDEX_FILE:
                shutil.copyfile(os.path.join(snapshot, name), os.path.join(temporary, name))
        try:
            os.rename(temporary, final)
        except OSError:
            if not os.path.isdir(final):  # else another process converted it first: keep theirs
                raise
            shutil.rmtree(temporary, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return final


def _safetensors_name(bin_name: str) -> str:
    """``pytorch_model-00001-of-00002.bin`` -> ``model-00001-of-00002.safetensors``."""
    return bin_name.removeprefix("pytorch_").removesuffix(".bin") + ".safetensors"


def _loaded(torch, path: str) -> dict:
    """The tensors of one PyTorch weight file, as safetensors can store them: each owning its
    own contiguous memory. ``torch.save`` keeps shared storage (tied embeddings, views of one
    buffer) and safetensors refuses it, so a tensor sharing or only viewing its storage is copied;
    dtypes are kept."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"cannot read PyTorch weights {path}: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UserError(f"{path} is not a PyTorch state dict (names to tensors)")
    tensors, owners = {}, set()
    for name, tensor in state.items():
        storage = tensor.untyped_storage()
        whole = (tensor.is_contiguous() and tensor.storage_offset() == 0
                 and storage.nbytes() == tensor.numel() * tensor.element_size())
        if not whole or storage.data_ptr() in owners:
            tensor = tensor.contiguous().clone()
        else:
            owners.add(storage.data_ptr())
        tensors[name] = tensor
    return tensors
