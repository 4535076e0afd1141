"""The command line: `moetier generate` on the tiny checkpoint, and one-line errors with exit status 2."""

import os
import subprocess
import sys

import pytest
from reference import save_tiny
from test_qwen3_moe import tiny_qwen3_config
from tiny_tokenizer import write_test_tokenizer

from moetier import cli
from moetier.engine.types import EngineConfig
from moetier.errors import ConfigError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-cli")
    save_tiny(tiny_qwen3_config(), path)
    write_test_tokenizer(path, vocab_size=320)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # One intra-op thread: on a small shared CI box, torch's thread pool fighting other processes makes
    # a tiny model's step ~100x slower; the subprocess tests behaviour, not throughput.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "moetier.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=env)


def test_generate_prints_the_completion(checkpoint):
    from moetier import LLM, SamplingParams

    prompt = "Hello, world!"
    result = run_cli(
        "generate", "--model", str(checkpoint), "--prompt", prompt, "--max-tokens", "12",
        "--temperature", "0", "--device", "cpu", "--dtype", "fp32",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    llm = LLM(checkpoint, device="cpu", load_progress=False)
    expected = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    assert expected.strip() != ""
    assert result.stdout == expected + "\n"
    assert "Traceback" not in result.stderr


def test_generate_chat_with_sampling_options_in_process(checkpoint, capsys):
    from moetier import LLM, SamplingParams

    args = ["generate", "--model", str(checkpoint), "--prompt", "Hi", "--chat", "--max-tokens", "6", "--device", "cpu"]
    args += ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "50", "--seed", "3", "--stop", "never\x00"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    llm = LLM(checkpoint, device="cpu", load_progress=False)
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=50, seed=3)
    expected = llm.chat([{"role": "user", "content": "Hi"}], params)[0].outputs[0].text
    assert printed == expected + "\n"


def test_missing_model_folder_prints_one_line_and_exits_2(tmp_path):
    result = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x", "--device", "cpu")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("moetier: error: ") and "not a model folder" in result.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "-1"], "temperature must be"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--max-model-len", "4096"], "exceeds the model's max_position_embeddings"),
        (["--dtype", "fp32", "--device", "cpu", "--max-tokens", "0"], "max_tokens must be"),
    ],
)
def test_user_errors_are_one_line_with_status_2(checkpoint, capsys, extra, message):
    assert cli.main(["generate", "--model", str(checkpoint), "--prompt", "x", "--device", "cpu", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    error_lines = [line for line in captured.err.splitlines() if line.startswith("moetier")]
    assert error_lines == [error_lines[0]] and error_lines[0].startswith("moetier: error: ")
    assert message in error_lines[0]
    assert "Traceback" not in captured.err


def test_main_returns_2_in_process(capsys, tmp_path):
    assert cli.main(["generate", "--model", str(tmp_path / "absent"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moetier: error: ")


def test_subcommands_are_registered_in_one_table():
    assert "generate" in cli.SUBCOMMANDS
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0


def test_tier_flags_reach_the_tier_options():
    from moetier.cli import build_parser, tier_options

    args = build_parser().parse_args(
        ["serve", "--gpu-memory", "24GiB", "--kv-reserve-streams", "1", "--min-cache-slots", "8", "--miss-route", "cpu"]
    )
    options = tier_options(args)
    assert (options.kv_reserve_streams, options.min_cache_slots, options.miss_route) == (1, 8, "cpu")
    assert tier_options(build_parser().parse_args(["serve"])) is None  # no budget: every expert resident


def test_spare_cache_seconds_reaches_the_engine_and_a_bad_value_is_one_line():
    from moetier.cli import build_parser
    from moetier.server.app import ServeConfig

    assert build_parser().parse_args(["serve"]).spare_cache_seconds == 30.0
    assert build_parser().parse_args(["serve", "--spare-cache-seconds", "0"]).spare_cache_seconds == 0.0
    for bad in (-1.0, float("inf")):
        with pytest.raises(ConfigError, match=r"spare_cache_seconds must be a number >= 0 \(0: off\)"):
            ServeConfig(spare_cache_seconds=bad)
    with pytest.raises(ConfigError, match="spare_cache_seconds"):
        EngineConfig(spare_cache_seconds=-0.5)


def test_prefix_cache_size_reaches_the_serve_config_and_a_bad_one_is_one_line(capsys):
    from moetier.cli import build_parser
    from moetier.server.app import ServeConfig

    assert build_parser().parse_args(["serve"]).prefix_cache == "1GiB"
    assert ServeConfig(prefix_cache="256MiB").prefix_cache == 256 << 20 and ServeConfig().prefix_cache == 1 << 30
    assert ServeConfig(prefix_cache="0").prefix_cache == 0  # no prefix caching
    with pytest.raises(ConfigError, match="--prefix-cache: cannot read 'lots'"):
        ServeConfig(prefix_cache="lots")
    assert cli.main(["serve", "--prefix-cache=24G", "--no-warmup"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moetier: error:") and "--prefix-cache" in err and err.count("\n") == 1
