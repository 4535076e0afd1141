"""moetier.Tokenizer against transformers' tokenizer for the same folder, plus streaming decode."""

from __future__ import annotations

import json
import random

import pytest
from tiny_tokenizer import BOS, CHAT_SPECIALS, EOS, write_test_tokenizer

from moetier.errors import CheckpointError
from moetier.tokenizer import Tokenizer

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog, twice!",
    "code": 'def f(x):\n    return {"k": x ** 2}  # done\n\tprint(f(3))\n',
    "cjk": "你好，世界！今天天气很好。日本語のテキスト",
    "emoji": "ok 😀👍🏽 fine 🇫🇷 …",
    "mixed": "Mixture 专家 of 😀 experts <｜User｜>hi<think>x</think>",
    "whitespace": "  leading\n\n\n  trailing   ",
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_test_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(folder):
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def hf_tok(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_fixture_ids_fit_the_vocab(tmp_path):
    for vocab_size in (320, 512):
        write_test_tokenizer(tmp_path / str(vocab_size), vocab_size=vocab_size)
        tok = Tokenizer.from_folder(tmp_path / str(vocab_size))
        assert tok.vocab_size == vocab_size
        ids = tok.encode("".join(TEXTS.values()) + "".join(CHAT_SPECIALS) + EOS)
        assert max(ids) < vocab_size
    with pytest.raises(ValueError):
        write_test_tokenizer(tmp_path / "small", vocab_size=260)


def test_special_ids_and_eos(tok, folder):
    assert tok.bos_token_id == tok.token_to_id(BOS) == 0
    assert tok.eos_token_ids == {tok.token_to_id(EOS)} == {1}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    try:
        assert Tokenizer.from_folder(folder).eos_token_ids == {1, 7}
    finally:
        (folder / "generation_config.json").unlink()


@pytest.mark.parametrize("name", list(TEXTS))
def test_round_trip_and_matches_transformers(tok, hf_tok, name):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
    # BOS is special: dropped by default, kept on request; the non-special chat markers survive.
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS + text
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_markers_are_single_ids(tok):
    for marker in [BOS, EOS, *CHAT_SPECIALS]:
        marker_id = tok.token_to_id(marker)
        assert marker_id is not None
        assert tok.encode(f"a{marker}b", add_special_tokens=False) == [
            *tok.encode("a", add_special_tokens=False),
            marker_id,
            *tok.encode("b", add_special_tokens=False),
        ]


def test_bos_handling(tok, folder, tmp_path):
    assert tok.encode("hello")[0] == tok.bos_token_id
    assert tok.encode("hello").count(tok.bos_token_id) == 1
    assert tok.bos_token_id not in tok.encode("hello", add_special_tokens=False)
    # A rendered chat prompt carries BOS itself: encoding it must not give two.
    assert tok.encode(BOS + "hello") == tok.encode("hello")

    def variant(name, **overrides):
        path = tmp_path / name
        write_test_tokenizer(path)
        config = json.loads((path / "tokenizer_config.json").read_text())
        config.update(overrides)
        for key in [k for k, v in overrides.items() if v is None]:
            del config[key]
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        return Tokenizer.from_folder(path)

    # add_bos_token: false wins over the post-processor that adds BOS.
    assert variant("off", add_bos_token=False).encode("hello") == tok.encode("hello", add_special_tokens=False)
    # Without the flag, the post-processor decides (it adds BOS here).
    assert variant("unset", add_bos_token=None).encode("hello") == tok.encode("hello")


def test_stream_decoder_matches_decode_for_every_prefix(tok):
    text = "".join(TEXTS.values())
    ids = tok.encode(text)
    # The fixture must really split characters across tokens, or this test proves nothing.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    for skip in (True, False):
        full = tok.decode(ids, skip_special_tokens=skip)
        for k in range(len(ids) + 1):
            stream = tok.stream_decoder(skip_special_tokens=skip)
            deltas = [stream.push(i) for i in ids[:k]]
            assert "".join(deltas) + stream.flush() == tok.decode(ids[:k], skip_special_tokens=skip)
        stream = tok.stream_decoder(skip_special_tokens=skip)
        deltas = [stream.push(i) for i in ids]
        # Never half a character: no replacement character in any delta, nothing left for flush.
        assert all("\ufffd" not in delta for delta in deltas)
        assert "".join(deltas) == full and stream.flush() == ""


def test_stream_decoder_random_token_soup(tok):
    """Arbitrary ids (invalid UTF-8 included) still stream to exactly what decode gives."""
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        stream = tok.stream_decoder()
        out = "".join(stream.push(i) for i in ids) + stream.flush()
        assert out == tok.decode(ids)


def test_bad_folders_give_one_line_errors(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json is missing") as missing:
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(CheckpointError, match="cannot be read as a tokenizer") as corrupt:
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(CheckpointError):
        Tokenizer.from_folder(tmp_path)
    for error in (missing, corrupt):
        assert "\n" not in str(error.value)
