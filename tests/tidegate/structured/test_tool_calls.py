"""Tool calls in a model's own format (``tidegate.structured.tool_calls``): the format read off
chat templates, the forcing grammar accepting exactly calls of the given tools (through a real
llguidance matcher), calls parsed out of complete replies, where a streamed reply may start a
call; the ChatML fallback template rendering tools, calls and tool turns; admission refusing
tools for a template without a format."""

from __future__ import annotations

import json

import llguidance
import pytest

from tidegate.model_files.chat_template import CHATML_TEMPLATE
from tidegate.model_files.model_source import resolve_model
from tidegate.model_files.tokenizer import load_tokenizer
from tidegate.producer.submit.admission import Admission, AdmissionError
from tidegate.protocol import ChatMessage, JobRequest, Tool
from tidegate.structured.tool_calls import HERMES, LLAMA3, forced_call_grammar, tool_format_of

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
LLAMA3_TEMPLATE = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
                   "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>' + m['content'] "
                   "+ '<|eot_id|>' }}{% endfor %}Respond in the format "
                   '{"name": function name, "parameters": dictionary of argument name and its '
                   "value}")


@pytest.fixture(scope="module")
def tiny() -> llguidance.LLTokenizer:
    tok = load_tokenizer(resolve_model("random:tiny"))
    return llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                  eos_token=sorted(tok.eos_token_ids))


def accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return (not matcher.is_error() and matcher.consume_tokens(list(text.encode()))
            and matcher.is_accepting())


def test_formats_are_read_off_templates() -> None:
    assert tool_format_of(CHATML_TEMPLATE) is HERMES
    assert tool_format_of(LLAMA3_TEMPLATE) is LLAMA3
    assert tool_format_of("{% for m in messages %}{{ m['content'] }}{% endfor %}") is None
    assert load_tokenizer(resolve_model()).tool_format is None  # SmolLM2's renders no tools


def test_the_forcing_grammar_accepts_exactly_calls_of_the_tools(
        tiny: llguidance.LLTokenizer) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    many = HERMES.grammar([WEATHER, TIME], None, parallel=True)
    assert accepts(tiny, many, call) and accepts(tiny, many, other)
    assert accepts(tiny, many, call + "\n" + other)
    one = HERMES.grammar([WEATHER, TIME], None, parallel=False)
    assert accepts(tiny, one, call) and not accepts(tiny, one, call + "\n" + other)
    named = HERMES.grammar([WEATHER, TIME], "get_time", parallel=True)
    assert accepts(tiny, named, other) and not accepts(tiny, named, call)
    assert not accepts(tiny, many, call.replace('"Oslo"', "7"))  # arguments follow the schema
    assert not accepts(tiny, many, "Sure! " + call)  # nothing but calls
    llama = LLAMA3.grammar([WEATHER], None, parallel=True)
    assert accepts(tiny, llama, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')


def test_calls_are_parsed_out_of_replies() -> None:
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>')
    rest, calls = HERMES.parse(text)
    assert rest == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert HERMES.parse("No tools needed.") == ("No tools needed.", [])
    assert HERMES.parse("<tool_call>{not json</tool_call>")[1] == []
    rest, calls = LLAMA3.parse(' {"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert rest == "" and calls[0].name == "get_weather"
    assert LLAMA3.parse("It is sunny.") == ("It is sunny.", [])


def test_a_streamed_reply_is_held_from_where_a_call_may_begin() -> None:
    assert HERMES.call_start("Hello") is None
    assert HERMES.call_start("Hello <tool") == len("Hello ")
    assert HERMES.call_start("Hi<tool_call>{") == 2
    assert HERMES.call_start("a < b") is None
    assert LLAMA3.call_start("  {") == 2 and LLAMA3.call_start("Sunny") is None


def test_the_fallback_template_renders_tools_calls_and_tool_turns() -> None:
    tokenizer = load_tokenizer(resolve_model("random:tiny"))
    messages = [
        ChatMessage(role="user", content="Weather in Oslo?"),
        ChatMessage(role="assistant", content=None, tool_calls=[{
            "id": "call_1", "function": {"name": "get_weather",
                                         "arguments": '{"city": "Oslo"}'}}]),
        ChatMessage(role="tool", content="-3C", tool_call_id="call_1")]
    tools = [Tool.model_validate({"function": WEATHER})]
    text = tokenizer.render_chat([m.template_dict() for m in messages],
                                 [t.model_dump(exclude_none=True) for t in tools])
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n-3C\n</tool_response>" in text
    plain = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_admission_forces_calls_by_grammar_and_refuses_tools_without_a_format() -> None:
    request = JobRequest(messages=[{"role": "user", "content": "Weather?"}],
                         tools=[{"function": WEATHER}], tool_choice="required")
    admitted = Admission.for_model("random:tiny").check(request)
    assert admitted.response_format is not None and admitted.response_format.type == "grammar"
    assert admitted.response_format.grammar == forced_call_grammar(  # type: ignore[union-attr]
        HERMES, request.tools or [], "required", True)
    with pytest.raises(AdmissionError) as info:
        Admission.for_model("smollm2").check(request)
    assert info.value.field == "tools" and "tool-call format" in info.value.reason
    with pytest.raises(AdmissionError) as info:
        Admission.for_model("random:tiny").check(JobRequest(prompt="x", logit_bias={99999: 1}))
    assert info.value.field == "logit_bias"
