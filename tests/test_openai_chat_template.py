"""manylora.openai.chat_template renders as transformers' apply_chat_template does; the embedded default's template;
model_info reads a checkpoint's template as transformers keeps it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jinja2")
from transformers import PreTrainedTokenizerFast  # noqa: E402

from manylora.embedded.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, save_tokenizer, train_tokenizer  # noqa: E402
from manylora.engine.requests.model_info import model_info  # noqa: E402
from manylora.openai.chat_template import ChatTemplate, message_dicts  # noqa: E402
from manylora.openai.errors import OpenAIError  # noqa: E402
from manylora.openai.protocol import ChatMessage  # noqa: E402

CORPUS = ["The baker opens at six and sells bread to the farmers.", "Über den Fluss fährt eine Fähre: 東京 🙂.",
          "The market is loud and busy every Saturday morning."] * 4

# templates in the styles checkpoints ship: ChatML, header blocks with whitespace control and trim, indented blocks
# without whitespace control (trim_blocks / lstrip_blocks matter), tojson of non-ASCII, loop controls, a refusal
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
HEADERS = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Conversation roles must be system, user or assistant, got ' + message['role']) }}
    {%- endif %}
    {%- set text = message['content'] | trim %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + text + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
INDENTED = """{% for message in messages %}
  {% if message.role == 'system' %}
[SYS] {{ message.content }}
  {% else %}
[{{ message.role | upper }}] {{ message.content }}{{ eos_token if message.role == 'assistant' else '' }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""
JSONY = """{% for message in messages %}{% if loop.index > 3 %}{% break %}{% endif %}{{ message | tojson }}
{% endfor %}{% if add_generation_prompt %}<reply>{% endif %}"""
TEMPLATES = {"chatml": CHATML, "headers": HEADERS, "indented": INDENTED, "json": JSONY, "embedded": CHAT_TEMPLATE}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "  Answer briefly.  "}, {"role": "user", "content": "Über den Fluss?"},
     {"role": "assistant", "content": "Ja, mit der Fähre."}, {"role": "user", "content": "東京 🙂 and back"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(CORPUS, 300), bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD)


def _special(tok) -> dict[str, str]:
    return {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers(hf_tokenizer, name, add_generation_prompt):
    source = TEMPLATES[name]
    template = ChatTemplate(source, _special(hf_tokenizer))
    for messages in CONVERSATIONS:
        expected = hf_tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
        assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("name", ["chatml", "headers", "indented"])
def test_continue_final_message_as_transformers(hf_tokenizer, name):
    source = TEMPLATES[name]
    messages = [{"role": "user", "content": "Write a line"}, {"role": "assistant", "content": "The river runs"}]
    expected = hf_tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                add_generation_prompt=False, continue_final_message=True)
    got = ChatTemplate(source, _special(hf_tokenizer)).render(messages, add_generation_prompt=False,
                                                              continue_final_message=True)
    assert got == expected and got.endswith("The river runs")


def test_a_template_refusal_is_a_400_with_its_message(hf_tokenizer):
    template = ChatTemplate(HEADERS, _special(hf_tokenizer))
    with pytest.raises(OpenAIError) as e:
        template.render([{"role": "tool", "content": "42"}])
    assert e.value.status == 400 and "roles must be system, user or assistant, got tool" in e.value.message


def test_the_sandbox_refuses_unsafe_attribute_access():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception) as e:  # jinja2's SecurityError, as transformers' sandbox raises it
        template.render([{"role": "user", "content": "x"}])
    assert "unsafe" in str(e.value) or "__class__" in str(e.value)


def test_a_template_that_does_not_compile_names_its_line():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}\n{{ m.content }")


def test_text_parts_are_joined_and_other_parts_refused():
    messages = [ChatMessage(role="user", content=[{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]),
                ChatMessage(role="assistant", content=None)]
    assert message_dicts(messages) == [{"role": "user", "content": "one\ntwo"}, {"role": "assistant", "content": ""}]
    with pytest.raises(OpenAIError, match="only text content parts"):
        message_dicts([ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])])


def test_embedded_default_template_and_model_info(tmp_path, hf_tokenizer):
    """The embedded build writes its chat template into tokenizer_config.json; transformers and model_info read it;
    a one-message chat is that message's completion prompt, token for token."""
    save_tokenizer(train_tokenizer(CORPUS, 300), tmp_path, model_max_length=128)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    loaded = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    info = model_info(tmp_path, 128)
    assert info["name"] == tmp_path.name and info["max_model_len"] == 128
    assert info["chat_template"] == CHAT_TEMPLATE
    assert info["special_tokens"] == {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    text = "The market is loud"
    rendered = ChatTemplate(info["chat_template"], info["special_tokens"]).render([{"role": "user", "content": text}])
    assert rendered == loaded.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
    assert loaded(rendered, add_special_tokens=False)["input_ids"] == loaded(text)["input_ids"]


def test_model_info_prefers_chat_template_jinja_and_reads_named_templates(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    info = model_info(tmp_path)
    assert info["chat_template"] == "D" and info["special_tokens"] == {"bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "chat_template.jinja").write_text("J")
    assert model_info(tmp_path)["chat_template"] == "J"
    assert model_info(tmp_path / "missing")["chat_template"] is None
