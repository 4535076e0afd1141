"""Every bad input gets an OpenAI-shaped error with the right status, type, param and code; the API
key guards the API; /health is 503 while the model loads and 200 once it serves."""

import threading

import httpx
import openai
import pytest
from server_harness import LiveServer, demo_config

from moetier.server.app import load_serving_model


@pytest.fixture(scope="module")
def server():
    live = LiveServer(demo_config(context=512)).start()
    yield live
    live.stop()


def post(server, path, body=None, content=None, headers=None):
    return httpx.post(server.base + path, json=body, content=content, headers=headers, timeout=30)


def chat(**fields):
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def assert_error(response, status, param=None, code=None, type="invalid_request_error"):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["type"] == type and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_malformed_json_and_wrong_body(server):
    json_type = {"Content-Type": "application/json"}
    for broken in (b'{"model": "demo", "messages": [', b"not json"):
        error = assert_error(post(server, "/v1/chat/completions", content=broken, headers=json_type), 400)
        assert "could not parse the JSON" in error["message"]
    # Without a JSON content type the body is not parsed (FastAPI's CSRF guard): the error says what to send.
    error = assert_error(post(server, "/v1/chat/completions", content=b'{"model": "demo"}'), 400)
    assert "application/json" in error["message"]
    assert_error(post(server, "/v1/chat/completions", body=[1, 2]), 400)
    assert_error(post(server, "/v1/completions", body={"model": "demo"}), 400, "prompt", "missing_required_parameter")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": "2"}, "n"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 5}, "stop"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"seed": 1.25}, "seed"),
    ],
)
def test_wrong_types_are_400_naming_the_field(server, fields, param):
    error = assert_error(post(server, "/v1/chat/completions", chat(**fields)), 400, param)
    assert param.split("[")[0] in error["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ],
)
def test_values_out_of_range(server, fields, param):
    assert_error(post(server, "/v1/chat/completions", chat(**fields)), 400, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": "f"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_bad_tool_and_format_requests(server, fields, param):
    assert_error(post(server, "/v1/chat/completions", chat(**fields)), 400, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": [[1, 2], [-1]]}, "prompt[1]"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 17}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"max_tokens": -1}, "max_tokens"),
    ],
)
def test_completion_errors(server, fields, param):
    assert_error(post(server, "/v1/completions", {"model": "demo", "prompt": "hi", **fields}), 400, param)


def test_unknown_model_route_and_method(server):
    error = assert_error(post(server, "/v1/chat/completions", chat(model="gpt-9")), 404, "model", "model_not_found",
                         type="not_found_error")  # fmt: skip
    assert "gpt-9" in error["message"] and "demo" in error["message"]
    assert_error(post(server, "/v1/completions", {"model": "nope", "prompt": "x"}), 404, "model", "model_not_found",
                 type="not_found_error")  # fmt: skip
    assert_error(httpx.get(server.base + "/v1/models/nope"), 404, "model", "model_not_found", type="not_found_error")
    assert_error(httpx.get(server.base + "/v1/nothing-here"), 404, type="not_found_error")
    assert httpx.get(server.base + "/v1/chat/completions").status_code == 405
    assert "error" in httpx.get(server.base + "/v1/chat/completions").json()


def test_unknown_fields_are_accepted(server):
    response = post(server, "/v1/chat/completions", chat(some_new_openai_field={"x": 1}, store=True, metadata={"a": 1}))
    assert response.status_code == 200, response.text
    messages = [{"role": "user", "content": "hi", "extra_key": 1}]
    assert post(server, "/v1/chat/completions", chat(messages=messages)).status_code == 200
    assert post(server, "/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 1, "x": 2}).status_code == 200


def test_openai_client_raises_typed_errors(server):
    client = server.client(max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], n=40)
    assert info.value.body["param"] == "n"


def test_api_key():
    live = LiveServer(demo_config(api_key="s3cret")).start()
    try:
        body = chat()
        assert_error(post(live, "/v1/chat/completions", body), 401, code="invalid_api_key")
        wrong = {"Authorization": "Bearer nope"}
        assert_error(post(live, "/v1/chat/completions", body, headers=wrong), 401, code="invalid_api_key")
        assert_error(httpx.get(live.base + "/v1/models"), 401, code="invalid_api_key")
        assert_error(post(live, "/tokenize", {"prompt": "x"}), 401, code="invalid_api_key")
        right = {"Authorization": "Bearer s3cret"}
        assert post(live, "/v1/chat/completions", body, headers=right).status_code == 200
        assert httpx.get(live.base + "/health").status_code == 200  # probes need no key
        assert httpx.get(live.base + "/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong", max_retries=0).models.list()
        assert live.client(api_key="s3cret").models.list().data[0].id == "demo"
    finally:
        live.stop()


def test_health_is_503_while_loading_then_200():
    config = demo_config()
    release = threading.Event()

    def slow_loader():
        release.wait(30)
        return load_serving_model(config)

    live = LiveServer(config, slow_loader).start(wait_ready=False)
    try:
        health = httpx.get(live.base + "/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        busy = post(live, "/v1/chat/completions", chat())
        assert_error(busy, 503, code="model_loading", type="service_unavailable_error")
        assert_error(httpx.get(live.base + "/v1/models"), 503, code="model_loading", type="service_unavailable_error")
        release.set()
        live.wait_healthy(30)
        assert httpx.get(live.base + "/health").status_code == 200
        assert post(live, "/v1/chat/completions", chat()).status_code == 200
    finally:
        release.set()
        live.stop()


def test_failed_load_is_reported(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    live = LiveServer(demo_config().__class__(model=str(tmp_path), device="cpu")).start(wait_ready=False)
    try:
        for _ in range(200):
            if live.state.error is not None:
                break
            threading.Event().wait(0.02)
        health = httpx.get(live.base + "/health")
        assert health.status_code == 503 and health.json()["status"] == "error" and health.json()["message"]
        assert_error(post(live, "/v1/chat/completions", chat()), 503, code="model_load_failed",
                     type="service_unavailable_error")  # fmt: skip
    finally:
        live.stop()
