import json

import pytest

from snip_megatron.data.sources import IndexedSource, parse_corpus, stdlib_files


def test_stdlib_is_real_in_a_fixed_order_and_excludes_site_packages():
    root, files = stdlib_files()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert len(files) > 500 and "os.py" in rel and len(set(rel)) == len(rel)
    assert rel == [p.relative_to(root).as_posix() for p in stdlib_files()[1]]
    assert rel != sorted(rel)  # hash order: a capped prefix samples the whole library
    assert not any("site-packages" in r for r in rel)


def test_caps_give_a_deterministic_prefix():
    docs = list(parse_corpus("stdlib", max_docs=5).documents())
    assert len(docs) == 5
    assert [d.name for d in docs] == [d.name for d in parse_corpus("stdlib", max_docs=5).documents()]
    capped = list(parse_corpus("stdlib", max_bytes=200_000).documents())
    assert 180_000 <= sum(len(d.text.encode()) for d in capped) <= 200_000
    assert [d.name for d in capped] == [d.name for d in parse_corpus("stdlib", max_bytes=200_000).documents()]
    # Documents too large for what is left of the cap are skipped; the order is kept.
    order = [d.name for d in parse_corpus("stdlib", max_docs=len(capped) * 3).documents()]
    positions = [order.index(d.name) for d in capped]
    assert positions == sorted(positions)


def test_folder_glob_and_jsonl(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "blank.txt").write_text("  \n")
    (tmp_path / ".hidden").write_text("skip me")
    assert [d.text for d in parse_corpus(str(tmp_path)).documents()] == ["first", "second"]
    assert [d.text for d in parse_corpus(str(tmp_path / "*.txt")).documents()] == ["first", "second"]
    jl = tmp_path / "c.jsonl"
    jl.write_text(json.dumps({"text": "x1", "body": "y1"}) + "\n\n" + json.dumps({"text": "x2", "body": "y2"}) + "\n")
    assert [d.text for d in parse_corpus(str(jl)).documents()] == ["x1", "x2"]
    assert [d.text for d in parse_corpus(f"{jl}:body").documents()] == ["y1", "y2"]
    with pytest.raises(ValueError, match="no text field 'nope'"):
        list(parse_corpus(f"{jl}:nope").documents())


def test_indexed_prefix_is_recognised(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"")
    (tmp_path / "x.idx").write_bytes(b"")
    src = parse_corpus(str(tmp_path / "x"))
    assert isinstance(src, IndexedSource) and src.prefix == tmp_path / "x"


@pytest.mark.parametrize("spec, match", [
    ("/no/such/corpus/anywhere", "does not exist"),
    ("/no/such/file.jsonl", "JSONL file .* does not exist"),
    ("", "non-empty"),
])
def test_bad_specs_raise(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_corpus(spec)


def test_empty_folder_raises(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        parse_corpus(str(tmp_path))


def test_bad_caps_raise():
    with pytest.raises(ValueError, match="max_docs"):
        parse_corpus("stdlib", max_docs=0)
