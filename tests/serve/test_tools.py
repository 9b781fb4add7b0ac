"""Tools through the official openai client: a 4-round tool loop whose tool results continue the kept
KV, calls streamed as delta.tool_calls, tool_choice (required, named, none) and parallel_tool_calls;
the SmolLM2 fallback (tools in the system prompt, a required call constrained by a grammar); and
the Llama 3.x, Qwen2.5 and Mistral call formats (the older JSON list and the newer `[TOOL_CALLS]name[ARGS]{...}`),
rendered through a template that knows tools."""

from __future__ import annotations

import json

import pytest

from tests.serve.conftest import MODEL
from tests.serve.test_errors import HELLO, assert_error, post
from turnkv.serve import tools as tc
from turnkv.serve.protocol import ChatCompletionRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SYSTEM = {"role": "system", "content": "You help with travel."}


@pytest.fixture(scope="module")
def server(long_llm):
    """A server over the 8K-context model: the fallback's tool descriptions take most of 512 tokens."""
    from tests.serve.conftest import running

    with running(long_llm, served_model_name=MODEL) as s:
        yield s


def create(client, messages, **options):
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=60, **options)


def test_a_four_round_tool_loop_continues_the_kept_kv(server):
    client = server.client()
    messages = [SYSTEM, {"role": "user", "content": "Plan my week in Paris."}]
    previous = None
    for round_ in range(4):
        r = create(client, messages, tool_choice="required")
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        assert set(args) == ({"city", "days"} if call.function.name == "get_weather" else {"zone"})
        if previous is not None:
            # Everything before the tool result came from the kept KV: the previous prompt and the
            # call it generated (but its last token, never fed).
            assert r.usage.prompt_tokens_details.cached_tokens == \
                previous.prompt_tokens + previous.completion_tokens - 1
        previous = r.usage
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"round": round_, "ok": True})})
    final = create(client, messages, tool_choice="none")
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens_details.cached_tokens == previous.prompt_tokens + previous.completion_tokens - 1


def test_a_streamed_call_arrives_as_delta_tool_calls(server):
    client = server.client()
    messages = [SYSTEM, {"role": "user", "content": "Weather in Oslo?"}]
    plain = create(client, messages, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = plain.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    chunks = list(create(client, messages, stream=True,
                         tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == call.function.arguments
    assert not "".join(d.content or "" for d in deltas).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_bad_tool_requests(server):
    r = post(server, {"model": MODEL, "messages": HELLO, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"].get("tool_calls") is None
    bad = [{"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
           {"tool_choice": "required"},
           {"tools": [WEATHER, WEATHER]},
           {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
           {"messages": [{"role": "tool", "content": "x"}]}]
    for extra in bad:
        assert_error(post(server, {"model": MODEL, "messages": HELLO, **extra}), 400)


# ---- formats ----------------------------------------------------------------------------------------
NAMES = {"get_weather", "get_time"}


def test_hermes_calls_are_parsed_with_their_arguments_as_written():
    fmt = tc.FORMATS["hermes"]
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name":"get_time","arguments":{"zone":"UTC"}}\n</tool_call>')
    content, calls = tc.parse(text, fmt, NAMES)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo", "days": 2}'),
                                                      ("get_time", '{"zone":"UTC"}')]
    assert tc.parse("no calls here", fmt, NAMES) == ("no calls here", [])
    assert tc.parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', fmt, NAMES)[1] == []


def test_llama3_and_mistral_calls_are_parsed():
    content, calls = tc.parse('{"name": "get_time", "parameters": {"zone": "CET"}}', tc.FORMATS["llama3"], NAMES)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "CET"})]
    two = '{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", "parameters": {"city": "Lima"}}'
    assert [c.name for c in tc.parse(two, tc.FORMATS["llama3"], NAMES)[1]] == ["get_time", "get_weather"]
    assert tc.parse("The time is noon.", tc.FORMATS["llama3"], NAMES) == ("The time is noon.", [])
    mistral = ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}, '
               '{"name": "get_time", "arguments": {}}]')
    content, calls = tc.parse(mistral, tc.FORMATS["mistral"], NAMES)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # the Mistral template's requirement


def test_the_stream_filter_holds_back_only_what_may_be_a_call():
    f = tc.StreamFilter(tc.FORMATS["hermes"])
    assert f.push("Sure, ") == "Sure, "
    assert f.push("checking <tool") == "checking "
    assert f.push('_call>\n{"name"') == ""
    assert f.rest().startswith("<tool_call>")
    g = tc.StreamFilter(tc.FORMATS["llama3"])
    assert g.push("  ") == "" and g.push('{"name"') == "" and g.rest() == '  {"name"'
    h = tc.StreamFilter(tc.FORMATS["llama3"])
    assert h.push("Hello") == "Hello"


QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else '' }}"
    "\n\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- endif %}{%- for message in messages %}{%- if message['role'] == 'system' and tools %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in message.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture
def qwen_llm(chat_model_dir):
    import turnkv

    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="8MiB")
    llm.tokenizer.chat_template = QWEN_LIKE
    return llm


def test_a_template_that_knows_tools_renders_them_and_the_calls(qwen_llm):
    from turnkv.serve import chat

    req = ChatCompletionRequest.model_validate({"messages": [
        SYSTEM, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}], "tools": TOOLS})
    plan = chat.plan(qwen_llm, req)
    assert plan.fmt.name == "hermes" and plan.names == NAMES
    text = plan.rendered.text
    assert '"name": "get_weather"' in text and "<tools>" in text  # the tools, rendered by the template
    # The call's arguments went to the template as an object, so it wrote JSON, not a quoted string.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>' in text
    assert "<tool_response>\nrain\n</tool_response>" in text


def test_a_required_call_on_a_template_that_knows_tools(qwen_llm):
    from tests.serve.conftest import running

    with running(qwen_llm, served_model_name=MODEL) as s:
        r = create(s.client(), [SYSTEM, {"role": "user", "content": "Time in CET?"}],
                   tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


# ---- Mistral's newer format (tokenizers v11 and later) ----------------------------------------------
# Cut from the templates of Mistral Small 3.x / Devstral: [TOOL_CALLS]name[ARGS]{...} per call, call ids
# of 9 letters and digits, tool results in [TOOL_RESULTS].
MISTRAL_V11_LIKE = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if system_message is defined %}{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}{%- endif %}"
    "{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
    "{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if tools and message == user_messages[-1] %}{{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- if call.id is not defined or call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{%- set arguments = call.function.arguments %}{%- if arguments is not string %}"
    "{%- set arguments = arguments|tojson %}{%- endif %}"
    "{{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' + arguments }}{%- endfor %}{{- eos_token }}"
    "{%- else %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS]' + message['content']|string + '[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}")
V11 = tc.FORMATS["mistral_v11"]


def test_the_newer_mistral_format_is_told_by_args_in_the_template():
    assert tc.detect(MISTRAL_V11_LIKE) is V11
    assert tc.detect("{{ '[TOOL_CALLS] [' + calls|tojson + ']' }}") is tc.FORMATS["mistral"]


def test_newer_mistral_calls_are_parsed_with_or_without_markers():
    # The markers are control tokens: the detokenizer leaves them out, so a call reads name{...}.
    content, calls = tc.parse('get_weather{"city": "Oslo", "days": 2}', V11, NAMES)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo", "days": 2}')]
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    two = 'Checking.get_weather{"city":"Lima","days":1}get_time{"zone":"UTC"}'
    content, calls = tc.parse(two, V11, NAMES)
    assert content == "Checking." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city":"Lima","days":1}'), ("get_time", '{"zone":"UTC"}')]
    marked = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
    content, calls = tc.parse(marked, V11, NAMES)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
    # Templates with [CALL_ID]: the model's id is kept, so the call renders back as it was written.
    [call] = tc.parse('[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"zone": "UTC"}', V11, NAMES)[1]
    assert (call.id, call.name) == ("a1B2c3D4e", "get_time")
    for text in ["The weather is fine.", "get_weather is the tool for that.", 'rm_rf{"path": "/"}',
                 "get_time{zone: UTC}", 'get_time{"zone": "UTC"} and then more text', 'get_time["UTC"]']:
        assert tc.parse(text, V11, NAMES) == (text, []), text


def test_the_stream_filter_holds_back_a_newer_mistral_call_and_releases_content():
    f = tc.StreamFilter(V11, NAMES)
    assert f.push("Sure. The ") == "Sure. The "
    assert f.push("get") == ""  # may be a call's head
    assert f.push("_weather tool") == "get_weather tool"  # it was not
    assert f.push(" helps. get_time") == " helps. "
    assert f.push('{"zone"') == "" and f.push(': "UTC"}') == ""
    assert tc.parse(f.rest(), V11, NAMES)[1][0].name == "get_time"
    g = tc.StreamFilter(V11, NAMES)
    assert g.push("[TOOL") == "" and g.push("_CALLS]get_weather[ARGS]") == "" and g.push('{"city"') == ""
    assert g.rest() == '[TOOL_CALLS]get_weather[ARGS]{"city"'
    h = tc.StreamFilter(V11, NAMES)
    assert h.push("[1, 2]") == "[1, 2]" and h.push(" hello") == " hello"


def test_the_newer_mistral_grammar_writes_what_the_parser_reads():
    prefix, schemas, suffix, leads = tc.call_grammar(TOOLS, V11, "get_time")
    assert leads == ["get_time"] and schemas == [TIME["function"]["parameters"]]
    content, [call] = tc.parse(prefix + leads[0] + json.dumps({"zone": "UTC"}) + suffix, V11, NAMES)
    assert content is None and (call.name, json.loads(call.arguments)) == ("get_time", {"zone": "UTC"})
    assert len(tc.call_grammar(TOOLS, V11)[3]) == 2
    assert tc.call_grammar(TOOLS, tc.FORMATS["hermes"])[3] is None


@pytest.fixture
def mistral_llm(chat_model_dir):
    import turnkv

    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="8MiB")
    llm.tokenizer.chat_template = MISTRAL_V11_LIKE
    return llm


def test_newer_mistral_calls_render_back_and_a_required_call_follows_the_format(mistral_llm):
    from tests.serve.conftest import running
    from turnkv.serve import chat

    req = ChatCompletionRequest.model_validate({"messages": [
        SYSTEM, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "a1B2c3D4e", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "rain"}], "tools": TOOLS})
    plan = chat.plan(mistral_llm, req)
    assert plan.fmt is V11 and "[AVAILABLE_TOOLS]" in plan.rendered.text
    rendered = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 1}'
    text = plan.rendered.text.replace(mistral_llm.tokenizer.eos_token, "")
    assert rendered + "[TOOL_RESULTS]rain[/TOOL_RESULTS]" in text
    assert tc.parse(rendered, V11, NAMES)[1][0].arguments == '{"city": "Oslo", "days": 1}'

    with running(mistral_llm, served_model_name=MODEL) as s:
        client = s.client()
        messages = [SYSTEM, {"role": "user", "content": "Time in CET?"}]
        named = {"type": "function", "function": {"name": "get_time"}}
        r = create(client, messages, tool_choice=named)
        [call] = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
        assert len(call.id) == 9 and call.id.isalnum()  # the template's requirement, met for the next request
        chunks = list(create(client, messages, stream=True, tool_choice=named))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        [streamed] = [t for d in deltas for t in d.tool_calls or []]
        assert streamed.function.arguments == call.function.arguments and not "".join(d.content or "" for d in deltas)
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
        after = create(client, messages, tool_choice="none")
        assert after.choices[0].message.tool_calls is None
        # The template writes the markers the grammar could not: reuse runs to the end of the previous prompt.
        assert after.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens
