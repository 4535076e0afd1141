"""Chat rendering: HF-template parity with transformers, the sandbox, validation, the built-in DeepSeek prompt."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from tiny_tokenizer import BOS, write_test_tokenizer

from moetier.errors import ChatTemplateError
from moetier.server.chat_template import ChatTemplates, normalize_messages, render_jinja
from moetier.tokenizer import Tokenizer

# A DeepSeek-V3.1-shaped template (namespace state, string concatenation, tool calls, thinking).
DEEPSEEK_STYLE = r"""{% if not thinking is defined %}{% set thinking = false %}{% endif %}
{% set ns = namespace(system='', last_user=false, in_tool=false) %}
{% for m in messages %}
  {% if m['role'] == 'system' %}
    {% set ns.system = ns.system + ('\n\n' if ns.system else '') + m['content'] %}
  {% endif %}
{% endfor %}
{% if tools is not none %}
  {% set ns.system = ns.system + '\n\n## Tools\n' %}
  {% for tool in tools %}
    {% set ns.system = ns.system + '### ' + tool.function.name + '\n' + (tool.function.parameters | tojson) + '\n' %}
  {% endfor %}
{% endif %}
{{ bos_token }}{{ ns.system }}
{%- for m in messages %}
  {%- if m['role'] == 'user' %}
    {%- set ns.last_user = true %}{% set ns.in_tool = false %}
    {{- '<｜User｜>' + m['content'] }}
  {%- elif m['role'] == 'assistant' %}
    {%- if ns.last_user %}{{ '<｜Assistant｜></think>' }}{% endif %}
    {%- set ns.last_user = false %}{% set ns.in_tool = false %}
    {%- set content = m['content'] or '' %}
    {%- if '</think>' in content %}{% set content = content.split('</think>', 1)[1] %}{% endif %}
    {{- content }}
    {%- if m['tool_calls'] is defined and m['tool_calls'] %}
      {{- '<｜tool▁calls▁begin｜>' }}
      {%- for call in m['tool_calls'] %}
        {%- set args = call['function']['arguments'] %}
        {{- '<｜tool▁call▁begin｜>' + call['function']['name'] + '<｜tool▁sep｜>' }}
        {{- args if args is string else args | tojson }}{{ '<｜tool▁call▁end｜>' }}
      {%- endfor %}
      {{- '<｜tool▁calls▁end｜>' }}
    {%- endif %}
    {{- '<｜end▁of▁sentence｜>' }}
  {%- elif m['role'] == 'tool' %}
    {%- set ns.last_user = false %}{% set ns.in_tool = true %}
    {{- '<｜tool▁output▁begin｜>' + m['content'] + '<｜tool▁output▁end｜>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt and ns.last_user %}
  {{- '<｜Assistant｜>' + ('<think>' if thinking else '</think>') }}
{%- endif %}"""

# A Qwen3-shaped template: im_start blocks, tools as tojson lines, reasoning_content, enable_thinking,
# loop controls, and plain (un-dashed) block tags that rely on trim_blocks/lstrip_blocks.
QWEN_STYLE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions:\n<tools>" }}
{%- for tool in tools %}
{{- "\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{ raise_exception('System message must come first') }}{% endif %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == 'user' %}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content and loop.index0 > ns.last_user %}
{{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
{{- message.content if message.content else '' }}
        {%- for call in message.tool_calls or [] %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
            {%- set args = call.function.arguments %}
            {%- if args is string %}{{ args }}{% else %}{{ args | tojson }}{% endif %}
{{- '}\n</tool_call>' }}
            {%- if loop.index >= 8 %}{% break %}{% endif %}
        {%- endfor %}
{{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
    {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\n' }}
    {% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

    {% endif %}
{% endif %}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}

CONVERSATIONS = {
    "simple": [{"role": "user", "content": "Hello 你好 😀"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Easy sum."},
        {"role": "user", "content": "And 3+3?"},
    ],
    "tool_loop": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Paris and the time there?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "\nI need two tools.\n",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18°C, sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
    ],
}


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers")


def _folders(tmp_path, template):
    write_test_tokenizer(tmp_path, chat_template=template)
    return tmp_path


@pytest.mark.parametrize("template_name", ["deepseek", "qwen"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize(
    "kwargs",
    [
        {"add_generation_prompt": True},
        {"add_generation_prompt": False},
        {"add_generation_prompt": True, "thinking": True, "enable_thinking": False, "tools": [WEATHER_TOOL, TIME_TOOL]},
    ],
    ids=["gen", "nogen", "tools_thinking"],
)
def test_matches_transformers(hf, tmp_path, template_name, conversation, kwargs):
    template = {"deepseek": DEEPSEEK_STYLE, "qwen": QWEN_STYLE}[template_name]
    folder = _folders(tmp_path, template)
    messages = CONVERSATIONS[conversation]
    ours = Tokenizer.from_folder(folder).apply_chat_template(messages, **kwargs)
    theirs = hf.AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours == theirs
    assert len(ours) > 20


def test_template_files_and_named_templates_match_transformers(hf, tmp_path):
    """chat_template.jinja overrides tokenizer_config; a named ``tool_use`` template is picked for tools."""
    write_test_tokenizer(tmp_path, chat_template="IGNORED {{ messages[0].content }}")
    (tmp_path / "chat_template.jinja").write_text(QWEN_STYLE + "\n")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(DEEPSEEK_STYLE)
    ours = Tokenizer.from_folder(tmp_path)
    theirs = hf.AutoTokenizer.from_pretrained(tmp_path)
    messages = CONVERSATIONS["system_multi_turn"]
    plain = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert plain.startswith("<|im_start|>system")
    assert plain == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with_tools = ours.apply_chat_template(messages, tools=[WEATHER_TOOL])
    assert with_tools.startswith(BOS)
    assert with_tools == theirs.apply_chat_template(
        messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )


def test_globals_and_filters():
    messages = normalize_messages([{"role": "user", "content": "x"}])
    out = render_jinja(
        "{{ {'b': 'ü', 'a': [1, 2]} | tojson }}|{{ {'a': 1} | tojson(indent=2) }}|{{ strftime_now('%Y') }}", messages
    )
    assert out == '{"b": "ü", "a": [1, 2]}|{\n  "a": 1\n}|' + str(datetime.now().year)
    # Loop controls and trim_blocks/lstrip_blocks.
    template = "{% for m in [1, 2, 3] %}\n  {% if m == 2 %}\n{% break %}\n  {% endif %}\n{{ m }}\n{% endfor %}"
    assert render_jinja(template, messages) == "1\n"
    assert (
        render_jinja("{{ '-' * 3 }}{{ 3 * 'ab' }}{{ 2 ** 10 }}{{ [0] * 2 }}{{ 2.5 * 2 }}", messages)
        == "---ababab1024[0, 0]5.0"
    )
    # {% generation %} (HF's assistant-mask marker) renders its body.
    assert render_jinja("a{% generation %}b{% endgeneration %}c", messages) == "abc"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{% set _ = messages.append(1) %}",
        "{{ 'x' * 10**10 }}",
        "{{ [1, 2] * 999999 }}",
        "{{ 9 ** 99999999 }}",
    ],
)
def test_sandbox_blocks_escapes(template):
    messages = normalize_messages([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="sandbox|unsafe|rejected") as error:
        render_jinja(template, messages)
    assert "\n" not in str(error.value)


def test_template_errors_are_one_line():
    messages = normalize_messages([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="rejected the messages: Roles must\nalternate".replace("\n", " ")):
        render_jinja("{{ raise_exception('Roles must\nalternate') }}", messages)
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        render_jinja("ok\n{% if %}", messages)
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_jinja("{{ 'a' + 1 }}", messages)
    folder_templates = ChatTemplates({"a": "A", "b": "B"})
    with pytest.raises(ChatTemplateError, match="several chat templates"):
        folder_templates.render(messages)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role 'robot'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}], "function.name"),
        ([{"role": "assistant", "content": "x", "reasoning_content": 5}], "reasoning_content must be a string"),
        (["hi"], "must be an object"),
    ],
)
def test_validation(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplates().render(messages)


def test_content_parts_developer_role_and_reasoning_alias():
    templates = ChatTemplates()
    as_parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    as_strings = [{"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "Hi"}]
    assert templates.render(as_parts) == templates.render(as_strings) == f"{BOS}Be\nbrief.<｜User｜>Hi<｜Assistant｜>"
    loop = CONVERSATIONS["tool_loop"][:3]
    renamed = [dict(m) for m in loop]
    renamed[2]["reasoning"] = renamed[2].pop("reasoning_content")
    assert templates.render(renamed, thinking=True) == templates.render(loop, thinking=True)


# ----------------------------------------------------------------------- built-in DeepSeek prompt

TOOLS_SECTION = (
    "## Tools\n"
    "You have access to the following tools:\n"
    "\n"
    "### get_weather\n"
    "Description: Current weather for a city.\n"
    "\n"
    'Parameters: {"type": "object", "properties": {"city": {"type": "string", "description": "City name, '
    'e.g. Zürich"}}, "required": ["city"]}\n'
    "\n"
    "### get_time\n"
    "Description: Local time in a time zone.\n"
    "\n"
    'Parameters: {"type": "object", "properties": {"tz": {"type": "string"}}}\n'
    "\n"
    "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_call_name\n"
    "```json\n"
    "tool_call_arguments\n"
    "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n"
    "\n"
    "Where:\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, put one <｜tool▁call▁begin｜>…<｜tool▁call▁end｜> block per call on its own "
    "line, all inside a single <｜tool▁calls▁begin｜>…<｜tool▁calls▁end｜>"
)

MULTI_TURN = [
    {"role": "system", "content": "You are a helpful assistant."},
    *CONVERSATIONS["tool_loop"][1:],
    {
        "role": "assistant",
        "content": "It is 18°C and sunny in Paris; the local time is 14:05.",
        "reasoning_content": "Both tools answered.",
    },
    {"role": "user", "content": "Thanks! And in Tokyo?"},
    {
        "role": "assistant",
        "reasoning": "Call the weather tool for Tokyo.",
        "content": "Checking.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}],
    },
    {"role": "tool", "content": "22°C, rain"},
]

FIRST_TURN = (
    "<｜User｜>Weather in Paris and the time there?"
    "<｜Assistant｜></think>"
    "<｜tool▁calls▁begin｜>"
    '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
    '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "<｜tool▁outputs▁begin｜>"
    "<｜tool▁output▁begin｜>18°C, sunny<｜tool▁output▁end｜>\n"
    "<｜tool▁output▁begin｜>14:05<｜tool▁output▁end｜>"
    "<｜tool▁outputs▁end｜>"
    "It is 18°C and sunny in Paris; the local time is 14:05.<｜end▁of▁sentence｜>"
)


def test_builtin_deepseek_multi_turn_thinking(tmp_path):
    write_test_tokenizer(tmp_path)  # no chat_template: the built-in one is used
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.chat_templates.builtin
    prompt = tok.apply_chat_template(MULTI_TURN, tools=[WEATHER_TOOL, TIME_TOOL], thinking=True)
    expected = (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.\n\n"
        + TOOLS_SECTION
        + FIRST_TURN  # a past turn: its reasoning is dropped, </think> kept
        + "<｜User｜>Thanks! And in Tokyo?"
        + "<｜Assistant｜><think>Call the weather tool for Tokyo.</think>Checking."  # current turn keeps it
        + "<｜tool▁calls▁begin｜>"
        + '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Tokyo"}\n```<｜tool▁call▁end｜>'
        + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        + "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>22°C, rain<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        + "<think>"  # the model goes on reasoning after the tool result
    )
    assert prompt == expected
    # Every marker is one token and the prompt's own BOS is not doubled by encode.
    ids = tok.encode(prompt)
    assert ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.token_to_id("<｜tool▁output▁begin｜>")) == 3
    assert tok.decode(ids, skip_special_tokens=False) == prompt


def test_builtin_deepseek_thinking_modes():
    templates = ChatTemplates()
    history = MULTI_TURN[:7]  # ends with the user's second question
    head = "<｜begin▁of▁sentence｜>You are a helpful assistant."
    # thinking=False: every assistant turn (and the prompt) closes reasoning at once.
    assert (
        templates.render(history, thinking=False)
        == head + FIRST_TURN + "<｜User｜>Thanks! And in Tokyo?<｜Assistant｜></think>"
    )
    # enable_thinking (Qwen's name) is accepted too.
    assert templates.render(history, enable_thinking=True).endswith(
        "<｜User｜>Thanks! And in Tokyo?<｜Assistant｜><think>"
    )
    # thinking unset: plain V3, no reasoning markers at all.
    assert (
        templates.render(history)
        == head + FIRST_TURN.replace("</think>", "") + "<｜User｜>Thanks! And in Tokyo?<｜Assistant｜>"
    )
    assert (
        templates.render(history, add_generation_prompt=False)
        == head + FIRST_TURN.replace("</think>", "") + "<｜User｜>Thanks! And in Tokyo?"
    )
    # Content that echoes "<think>…</think>" keeps only the answer.
    echoed = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>hmm</think>A"}]
    assert (
        templates.render(echoed, add_generation_prompt=False)
        == f"{BOS}<｜User｜>Q<｜Assistant｜>A<｜end▁of▁sentence｜>"
    )


def test_builtin_tool_definitions_accept_bare_functions():
    templates = ChatTemplates()
    messages = [{"role": "user", "content": "hi"}]
    bare = [WEATHER_TOOL["function"], TIME_TOOL["function"]]
    assert templates.render(messages, tools=bare) == templates.render(messages, tools=[WEATHER_TOOL, TIME_TOOL])
    assert templates.render(messages, tools=bare).startswith(f"{BOS}{TOOLS_SECTION}<｜User｜>hi")
    with pytest.raises(ChatTemplateError, match="function.name"):
        templates.render(messages, tools=[{"type": "function"}])
    with pytest.raises(ChatTemplateError, match="tools must be a list"):
        templates.render(messages, tools={"name": "x"})


def test_parity_json_round_trip_of_arguments():
    """Dict arguments render as the JSON a client would have sent as a string."""
    templates = ChatTemplates()
    as_dict = CONVERSATIONS["tool_loop"][:3]
    as_string = json.loads(json.dumps(as_dict))
    as_string[2]["tool_calls"][1]["function"]["arguments"] = '{"tz": "CET"}'
    assert templates.render(as_dict) == templates.render(as_string)


def test_string_arguments_suit_both_template_conventions(hf, tmp_path):
    """OpenAI history sends arguments as JSON strings: templates that concatenate them get the string
    verbatim (DeepSeek-V3's official template), templates that ``tojson`` them get the object (HF's
    convention), each as transformers renders the form that template was written for."""
    compact = '{"city":"Paris","units":"°C"}'
    call = {"type": "function", "function": {"name": "get_weather", "arguments": compact}}
    as_string = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    as_object = json.loads(json.dumps(as_string))
    as_object[1]["tool_calls"][0]["function"]["arguments"] = json.loads(compact)
    loop = "{% for m in messages %}{% for c in m.tool_calls or [] %}BODY{% endfor %}{% endfor %}"
    concat = loop.replace("BODY", "{{ c.function.name + '(' + c.function.arguments + ')' }}")
    to_json = loop.replace(
        "BODY",
        "{{ c.function.name }}{{ c.function.arguments | tojson }}"
        "{% for k, v in c.function.arguments.items() %};{{ k }}={{ v }}{% endfor %}",
    )
    for name, template, hf_messages in [("concat", concat, as_string), ("tojson", to_json, as_object)]:
        write_test_tokenizer(tmp_path / name, chat_template=template)
        ours = Tokenizer.from_folder(tmp_path / name).apply_chat_template(as_string, add_generation_prompt=False)
        theirs = hf.AutoTokenizer.from_pretrained(tmp_path / name).apply_chat_template(
            hf_messages, tokenize=False, add_generation_prompt=False
        )
        assert ours == theirs
    assert ours == 'get_weather{"city": "Paris", "units": "°C"};city=Paris;units=°C'
    # The caller's messages are not modified.
    assert as_string[1]["tool_calls"][0]["function"]["arguments"] == compact
