"""Bench checkpoints are servable: a tokenizer covering the whole vocabulary, DeepSeek's special tokens at
the config's ids, streaming detokenisation of any id, and the real server under ``moetier bench serve``."""

import json
import random
import time

import pytest

from moetier.bench.make_model import main as make_bench_model
from moetier.bench.serve import _WORDS, make_prompts
from moetier.engine.detokenizer import IncrementalText
from moetier.engine.sampling import SamplingParams
from moetier.tokenizer import Tokenizer
from moetier.tokenizer_training import (
    BENCH_WORDS,
    BOS,
    CHAT_SPECIALS,
    EOS,
    full_vocabulary_tokenizer,
    write_tokenizer_folder,
)

VOCAB = 4096  # above the ~2250 trained tokens, so the tiny model has filler ids too
TINY_V4 = [
    "--shape", "deepseek-v4-flash", "--layers", "3", "--experts-per-layer", "8", "--hidden-size", "64",
    "--moe-intermediate-size", "32", "--vocab-size", str(VOCAB), "--quiet", "--device", "cpu",
    "--set", "num_attention_heads=4", "--set", "head_dim=32", "--set", "qk_rope_head_dim=8",
    "--set", "q_lora_rank=32", "--set", "o_lora_rank=16", "--set", "o_groups=2", "--set", "index_n_heads=4",
    "--set", "index_head_dim=16", "--set", "index_topk=4", "--set", "sliding_window=8",
    "--set", "num_experts_per_tok=2",
]  # fmt: skip


def streamed_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """What the engine's detokenizer emits for ``ids``, delta by delta, until the sequence ends."""
    text = IncrementalText(SamplingParams(ignore_eos=True), tokenizer.eos_token_ids, tokenizer)
    pieces = []
    for token in ids:
        assert not text.add(token)
        pieces.append(text.take_delta())
    text.finish_length()
    return "".join(pieces) + text.take_delta()


@pytest.mark.parametrize(
    ("vocab", "bos", "eos"),
    [(129280, 0, 1), (151936, 151643, 151645)],  # DeepSeek-V4-Flash, and Qwen3's ids in Qwen3's vocabulary
    ids=["v4-flash", "qwen3-ids"],
)
def test_full_size_vocabulary_is_covered_fast_and_deterministically(tmp_path, vocab, bos, eos):
    started = time.perf_counter()
    tok, counts = full_vocabulary_tokenizer(vocab, bos_id=bos, eos_id=eos)
    seconds = time.perf_counter() - started
    print(f"full-vocabulary tokenizer, {vocab} ids: {counts} built in {seconds:.2f} s")
    assert seconds < 5
    assert tok.get_vocab_size(with_added_tokens=True) == vocab == sum(counts.values())
    assert counts["filler"] > 0.9 * vocab and counts["trained"] > 256 + len(BENCH_WORDS)
    ids = tok.get_vocab(with_added_tokens=True)
    assert sorted(ids.values()) == list(range(vocab))  # no holes, no duplicates
    assert (ids[BOS], ids[EOS]) == (bos, eos)
    assert [ids[m] for m in CHAT_SPECIALS] == list(range(vocab - len(CHAT_SPECIALS), vocab))
    assert full_vocabulary_tokenizer(vocab, bos_id=bos, eos_id=eos)[0].to_str() == tok.to_str()

    # Every id decodes alone. Only the lone bytes of multi-byte UTF-8 characters (0x80-0xFF) decode to
    # U+FFFD; every filler decodes to a space and a printable word.
    texts = tok.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    assert sum("\ufffd" in t for t in texts) == 128
    reserved = {bos, eos, *range(vocab - len(CHAT_SPECIALS), vocab)}
    filler_ids = [i for i in range(vocab) if i not in reserved][counts["trained"] :]
    assert len(filler_ids) == counts["filler"]
    assert all(texts[i][0] == " " and texts[i][1:].isalpha() and texts[i].isascii() for i in filler_ids)
    assert len({texts[i] for i in filler_ids}) == len(filler_ids)
    # Encoding never produces a filler: text is made of trained tokens only.
    assert max(tok.encode(" ".join(texts[i] for i in filler_ids[:2000]), add_special_tokens=False).ids) < 2 + 2500

    # The streaming decoder turns every id, in a random order, into exactly decode()'s text (the
    # engine's detokenizer on top of it is checked on the tiny model below).
    write_tokenizer_folder(tmp_path, tok)
    loaded = Tokenizer.from_folder(tmp_path)
    assert loaded.vocab_size == vocab and loaded.bos_token_id == bos
    order = list(range(vocab))
    random.Random(0).shuffle(order)
    decoder = loaded.stream_decoder()
    streamed = "".join(decoder.push(i) for i in order) + decoder.flush()
    full = loaded.decode(order)
    assert len(full) > 4 * vocab and streamed == full


def test_reserved_ids_are_checked():
    with pytest.raises(ValueError, match="too small"):
        full_vocabulary_tokenizer(256 + 2 + len(CHAT_SPECIALS) - 1)
    with pytest.raises(ValueError, match="distinct"):
        full_vocabulary_tokenizer(1000, bos_id=5, eos_id=5)
    with pytest.raises(ValueError, match="below vocab_size"):
        full_vocabulary_tokenizer(1000, eos_id=1000)
    tok, counts = full_vocabulary_tokenizer(300)  # smaller than the word list: training stops early
    assert counts["filler"] == 0 and tok.get_vocab_size(with_added_tokens=True) == 300


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-tok") / "v4"
    assert make_bench_model([*TINY_V4, "--out", str(out)]) == 0
    return out


def test_bench_checkpoint_ships_its_tokenizer(bench_model, tmp_path):
    config = json.loads((bench_model / "config.json").read_text())
    receipt = json.loads((bench_model / "bench_model.json").read_text())["tokenizer"]
    tokenizer = Tokenizer.from_folder(bench_model)
    assert tokenizer.vocab_size == config["vocab_size"] == VOCAB == receipt["vocab_size"]
    assert tokenizer.bos_token_id == config["bos_token_id"] and tokenizer.eos_token_ids == {config["eos_token_id"]}
    assert receipt["filler"] > 1000 and receipt["seconds"] < 5

    # Every id streams through the engine's detokenizer to exactly what decode() gives.
    ids = list(range(VOCAB))
    random.Random(1).shuffle(ids)
    assert streamed_text(tokenizer, ids) == tokenizer.decode(ids)
    assert tokenizer.decode([config["eos_token_id"]]) == ""  # special: skipped by default

    # Plain text round-trips; bench prompts are one token per word (plus BOS).
    text = "Hello, world! The quick brown fox: 12:30, naïve café, 你好 🙂"
    encoded = tokenizer.encode(text)
    assert encoded[0] == tokenizer.bos_token_id and tokenizer.decode(encoded) == text
    for prompt in make_prompts(3, 40, seed=0):
        assert len(tokenizer.encode(prompt)) == 41
    assert all(len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1 for word in _WORDS)

    # The built-in DeepSeek chat template renders, and its markers are single tokens.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], thinking=True)
    assert prompt == f"{BOS}<｜User｜>hi<｜Assistant｜><think>"
    marker_ids = [tokenizer.token_to_id(m) for m in ("<｜User｜>", "<｜Assistant｜>", "<think>")]
    assert tokenizer.encode(prompt) == [0, marker_ids[0], *tokenizer.encode("hi", False), *marker_ids[1:]]

    # The tokenizer is deterministic; --no-tokenizer writes none, and --force removes an old one.
    other = tmp_path / "again"
    assert make_bench_model([*TINY_V4, "--out", str(other)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (other / name).read_bytes() == (bench_model / name).read_bytes()
    assert make_bench_model([*TINY_V4, "--out", str(other), "--force", "--no-tokenizer"]) == 0
    assert not (other / "tokenizer.json").exists() and not (other / "tokenizer_config.json").exists()
    assert json.loads((other / "bench_model.json").read_text())["tokenizer"] is None


def test_llm_generates_text_from_any_id(bench_model):
    from moetier.llm import LLM

    llm = LLM(bench_model, device="cpu", load_progress=False)
    receipt = json.loads((bench_model / "bench_model.json").read_text())["tokenizer"]
    filler_ids = range(2 + receipt["trained"], VOCAB - len(CHAT_SPECIALS))
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=0, ignore_eos=True)
    out = llm.generate("the model", params)[0].outputs[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    assert any(i in filler_ids for i in out.token_ids)  # a near-uniform random model samples fillers
    assert out.text == llm.tokenizer.decode(out.token_ids) and len(out.text) > 24


def test_bench_serve_starts_the_server_on_the_bench_model(bench_model, tmp_path, monkeypatch):
    from moetier.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["bench", "serve", "--start-model", str(bench_model), "--serve-args=--device cpu --log-level warning"]
    args += ["--concurrency", "1", "--requests", "2", "--prompt-tokens", "16", "--max-tokens", "4"]
    assert main([*args, "--start-timeout", "90", "--out", str(tmp_path)]) == 0
    receipt = json.loads(next(tmp_path.glob("serve-*.json")).read_text())
    assert receipt["server"]["exit_status"] == 0 and receipt["server"]["warmup_errors"] == []
    level = receipt["results"][0]
    assert level["errors"] == 0 and level["error_messages"] == []
    assert level["completion_tokens"] == [4, 4] and level["prompt_tokens"] == [17, 17]  # 16 words + BOS
    assert all(chunks >= 1 for chunks in level["text_chunks"])
