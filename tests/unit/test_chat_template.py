"""Chat templates: same output as transformers' apply_chat_template; sandboxed; messages validated."""
from __future__ import annotations

import copy
import json

import pytest

from checkpoints.bpe import DEFAULT_SYSTEM_PROMPT, kimi_chat_template, write_tokenizer_files
from kimi_jax.text.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateNotFound

SPECIALS = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What's the weather in Paris? Answer in 日本語 too."},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp_c": 21, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": [{"type": "text", "text": "18 C"}]},
    {"role": "assistant", "content": "Paris: 21 °C, clear. パリは晴れ 😀"},
    {"role": "user", "name": "bob", "content": [{"type": "text", "text": "Thanks! "}, {"type": "text", "text": "Bye."}]},
]

# A template exercising the environment features transformers provides (namespace, tojson options,
# raise_exception, loop controls, the generation tag, special-token variables, trim/lstrip blocks).
FEATURE_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role') }}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {% if m.role == 'assistant' %}
    {% generation %}[A{{ ns.n }}] {{ m.content }}{% endgeneration %}
  {% else %}
    [{{ m.role | upper }}] {{ m.content if m.content is string else m.content | tojson(indent=1) }}
  {% endif %}
  {% if loop.index > 50 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}{{ tools | tojson(sort_keys=True) }}{% endif %}
{% if add_generation_prompt %}[A]{% endif %}{{ eos_token }}"""


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = HFTokenizer(WordLevel({"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, "[PAD]": 3}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIALS)


def _hf_render(hf_tokenizer, template, messages, **kw):
    hf_tokenizer.chat_template = template
    return hf_tokenizer.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kw)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("template_name", ["kimi", "feature"])
def test_matches_transformers(hf_tokenizer, add_generation_prompt, with_tools, template_name):
    template = kimi_chat_template() if template_name == "kimi" else FEATURE_TEMPLATE
    tools = TOOLS if with_tools else None
    ours = ChatTemplate(template, special_tokens=SPECIALS).render(
        CONVERSATION, add_generation_prompt=add_generation_prompt, tools=tools
    )
    theirs = _hf_render(hf_tokenizer, template, CONVERSATION, add_generation_prompt=add_generation_prompt, tools=tools)
    assert ours == theirs


def test_kimi_format(hf_tokenizer):
    t = ChatTemplate(kimi_chat_template())
    out = t.render(CONVERSATION, tools=TOOLS)
    assert out.startswith("<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS, ensure_ascii=False) + "<|im_end|>")
    assert "<|im_system|>system<|im_middle|>You are a terse assistant.<|im_end|>" in out
    assert "<|im_user|>user<|im_middle|>What's the weather" in out
    assert (
        "<|im_assistant|>assistant<|im_middle|>Let me check.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Lyon"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    ) in out
    assert '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"temp_c": 21, "sky": "clear"}<|im_end|>' in out
    assert "<|im_user|>bob<|im_middle|>Thanks! Bye.<|im_end|>" in out
    assert out.endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert not t.render(CONVERSATION, add_generation_prompt=False).endswith("<|im_middle|>")
    # default system message when none is given
    out = t.render([{"role": "user", "content": "hi"}])
    assert out == (
        f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    assert out == _hf_render(hf_tokenizer, kimi_chat_template(), [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    custom = ChatTemplate(kimi_chat_template("Be 'brief'.\nOK")).render([{"role": "user", "content": "x"}])
    assert custom.startswith("<|im_system|>system<|im_middle|>Be 'brief'.\nOK<|im_end|>")


def test_render_does_not_mutate_messages():
    msgs = copy.deepcopy(CONVERSATION)
    ChatTemplate(kimi_chat_template()).render(msgs, tools=TOOLS)
    assert msgs == CONVERSATION


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ ''.__class__ }}",
        "{{ messages.__class__.__base__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
        "{{ '{0.__class__}'.format(messages) }}",
        "{{ (messages|first).content.format.__self__.__class__ }}",
    ],
)
def test_sandbox_refuses_internals(source):
    with pytest.raises(ChatTemplateError) as ei:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    msg = str(ei.value)
    assert "\n" not in msg
    assert "refused" in msg or "unsafe" in msg or "not allowed" in msg


def test_template_errors_are_one_line():
    with pytest.raises(ChatTemplateError, match="syntax error"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="no tools here") as ei:
        ChatTemplate("{{ raise_exception('no tools here') }}").render([{"role": "user", "content": "x"}])
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize(
    "messages, where",
    [
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}], r"messages\[1\]"),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user"}], r"messages\[2\]"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]}], r"messages\[0\]\.content\[1\]"),
        ([{"role": "user", "content": "a"}, "just a string"], r"messages\[1\]"),
        ([{"content": "a"}], r"messages\[0\]"),
        ([{"role": "user", "content": "a", "tool_calls": []}], r"messages\[0\]"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], r"messages\[0\]\.tool_calls\[0\]"),
    ],
)
def test_bad_messages_name_the_index(messages, where):
    with pytest.raises(ChatTemplateError, match=where):
        ChatTemplate(kimi_chat_template()).render(messages)


def test_assistant_tool_call_without_content_is_valid():
    out = ChatTemplate(kimi_chat_template()).render(
        [{"role": "user", "content": "go"},
         {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
        add_generation_prompt=False,
    )
    assert out.endswith(
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    )


def test_from_pretrained(tmp_path):
    ranks = {bytes([i]): i for i in range(256)}
    d = tmp_path / "ckpt"
    write_tokenizer_files(d, ranks, model_max_length=64)
    t = ChatTemplate.from_pretrained(d)
    assert t.path.endswith("chat_template.jinja")
    assert t.special_tokens["bos_token"] == "[BOS]" and t.special_tokens["eos_token"] == "[EOS]"
    assert t.render([{"role": "user", "content": "hi"}]).endswith("<|im_assistant|>assistant<|im_middle|>")

    # without chat_template.jinja, the tokenizer_config entry is used
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = ChatTemplate.from_pretrained(d)
    assert t.path.endswith("tokenizer_config.json")
    assert t.render([{"role": "user", "content": "hi"}]) == "[BOS]hi"

    # the jinja file wins over the config entry
    (d / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert ChatTemplate.from_pretrained(d).render([{"role": "user", "content": "hi"}]) == "J1"

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ChatTemplateNotFound, match="empty"):
        ChatTemplate.from_pretrained(empty)
