"""Training data: documents -> cached token stream -> packed sequences -> numbered work units.

Design choices:
- Sources (`iter_documents`) yield `(doc_id, text)` in a deterministic order:
  `stdlib` (this interpreter's standard-library .py files, sorted by relative path, no
  site-/dist-packages), a local file or folder of .txt (one file = one document), .jsonl
  (one line = one document, field `text_field`) and .parquet (one row = one document,
  column `text_field`, read in row batches) files, sorted by relative path; or
  `hf:<name>[:<config>][:<split>]` streamed through Hugging Face `datasets`
  (`hf:json:<files>`, `hf:text:<files>`, `hf:parquet:<files>`, `hf:csv:<files>` load local
  files with the packaged builders, offline).
- Bad input is an error naming the file and line (or row), never a silent skip. The only
  things skipped are blank .jsonl lines, files of other types inside a source folder (logged),
  and documents that encode to no tokens. The standard library alone is decoded with
  `errors="replace"`: it ships a few deliberately mis-encoded test fixtures.
- The held-out split is per document: `crc32(doc_id) < fraction * 2**32`. It depends on
  nothing but the id, so every machine agrees without coordination.
- `TokenStore` tokenizes both splits in one pass into flat arrays, documents joined by the
  tokenizer's eos id, streamed to raw files (bounded memory) and loaded with `np.memmap`. The
  cache key hashes the source spec, text field, tokenizer identity, held-out fraction and, for
  local sources, every file's path, size and mtime. A build goes to a temporary directory that
  is renamed into place (atomic); an advisory file lock makes a concurrent builder wait and then
  reuse the result instead of tokenizing twice. A store whose files do not match its metadata
  (a crash mid-write on a filesystem without ordered renames) is rebuilt.
  Hub datasets are keyed by name only: a changed remote revision is not noticed.
- `PackedSequences`: sequence i is `tokens[i*L : i*L + L + 1]` (inputs `[:-1]`, targets
  `[1:]`); sequences share their boundary token, so no token is lost to packing.
- `WorkUnits`: unit u of epoch `e = u // units_per_epoch` holds a contiguous slice of the
  permutation `default_rng([seed, e]).permutation(n_sequences)`. Units never straddle epochs;
  the `n_sequences % sequences_per_unit` sequences at the end of each epoch's permutation are
  dropped (a different set each epoch), so every unit is full and has a fixed shape.
  A unit is a pure function of (tokens, seq_len, sequences_per_unit, seed, u): any process
  with the same corpus gets the same tokens. `RunData.fingerprint` (a hash of the token
  streams) lets peers check they hold the same corpus (the stdlib differs between Pythons).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from agora.pipeline.config import ConfigError, DataConfig, RunConfig
from agora.pipeline.tokenizer import Tokenizer, load_tokenizer

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX: the atomic rename alone still protects the cache
    fcntl = None

__all__ = [
    "DataSourceError",
    "iter_documents",
    "source_files",
    "is_heldout",
    "resolve_cache_dir",
    "cache_key",
    "TokenStore",
    "PackedSequences",
    "WorkUnits",
    "heldout_batches",
    "RunData",
    "build_data",
]

logger = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
HF_PACKAGED_BUILDERS = ("json", "text", "parquet", "csv")
STORE_FORMAT = 1  # bump when the on-disk layout or the tokenization pipeline changes
ENCODE_BATCH_DOCUMENTS = 256
PARQUET_BATCH_ROWS = 1024


class DataSourceError(ConfigError):
    """The data named by `data.source` cannot be read; says which file and line.

    A ConfigError subclass so the CLI reports it as one readable line."""


# ---------------------------------------------------------------- sources


def _stdlib_files() -> list[tuple[Path, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        found += [(Path(folder, f), Path(folder, f).relative_to(root).as_posix()) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda item: item[1])


def _local_files(root: Path) -> list[tuple[Path, str]]:
    if root.is_file():
        if root.suffix not in LOCAL_SUFFIXES:
            raise DataSourceError(f"data.source: {root}: unsupported file type (expected {', '.join(LOCAL_SUFFIXES)})")
        return [(root, root.name)]
    if not root.is_dir():
        raise DataSourceError(f"data.source: no such file or folder {str(root)!r}")
    found, ignored = [], 0
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if not path.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        if path.suffix in LOCAL_SUFFIXES:
            found.append((path, relative.as_posix()))
        else:
            ignored += 1
    if ignored:
        logger.info("data source %s: ignoring %d files that are not %s", root, ignored, "/".join(LOCAL_SUFFIXES))
    if not found:
        raise DataSourceError(f"data.source: {root} holds no {', '.join(LOCAL_SUFFIXES)} files")
    return sorted(found, key=lambda item: item[1])


def _parse_hf(spec: str) -> tuple[str, dict, str]:
    """`hf:<name>[:<config>][:<split>]` -> (name, load_dataset keyword arguments, split)."""
    name, _, rest = spec[len("hf:"):].partition(":")
    if not name:
        raise ConfigError(f"data.source: {spec!r}: expected hf:<name>[:<config>][:<split>]")
    if name in HF_PACKAGED_BUILDERS:  # the rest is a file path or glob, which may itself hold ':'
        if not rest:
            raise ConfigError(f"data.source: {spec!r}: expected hf:{name}:<data files>")
        return name, {"data_files": rest}, "train"
    parts = rest.split(":") if rest else []
    if len(parts) > 2:
        raise ConfigError(f"data.source: {spec!r}: expected hf:<name>[:<config>][:<split>]")
    config = parts[0] if parts and parts[0] else None
    split = parts[1] if len(parts) == 2 and parts[1] else "train"
    return name, {"name": config} if config else {}, split


def source_files(data_config: DataConfig) -> list[tuple[Path, str]]:
    """The files a stdlib or local source reads, in order, with their relative names ([] for hf)."""
    if data_config.source == "stdlib":
        return _stdlib_files()
    if data_config.source.startswith("hf:"):
        name, kwargs, _ = _parse_hf(data_config.source)
        local = Path(kwargs.get("data_files", ""))
        return [(local, local.name)] if name in HF_PACKAGED_BUILDERS and local.is_file() else []
    return _local_files(Path(data_config.source).expanduser())


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise DataSourceError(f"data.source: cannot read {path}: {error.strerror or error}") from None


def _decode_strict(content: bytes, path: Path) -> str:
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError as error:
        line = content[: error.start].count(b"\n") + 1
        raise DataSourceError(f"data.source: {path}:{line}: not valid UTF-8 (byte offset {error.start})") from None


def _jsonl_documents(path: Path, name: str, field: str) -> Iterator[tuple[str, str]]:
    try:
        file = open(path, "rb")  # streamed line by line: a jsonl file may be larger than memory
    except OSError as error:
        raise DataSourceError(f"data.source: cannot read {path}: {error.strerror or error}") from None
    with file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue  # a blank line holds no document
            try:
                record = json.loads(line)
            except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
                raise DataSourceError(f"data.source: {path}:{number}: invalid JSON line ({error})") from None
            if not isinstance(record, dict) or field not in record:
                raise DataSourceError(f"data.source: {path}:{number}: no field {field!r} (data.text_field)")
            if not isinstance(record[field], str):
                raise DataSourceError(
                    f"data.source: {path}:{number}: field {field!r} is {type(record[field]).__name__}, not a string"
                )
            yield f"{name}:{number}", record[field]


def _parquet_documents(path: Path, name: str, field: str) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as error:
        raise DataSourceError(f"data.source: {path}: cannot read as parquet: {error}") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise DataSourceError(
            f"data.source: {path}: no column {field!r} (data.text_field); columns: {', '.join(schema.names)}"
        )
    if not (pa.types.is_string(schema.field(field).type) or pa.types.is_large_string(schema.field(field).type)):
        raise DataSourceError(f"data.source: {path}: column {field!r} is {schema.field(field).type}, not a string")
    row = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is None:
                raise DataSourceError(f"data.source: {path}: row {row}: column {field!r} is null")
            yield f"{name}:{row}", text
            row += 1


def _hf_documents(spec: str, field: str) -> Iterator[tuple[str, str]]:
    name, kwargs, split = _parse_hf(spec)
    try:
        import datasets
    except ImportError:  # pragma: no cover - the extra is installed in tests
        raise ConfigError("data.source: hf: sources need the `datasets` package (pip install 'agora-node[hf]')") from None
    try:
        stream = datasets.load_dataset(name, split=split, streaming=True, **kwargs)
        for index, record in enumerate(stream):
            if field not in record or not isinstance(record[field], str):
                raise DataSourceError(f"data.source: {spec}: record {index}: no string field {field!r} (data.text_field)")
            yield f"{name}:{split}:{index}", record[field]
    except DataSourceError:
        raise
    except Exception as error:  # datasets raises many types (ConnectionError, FileNotFoundError, hub errors)
        raise DataSourceError(
            f"data.source: cannot load Hugging Face dataset {spec!r} (unreachable or invalid): "
            f"{type(error).__name__}: {error}"
        ) from error


def iter_documents(data_config: DataConfig) -> Iterator[tuple[str, str]]:
    """Every `(doc_id, text)` of the source, in a deterministic order."""
    source = data_config.source
    if source.startswith("hf:"):
        yield from _hf_documents(source, data_config.text_field)
        return
    stdlib = source == "stdlib"
    for path, name in source_files(data_config):
        if stdlib:
            yield name, _read_bytes(path).decode("utf-8", errors="replace")
        elif path.suffix == ".txt":
            yield name, _decode_strict(_read_bytes(path), path)
        elif path.suffix == ".jsonl":
            yield from _jsonl_documents(path, name, data_config.text_field)
        else:
            yield from _parquet_documents(path, name, data_config.text_field)


def is_heldout(doc_id: str, fraction: float) -> bool:
    """Whether a document belongs to the held-out split; a pure function of its id."""
    return zlib.crc32(doc_id.encode("utf-8")) < fraction * (1 << 32)


# ---------------------------------------------------------------- token cache


def resolve_cache_dir(data_config: DataConfig) -> Path:
    """data.cache_dir, else $AGORA_CACHE_DIR, else ~/.cache/agora-node."""
    chosen = data_config.cache_dir or os.environ.get("AGORA_CACHE_DIR") or "~/.cache/agora-node"
    return Path(chosen).expanduser()


def cache_key(data_config: DataConfig, tokenizer: Tokenizer) -> str:
    """Hash of everything the token streams depend on (see the module docstring)."""
    source = data_config.source
    if source != "stdlib" and not source.startswith("hf:"):
        source = str(Path(source).expanduser().resolve())
    files = []
    for path, name in source_files(data_config):
        stat = path.stat()
        files.append([name, stat.st_size, stat.st_mtime_ns])
    described = {
        "format": STORE_FORMAT, "source": source, "text_field": data_config.text_field,
        "tokenizer": tokenizer.identity, "heldout_fraction": data_config.heldout_fraction, "files": files,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


class _SplitWriter:
    """Appends documents to one split's raw token file, separator between documents."""

    def __init__(self, path: Path, separator: np.ndarray):
        self.file = open(path, "wb")
        self.separator = separator
        self.digest = hashlib.sha256()
        self.tokens = 0
        self.documents = 0

    def write(self, ids: np.ndarray) -> None:
        chunk = ids.tobytes() if self.documents == 0 else self.separator.tobytes() + ids.tobytes()
        self.file.write(chunk)
        self.digest.update(chunk)
        self.tokens += len(ids) + (self.documents > 0)
        self.documents += 1

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())  # data on disk before the rename publishes it
        self.file.close()
        return {"tokens": self.tokens, "documents": self.documents, "sha256": self.digest.hexdigest()}


class TokenStore:
    """A corpus's train and held-out token streams, memory-mapped from the on-disk cache."""

    SPLITS = ("train", "heldout")

    def __init__(self, directory: Path, cache_hit: bool):
        self.directory = directory
        self.cache_hit = cache_hit  # False when this call tokenized the corpus
        self.meta = json.loads((directory / "meta.json").read_text())
        self.dtype = np.dtype(self.meta["dtype"])
        self.train = self._map("train")
        self.heldout = self._map("heldout")

    def _map(self, split: str) -> np.ndarray:
        count = self.meta["splits"][split]["tokens"]
        if count == 0:  # np.memmap cannot map an empty file
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.directory / f"{split}.bin", dtype=self.dtype, mode="r", shape=(count,))

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @classmethod
    def open(cls, data_config: DataConfig, tokenizer: Tokenizer) -> "TokenStore":
        """Load the cached streams for this source and tokenizer, tokenizing once if absent."""
        root = resolve_cache_dir(data_config) / "tokens"
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"data.cache_dir: cannot create {root}: {error.strerror or error}") from None
        key = cache_key(data_config, tokenizer)
        final = root / key
        with open(root / f"{key}.lock", "a+b") as lock:
            if fcntl is not None:  # a concurrent builder waits here, then finds the store built
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
            if final.is_dir():
                if cls._complete(final):
                    logger.debug("token cache hit %s", final)
                    return cls(final, cache_hit=True)
                logger.warning("token cache %s is incomplete; rebuilding it", final)
                shutil.rmtree(final)
            cls._build(root, final, data_config, tokenizer)
        return cls(final, cache_hit=False)

    @staticmethod
    def _complete(directory: Path) -> bool:
        try:
            meta = json.loads((directory / "meta.json").read_text())
            itemsize = np.dtype(meta["dtype"]).itemsize
            return all(
                (directory / f"{split}.bin").stat().st_size == meta["splits"][split]["tokens"] * itemsize
                for split in TokenStore.SPLITS
            )
        except (OSError, ValueError, KeyError):
            return False

    @staticmethod
    def _build(root: Path, final: Path, data_config: DataConfig, tokenizer: Tokenizer) -> None:
        logger.info("tokenizing %s with %s into %s", data_config.source, tokenizer.identity, final)
        temporary = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=root))
        try:  # everything below writes only inside `temporary` until the rename
            separator = np.asarray([tokenizer.eos_id], dtype=tokenizer.dtype)
            writers = {split: _SplitWriter(temporary / f"{split}.bin", separator) for split in TokenStore.SPLITS}
            # A one-off that takes a while on a large corpus: a bar on a terminal (the line above otherwise).
            bar = tqdm(desc=f"tokenizing {data_config.source}", unit=" documents", file=sys.stderr,
                       disable=not sys.stderr.isatty(), leave=False)
            try:
                documents = iter_documents(data_config)
                while batch := list(itertools.islice(documents, ENCODE_BATCH_DOCUMENTS)):
                    encoded = tokenizer.encode_batch([text for _, text in batch])
                    bar.update(len(batch))
                    for (doc_id, _), ids in zip(batch, encoded):
                        if len(ids):  # an empty document would add only a separator
                            split = "heldout" if is_heldout(doc_id, data_config.heldout_fraction) else "train"
                            writers[split].write(ids)
            finally:
                bar.close()
                splits = {split: writer.close() for split, writer in writers.items()}
            fingerprint = hashlib.sha256("".join(s["sha256"] for s in splits.values()).encode()).hexdigest()
            meta = {
                "format": STORE_FORMAT, "source": data_config.source, "text_field": data_config.text_field,
                "tokenizer": tokenizer.identity, "heldout_fraction": data_config.heldout_fraction,
                "dtype": tokenizer.dtype.name, "eos_id": tokenizer.eos_id, "splits": splits,
                "fingerprint": fingerprint,
            }
            (temporary / "meta.json").write_text(json.dumps(meta, indent=1))
            os.replace(temporary, final)  # atomic publish; fails if another builder got there first
        except OSError:
            if not TokenStore._complete(final):
                raise
            logger.debug("another process published %s first; keeping its copy", final)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)


# ---------------------------------------------------------------- sequences and work units


def _as_long(rows: np.ndarray) -> torch.Tensor:
    # torch has no uint16 arithmetic on every version: widen in numpy, then share the buffer.
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))


class PackedSequences:
    """Fixed-length training windows over one flat token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> np.ndarray:
        """Sequence `index`: seq_len + 1 tokens (inputs [:-1], targets [1:])."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range 0..{len(self) - 1}")
        start = index * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1])

    def batch(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """LongTensor (len(indices), seq_len + 1) of the given sequences, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"sequence indices must be in 0..{len(self) - 1}")
        positions = indices[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return _as_long(self.tokens[positions])


class WorkUnits:
    """The training schedule cut into numbered units of `sequences_per_unit` sequences each."""

    def __init__(self, packed: PackedSequences, sequences_per_unit: int, seed: int):
        if sequences_per_unit <= 0:
            raise ValueError(f"sequences_per_unit must be positive, got {sequences_per_unit}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.packed = packed
        self.sequences_per_unit = sequences_per_unit
        self.seed = seed
        self.units_per_epoch = len(packed) // sequences_per_unit
        if self.units_per_epoch == 0:
            raise ValueError(
                f"{len(packed)} sequences of {packed.seq_len} tokens cannot fill one unit of {sequences_per_unit}"
            )
        self._permutation: tuple[int, np.ndarray] | None = None  # (epoch, order): units are read in order

    @property
    def seq_len(self) -> int:
        return self.packed.seq_len

    def epoch(self, unit: int) -> int:
        return unit // self.units_per_epoch

    def _order(self, epoch: int) -> np.ndarray:
        cached = self._permutation
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.packed)))
            self._permutation = cached
        return cached[1]

    def sequence_indices(self, unit: int) -> np.ndarray:
        """The exact sequence indices of unit `unit`, in order."""
        if unit < 0:
            raise ValueError(f"work unit must be >= 0, got {unit}")
        epoch, position = divmod(unit, self.units_per_epoch)
        start = position * self.sequences_per_unit
        return self._order(epoch)[start : start + self.sequences_per_unit].copy()

    def unit(self, unit: int) -> torch.Tensor:
        """LongTensor (sequences_per_unit, seq_len + 1): the tokens of unit `unit`."""
        return self.packed.batch(self.sequence_indices(unit))


def heldout_batches(packed: PackedSequences, n_batches: int, batch_size: int) -> list[torch.Tensor]:
    """The first n_batches * batch_size held-out sequences, in order, as LongTensors.

    Fewer batches (with a warning) when the held-out split is too small; an error when it
    cannot fill a single batch."""
    if n_batches <= 0 or batch_size <= 0:
        raise ValueError("n_batches and batch_size must be positive")
    available = len(packed) // batch_size
    if available == 0:
        raise ConfigError(
            f"data.heldout_fraction: the held-out split has {len(packed)} sequences of {packed.seq_len} tokens, "
            f"fewer than one batch of {batch_size}"
        )
    if available < n_batches:
        logger.warning("held-out split fills only %d of %d evaluation batches", available, n_batches)
    return [packed.batch(np.arange(b * batch_size, (b + 1) * batch_size)) for b in range(min(n_batches, available))]


@dataclass(frozen=True)
class RunData:
    """Everything a trainer reads: the tokenizer, the training units and the held-out split."""

    config: RunConfig
    tokenizer: Tokenizer
    store: TokenStore
    train: WorkUnits
    heldout: PackedSequences

    @property
    def fingerprint(self) -> str:
        """Hash of both token streams: equal on two machines iff they hold the same corpus."""
        return self.store.fingerprint

    def heldout_batches(self, n_batches: int | None = None, batch_size: int | None = None) -> list[torch.Tensor]:
        """Evaluation batches; defaults: train.eval_batches batches of train.batch_size."""
        train = self.config.train
        return heldout_batches(self.heldout, train.eval_batches if n_batches is None else n_batches,
                               train.batch_size if batch_size is None else batch_size)


def build_data(run_config: RunConfig) -> RunData:
    """Tokenizer, token cache, training units and held-out sequences for a run."""
    data, train = run_config.data, run_config.train
    tokenizer = load_tokenizer(data.tokenizer)
    if tokenizer.vocab_size > run_config.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: {run_config.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}, data.tokenizer={data.tokenizer!r})"
        )
    if data.seed < 0:
        raise ConfigError(f"data.seed: must be >= 0, got {data.seed}")
    store = TokenStore.open(data, tokenizer)
    packed = PackedSequences(store.train, train.seq_len)
    if len(packed) < train.batch_size:
        raise ConfigError(
            f"data.source: {data.source!r} gives {len(packed)} training sequences of train.seq_len={train.seq_len} "
            f"tokens, fewer than one unit of train.batch_size={train.batch_size}"
        )
    return RunData(run_config, tokenizer, store, WorkUnits(packed, train.batch_size, data.seed),
                   PackedSequences(store.heldout, train.seq_len))
