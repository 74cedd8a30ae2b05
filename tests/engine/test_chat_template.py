"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False), in the sandbox."""

from __future__ import annotations

import json

import pytest

from tests.engine.test_tokenizer_helpers import build_byte_level_tokenizer, write_tokenizer_gguf
from workbench.core.errors import ModelFormatError, WorkbenchError
from workbench.engine.chat_template import ChatTemplate, find_chat_templates, load_chat_template

CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.function.name }}{{- '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Relies on trim_blocks / lstrip_blocks (no "-" markers), a generation block, loop controls and tojson.
BLOCKS = """{% for message in messages %}
    {% if message.role == 'system' %}
        {% continue %}
    {% endif %}
<|{{ message.role }}|>
    {% generation %}
{{ message.content }}
    {% endgeneration %}
    {% if message.meta is defined %}
{{ message.meta | tojson }}
    {% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

CHATS = [
    [{"role": "user", "content": "Hi there, café?"}],
    [{"role": "system", "content": "  Be terse.  "}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "东京 and 🙂"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=build_byte_level_tokenizer(), bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>")


SPECIAL = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}


@pytest.mark.parametrize("template", [CHATML, LLAMA3, BLOCKS], ids=["chatml", "llama3", "blocks"])
@pytest.mark.parametrize("chat", CHATS, ids=["one_turn", "multi_turn"])
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_renders_like_transformers(hf_tokenizer, template, chat, gen_prompt):
    expected = hf_tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False,
                                                add_generation_prompt=gen_prompt)
    assert ChatTemplate(template, SPECIAL).render(chat, add_generation_prompt=gen_prompt) == expected


def test_tools_tool_calls_and_extra_variables_like_transformers(hf_tokenizer):
    chat = [{"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
            {"role": "user", "content": "Thanks", "meta": {"note": "ünïcode"}}]
    for template in (CHATML, BLOCKS):
        expected = hf_tokenizer.apply_chat_template(chat, tools=TOOLS, chat_template=template, tokenize=False,
                                                    add_generation_prompt=True)
        assert ChatTemplate(template, SPECIAL).render(chat, tools=TOOLS) == expected
    expected = hf_tokenizer.apply_chat_template(CHATS[0], chat_template=LLAMA3, tokenize=False,
                                                date_string="1 Jan 2030")
    assert ChatTemplate(LLAMA3, SPECIAL).render(CHATS[0], add_generation_prompt=False,
                                                date_string="1 Jan 2030") == expected
    assert "Météo" in ChatTemplate(CHATML).render(CHATS[0], tools=TOOLS)


def test_mistral_template_and_raise_exception(hf_tokenizer):
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    expected = hf_tokenizer.apply_chat_template(chat, chat_template=MISTRAL, tokenize=False)
    assert ChatTemplate(MISTRAL, SPECIAL).render(chat, add_generation_prompt=False) == expected
    with pytest.raises(WorkbenchError, match="roles must alternate"):
        ChatTemplate(MISTRAL, SPECIAL).render(chat[1:])


@pytest.mark.parametrize("evil", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% set x = messages.append({'role': 'x'}) %}",
    "{% set ns = namespace() %}{% set ns._secret = 1 %}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_sandbox_refuses_escapes(evil):
    with pytest.raises(WorkbenchError):
        ChatTemplate(evil).render(CHATS[0])


def test_syntax_error_is_a_clear_error():
    with pytest.raises(ModelFormatError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")


def test_sources_and_precedence(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "cfg-default"}, {"name": "tool_use", "template": "cfg-tools"}]}
    ))
    assert find_chat_templates(tmp_path) == {"default": "cfg-default", "tool_use": "cfg-tools"}
    assert load_chat_template(tmp_path, tools=True).source == "cfg-tools"
    (tmp_path / "chat_template.jinja").write_text("jinja-file")
    assert load_chat_template(tmp_path).source == "jinja-file"
    with pytest.raises(WorkbenchError, match="no chat template named"):
        load_chat_template(tmp_path, name="nope")
    assert load_chat_template(tmp_path / "missing_dir_file.gguf") is None


def test_gguf_chat_template(tmp_path):
    from workbench.engine.tokenizer import from_gguf, read_gguf_tokenizer_fields

    tok = build_byte_level_tokenizer()
    path = write_tokenizer_gguf(tmp_path / "m.gguf", tok, "gpt2", eos=tok.token_to_id("<|im_end|>"),
                                chat_template=CHATML)
    fields = read_gguf_tokenizer_fields(path)
    template = load_chat_template(path, from_gguf(path, fields).special_tokens, gguf_fields=fields)
    text = template.render(CHATS[0])
    assert text.endswith("<|im_start|>assistant\n") and "café" in text


# Shaped like Qwen3's template: reversed scan with a namespace, string methods, reasoning content,
# tool responses, an ``enable_thinking`` switch passed as an extra variable.
QWEN3_LIKE = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen3_shaped_template_like_transformers(hf_tokenizer, thinking):
    chat = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\na1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2", "reasoning": "because"},
            {"role": "tool", "content": "42"}]
    extra = {} if thinking is None else {"enable_thinking": thinking}
    expected = hf_tokenizer.apply_chat_template(chat, chat_template=QWEN3_LIKE, tokenize=False,
                                                add_generation_prompt=True, **extra)
    assert ChatTemplate(QWEN3_LIKE, SPECIAL).render(chat, **extra) == expected
    assert "<think>\nbecause\n</think>" in expected
