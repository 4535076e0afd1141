"""The built-in demo model: built deterministically and atomically into the user's cache, a real
DeepSeek-V4-family checkpoint with DeepSeek's tokenizer conventions, fast enough to chat with, and
what ``moetier serve`` serves when no ``--model`` is given."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_harness import demo_path, free_port

from moetier import demo
from moetier.tokenizer import Tokenizer
from moetier.tokenizer_training import BOS, CHAT_SPECIALS, EOS


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_built_into_the_cache_deterministically(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    started = time.perf_counter()
    folder = demo.ensure_demo_model()
    seconds = time.perf_counter() - started
    assert folder == tmp_path / "xdg" / "moetier" / f"demo-deepseek-v4-v{demo.DEMO_VERSION}"
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no staging folder left behind
    marker = json.loads((folder / "demo.json").read_text())
    assert marker["version"] == demo.DEMO_VERSION
    size_mb = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
    print(f"demo model: {size_mb:.1f} MB built in {seconds:.2f} s")
    assert 10 < size_mb < 30 and seconds < 20

    # A second build elsewhere is byte-identical; asking again reuses the cached copy.
    other = demo.ensure_demo_model(tmp_path / "other" / "demo")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert digest(folder / name) == digest(other / name), name
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert demo.ensure_demo_model() == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo.demo_folder() == tmp_path / "home" / ".cache" / "moetier" / folder.name


def test_interrupted_build_leaves_nothing_and_stale_copies_are_replaced(tmp_path, monkeypatch):
    target = tmp_path / "cache" / "demo"

    def broken(folder):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "build_demo_model", broken)
    with pytest.raises(KeyboardInterrupt):
        demo.ensure_demo_model(target)
    assert not target.exists() and list(target.parent.iterdir()) == []
    monkeypatch.undo()

    target.mkdir()
    (target / "demo.json").write_text(json.dumps({"version": demo.DEMO_VERSION - 1}))
    assert demo.ensure_demo_model(target) == target
    assert json.loads((target / "demo.json").read_text())["version"] == demo.DEMO_VERSION
    assert (target / "model.safetensors").is_file()


def test_checkpoint_is_a_v4_model_with_deepseek_tokens():
    folder = demo_path()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    kinds = set(config["layer_types"])
    assert kinds == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert set(config["mlp_layer_types"]) == {"hash_moe", "moe"}
    assert config["n_routed_experts"] >= 8 and config["num_experts_per_tok"] >= 2

    tokenizer = Tokenizer.from_folder(folder)
    assert tokenizer.token_to_id(BOS) == 0 and tokenizer.token_to_id(EOS) == 1 and tokenizer.eos_token_ids == {1}
    assert tokenizer.vocab_size == config["vocab_size"]
    for marker in CHAT_SPECIALS:
        assert tokenizer.encode(marker, add_special_tokens=False) == [tokenizer.token_to_id(marker)]
    text = "Hello, world! def add(a, b): 你好 🙂"
    ids = tokenizer.encode(text)
    assert ids[0] == 0 and tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # the trained merges compress text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == f"{BOS}<｜User｜>hi<｜Assistant｜>"  # the built-in DeepSeek template


def test_generates_at_interactive_speed():
    from moetier.engine.engine import Engine, EngineConfig
    from moetier.engine.sampling import SamplingParams

    engine = Engine(demo_path(), EngineConfig(max_streams=2, max_model_len=512), device="cpu", load_progress=False)
    prompt = engine.tokenizer.encode("Hello there")
    engine.add_request("warmup", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_work():
        engine.step()
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    started, tokens = time.perf_counter(), 0
    while engine.has_work():
        tokens += sum(len(u.new_token_ids) for u in engine.step())
    rate = tokens / (time.perf_counter() - started)
    print(f"demo model decode on CPU: {rate:.0f} tokens/s")
    assert tokens == 64 and rate > 15


def _serve(*args, env):
    return subprocess.Popen(
        [sys.executable, "-m", "moetier.cli", "serve", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_moetier_serve_without_a_model_serves_the_demo(tmp_path):
    import openai

    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    process = _serve("--port", str(port), "--device", "cpu", "--log-level", "warning", env=env)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, process.communicate()[1]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the demo server did not become healthy"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        assert client.models.list().data[0].id == demo.DEMO_NAME
        reply = client.chat.completions.create(
            model=demo.DEMO_NAME, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
        )
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")
        assert (tmp_path / "moetier" / f"demo-deepseek-v4-v{demo.DEMO_VERSION}" / "demo.json").is_file()
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err


def test_moetier_serve_rejects_a_bad_model_in_one_line(tmp_path):
    process = _serve("--model", str(tmp_path / "nothing"), "--port", str(free_port()), env=dict(os.environ))
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert err.strip().count("\n") == 0 and err.startswith("moetier: error:") and "nothing" in err
    # A folder that passes the quick check but fails to load: the server stops and says why.
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"]}))
    args = ("--model", str(tmp_path), "--port", str(free_port()), "--log-level", "warning")
    process = _serve(*args, env={**os.environ, "OMP_NUM_THREADS": "1"})
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert err.strip().count("\n") == 0 and err.startswith("moetier: error:"), err
