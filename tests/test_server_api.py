"""The OpenAI-compatible server end to end: a real uvicorn server on the demo model (DeepSeek-V4
family), driven by the official ``openai`` client and raw httpx.

Scripted outputs (``[[script:NAME]]`` in a prompt, see ``server_harness``) stand in for a trained
model where the test needs a particular output (tool calls, reasoning); the server's own parsers
process them.
"""

import json
import threading
import time

import httpx
import pytest
from server_harness import FAIL, LiveServer, demo_config, scripted_loader

CALL_TEXT = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
SCRIPTS = {
    "call": CALL_TEXT,
    "answer": "It is sunny in Paris.",
    "think": "<think>\nThe user greets me. I greet back.\n</think>\n\nHello there!",
    "think_opened": "The user greets me.</think>Hello!",
    "json": '{"answer": 42}',
    "prose": "Sure, here it is: 42",
    "args_only": '{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "fail": "partial output" + FAIL,
    "two_calls": "Checking both.<｜tool▁calls▁begin｜>"
    + "\n".join(
        f'<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{{"city": "{city}"}}\n```<｜tool▁call▁end｜>'
        for city in ("Paris", "Rome")
    )
    + "<｜tool▁calls▁end｜>",
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WINDOW = 1024


@pytest.fixture(scope="module")
def server():
    config = demo_config(context=WINDOW)
    live = LiveServer(config, scripted_loader(config, SCRIPTS)).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def user(text):
    return [{"role": "user", "content": text}]


def sse_events(response):
    """The ``data:`` payloads of an SSE response (``[DONE]`` as the string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --- basics --------------------------------------------------------------------------------------


def test_models_health_and_openapi(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["demo"]
    assert models[0].model_extra["max_model_len"] == WINDOW
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    spec = httpx.get(server.base + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize"} <= set(spec["paths"])


def test_chat_plain_and_streamed_agree(client):
    kwargs = dict(model="demo", messages=user("Hello, how are you?"), max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert plain.usage.completion_tokens == 12 or choice.finish_reason == "stop"

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_usage_adds_up(server, client):
    messages = user("Count the tokens, please.")
    prompt_tokens = httpx.post(server.base + "/tokenize", json={"messages": messages}).json()["count"]
    stream = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=9, temperature=0, logprobs=True, top_logprobs=3,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    final = chunks[-1].usage
    assert final.prompt_tokens == prompt_tokens
    assert final.completion_tokens == len(entries) == 9
    assert final.total_tokens == prompt_tokens + 9
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    # The logprob tokens spell the streamed text (no special tokens in the demo's random output here
    # would be dropped by skip_special_tokens, so compare only when none appear).
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if "<｜" not in "".join(e.token for e in entries):
        assert "".join(e.token for e in entries).replace("\ufffd", "") == text.replace("\ufffd", "")

    plain = client.chat.completions.create(model="demo", messages=messages, max_tokens=5, temperature=0, n=2)
    assert len(plain.choices) == 2
    assert plain.usage.prompt_tokens == prompt_tokens and plain.usage.completion_tokens == 10


def test_sampling_is_seeded_and_stop_strings_cut(client):
    kwargs = dict(model="demo", messages=user("Tell me a story."), max_tokens=16, temperature=1.0, seed=11)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    again = client.chat.completions.create(**kwargs).choices[0].message.content
    other = client.chat.completions.create(**{**kwargs, "seed": 12}).choices[0].message.content
    assert first == again != other
    greedy = client.chat.completions.create(model="demo", messages=user("Hi"), max_tokens=16, temperature=0)
    text = greedy.choices[0].message.content
    stop = text[3:6].strip() or text[3:6]
    cut = client.chat.completions.create(model="demo", messages=user("Hi"), max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[: text.find(stop)]


# --- tools and reasoning --------------------------------------------------------------------------


def test_tool_call_round_trip(client):
    first = client.chat.completions.create(
        model="demo", messages=user("[[script:call]] What is the weather in Paris?"), tools=[WEATHER_TOOL]
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert not choice.message.content

    history = [
        {"role": "user", "content": "[[script:answer]] What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 24}'},
    ]
    second = client.chat.completions.create(model="demo", messages=history, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls


def test_tool_call_streamed_as_deltas(client):
    chunks = list(
        client.chat.completions.create(
            model="demo", messages=user("[[script:call]] weather?"), tools=[WEATHER_TOOL], stream=True
        )
    )
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    assert len(deltas) > 2  # the arguments arrive in pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_calls_and_content_before_them(client):
    kwargs = dict(model="demo", messages=user("[[script:two_calls]] weather?"), tools=[WEATHER_TOOL])
    both = client.chat.completions.create(**kwargs).choices[0]
    assert both.message.content == "Checking both." and both.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in both.message.tool_calls] == ["Paris", "Rome"]
    assert len({c.id for c in both.message.tool_calls}) == 2
    first_only = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    assert [json.loads(c.function.arguments)["city"] for c in first_only.message.tool_calls] == ["Paris"]


def test_tool_choice_none_and_unknown_names(server, client):
    # none: tools are not rendered and calls are not parsed (the markers stay in the text).
    kwargs = dict(model="demo", messages=user("[[script:call]] weather?"), tools=[WEATHER_TOOL])
    none = client.chat.completions.create(**kwargs, tool_choice="none")
    assert none.choices[0].finish_reason == "stop" and not none.choices[0].message.tool_calls
    assert "get_weather" in none.choices[0].message.content
    with_tools = httpx.post(server.base + "/tokenize", json={"messages": kwargs["messages"], "tools": [WEATHER_TOOL]})
    without = httpx.post(server.base + "/tokenize", json={"messages": kwargs["messages"]})
    assert with_tools.json()["count"] > without.json()["count"]
    # A call of a function that is not among the tools is not reported as a call.
    other = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "name": "get_time"}}
    rejected = client.chat.completions.create(**{**kwargs, "tools": [other]})
    assert not rejected.choices[0].message.tool_calls and rejected.choices[0].finish_reason == "stop"


def test_named_tool_choice_forces_the_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    # The script holds only the arguments: the server put the call's opening and name in the prompt.
    result = client.chat.completions.create(
        model="demo", messages=user("[[script:args_only]] weather in Rome"), tools=[WEATHER_TOOL], tool_choice=named
    )
    (call,) = result.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert result.choices[0].finish_reason == "tool_calls" and "warnings" not in result.model_extra
    # required with output that never makes a call: answered, with a warning.
    required = client.chat.completions.create(
        model="demo", messages=user("[[script:answer]] hi"), tools=[WEATHER_TOOL], tool_choice="required",
        max_tokens=8,
    )  # fmt: skip
    assert not required.choices[0].message.tool_calls
    assert any("tool_choice" in w for w in required.model_extra["warnings"])


def test_reasoning_is_separated(client):
    result = client.chat.completions.create(model="demo", messages=user("[[script:think]] Hello!"))
    message = result.choices[0].message
    assert message.content == "Hello there!"
    assert (
        message.model_extra["reasoning_content"]
        == message.model_extra["reasoning"]
        == ("The user greets me. I greet back.")
    )
    chunks = list(client.chat.completions.create(model="demo", messages=user("[[script:think]] Hello!"), stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    reasoning_alias = "".join(c.choices[0].delta.model_extra.get("reasoning") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert reasoning == reasoning_alias == "The user greets me. I greet back." and content == "Hello there!"

    # thinking=True: the rendered prompt already opened <think>, so the output starts inside it.
    opened = client.chat.completions.create(
        model="demo",
        messages=user("[[script:think_opened]] Hi"),
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    assert opened.choices[0].message.content == "Hello!"
    assert opened.choices[0].message.model_extra["reasoning_content"] == "The user greets me."
    plain = client.chat.completions.create(model="demo", messages=user("[[script:answer]] Hi"))
    assert plain.choices[0].message.model_extra["reasoning_content"] is None


def test_response_format_json_object(client):
    ok = client.chat.completions.create(
        model="demo", messages=user("[[script:json]] answer"), response_format={"type": "json_object"}
    )
    assert json.loads(ok.choices[0].message.content) == {"answer": 42} and "warnings" not in ok.model_extra
    bad = client.chat.completions.create(
        model="demo", messages=user("[[script:prose]] answer"), response_format={"type": "json_object"}
    )
    assert "not valid JSON" in bad.model_extra["warnings"][0]


def test_error_mid_stream_is_sent_in_band(server):
    body = {"model": "demo", "messages": user("[[script:fail]] go"), "stream": True}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "scripted failure" in error["message"]
    assert "partial" in "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2] if e.get("choices"))


# --- completions ---------------------------------------------------------------------------------


def test_completions_echo_logprobs_for_scoring(server, client):
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = httpx.post(server.base + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    # lm-evaluation-harness local-completions: echo + logprobs + max_tokens=1, the last token dropped.
    result = client.completions.create(model="demo", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    for token, best in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert token in best.values() and max(best.values()) >= token  # the chosen token is listed
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert result.choices[0].text.startswith(prompt)  # echoed

    # max_tokens=0 scores the prompt only; the same numbers as above.
    scored = client.completions.create(model="demo", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    slp = scored.choices[0].logprobs
    assert slp.token_logprobs == pytest.approx(lp.token_logprobs[:-1], abs=1e-4) or slp.token_logprobs[0] is None
    assert slp.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-4)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == len(ids)

    # A text prompt gives the same prompt logprobs as its token ids (BOS included by the tokenizer).
    by_text = client.completions.create(model="demo", prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    assert by_text.choices[0].logprobs.token_logprobs[1:] == pytest.approx(slp.token_logprobs[1:], abs=1e-4)


def test_completions_prompt_shapes_and_streaming(server, client):
    result = client.completions.create(model="demo", prompt=["one", "two"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.choices[0].text == result.choices[1].text  # greedy: n copies agree
    ids = httpx.post(server.base + "/tokenize", json={"prompt": "two"}).json()["tokens"]
    by_ids = client.completions.create(model="demo", prompt=[ids, ids], max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_ids.choices[1].text == result.choices[2].text
    one = httpx.post(server.base + "/tokenize", json={"prompt": "one"}).json()["count"]
    assert result.usage.prompt_tokens == one + len(ids)  # counted once per prompt, not per choice

    stream = client.completions.create(
        model="demo", prompt="two", max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == result.choices[2].text
    assert chunks[-1].usage.completion_tokens == 4


def test_tokenize_detokenize_round_trip(server):
    text = "Hello, world! 你好"
    tokens = httpx.post(server.base + "/tokenize", json={"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == WINDOW
    back = httpx.post(server.base + "/detokenize", json={"tokens": tokens["tokens"], "skip_special_tokens": True})
    assert back.json()["prompt"] == text
    # vLLM's /tokenizer_info, which lm-evaluation-harness probes to use the server as its tokenizer.
    info = httpx.get(server.base + "/tokenizer_info").json()
    assert info["eos_token"] == "<｜end▁of▁sentence｜>" and info["model_max_length"] == WINDOW
    bos = httpx.post(server.base + "/tokenize", json={"prompt": info["bos_token"], "add_special_tokens": False})
    assert bos.json()["tokens"] == [tokens["tokens"][0]]


# --- context window -------------------------------------------------------------------------------


def test_context_window(server, client):
    word = httpx.post(server.base + "/tokenize", json={"prompt": " fox", "add_special_tokens": False}).json()
    (fox,) = word["tokens"]
    too_long = httpx.post(server.base + "/v1/completions", json={"model": "demo", "prompt": [fox] * WINDOW})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    chat = httpx.post(server.base + "/v1/chat/completions", json={"model": "demo", "messages": user(" fox" * WINDOW)})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    assert chat.json()["error"]["param"] == "messages"

    # prompt + max_tokens beyond the window: accepted, generation stops at the window.
    capped = client.completions.create(
        model="demo", prompt=[fox] * (WINDOW - 6), max_tokens=100, temperature=0, extra_body={"ignore_eos": True}
    )
    assert capped.choices[0].finish_reason == "length" and capped.usage.completion_tokens == 6
    assert capped.usage.total_tokens == WINDOW


# --- concurrency and disconnects ------------------------------------------------------------------


def test_concurrent_streams_match_running_alone(server, client):
    prompts = ["Hello!", "What is a mixture of experts?", "def add(a, b):", "你好，世界"]

    def run(prompt):
        stream = client.chat.completions.create(
            model="demo", messages=user(prompt), max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(stream)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

    alone = [run(p) for p in prompts]
    together = [None] * len(prompts)

    def worker(i):
        together[i] = run(prompts[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [t[0] for t in together] == [a[0] for a in alone]
    assert all(t[1].completion_tokens == 24 for t in together)
    server.wait_idle()


def _generated_total(server):
    return server.engine_stats().generation_tokens_total


def test_client_disconnect_aborts_the_stream(server):
    server.wait_idle()
    before = _generated_total(server)
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few tokens, then hang up
    assert any(line.startswith("data: ") for line in received)
    stats = server.wait_idle(timeout=5)
    time.sleep(0.3)
    generated = _generated_total(server) - before
    assert generated < 150, f"the request was not aborted ({generated} tokens generated)"
    assert stats.kv_tokens_used == 0 and stats.running == 0


def test_client_disconnect_aborts_a_plain_request(server):
    server.wait_idle()
    before = _generated_total(server)
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
    server.wait_idle(timeout=5)
    time.sleep(0.3)
    generated = _generated_total(server) - before
    assert generated < 150, f"the request was not aborted ({generated} tokens generated)"


def test_metrics_after_requests(server, client):
    stats = server.engine_stats()
    text = httpx.get(server.base + "/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits",
                 "prompt_tokens_total", "generation_tokens_total"):  # fmt: skip
        assert f"moetier:{name}" in text, name

    def value(series):
        line = next(line for line in text.splitlines() if line.startswith(series))
        return float(line.rsplit(" ", 1)[1])

    assert value("moetier:generation_tokens_total") == stats.generation_tokens_total > 0
    assert value("moetier:prompt_tokens_total") == stats.prompt_tokens_total > 0
    assert value("moetier:time_to_first_token_seconds_count") > 0
    assert value("moetier:inter_token_latency_seconds_count") > 0
    # The demo model is a V4: finished requests' caches wait for the next ones; graphs are captured on CUDA only.
    assert value("moetier:spare_caches") == stats.spare_caches >= 1
    assert value("moetier:spare_cache_reuses_total") == stats.spare_cache_reuses_total >= 1
    assert value("moetier:decode_graph_captures_total") == stats.decode_graph_captures_total == 0
