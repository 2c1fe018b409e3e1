"""Models named as users have them: a folder, or a HuggingFace hub id ``org/name`` (``@revision``).

:func:`resolve_model` resolves a hub id against the ``huggingface_hub`` cache (offline: the cache's
``refs/``), fetches the small files every rank needs and returns a :class:`ModelSource` on the cached
snapshot; weight files are fetched by the stage that opens them (:meth:`ModelSource.fetch`), so a stage
downloads only its own layers' shards. :func:`missing_weights` lets the plan refuse shards that are
neither cached nor fetchable (of a folder: missing from it), :func:`missing_tokenizer` a model without
a tokenizer. Everything that cannot work raises :class:`ModelUnavailable` saying how to
fix it (``HF_HUB_OFFLINE``, ``HF_TOKEN``, ``HF_ENDPOINT``: docs/usage/models.md).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# files every rank needs before loading: config, tokenizer, generation config, shard index, custom code
SMALL_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_LAYER = re.compile(r"\.(\d+)\.")  # the first number in a tensor name is its layer (model.layers.7.mlp...)


class ModelUnavailable(ValueError):
    """A model, revision or file that cannot be had; the message names it and how to fix it."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a local folder, or a hub snapshot (``repo_id`` set).

    It is a path (``os.fspath`` gives the folder), so loaders take it wherever they take a folder;
    :meth:`fetch` brings a hub file into the snapshot on demand."""

    folder: Path
    repo_id: str | None = None
    revision: str | None = None  # as the user asked (branch, tag or commit)
    commit: str | None = None  # what it resolved to
    cache_dir: str | None = None
    files: frozenset[str] | None = None  # the repository's files at ``commit`` (None: offline, only the cache)

    def __fspath__(self) -> str:
        return str(self.folder)

    @property
    def name(self) -> str:
        """The ``model`` of every result: ``org/name@commit`` for a hub model, the folder's name otherwise."""
        return f"{self.repo_id}@{self.commit}" if self.repo_id else self.folder.name

    @property
    def record(self) -> str:
        """What the run record keeps: another commit, or another folder, is another run's output."""
        return f"hub:{self.repo_id}@{self.commit}" if self.repo_id else str(self.folder.resolve())

    def available(self, filename: str) -> bool:
        """Whether ``filename`` is in the snapshot already or can be fetched into it."""
        return (self.folder / filename).is_file() or (self.repo_id is not None and self.files is not None
                                                      and filename in self.files)

    def fetch(self, filename: str) -> bool:
        """Bring ``filename`` into the snapshot folder (a no-op when cached); False when the repository
        does not have it. Raises :class:`ModelUnavailable` when it cannot be downloaded."""
        if (self.folder / filename).is_file():
            return True
        if self.repo_id is None or self.files is None or filename not in self.files:
            return False
        _download(self.repo_id, filename, self.commit, self.cache_dir, self.revision)
        return True


def looks_like_repo_id(value: str) -> bool:
    """``org/name`` or ``org/name@rev``: one slash, no leading ``.``, ``/`` or ``~`` (those are folders)."""
    return bool(_REPO_ID.match(value.split("@", 1)[0])) and not value.startswith(("~", "."))


def split_ref(value: str, revision: str | None) -> tuple[str, str]:
    """``org/name@rev`` -> (``org/name``, ``rev``); ``--revision`` when there is no ``@``; else ``main``."""
    repo_id, sep, rev = value.partition("@")
    if sep and revision and rev != revision:
        raise ModelUnavailable(f"--model-name {value} names revision {rev!r} but --revision says {revision!r}: "
                               "give the revision once")
    if sep and not rev:
        raise ModelUnavailable(f"--model-name {value}: nothing after '@' (expected org/name@REVISION)")
    return repo_id, rev or revision or "main"


def resolve_model(value: str, revision: str | None = None, cache_dir: str | None = None,
                  what: str = "--model-name", first: str = "config.json") -> ModelSource:
    """A folder as is, or a hub id resolved (cache first) with its small files fetched. ``first``: the file
    that must be there (``adapter_config.json`` for a LoRA adapter); its lookup resolves the revision."""
    if Path(value).expanduser().is_dir():
        if revision:
            raise ModelUnavailable(f"--revision {revision} applies to a hub id, but {what} {value} is a local folder: "
                                   "drop --revision")
        return ModelSource(Path(value).expanduser())
    if not looks_like_repo_id(value):
        raise ModelUnavailable(f"{what} {value}: no such folder (give a HuggingFace model folder or a hub id "
                               "org/name, e.g. Qwen/Qwen2.5-0.5B-Instruct)")
    repo_id, rev = split_ref(value, revision)
    config = Path(_download(repo_id, first, rev, cache_dir, rev, what))
    folder, commit = config.parent, config.parent.name
    files = _listing(repo_id, commit)
    wanted = sorted(f for f in files if _small(f)) if files is not None else []
    for name in wanted:
        _download(repo_id, name, commit, cache_dir, rev, what)
    log.info("%s: %s at commit %s (%s)", what, repo_id, commit, folder)
    return ModelSource(folder, repo_id, rev, commit, cache_dir, files)


def weight_files(source: ModelSource, depth: int | None = None) -> list[str]:
    """The weight files a run over layers ``[0, depth)`` (None: all) reads: the shards of the index's
    ``weight_map`` that hold one of those layers or a tensor outside the layers, or the single file."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = source.folder / index
        if path.is_file():
            weight_map = json.loads(path.read_text())["weight_map"]
            needed = {f for name, f in weight_map.items()
                      if depth is None or not (m := _LAYER.search(name)) or int(m.group(1)) < depth}
            return sorted(needed)
    for single in ("model.safetensors", "pytorch_model.bin"):
        if source.available(single):
            return [single]
    if (source.folder / "pytorch_embs.pt").is_file():  # the pre-split layout of a local folder
        return []
    offline = source.repo_id is not None and source.files is None
    fix = f"; offline, only the cache was searched: {_fix(source.repo_id, source.commit, source.cache_dir)}" \
        if offline else ""
    raise ModelUnavailable(f"{source.repo_id or source.folder}: no weights found (expected model.safetensors, a "
                           f"sharded model.safetensors.index.json, pytorch_model.bin or its index){fix}")


def missing_weights(source: ModelSource, depth: int | None = None) -> None:
    """Raise :class:`ModelUnavailable` naming every weight file the plan needs that is neither cached nor
    fetchable (rank 0 calls this before any process group or loading); of a folder: not in it."""
    needed = weight_files(source, depth)
    missing = [f for f in needed if not source.available(f)]
    if not missing:
        return
    shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
    if source.repo_id is None:
        raise ModelUnavailable(f"--model-name {source.folder}: weight file(s) {shown}, listed in the shard index, are "
                               "not in the folder: the checkpoint is incomplete; copy them into it")
    if source.files is None:
        raise ModelUnavailable(f"--model-name {source.repo_id} (commit {source.commit}): weight file(s) {shown} not in "
                               f"the cache and the hub cannot be asked (offline): "
                               f"{_fix(source.repo_id, source.commit, source.cache_dir, missing)}")
    raise ModelUnavailable(f"--model-name {source.repo_id} (commit {source.commit}): weight file(s) {shown}, listed in "
                           "the shard index, are not in the repository: the checkpoint is incomplete at this revision; "
                           "pick another --revision")


def missing_tokenizer(source: ModelSource) -> None:
    """Raise :class:`ModelUnavailable` when the model's folder holds no tokenizer (first and last ranks load one)."""
    if any((source.folder / t).is_file() for t in TOKENIZER_FILES):
        return
    fix = "copy the tokenizer's files into it" if source.repo_id is None else \
        "the repository has none at this revision" if source.files is not None else \
        f"offline: {_fix(source.repo_id, source.revision, source.cache_dir)}"
    raise ModelUnavailable(f"--model-name {source.repo_id or source.folder}: {source.folder} holds no tokenizer "
                           f"files ({', '.join(TOKENIZER_FILES)}): {fix}")


def _small(filename: str) -> bool:
    return "/" not in filename and any(fnmatch.fnmatch(filename, p) for p in SMALL_FILES) \
        and not filename.endswith(WEIGHT_SUFFIXES)


def _fix(repo_id: str, revision: str | None, cache_dir: str | None, files: list[str] | None = None) -> str:
    """How to get the files into the cache, or let the run fetch them."""
    where = f" --cache-dir {cache_dir}" if cache_dir else ""
    names = "".join(f" {f}" for f in files[:6]) if files else ""
    rev = f" --revision {revision}" if revision and revision != "main" else ""
    how = f"run `hf download {repo_id}{names}{rev}{where}` where the hub is reachable (and copy the cache here)"
    if _offline():
        how += ", or unset HF_HUB_OFFLINE to let this run download"
    return how


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _listing(repo_id: str, commit: str) -> frozenset[str] | None:
    """The repository's files at ``commit`` (GET /api/models/{id}/revision/{commit}); None offline or
    when the hub cannot be reached (then only the cache counts)."""
    if _offline():
        return None
    import httpx2
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    try:  # bounded as the library's own metadata requests are (a hub that never answers must not hang the run)
        info = HfApi().model_info(repo_id, revision=commit, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (httpx2.TransportError, HfHubHTTPError, OSError) as e:
        log.warning("%s: cannot list the repository (%s); using the cached snapshot only", repo_id, e)
        return None
    return frozenset(s.rfilename for s in info.siblings or [])


def _download(repo_id: str, filename: str, revision: str, cache_dir: str | None, asked: str | None,
              what: str = "--model-name") -> str:
    """hf_hub_download (the cache first; a download only online), its errors as ModelUnavailable."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    label = f"{what} {repo_id}" + (f" (revision {asked})" if asked and asked != "main" else "")
    try:
        return hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir)
    except GatedRepoError:
        raise ModelUnavailable(f"{label}: a gated repository: accept its terms on the hub's page, then set HF_TOKEN "
                               "(or run `hf auth login`) on every node") from None
    except RepositoryNotFoundError:
        token = "" if os.environ.get("HF_TOKEN") else "; if it is private, set HF_TOKEN (or run `hf auth login`)"
        raise ModelUnavailable(f"{label}: no such model on the hub (check the spelling{token})") from None
    except RevisionNotFoundError:
        raise ModelUnavailable(f"{label}: the hub has no revision {revision!r} (a branch, tag or commit); "
                               "check --revision") from None
    except LocalEntryNotFoundError as e:  # offline, or the hub unreachable or refusing, and not cached
        _refused(label, e.__cause__)
        why = "HF_HUB_OFFLINE is set" if _offline() else "the hub cannot be reached"
        raise ModelUnavailable(f"{label}: {filename} is not in the cache and {why}: "
                               f"{_fix(repo_id, asked, cache_dir, None if filename == 'config.json' else [filename])}"
                               ) from None
    except EntryNotFoundError:
        raise ModelUnavailable(f"{label}: the repository has no {filename} at revision {revision}"
                               + (" (it is not a transformers model)" if filename == "config.json" else "")) from None
    except (HfHubHTTPError, OSError) as e:
        _refused(label, e)
        raise ModelUnavailable(f"{label}: cannot fetch {filename}: {str(e).strip().splitlines()[0]}") from None


def _refused(label: str, error: BaseException | None) -> None:
    """The hub's 401 (a token it does not accept) or 403 (one without the right to read the repository)."""
    response = getattr(error, "response", None)
    if response is not None and response.status_code in (401, 403):
        said = response.headers.get("X-Error-Message")
        raise ModelUnavailable(f"{label}: the hub refused access (HTTP {response.status_code}"
                               f"{': ' + said if said else ''}): set HF_TOKEN (or run `hf auth login`) "
                               "to a valid token allowed to read this repository (a fine-grained token needs read "
                               "access to it, and to public gated repositories)")


def resolve_adapter(value: str, cache_dir: str | None = None) -> ModelSource:
    """A LoRA adapter folder as is, or a hub id (``org/adapter@rev``) with all its files fetched (an
    adapter is small, and every stage reads its own layers' factors from the one weights file)."""
    source = resolve_model(value, None, cache_dir, what="--lora", first="adapter_config.json")
    if source.repo_id is not None:
        for name in ("adapter_model.safetensors", "adapter_model.bin"):
            if source.fetch(name):
                break
    return source
