"""Chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)` does."""

from __future__ import annotations

import datetime
import json

import pytest
from transformers import AutoTokenizer

from metrale_jax.errors import ChatTemplateError
from metrale_jax.text import ChatTemplate, load_tokenizer

CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "Hi!"}],
    "multi_turn": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4 — naïve arithmetic. 😀"},
        {"role": "user", "content": "And 日本?"},
    ],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye\n\nnow"},
    ],
}

# A Qwen-3-like template: tools, tool calls, reasoning, enable_thinking, namespace, errors.
RICH_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=0) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}\
{% endfor %}
{%- for m in messages %}
{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}\
{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}
<|im_start|>{{ m.role }}
{% if m.reasoning_content is defined and loop.index0 > ns.last_user %}\
<think>{{ m.reasoning_content }}</think>{% endif %}
{%- if m.content is defined %}{{ m.content }}{% endif %}
{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}
<tool_call>{{ c.function | tojson(indent=2, sort_keys=True) }}</tool_call>{% endfor %}{% endif %}\
<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>
{% endif %}{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather <now> & "here"',
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Call the tool.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
]


@pytest.fixture(scope="module")
def hf_plain(byte_level_folder):
    """A transformers tokenizer to render arbitrary templates with."""
    return AutoTokenizer.from_pretrained(str(byte_level_folder))


@pytest.mark.default_model
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_template_matches_transformers(smollm, hf_smollm, name, add_generation_prompt):
    template = ChatTemplate.for_tokenizer(smollm)
    messages = CONVERSATIONS[name]
    ours = template.render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_smollm.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if name == "with_system":
        assert "SmolLM" not in ours  # the default system prompt only comes without one
    else:
        assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("enable_thinking", [None, False, True])
def test_tools_reasoning_and_kwargs_match_transformers(hf_plain, enable_thinking):
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours = ChatTemplate(RICH_TEMPLATE).render(TOOL_CHAT, tools=TOOLS, **extra)
    theirs = hf_plain.apply_chat_template(
        TOOL_CHAT,
        chat_template=RICH_TEMPLATE,
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
        **extra,
    )
    assert ours == theirs
    assert json.dumps(TOOLS[0], ensure_ascii=False) in ours  # tojson: no HTML escaping, UTF-8
    assert '"city": "Zürich"' in ours and "<think>Call the tool.</think>" in ours
    assert ("<think>\n\n</think>" in ours) is (enable_thinking is False)


def test_raise_exception_gives_chat_template_error():
    template = ChatTemplate(RICH_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        template.render([{"role": "robot", "content": "beep"}])


def test_invalid_template_and_runtime_errors():
    with pytest.raises(ChatTemplateError, match="line 2"):
        ChatTemplate("ok\n{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="failed"):
        ChatTemplate("{{ messages[3].content.upper() }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([])  # the sandbox refuses
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set x = [] %}{{ x.append(1) }}").render([])  # immutable
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])


def test_models_without_a_template(spm_folder):
    with pytest.raises(ChatTemplateError, match="model tiny-model has no chat template"):
        ChatTemplate.require(None, "tiny-model")
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate.for_tokenizer(load_tokenizer(spm_folder))


def test_template_globals_filters_and_tokens():
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
        "{{ {'b': 1, 'a': [1, 2]} | tojson(indent=1, sort_keys=True) }}"
        "|{{ strftime_now('%Y') }}|{{ dict(x=1).x }}|{{ pad_token }}{{ eos_token }}",
        bos_token="<s>",
        eos_token="</s>",
        special_tokens={"pad_token": "<pad>"},
    )
    text = template.render(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "user", "content": "never"},
        ]
    )
    year = str(datetime.datetime.now().year)
    assert text == '<s>[u]{\n "a": [\n  1,\n  2\n ],\n "b": 1\n}|' + year + "|1|<pad></s>"


def test_none_values_are_dropped_and_messages_left_alone():
    messages = [{"role": "assistant", "content": None, "thinking": "hmm"}]
    template = ChatTemplate(
        "{% for m in messages %}{{ m.content is defined }} "
        "{{ m.reasoning_content }}{% endfor %}{{ add_generation_prompt }}"
    )
    assert template.render(messages, add_generation_prompt=False) == "False hmmFalse"
    assert messages == [{"role": "assistant", "content": None, "thinking": "hmm"}]
