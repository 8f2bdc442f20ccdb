import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from snip_megatron.data import prepare as prepare_mod
from snip_megatron.data.indexed import read_indexed, token_stream
from snip_megatron.data.prepare import DataConfig, main, prepare
from snip_megatron.data.sources import parse_corpus
from snip_megatron.data.tokenizer import EOD_TOKEN, MegatronTokenizer, load_tokenizer


def test_tokenizer_round_trip_on_default_corpus(small_config, small_data):
    tok = load_tokenizer(small_data.tokenizer_path)
    assert tok.get_vocab_size() == small_config.vocab_size == small_data.vocab_size
    eod = tok.token_to_id(EOD_TOKEN)
    dataset = read_indexed(small_data.prefix)
    docs = list(parse_corpus("stdlib", max_bytes=small_config.max_bytes).documents())
    assert len(dataset) == len(docs) == small_data.num_docs > 10
    for i, doc in enumerate(docs):
        ids = dataset[i].tolist()
        assert ids[-1] == eod and eod not in ids[:-1]
        assert tok.decode(ids[:-1], skip_special_tokens=False) == doc.text, doc.name
    # BPE compresses Python source: well under one token per byte.
    assert small_data.num_tokens < 0.5 * sum(len(d.text.encode()) for d in docs)


def test_two_runs_give_identical_token_streams(tmp_path, small_config, small_data):
    again = prepare(replace(small_config, cache_dir=str(tmp_path)))
    assert not again.reused and again.digest == small_data.digest
    a = token_stream(read_indexed(small_data.prefix))
    b = token_stream(read_indexed(again.prefix))
    assert a.size == small_data.num_tokens and np.array_equal(a, b)
    assert Path(again.tokenizer_path).read_bytes() == Path(small_data.tokenizer_path).read_bytes()


def test_cache_is_reused_without_retokenizing(monkeypatch, small_config, small_data):
    bin_path = Path(small_data.prefix + ".bin")
    mtime = bin_path.stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("re-tokenized despite a cache hit")

    monkeypatch.setattr(prepare_mod, "train_bpe", boom)
    monkeypatch.setattr(prepare_mod, "write_indexed", boom)
    hit = prepare(small_config)
    assert hit.reused and hit.prefix == small_data.prefix and bin_path.stat().st_mtime_ns == mtime


def test_cache_key_changes_with_inputs(small_config, small_data):
    other = prepare(replace(small_config, vocab_size=512, max_bytes=100_000))
    assert other.digest != small_data.digest and other.vocab_size == 512


def test_loaded_tokenizer_and_indexed_prefix(tmp_path, small_data):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 50)
    cfg = DataConfig(corpus=str(tmp_path / "t"), cache_dir=str(tmp_path / "c"),
                     tokenizer=small_data.tokenizer_path)
    data = prepare(cfg)
    assert data.vocab_size == small_data.vocab_size and data.num_docs == 1
    # An existing .bin/.idx prefix is used as is, with the tokenizer found next to it.
    again = prepare(DataConfig(corpus=data.prefix, cache_dir=str(tmp_path / "c")))
    assert again.prefix == data.prefix and again.num_tokens == data.num_tokens
    assert again.tokenizer_path == data.tokenizer_path
    assert MegatronTokenizer(again.tokenizer_path).eod == load_tokenizer(data.tokenizer_path).token_to_id(EOD_TOKEN)


def test_empty_and_unknown_corpus_raise(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "blank.txt").write_text("\n\n  ")
    with pytest.raises(ValueError, match="empty"):
        prepare(DataConfig(corpus=str(tmp_path / "e"), cache_dir=str(tmp_path / "c")))
    with pytest.raises(ValueError, match="does not exist"):
        prepare(DataConfig(corpus=str(tmp_path / "missing"), cache_dir=str(tmp_path / "c")))
    with pytest.raises(ValueError, match="vocab_size"):
        DataConfig(vocab_size=100)
    with pytest.raises(ValueError, match="tokenizer"):
        prepare(DataConfig(corpus="stdlib", max_docs=1, cache_dir=str(tmp_path / "c"),
                           tokenizer=str(tmp_path / "nope.json")))
    assert not any((tmp_path / "c").glob("*/meta.json"))  # nothing half-written left behind


def test_cli_prints_result(tmp_path, capsys, small_config, small_data):
    argv = ["--corpus", "stdlib", "--out", small_config.cache_dir, "--vocab-size",
            str(small_config.vocab_size), "--max-bytes", str(small_config.max_bytes)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"RESULT docs={small_data.num_docs} tokens={small_data.num_tokens}" in out
    assert "reused=True" in out
    assert json.loads(out[:out.rindex("}") + 1])["digest"] == small_data.digest
