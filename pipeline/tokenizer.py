"""Tokenizers for the data pipeline: raw UTF-8 bytes, or a `tokenizers` JSON file.

Design choices:
- Two implementations of one small interface (`Tokenizer`): `vocab_size`, `eos_id`, `dtype`,
  `identity`, `encode`, `encode_batch`, `decode`. The data pipeline needs nothing else.
- `eos_id` doubles as the document separator in the flat token stream. For bytes it is 0:
  NUL never occurs in source text, so it cannot be confused with a real byte. (A user's text
  that does contain NUL is tokenized as is; the boundary is then ambiguous but no data is lost.)
- A JSON tokenizer's end-of-text id comes from an explicit `eos_token` when given, otherwise
  from the first of `EOS_TOKEN_CANDIDATES` the vocabulary contains (GPT-2/Pythia, Llama 2,
  Llama 3, BERT-style names). A vocabulary with none of them is refused with a `ConfigError`
  rather than guessing an id that may be an ordinary token and would silently glue documents.
- `encode` returns the storage dtype directly (uint16 when the vocabulary fits, else uint32)
  so the token cache is written without another conversion.
- `identity` names the tokenizer by content (a hash of the JSON file, not its path), so the
  token cache is shared by copies of the same file and invalidated when the file changes.
- `tokenizers` is imported only when a JSON tokenizer is requested: it is an optional extra.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Protocol, Sequence

import numpy as np

from agora.pipeline.config import ConfigError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "JsonTokenizer",
    "EOS_TOKEN_CANDIDATES",
    "load_tokenizer",
    "token_dtype",
]

EOS_TOKEN_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]", "<|eot_id|>")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a vocabulary (uint16 or uint32)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int  # also the separator between documents in a token stream
    dtype: np.dtype  # what encode returns; what the token cache stores
    identity: str  # stable content-derived name, part of cache keys

    def encode(self, text: str) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Token id = UTF-8 byte value; 256 ids; 0 (NUL) separates documents."""

    vocab_size = 256
    eos_id = 0
    dtype = token_dtype(256)
    identity = "bytes-v1"

    def encode(self, text: str) -> np.ndarray:
        # frombuffer is a zero-copy view; the one astype copy is the whole cost (~GB/s).
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(self.dtype)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        array = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        if array.size and (array.min() < 0 or array.max() > 255):
            raise ValueError(f"byte tokenizer: ids must be in 0..255, got {array.min()}..{array.max()}")
        # Slicing a stream can cut a multi-byte character; replace rather than fail on that.
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class JsonTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from its JSON file."""

    def __init__(self, path: str | Path, eos_token: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"data.tokenizer: no such tokenizer file {str(self.path)!r}")
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:  # pragma: no cover - the extra is installed in tests
            raise ConfigError("data.tokenizer: a JSON tokenizer needs the `tokenizers` package "
                              "(pip install 'agora-node[hf]')") from None
        try:
            content = self.path.read_bytes()
            self._tokenizer = HFTokenizer.from_str(content.decode("utf-8"))
        except Exception as error:  # tokenizers raises a bare Exception for a bad file
            raise ConfigError(
                f"data.tokenizer: {str(self.path)!r} is not a valid tokenizers JSON file: {error}"
            ) from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.dtype = token_dtype(self.vocab_size)
        self.eos_id = self._find_eos(eos_token)
        self.identity = "json-" + hashlib.sha256(content).hexdigest()[:24]

    def _find_eos(self, eos_token: str | None) -> int:
        candidates = (eos_token,) if eos_token is not None else EOS_TOKEN_CANDIDATES
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        wanted = repr(eos_token) if eos_token is not None else f"any of {', '.join(EOS_TOKEN_CANDIDATES)}"
        raise ConfigError(
            f"data.tokenizer: {str(self.path)!r} has no end-of-text token ({wanted}); add one as a "
            "special token so documents can be separated"
        )

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # The Rust side encodes a batch on its own thread pool: much faster than a Python loop.
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=self.dtype) for encoding in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"JsonTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """`"bytes"` or a path to a `tokenizers` JSON file (see `JsonTokenizer` for `eos_token`)."""
    if spec == "bytes":
        return ByteTokenizer()
    return JsonTokenizer(spec, eos_token=eos_token)
