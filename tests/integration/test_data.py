"""Data pipeline: tokenizers, document sources, the token cache, packing and work units."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from agora.pipeline.config import ConfigError, DataConfig, ModelConfig, RunConfig, TrainConfig
from agora.pipeline.data import (
    DataSourceError,
    PackedSequences,
    TokenStore,
    WorkUnits,
    build_data,
    cache_key,
    is_heldout,
    iter_documents,
    resolve_cache_dir,
)
from agora.pipeline.tokenizer import ByteTokenizer, JsonTokenizer, load_tokenizer

pytestmark = pytest.mark.timeout(120)


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text, "other": 1}) + "\n" for text in texts))
    return path


def _corpus_texts(n: int) -> list[str]:
    """Distinct, varied documents (a deterministic generator, not random bytes)."""
    rng = np.random.default_rng(7)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "ünïcode", "λx"]
    return [f"doc {i}: " + " ".join(rng.choice(words, size=40 + i % 17)) for i in range(n)]


class CountingByteTokenizer(ByteTokenizer):
    """Same identity as ByteTokenizer (so same cache key), counts the documents it encodes."""

    def __init__(self):
        self.encoded = 0

    def encode_batch(self, texts):
        self.encoded += len(texts)
        return super().encode_batch(texts)


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tokenizer = load_tokenizer("bytes")
    text = "def f(x):\n    return x ** 2  # ünïcode, λ, 日本, 🙂\n"
    ids = tokenizer.encode(text)
    assert ids.dtype == np.uint16 and len(ids) == len(text.encode("utf-8"))
    assert ids.max() < tokenizer.vocab_size == 256 and tokenizer.eos_id not in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids.tolist()) == text
    assert [list(a) for a in tokenizer.encode_batch(["ab", ""])] == [[97, 98], []]
    assert tokenizer.identity == ByteTokenizer().identity
    with pytest.raises(ValueError):
        tokenizer.decode([300])


def _train_json_tokenizer(path: Path, special_tokens=("[UNK]", "<|endoftext|>")) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus_texts(50) + ["def main():\n    return 0\n"], trainer)
    tokenizer.save(str(path))
    return path


def test_json_tokenizer_trained_in_test(tmp_path):
    path = _train_json_tokenizer(tmp_path / "tok.json")
    tokenizer = load_tokenizer(str(path))
    assert isinstance(tokenizer, JsonTokenizer)
    assert 256 < tokenizer.vocab_size <= 300 and tokenizer.dtype == np.uint16
    assert tokenizer.eos_id == 1  # "<|endoftext|>", the second special token
    text = "doc 3: alpha beta ünïcode\n    return 0"
    ids = tokenizer.encode(text)
    assert len(ids) < len(text.encode()) and tokenizer.decode(ids) == text
    assert [list(a) for a in tokenizer.encode_batch([text])] == [list(ids)]
    assert JsonTokenizer(path, eos_token="[UNK]").eos_id == 0

    copy = tmp_path / "copy.json"
    copy.write_bytes(path.read_bytes())
    assert load_tokenizer(str(copy)).identity == tokenizer.identity  # content, not path
    other = _train_json_tokenizer(tmp_path / "other.json", special_tokens=("[UNK]", "</s>", "x"))
    assert load_tokenizer(str(other)).identity != tokenizer.identity


def test_tokenizer_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer.*no such tokenizer file"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="data.tokenizer.*not a valid tokenizers JSON"):
        load_tokenizer(str(tmp_path / "bad.json"))
    no_eos = _train_json_tokenizer(tmp_path / "no_eos.json", special_tokens=("[UNK]",))
    with pytest.raises(ConfigError, match="data.tokenizer.*no end-of-text token"):
        load_tokenizer(str(no_eos))
    with pytest.raises(ConfigError, match="'<nope>'"):
        JsonTokenizer(no_eos, eos_token="<nope>")


# ---------------------------------------------------------------- sources


def test_stdlib_source_is_deterministic_and_split_by_document(tmp_path):
    config = DataConfig(cache_dir=str(tmp_path))
    texts = dict(iter_documents(config))
    ids = list(texts)
    assert len(ids) > 500 and ids == sorted(ids) and len(set(ids)) == len(ids)
    assert "os.py" in ids and not any("site-packages" in i or "dist-packages" in i for i in ids)
    assert [doc_id for doc_id, _ in iter_documents(config)] == ids

    heldout_ids = {i for i in ids if is_heldout(i, config.heldout_fraction)}
    assert 0 < len(heldout_ids) < 0.1 * len(ids)

    store = TokenStore.open(config, ByteTokenizer())
    meta = store.meta["splits"]
    non_empty = {i for i in ids if texts[i]}  # an empty __init__.py adds no tokens
    assert meta["heldout"]["documents"] == len(heldout_ids & non_empty)
    assert meta["train"]["documents"] == len(non_empty - heldout_ids)
    assert store.train.dtype == np.uint16 and len(store.train) > 20_000_000
    # A held-out document's text is in the held-out stream and nowhere in the training stream.
    largest = max(heldout_ids, key=lambda i: len(texts[i]))
    needle = texts[largest].encode("utf-8")
    assert store.heldout.astype(np.uint8).tobytes().find(needle) >= 0
    assert store.train.astype(np.uint8).tobytes().find(needle) == -1


def test_local_txt_jsonl_parquet_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second file ü\n")
    (folder / "a.txt").write_text("first file\n")
    _write_jsonl(folder / "sub" / "c.jsonl", ["json one", "json two"])
    with open(folder / "sub" / "c.jsonl", "a") as f:
        f.write("\n")  # a trailing blank line is not a document
    rows = [f"row {i}" for i in range(2500)]  # > one 1024-row read batch, several row groups
    pq.write_table(pa.table({"text": rows, "n": list(range(2500))}), folder / "d.parquet", row_group_size=700)
    (folder / "README.md").write_text("not data")
    (folder / ".hidden.txt").write_text("hidden")

    documents = list(iter_documents(DataConfig(source=str(folder))))
    assert documents[:4] == [("a.txt", "first file\n"), ("b.txt", "second file ü\n"),
                             ("d.parquet:0", "row 0"), ("d.parquet:1", "row 1")]
    assert documents[2501] == ("d.parquet:2499", "row 2499")
    assert documents[2502:] == [("sub/c.jsonl:1", "json one"), ("sub/c.jsonl:2", "json two")]
    assert list(iter_documents(DataConfig(source=str(folder / "sub" / "c.jsonl")))) == [
        ("c.jsonl:1", "json one"), ("c.jsonl:2", "json two")]

    store = TokenStore.open(DataConfig(source=str(folder), cache_dir=str(tmp_path / "cache"),
                                       heldout_fraction=0.1), ByteTokenizer())
    joined = np.concatenate([store.train, store.heldout]).astype(np.uint8).tobytes()
    assert joined.count(b"\0") == len(documents) - 2  # one separator between documents, per split
    assert store.meta["splits"]["heldout"]["documents"] == sum(is_heldout(i, 0.1) for i, _ in documents)


def test_bad_input_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n{"text": "never read"}\n')
    with pytest.raises(DataSourceError, match=rf"{re.escape(str(bad))}:2: invalid JSON line"):
        list(iter_documents(DataConfig(source=str(bad))))
    bad.write_text('{"text": "fine"}\n\n{"body": "wrong field"}\n')
    with pytest.raises(DataSourceError, match=rf"{re.escape(str(bad))}:3: no field 'text' \(data.text_field\)"):
        list(iter_documents(DataConfig(source=str(bad))))
    bad.write_text('{"text": 5}\n')
    with pytest.raises(DataSourceError, match=rf"{re.escape(str(bad))}:1: field 'text' is int"):
        list(iter_documents(DataConfig(source=str(bad))))

    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"ok\nok\ncaf\xe9\n")
    with pytest.raises(DataSourceError, match=rf"{re.escape(str(latin))}:3: not valid UTF-8"):
        list(iter_documents(DataConfig(source=str(latin))))

    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DataSourceError, match=r"p.parquet: no column 'text'.*columns: body"):
        list(iter_documents(DataConfig(source=str(tmp_path / "p.parquet"))))
    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "p.parquet")
    with pytest.raises(DataSourceError, match=r"p.parquet: row 1: column 'text' is null"):
        list(iter_documents(DataConfig(source=str(tmp_path / "p.parquet"))))

    with pytest.raises(DataSourceError, match="no such file or folder"):
        list(iter_documents(DataConfig(source=str(tmp_path / "absent"))))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataSourceError, match="unsupported file type"):
        list(iter_documents(DataConfig(source=str(tmp_path / "x.csv"))))


def test_hf_json_and_text_builders_on_local_files(tmp_path):
    texts = _corpus_texts(30)
    path = _write_jsonl(tmp_path / "data.jsonl", texts)
    documents = list(iter_documents(DataConfig(source=f"hf:json:{path}")))
    assert [text for _, text in documents] == texts
    assert documents[0][0] == "json:train:0" and len({i for i, _ in documents}) == len(texts)

    (tmp_path / "lines.txt").write_text("one\ntwo\n")
    assert [t for _, t in iter_documents(DataConfig(source=f"hf:text:{tmp_path / 'lines.txt'}"))] == ["one", "two"]

    config = DataConfig(source=f"hf:json:{path}", cache_dir=str(tmp_path / "cache"), heldout_fraction=0.2)
    store = TokenStore.open(config, ByteTokenizer())
    assert store.meta["splits"]["train"]["documents"] + store.meta["splits"]["heldout"]["documents"] == 30
    # The local file's size and mtime are part of the key, as for plain local sources.
    key = cache_key(config, ByteTokenizer())
    _write_jsonl(path, texts + ["one more"])
    assert cache_key(config, ByteTokenizer()) != key


def test_hf_unreachable_is_a_clear_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataSourceError, match=r"cannot load Hugging Face dataset 'hf:someone/corpus:en:validation'"):
        list(iter_documents(DataConfig(source="hf:someone/corpus:en:validation")))
    with pytest.raises(ConfigError, match="expected hf:json:<data files>"):
        list(iter_documents(DataConfig(source="hf:json")))


# ---------------------------------------------------------------- cache


def test_cache_is_reused_and_invalidated(tmp_path, monkeypatch):
    path = _write_jsonl(tmp_path / "data.jsonl", _corpus_texts(200))
    config = DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"))

    first = CountingByteTokenizer()
    store = TokenStore.open(config, first)
    assert not store.cache_hit and first.encoded == 200
    meta_mtime = (store.directory / "meta.json").stat().st_mtime_ns

    second = CountingByteTokenizer()
    again = TokenStore.open(config, second)
    assert again.cache_hit and second.encoded == 0 and again.directory == store.directory
    assert (again.directory / "meta.json").stat().st_mtime_ns == meta_mtime
    assert np.array_equal(again.train, store.train) and again.fingerprint == store.fingerprint
    assert sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir()) == [
        store.directory.name, store.directory.name + ".lock"]  # no temporary leftovers

    # Without a lock (no flock), a builder that loses the race to publish keeps the winner's copy.
    TokenStore._build(store.directory.parent, store.directory, config, ByteTokenizer())
    assert TokenStore.open(config, ByteTokenizer()).cache_hit
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2

    # A store cut short (crash before the data reached the disk) is rebuilt, not trusted.
    with open(store.directory / "train.bin", "r+b") as f:
        f.truncate(10)
    rebuilt = TokenStore.open(config, CountingByteTokenizer())
    assert not rebuilt.cache_hit and rebuilt.fingerprint == store.fingerprint

    # Changing the file (size/mtime) or the held-out fraction is a different store.
    os.utime(path, ns=(1, 1))
    assert not TokenStore.open(config, ByteTokenizer()).cache_hit
    assert not TokenStore.open(replace(config, heldout_fraction=0.5), ByteTokenizer()).cache_hit

    monkeypatch.setenv("AGORA_CACHE_DIR", str(tmp_path / "env-cache"))
    assert resolve_cache_dir(replace(config, cache_dir=None)) == tmp_path / "env-cache"
    assert resolve_cache_dir(config) == tmp_path / "cache"


def test_concurrent_builders_share_one_store(tmp_path):
    path = _write_jsonl(tmp_path / "data.jsonl", _corpus_texts(3000))
    script = textwrap.dedent(f"""
        import hashlib, torch
        from agora.pipeline.config import DataConfig
        from agora.pipeline.data import PackedSequences, TokenStore, WorkUnits
        from agora.pipeline.tokenizer import ByteTokenizer
        torch.set_num_threads(1)
        store = TokenStore.open(DataConfig(source={str(path)!r}, cache_dir={str(tmp_path / 'cache')!r}), ByteTokenizer())
        units = WorkUnits(PackedSequences(store.train, 64), 4, seed=3)
        print(store.fingerprint, hashlib.sha256(units.unit(5).numpy().tobytes()).hexdigest(), store.cache_hit)
    """)
    processes = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=90)
        assert process.returncode == 0, err
        outputs.append(out.split())
    assert outputs[0][:2] == outputs[1][:2]
    assert sorted(o[2] for o in outputs) == ["False", "True"]  # one built, the other waited and reused
    assert len([p for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir()]) == 1


# ---------------------------------------------------------------- sequences and units


def test_packed_sequences_share_boundary_tokens():
    packed = PackedSequences(np.arange(1001, dtype=np.uint16), seq_len=10)
    assert len(packed) == 100
    assert list(packed[0]) == list(range(11)) and list(packed[99]) == list(range(990, 1001))
    batch = packed.batch([3, 0])
    assert batch.dtype == torch.long and batch.shape == (2, 11)
    assert batch[0].tolist() == list(range(30, 41)) and batch[1].tolist() == list(range(11))
    assert len(PackedSequences(np.arange(1000), 10)) == 99
    with pytest.raises(IndexError):
        packed.batch([100])


def test_units_of_an_epoch_are_disjoint_and_cover_it():
    packed = PackedSequences(np.arange(103 * 16 + 1, dtype=np.uint32), seq_len=16)
    units = WorkUnits(packed, sequences_per_unit=10, seed=5)
    assert units.units_per_epoch == 10
    epoch0 = np.concatenate([units.sequence_indices(u) for u in range(10)])
    assert len(set(epoch0.tolist())) == 100 and set(epoch0.tolist()) <= set(range(103))  # 3 dropped
    epoch1 = np.concatenate([units.sequence_indices(u) for u in range(10, 20)])
    assert len(set(epoch1.tolist())) == 100 and not np.array_equal(epoch0, epoch1)
    assert units.epoch(9) == 0 and units.epoch(10) == 1

    tokens = units.unit(13)
    assert tokens.shape == (10, 17) and tokens.dtype == torch.long
    assert torch.equal(tokens, packed.batch(units.sequence_indices(13)))
    # Deterministic: a fresh object (cold permutation cache) and random access agree.
    fresh = WorkUnits(packed, 10, seed=5)
    assert torch.equal(fresh.unit(13), tokens) and torch.equal(fresh.unit(2), units.unit(2))
    assert not np.array_equal(WorkUnits(packed, 10, seed=6).sequence_indices(0), units.sequence_indices(0))
    with pytest.raises(ValueError):
        units.unit(-1)
    with pytest.raises(ValueError):
        WorkUnits(packed, 200, seed=0)


def _run_config(cache_dir, **data) -> RunConfig:
    return RunConfig(data=DataConfig(cache_dir=str(cache_dir), seed=11, **data),
                     train=TrainConfig(batch_size=8, microbatches=2, seq_len=128),
                     model=ModelConfig(vocab_size=256, max_seq_len=256))


def test_same_unit_across_separately_built_run_data(tmp_path):
    cold = build_data(_run_config(tmp_path / "a"))
    warm = build_data(_run_config(tmp_path / "a"))
    other = build_data(_run_config(tmp_path / "b"))
    assert not cold.store.cache_hit and warm.store.cache_hit and not other.store.cache_hit
    assert cold.fingerprint == warm.fingerprint == other.fingerprint
    assert cold.train.sequences_per_unit == 8 and cold.train.seq_len == 128 and cold.train.seed == 11
    for unit in (0, 7, cold.train.units_per_epoch + 3):
        assert torch.equal(cold.train.unit(unit), warm.train.unit(unit))
        assert torch.equal(cold.train.unit(unit), other.train.unit(unit))
    assert cold.train.unit(0).shape == (8, 129)

    batches = warm.heldout_batches()
    assert len(batches) == 4 and all(b.shape == (8, 129) for b in batches)
    assert batches[0][0].tolist() == warm.heldout[0].tolist() and batches[1][0].tolist() == warm.heldout[8].tolist()
    assert all(torch.equal(a, b) for a, b in zip(batches, other.heldout_batches(4, 8)))
    assert isinstance(warm.tokenizer.decode(warm.heldout[0]), str)


def test_build_data_checks_vocabulary_and_size(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.vocab_size: 128 is smaller"):
        build_data(replace(_run_config(tmp_path), model=ModelConfig(vocab_size=128)))
    tiny = _write_jsonl(tmp_path / "tiny.jsonl", ["just a few bytes"])
    with pytest.raises(ConfigError, match="fewer than one unit of train.batch_size=8"):
        build_data(_run_config(tmp_path, source=str(tiny)))
    path = _write_jsonl(tmp_path / "data.jsonl", _corpus_texts(400))
    data = build_data(_run_config(tmp_path, source=str(path), heldout_fraction=0.01))
    with pytest.raises(ConfigError, match="data.heldout_fraction"):
        data.heldout_batches(1, 10_000)
