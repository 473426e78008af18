"""Datastore build -> load round trips and every user-facing error, with a tiny tokenizer."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from helpers import WORDS, make_tokenizer
from vllm_retrieval_spec.datastore import (
    FORMAT_VERSION,
    SEPARATOR,
    DatastoreError,
    SuffixArrayDatastore,
    build_datastore,
    build_datastore_from_token_ids,
    load_datastore,
    tokenizer_fingerprint,
)
from vllm_retrieval_spec.datastore.format import MANIFEST_FILE, SUFFIX_ARRAY_FILE, TOKENS_FILE

@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "print x"}]


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[list[str], list[str], int]:
    """(sources, documents in build order, number of files that must be skipped)."""
    code = tmp_path / "code"
    (code / "sub").mkdir(parents=True)
    (code / "b.py").write_text("def x return y\n")
    (code / "a.py").write_text("import x\nprint x\n")
    (code / "empty.py").write_text("")
    (code / "binary.py").write_bytes(b"def\x00\x01")
    (code / "latin1.py").write_bytes(b"print \xe9")
    (code / "notes.md").write_text("not a .py file")
    (code / "sub" / "c.py").write_text("class self")
    text_jsonl = tmp_path / "text.jsonl"
    text_jsonl.write_text(
        json.dumps({"text": "hello world", "id": 1}) + "\n\n" + json.dumps({"text": "print x"})
    )
    chat_jsonl = tmp_path / "chat.jsonl"
    chat_jsonl.write_text(json.dumps({"messages": CHAT}) + "\n")
    gz = tmp_path / "more.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"text": "if x else y"}) + "\n")
    txt = tmp_path / "notes.txt"
    txt.write_text("the world\nthe x")
    documents = [
        "import x\nprint x\n",
        "def x return y\n",
        "class self",
        "hello world",
        "print x",
        "user hello </s> assistant print x </s> ",
        "if x else y",
        "the world\nthe x",
    ]
    sources = [str(code), str(text_jsonl), str(chat_jsonl), str(gz), str(txt)]
    return sources, documents, 2


def build(sources, out, tokenizer, **kwargs):
    return build_datastore(sources, out, tokenizer, tokenizer_name="tiny", progress=False, **kwargs)


@pytest.fixture
def store(tmp_path: Path, tokenizer) -> Path:
    src = tmp_path / "doc.txt"
    src.write_text("def x return y if x else y print x")
    out = tmp_path / "store"
    build([src], out, tokenizer)
    return out


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_round_trip(tmp_path, tokenizer, corpus):
    sources, documents, skipped = corpus
    out = tmp_path / "ds"
    manifest = build(sources, out, tokenizer, batch_size=3)

    expected = [t for doc in documents for t in [*ids(tokenizer, doc), SEPARATOR]]
    assert max(expected) >= 65_536
    assert manifest.num_documents == len(documents)
    assert manifest.num_tokens == len(expected)
    assert manifest.skipped_files == skipped
    assert manifest.sources == sources
    assert manifest.tokenizer_name == "tiny"
    assert manifest.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    assert manifest.vocab_size == len(tokenizer)
    assert manifest.format_version == FORMAT_VERSION

    ds = load_datastore(out, expected_fingerprint=tokenizer_fingerprint(tokenizer))
    assert ds.manifest == manifest
    assert isinstance(ds.tokens, np.memmap) and isinstance(ds.suffix_array, np.memmap)
    assert ds.tokens.dtype == np.int32 and ds.suffix_array.dtype == np.int32
    assert ds.tokens.tolist() == expected
    tokens = ds.tokens.tolist()
    assert ds.suffix_array.tolist() == sorted(range(len(tokens)), key=lambda i: tokens[i:])
    assert json.loads((out / MANIFEST_FILE).read_text())["files"][TOKENS_FILE]["shape"] == [
        len(expected)
    ]
    assert leftovers(tmp_path) == []


def test_lookup_on_built_store(tmp_path, tokenizer, corpus):
    sources, _, _ = corpus
    build(sources, tmp_path / "ds", tokenizer)
    index = SuffixArrayDatastore.from_path(
        tmp_path / "ds", expected_fingerprint=tokenizer_fingerprint(tokenizer)
    )
    # "print x" ends one document and continues "</s> ..." in the chat one.
    cands, lengths, n = index.lookup(ids(tokenizer, "hello world the print x"), continuation_len=3)
    assert n == 2
    rows = sorted(tuple(c[:k]) for c, k in zip(cands.tolist(), lengths.tolist(), strict=True))
    eos = tokenizer.convert_tokens_to_ids("</s>")
    assert rows == [(), (), (eos,)]
    assert lengths.tolist().count(0) == 2  # a.py and text.jsonl end with "print x"
    cands, lengths, n = index.lookup([0, 1, 2])
    assert (cands.shape, n) == ((0, 10), 0)


def test_build_from_token_ids(tmp_path):
    documents = [[70_000, 3, 5], np.array([], dtype=np.int32), np.array([5, 70_000], np.int64)]
    manifest = build_datastore_from_token_ids(
        iter(documents),
        tmp_path / "ds",
        tokenizer_name="generated",
        tokenizer_fingerprint="f" * 64,
        vocab_size=70_001,
        progress=False,
    )
    assert (manifest.num_documents, manifest.num_tokens) == (2, 7)
    ds = load_datastore(tmp_path / "ds", expected_fingerprint="f" * 64)
    assert ds.tokens.tolist() == [70_000, 3, 5, -1, 5, 70_000, -1]
    with pytest.raises(
        DatastoreError, match=r"token ids outside \[0, 70000\) \(min 3, max 70000\)"
    ):
        build_datastore_from_token_ids(
            documents,
            tmp_path / "bad",
            tokenizer_name="generated",
            tokenizer_fingerprint="f" * 64,
            vocab_size=70_000,
            progress=False,
        )
    assert not (tmp_path / "bad").exists() and leftovers(tmp_path) == []


def test_fingerprint_is_stable_and_discriminating(tokenizer):
    assert tokenizer_fingerprint(make_tokenizer()) == tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(make_tokenizer(WORDS + " extra")) != tokenizer_fingerprint(
        tokenizer
    )
    swapped = " ".join(reversed(WORDS.split()))
    assert tokenizer_fingerprint(make_tokenizer(swapped)) != tokenizer_fingerprint(tokenizer)
    added = make_tokenizer()
    added.add_tokens(["<tool>"])
    assert tokenizer_fingerprint(added) != tokenizer_fingerprint(tokenizer)


def test_missing_directory(tmp_path):
    with pytest.raises(DatastoreError, match=r"does not exist.*vllm-rsd build-datastore"):
        load_datastore(tmp_path / "nope")


def test_a_file_is_not_a_missing_directory(store):
    # e.g. the corpus passed instead of the datastore: once "does not exist", which it does.
    with pytest.raises(DatastoreError, match=r"doc.txt is a file, not a datastore directory"):
        load_datastore(store.parent / "doc.txt")


def test_directory_without_manifest(store):
    (store / MANIFEST_FILE).unlink()
    with pytest.raises(
        DatastoreError, match=re.escape(f"{store} is not a datastore: it has no manifest")
    ):
        load_datastore(store)


def test_leftover_temporary_directory_never_loads(store):
    leftover = store.rename(store.with_name("store.tmp-12345"))
    with pytest.raises(DatastoreError, match="temporary directory of an unfinished"):
        load_datastore(leftover)


def test_truncated_tokens(store):
    data = (store / TOKENS_FILE).read_bytes()
    (store / TOKENS_FILE).write_bytes(data[:-4])
    with pytest.raises(
        DatastoreError, match=rf"{TOKENS_FILE} is truncated: it has {len(data) - 4}"
    ):
        load_datastore(store, verify_checksums=False)


def test_missing_file(store):
    (store / SUFFIX_ARRAY_FILE).unlink()
    with pytest.raises(DatastoreError, match=f"{SUFFIX_ARRAY_FILE} is missing; rebuild"):
        load_datastore(store)


def test_flipped_byte_fails_checksum(store):
    path = store / SUFFIX_ARRAY_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DatastoreError, match=f"{SUFFIX_ARRAY_FILE} is corrupt: its sha256 is"):
        load_datastore(store)
    # Skipping the checksums is the user's call (faster start-up); sizes still match.
    load_datastore(store, verify_checksums=False)


def test_wrong_fingerprint(store, tokenizer):
    ours = tokenizer_fingerprint(tokenizer)
    theirs = tokenizer_fingerprint(make_tokenizer("completely different words"))
    with pytest.raises(DatastoreError) as err:
        load_datastore(store, expected_fingerprint=theirs)
    message = str(err.value)
    assert ours in message and theirs in message and "'tiny'" in message
    assert "another tokenizer" in message


def edit_manifest(store: Path, **changes) -> None:
    data = json.loads((store / MANIFEST_FILE).read_text())
    data.update(changes)
    (store / MANIFEST_FILE).write_text(json.dumps(data))


def test_unsupported_format_version(store):
    edit_manifest(store, format_version=FORMAT_VERSION + 1)
    with pytest.raises(DatastoreError, match=f"format version {FORMAT_VERSION + 1} is not supp"):
        load_datastore(store)


def test_unparsable_manifest(store):
    (store / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(DatastoreError, match=r"manifest.json is not valid JSON"):
        load_datastore(store)
    edit_manifest_text = json.dumps({"format_version": FORMAT_VERSION, "kind": "x"})
    (store / MANIFEST_FILE).write_text(edit_manifest_text)
    with pytest.raises(DatastoreError, match=r"lacks the field.*tokenizer_fingerprint"):
        load_datastore(store)


@pytest.mark.parametrize("field, value", [("bytes", "152"), ("shape", 11)])
def test_manifest_file_entry_of_the_wrong_type(store, field, value):
    # A hand-edited manifest: once a TypeError deep in the size or header check.
    files = json.loads((store / MANIFEST_FILE).read_text())["files"]
    files[TOKENS_FILE][field] = value
    edit_manifest(store, files=files)
    with pytest.raises(DatastoreError, match=r"field 'files' must map names to \{bytes: integer"):
        load_datastore(store)


def test_dtype_and_shape_mismatch(store):
    files = json.loads((store / MANIFEST_FILE).read_text())["files"]
    files[TOKENS_FILE]["dtype"] = "int64"
    edit_manifest(store, files=files)
    with pytest.raises(DatastoreError, match=r"holds int32 .* the manifest records int64"):
        load_datastore(store)

    files[TOKENS_FILE]["dtype"] = "int32"
    num_tokens = json.loads((store / MANIFEST_FILE).read_text())["num_tokens"]
    edit_manifest(store, files=files, num_tokens=num_tokens + 1)
    with pytest.raises(DatastoreError, match=rf"this format needs int32 \[{num_tokens + 1}\]"):
        load_datastore(store)

    # Written on a big-endian machine: the same dtype name, refused, and named as such.
    tokens = np.load(store / TOKENS_FILE)
    np.save(store / TOKENS_FILE, tokens.astype(">i4"))
    edit_manifest(store, num_tokens=num_tokens)
    with pytest.raises(DatastoreError, match=r"holds big-endian int32 .* the manifest records "
                                             r"int32 .* this format needs int32"):
        load_datastore(store, verify_checksums=False)


@pytest.mark.parametrize("name", [TOKENS_FILE, SUFFIX_ARRAY_FILE])
def test_npy_header_that_no_longer_parses(store, name):
    """One byte of a header damaged (its closing brace): a one-line 'rebuild it', checksums on
    or off. Before: numpy's tokenize.TokenError ("EOF in multi-line statement") as a traceback,
    since the header check runs before the checksums."""
    path = store / name
    path.write_bytes(path.read_bytes().replace(b"}", b" ", 1))
    for verify in (True, False):
        with pytest.raises(DatastoreError, match=rf"{name} is not a valid .npy file \(.*\); "
                                                 r"rebuild it"):
            load_datastore(store, verify_checksums=verify)


def test_empty_corpus(tmp_path, tokenizer):
    src = tmp_path / "src"
    src.mkdir()
    (src / "binary.py").write_bytes(b"\x00\x01")
    (src / "empty.py").write_text("")
    out = tmp_path / "out"
    with pytest.raises(
        DatastoreError, match=rf"no documents .*{re.escape(str(src))}.*1 file\(s\) skipped"
    ):
        build([src], out, tokenizer)
    assert not out.exists() and leftovers(tmp_path) == []

    whitespace = tmp_path / "blank.txt"
    whitespace.write_text("   \n")
    with pytest.raises(DatastoreError, match="no documents"):
        build([whitespace], out, tokenizer)
    assert not out.exists() and leftovers(tmp_path) == []


def test_bad_sources(tmp_path, tokenizer):
    with pytest.raises(DatastoreError, match=r"source .*missing.txt does not exist"):
        build([tmp_path / "missing.txt"], tmp_path / "out", tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"body": "y"}) + "\n")
    with pytest.raises(DatastoreError, match=r"bad.jsonl:2: neither a 'text' nor a 'messages'"):
        build([bad], tmp_path / "out", tokenizer)
    bad.write_text("[1, 2]\n")
    with pytest.raises(DatastoreError, match=r"bad.jsonl:1: not a JSON object"):
        build([bad], tmp_path / "out", tokenizer)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x00\xff")
    with pytest.raises(DatastoreError, match=r"blob.bin is not a UTF-8 text file"):
        build([binary], tmp_path / "out", tokenizer)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_unreadable_jsonl(tmp_path, tokenizer):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"text": "ok"}).encode() + b'\n{"text": "caf\xe9"}\n')
    with pytest.raises(DatastoreError, match=r"latin1.jsonl cannot be read as UTF-8 JSON lines "
                                             r"\('utf-8' codec can't decode byte 0xe9"):
        build([latin1], tmp_path / "out", tokenizer)
    # In a directory too: a .jsonl there is read as a corpus, not skipped like a binary file.
    folder = tmp_path / "folder"
    folder.mkdir()
    latin1.rename(folder / "latin1.jsonl")
    with pytest.raises(DatastoreError, match=r"latin1.jsonl cannot be read as UTF-8 JSON lines"):
        build([folder], tmp_path / "out", tokenizer, extensions=[".jsonl"])
    fake_gz = tmp_path / "fake.jsonl.gz"
    fake_gz.write_text(json.dumps({"text": "not compressed"}) + "\n")
    with pytest.raises(DatastoreError, match=r"fake.jsonl.gz cannot be read .*Not a gzipped file"):
        build([fake_gz], tmp_path / "out", tokenizer)
    cut_gz = tmp_path / "cut.jsonl.gz"
    cut_gz.write_bytes(gzip.compress(json.dumps({"text": "x" * 1000}).encode())[:-12])
    with pytest.raises(DatastoreError, match=r"cut.jsonl.gz cannot be read .*end-of-stream"):
        build([cut_gz], tmp_path / "out", tokenizer)
    # A gzip header followed by a damaged deflate stream: zlib.error, which is no OSError.
    damaged = bytearray(gzip.compress(json.dumps({"text": "x y " * 500}).encode()))
    damaged[12:24] = b"\xff" * 12
    bad_gz = tmp_path / "damaged.jsonl.gz"
    bad_gz.write_bytes(bytes(damaged))
    with pytest.raises(DatastoreError, match=r"damaged.jsonl.gz cannot be read .*decompressing"):
        build([bad_gz], tmp_path / "out", tokenizer)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_extensions_with_or_without_their_dot(tmp_path, tokenizer):
    # Before: "py" matched every name ending in those letters, "happy" and "numpy" too.
    folder = tmp_path / "folder"
    folder.mkdir()
    for name, text in (("a.py", "import x"), ("b.MD", "hello world"), ("happy", "the a"),
                       ("numpy", "if x"), ("c.txt", "print x")):
        (folder / name).write_text(text)
    expected = [t for doc in ("import x", "hello world") for t in [*ids(tokenizer, doc), SEPARATOR]]
    for extensions in (["py", "md"], [".py", ".md"], [" py", ".MD"]):
        build([folder], tmp_path / "out", tokenizer, extensions=extensions, overwrite=True)
        assert load_datastore(tmp_path / "out").tokens.tolist() == expected, extensions
    # An empty one (`--extensions py,`) would match every file.
    with pytest.raises(DatastoreError, match=r"^extension '' is empty; give suffixes such as "
                                             r"py or \.py$"):
        build([folder], tmp_path / "empty", tokenizer, extensions=["py", ""])
    assert not (tmp_path / "empty").exists()


def test_missing_source_is_found_before_tokenizing(tmp_path, tokenizer):
    first = tmp_path / "first.txt"
    first.write_text("hello world")
    counting = ExplodingTokenizer(tokenizer, AssertionError("never reached"))
    with pytest.raises(DatastoreError, match=r"source .*typo.txt does not exist"):
        build([first, tmp_path / "typo.txt"], tmp_path / "out", counting, batch_size=1)
    assert counting.calls == 0
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_text_and_messages_field_names(tmp_path, tokenizer):
    src = tmp_path / "custom.jsonl"
    src.write_text(json.dumps({"body": "hello world"}) + "\n" + json.dumps({"turns": CHAT}) + "\n")
    manifest = build([src], tmp_path / "out", tokenizer, text_field="body", messages_field="turns")
    assert manifest.num_documents == 2


class ExplodingTokenizer:
    """Delegates to a tokenizer and raises on its second batch, like Ctrl-C mid-build."""

    def __init__(self, inner, exc: BaseException) -> None:
        self.inner = inner
        self.exc = exc
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise self.exc
        return self.inner(*args, **kwargs)


def test_interrupted_tokenization_leaves_nothing(tmp_path, tokenizer, corpus):
    sources, _, _ = corpus
    out = tmp_path / "ds"
    with pytest.raises(KeyboardInterrupt):
        build(sources, out, ExplodingTokenizer(tokenizer, KeyboardInterrupt()), batch_size=1)
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_killed_builds_temporary_is_named_by_the_next_build(tmp_path, tokenizer, corpus,
                                                              capsys):
    # SIGKILL or the OOM killer runs no cleanup: its <out>.tmp-<pid> stayed unnoticed for good.
    from test_atomic import dead_pid

    sources, _, _ = corpus
    out = tmp_path / "ds"
    killed = tmp_path / f"ds.tmp-{dead_pid()}"
    killed.mkdir()
    build(sources, out, tokenizer)
    assert f"note: {killed} (0.0 MiB) was left by process" in capsys.readouterr().err
    assert leftovers(tmp_path) == [killed.name] and load_datastore(out).manifest.num_documents


def test_failed_suffix_array_leaves_nothing(tmp_path, tokenizer, corpus, monkeypatch):
    import pydivsufsort

    def fail(*args, **kwargs):
        raise MemoryError("divsufsort ran out of memory")

    monkeypatch.setattr(pydivsufsort, "divsufsort", fail)
    sources, _, _ = corpus
    out = tmp_path / "ds"
    with pytest.raises(MemoryError):
        build(sources, out, tokenizer)
    assert not out.exists() and leftovers(tmp_path) == []


def test_failed_rebuild_keeps_the_old_store(store, tokenizer, monkeypatch):
    import pydivsufsort

    before = load_datastore(store).manifest
    monkeypatch.setattr(pydivsufsort, "divsufsort", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        build([store.parent / "doc.txt"], store, tokenizer, overwrite=True)
    assert load_datastore(store).manifest == before
    assert leftovers(store.parent) == []


def test_overwrite(store, tokenizer, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("hello world")
    with pytest.raises(DatastoreError, match="already holds a datastore; pass overwrite=True"):
        build([other], store, tokenizer)
    assert load_datastore(store).manifest.num_tokens == 11
    build([other], store, tokenizer, overwrite=True)
    assert load_datastore(store).tokens.tolist() == [*ids(tokenizer, "hello world"), SEPARATOR]
    assert leftovers(tmp_path) == []

    # A directory with other content is never replaced, even with overwrite=True.
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("...")
    with pytest.raises(DatastoreError, match=r"is not a datastore .*refusing to replace"):
        build([other], precious, tokenizer, overwrite=True)
    assert (precious / "thesis.tex").exists()


def test_overwrite_through_a_symlink(store, tokenizer, tmp_path):
    """A datastore reached through a symbolic link (to a larger disk, say) is replaced where the
    link points. Before: the whole build ran, then renaming it into place failed with
    NotADirectoryError (a traceback; the old store was kept)."""
    link = tmp_path / "link"
    link.symlink_to(store)
    other = tmp_path / "other.txt"
    other.write_text("hello world")
    with pytest.raises(DatastoreError, match="already holds a datastore; pass overwrite=True"):
        build([other], link, tokenizer)
    build([other], link, tokenizer, overwrite=True)
    assert link.is_symlink() and link.resolve() == store
    assert load_datastore(link).tokens.tolist() == [*ids(tokenizer, "hello world"), SEPARATOR]
    assert leftovers(tmp_path) == []


def test_output_without_a_name(tmp_path, tokenizer, monkeypatch):
    # `mkdir ds && cd ds && vllm-rsd build-datastore ... -o .`: once a ValueError traceback.
    (tmp_path / "doc.txt").write_text("hello world")
    (tmp_path / "ds").mkdir()
    monkeypatch.chdir(tmp_path / "ds")
    with pytest.raises(DatastoreError, match=r"output '\.' is not a directory name; give one, "
                                             r"e\.g\. 'datastore'"):
        build([tmp_path / "doc.txt"], ".", tokenizer)
    assert list((tmp_path / "ds").iterdir()) == [] and leftovers(tmp_path) == []


def test_output_that_cannot_be_created(store, tokenizer, tmp_path):
    # An output under a file (or in a read-only place) is a wrong path: named, not a traceback.
    doc = tmp_path / "doc.txt"
    with pytest.raises(DatastoreError, match=r"cannot create .*doc.txt/ds \(File exists: "
                                             r".*doc.txt\); choose another output"):
        build([doc], doc / "ds", tokenizer)
    assert doc.is_file() and leftovers(tmp_path) == []


def test_generate_corpus_checks_its_output_before_generating(tmp_path, monkeypatch):
    from vllm_retrieval_spec.datastore import generate

    def answer(*args, **kwargs):
        raise AssertionError("the model ran before the output was checked")

    monkeypatch.setattr(generate, "answer_conversations", answer)
    conversations = [[{"role": "user", "content": "hello"}]]
    folder = tmp_path / "corpora"
    folder.mkdir()
    (folder / "mine.jsonl").write_text("precious\n")
    # Written after generating, the directory (and what is in it) would become the file.
    with pytest.raises(DatastoreError, match=r"corpora is a directory; give the path of the "):
        generate.generate_corpus("model", conversations, folder, max_tokens=4)
    assert (folder / "mine.jsonl").read_text() == "precious\n"
    with pytest.raises(DatastoreError, match=r"cannot create .*mine.jsonl/own.jsonl \(File exi"):
        generate.generate_corpus("model", conversations, folder / "mine.jsonl" / "own.jsonl",
                                 max_tokens=4)
    # An earlier corpus (hours of answers, perhaps) is replaced only when asked.
    with pytest.raises(DatastoreError, match=r"mine.jsonl exists; pass --overwrite to replace"):
        generate.generate_corpus("model", conversations, folder / "mine.jsonl", max_tokens=4)
    assert (folder / "mine.jsonl").read_text() == "precious\n"
    # A missing parent is made, as build-datastore does, before the model runs.
    monkeypatch.setattr(generate, "answer_conversations", lambda *a, **k: ["hi"])
    assert generate.generate_corpus("model", conversations, tmp_path / "new" / "own.jsonl",
                                    max_tokens=4) == 1
    assert json.loads((tmp_path / "new" / "own.jsonl").read_text())["messages"][1] == {
        "role": "assistant", "content": "hi"}
    assert generate.generate_corpus("model", conversations, folder / "mine.jsonl", max_tokens=4,
                                    overwrite=True) == 1
    assert "precious" not in (folder / "mine.jsonl").read_text()


def test_loading_does_not_read_the_store_into_memory(tmp_path):
    """Loading, checksums included, leaves RSS flat: arrays are mapped, hashes streamed."""
    import subprocess
    import sys
    import textwrap

    rng = np.random.default_rng(0)
    paths = {}
    for name, num_documents in (("small", 1), ("big", 8)):
        paths[name] = tmp_path / name
        documents = [rng.integers(0, 49_152, 1_000_000).astype(np.int32)
                     for _ in range(num_documents)]
        build_datastore_from_token_ids(documents, paths[name], tokenizer_name="random",
                                       tokenizer_fingerprint="0" * 64, vocab_size=49_152,
                                       progress=False)
    store_bytes = sum(f.stat().st_size for f in paths["big"].iterdir())
    # The small store is loaded first so that imports and first-use allocations are not counted.
    script = textwrap.dedent(f"""
        from vllm_retrieval_spec.datastore import load_datastore

        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024

        load_datastore({str(paths["small"])!r}, verify_checksums=True)
        before = rss()
        store = load_datastore({str(paths["big"])!r}, verify_checksums=True)
        print(rss() - before, len(store.tokens))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.split()
    growth, num_tokens = int(out[0]), int(out[1])
    assert num_tokens == 8 * 1_000_001
    assert store_bytes > 60 << 20
    assert growth < 2 << 20, f"RSS grew by {growth} bytes loading a {store_bytes}-byte store"
