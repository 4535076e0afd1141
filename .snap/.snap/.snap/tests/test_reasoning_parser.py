"""Reasoning parser: one-shot results, and the same results from the stream under every split."""

from __future__ import annotations

import random

import pytest

from moetier.errors import ConfigError
from moetier.server.reasoning import (
    REASONING_PARSERS,
    ReasoningDelta,
    ThinkTagParser,
    reasoning_parser_class,
)

# (id, output text, prompt opened <think>, expected (reasoning | None, content))
CASES = [
    (
        "reasoning_then_content",
        "<think>\nCompare 2 < 3 and a<b; </th is not a tag.\n</think>\n\nThe answer is <b>5</b>.",
        False,
        ("Compare 2 < 3 and a<b; </th is not a tag.", "The answer is <b>5</b>."),
    ),
    (
        "prompt_opened",
        "The user wants a greeting <: keep it short.\n\n</think>\n\nHello! </think> stays here.",
        True,
        ("The user wants a greeting <: keep it short.", "Hello! </think> stays here."),
    ),
    ("prompt_opened_repeats_tag", "\n<think>\nagain</think>x", True, ("again", "x")),
    (
        "no_reasoning",
        "  a < b, <thinking> is no tag; </think> neither.",
        False,
        (None, "  a < b, <thinking> is no tag; </think> neither."),
    ),
    ("open_tag_mid_text", "Use <think> tags.", False, (None, "Use <think> tags.")),
    ("unterminated", "<think>\nStill going: x < y </thi", False, ("Still going: x < y </thi", "")),
    ("unterminated_prompt_opened", "\n  thinking <\n", True, ("thinking <\n", "")),
    ("empty_reasoning", "<think>\n\n</think>\n\nDirect answer.", False, ("", "Direct answer.")),
    ("only_partial_open_tag", "<thin", False, (None, "<thin")),
    ("empty_output", "", False, (None, "")),
    ("empty_output_prompt_opened", "", True, ("", "")),
]


def chunkings(text: str, seed: int = 0, n_random: int = 12):
    """Every way the tests split ``text``: whole, every two-piece split, per character, random."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def run_stream(parser: ThinkTagParser, chunks: list[str]) -> tuple[str | None, str]:
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    assert all(isinstance(d, ReasoningDelta) for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return (reasoning if parser.has_reasoning else None), content


@pytest.mark.parametrize(("text", "opened", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_shot_and_every_split(text: str, opened: bool, expected: tuple[str | None, str]) -> None:
    assert ThinkTagParser(starts_in_reasoning=opened).parse(text) == expected
    for seed, chunks in enumerate(chunkings(text)):
        assert run_stream(ThinkTagParser(starts_in_reasoning=opened), chunks) == expected, (seed, chunks)


def test_releases_reasoning_progressively_and_holds_partial_tags() -> None:
    parser = ThinkTagParser()
    assert parser.feed("<thi") == ReasoningDelta()
    assert not parser.has_reasoning
    assert parser.feed("nk>\nstep one, then") == ReasoningDelta(reasoning="step one, then")
    assert parser.has_reasoning
    # Trailing whitespace and a partial closing tag wait until decided.
    assert parser.feed(" two\n</th") == ReasoningDelta(reasoning=" two")
    assert parser.feed("ink>\n\nDone") == ReasoningDelta(content="Done")
    assert parser.feed(" now <") == ReasoningDelta(content=" now <")
    assert parser.finish() == ReasoningDelta()


def test_false_alarm_is_released_into_the_right_stream() -> None:
    parser = ThinkTagParser()
    assert parser.feed("<think>a </thought") == ReasoningDelta(reasoning="a </thought")
    parser = ThinkTagParser()
    assert parser.feed("<th") == ReasoningDelta()
    assert parser.feed("e end>") == ReasoningDelta(content="<the end>")


def test_parse_does_not_disturb_streaming_state() -> None:
    parser = ThinkTagParser()
    parser.feed("<think>abc")
    assert parser.parse("no tags") == (None, "no tags")
    assert parser.feed("</think>x") == ReasoningDelta(content="x")


def test_for_prompt_detects_an_opened_block() -> None:
    assert ThinkTagParser.for_prompt("<｜User｜>hi<｜Assistant｜><think>\n").starts_in_reasoning
    assert not ThinkTagParser.for_prompt("<｜User｜>hi<｜Assistant｜></think>").starts_in_reasoning
    assert not ThinkTagParser.for_prompt("<think>\n\n</think>\n\n").starts_in_reasoning


def test_registry() -> None:
    for name in ("deepseek_r1", "deepseek_v3", "deepseek_v4"):
        assert reasoning_parser_class(name) is ThinkTagParser
    assert set(REASONING_PARSERS) >= {"deepseek_r1", "deepseek_v3"}
    with pytest.raises(ConfigError, match="deepseek_r1"):
        reasoning_parser_class("nope")
