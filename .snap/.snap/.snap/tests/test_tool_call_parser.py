"""DeepSeek tool-call parser: one-shot results, OpenAI delta shapes, and split invariance."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import pytest

from moetier.errors import ConfigError
from moetier.server.reasoning import ThinkTagParser
from moetier.server.tool_calls import (
    TOOL_CALL_PARSERS,
    DeepSeekToolCallParser,
    ToolCallDelta,
    tool_call_parser_class,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def v3_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def v31_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"tz": "Europe/Paris"}'
# Braces, backticks, fences, escaped newlines and a special-token lookalike inside strings.
NESTED = (
    '{"code": "```py\\nprint({\'a\': [1, 2]})\\n```", "q": "a `` b } {", '
    '"deep": {"x": [1, {"y": "}]"}], "z": {}}, "tok": "<｜tool▁call"}'
)
PRETTY = '{\n  "city": "Oslo",\n  "days": [\n    1,\n    2\n  ]\n}'
INVALID = '{"city": "Paris", "unit":'
SPACED_INVALID = " {tz: }}\n "


@dataclass
class Case:
    text: str
    content: str
    calls: list[tuple[str, str]]  # (name, arguments text)
    allowed: set[str] | None = None
    rejected: list[tuple[str, str]] = field(default_factory=list)


CASES = {
    "v3_single": Case(
        f"Let me check the weather.\n\n{CALLS_BEGIN}{v3_call('get_weather', WEATHER)}{CALLS_END}",
        "Let me check the weather.\n\n",
        [("get_weather", WEATHER)],
    ),
    "v3_multiple": Case(
        f"Two lookups < one.{CALLS_BEGIN}{v3_call('get_weather', WEATHER)}\n{v3_call('get_time', TIME)}{CALLS_END}",
        "Two lookups < one.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    "v31_single": Case(
        f"Checking.{CALLS_BEGIN}{v31_call('get_weather', WEATHER)}{CALLS_END}",
        "Checking.",
        [("get_weather", WEATHER)],
    ),
    "v31_multiple": Case(
        f"a<b {CALLS_BEGIN}{v31_call('get_weather', WEATHER)}{v31_call('get_time', TIME)}{CALLS_END}",
        "a<b ",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    "v3_nested_and_pretty": Case(
        f"Run it.{CALLS_BEGIN}{v3_call('run_code', NESTED)}{v3_call('forecast', PRETTY)}{CALLS_END}",
        "Run it.",
        [("run_code", NESTED), ("forecast", PRETTY)],
    ),
    "v31_nested": Case(
        f"{CALLS_BEGIN}{v31_call('run_code', NESTED)}{v31_call('function', TIME)}{CALLS_END}",
        "",
        [("run_code", NESTED), ("function", TIME)],
    ),
    "invalid_json_both_formats": Case(  # also: whitespace around arguments is dropped
        f"Oops{CALLS_BEGIN}{v3_call('get_weather', INVALID + ' ')}{v31_call('get_time', SPACED_INVALID)}{CALLS_END}",
        "Oops",
        [("get_weather", INVALID), ("get_time", "{tz: }}")],
    ),
    "unknown_tool_rejected": Case(
        f"Sure.{CALLS_BEGIN}{v31_call('rm_rf', '{}')}{v31_call('get_weather', WEATHER)}"
        f"{v3_call('launch', TIME)}{v3_call('get_time', TIME)}{CALLS_END}",
        "Sure.",
        [("get_weather", WEATHER), ("get_time", TIME)],
        allowed={"get_weather", "get_time"},
        rejected=[("rm_rf", "{}"), ("launch", TIME)],
    ),
    "all_rejected": Case(
        f"Hmm.{CALLS_BEGIN}{v31_call('rm_rf', '{}')}{CALLS_END}",
        "Hmm.",
        [],
        allowed=set(),
        rejected=[("rm_rf", "{}")],
    ),
    "empty_name_rejected": Case(
        f"{CALLS_BEGIN}{v31_call('', '{}')}{v3_call(' ', WEATHER)}{v31_call('get_time', TIME)}{CALLS_END}",
        "",
        [("get_time", TIME)],
        rejected=[("", "{}"), ("", WEATHER)],
    ),
    "no_outer_token_and_trailing_text": Case(
        f"x {v31_call('get_time', TIME)}{CALLS_END} ignored",
        "x ",
        [("get_time", TIME)],
    ),
    "no_calls_with_lookalikes": Case(
        "a < b, <｜tool▁call but not a token, <｜tool▁sep｜> and ``` stay content <",
        "a < b, <｜tool▁call but not a token, <｜tool▁sep｜> and ``` stay content <",
        [],
    ),
    "truncated_arguments": Case(
        f'Go.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Par',
        "Go.",
        [("get_weather", '{"city": "Par')],
    ),
    "truncated_v3_header_dropped": Case(f"Go.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_wea", "Go.", []),
}


def chunkings(text: str, seed: int = 0, n_random: int = 12):
    """Every way the tests split ``text``: whole, every two-piece split, per character, random."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 8))))
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def reassemble(items: list[ToolCallDelta | str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Join streamed items the way a client does, asserting OpenAI's delta shapes on the way."""
    content, calls, ids = "", [], []
    for item in items:
        if isinstance(item, str):
            assert item and not calls, "content pieces are non-empty and come before the calls"
            content += item
            continue
        d = item.to_openai()
        if item.is_first:
            assert d == {
                "index": len(calls),
                "id": item.id,
                "type": "function",
                "function": {"name": item.name, "arguments": ""},
            }
            assert CALL_ID.fullmatch(item.id)
            calls.append([item.name, ""])
            ids.append(item.id)
        else:
            assert d == {"index": len(calls) - 1, "function": {"arguments": item.arguments}}
            assert item.arguments and item.id is None and item.name is None
            calls[-1][1] += item.arguments
    return content, [tuple(c) for c in calls], ids


def run_stream(parser: DeepSeekToolCallParser, chunks: list[str]) -> list[ToolCallDelta | str]:
    items = []
    for chunk in chunks:
        items += parser.feed(chunk)
    return items + parser.finish()


@pytest.mark.parametrize("name", list(CASES))
def test_one_shot_and_every_split(name: str) -> None:
    case = CASES[name]
    one = DeepSeekToolCallParser(case.allowed).parse(case.text)
    assert one.content == case.content
    assert [(c.name, c.arguments_json) for c in one.tool_calls] == case.calls
    assert [(c.name, c.arguments_json) for c in one.rejected] == case.rejected
    assert all(CALL_ID.fullmatch(c.id) for c in one.tool_calls + one.rejected)
    for chunks in chunkings(case.text, seed=len(name)):
        parser = DeepSeekToolCallParser(case.allowed)
        content, calls, ids = reassemble(run_stream(parser, chunks))
        assert (content, calls) == (case.content, case.calls), chunks
        assert [(c.name, c.arguments_json) for c in parser.rejected] == case.rejected
        assert len(set(ids)) == len(ids)
        assert parser.has_tool_calls == bool(case.calls)


def test_valid_arguments_round_trip_as_json() -> None:
    result = DeepSeekToolCallParser().parse(CASES["v3_nested_and_pretty"].text)
    code = json.loads(result.tool_calls[0].arguments_json)
    assert code["code"] == "```py\nprint({'a': [1, 2]})\n```" and code["deep"]["x"][1] == {"y": "}]"}
    assert json.loads(result.tool_calls[1].arguments_json) == {"city": "Oslo", "days": [1, 2]}
    assert result.tool_calls[0].to_openai() == {
        "id": result.tool_calls[0].id,
        "type": "function",
        "function": {"name": "run_code", "arguments": NESTED},
    }


def test_arguments_stream_as_they_arrive() -> None:
    parser = DeepSeekToolCallParser()
    assert parser.feed("Hi <｜tool") == ["Hi "]
    assert not parser.has_tool_calls
    first = parser.feed(f"▁calls▁begin｜>{CALL_BEGIN}function{SEP}get_weather\n``")
    assert [d.to_openai()["function"] for d in first] == [{"name": "get_weather", "arguments": ""}]
    assert parser.has_tool_calls
    assert parser.feed('`json\n{"city": "Par') == [ToolCallDelta(0, '{"city": "Par')]
    # Whitespace, backticks and a partial end token are held: they may be the closing fence.
    assert parser.feed('is"}\n``') == [ToolCallDelta(0, 'is"}')]
    assert parser.feed("`<｜tool▁call") == []
    assert parser.feed(f"▁end｜>{CALLS_END}") == []
    assert parser.finish() == []


def test_pipeline_reasoning_then_tool_calls() -> None:
    """The server's composition: the reasoning parser's content stream feeds the tool parser."""
    text = (
        f"<think>\nThe user asks about Paris; I need {CALL_BEGIN[:8]} the tool.\n</think>\n\n"
        f"Checking.{CALLS_BEGIN}{v31_call('get_weather', WEATHER)}{CALLS_END}"
    )
    for chunks in chunkings(text, seed=7):
        reasoning, tools = ThinkTagParser(), DeepSeekToolCallParser({"get_weather"})
        thought, items = "", []
        for chunk in [*chunks, None]:
            delta = reasoning.feed(chunk) if chunk is not None else reasoning.finish()
            thought += delta.reasoning
            items += tools.feed(delta.content)
        items += tools.finish()
        content, calls, _ = reassemble(items)
        assert thought == f"The user asks about Paris; I need {CALL_BEGIN[:8]} the tool."
        assert (content, calls) == ("Checking.", [("get_weather", WEATHER)])


def test_registry() -> None:
    for name in ("deepseek_v3", "deepseek_v31", "deepseek_v4"):
        assert tool_call_parser_class(name) is DeepSeekToolCallParser
    assert "deepseek_v3" in TOOL_CALL_PARSERS
    with pytest.raises(ConfigError, match="deepseek_v3"):
        tool_call_parser_class("hermes")
