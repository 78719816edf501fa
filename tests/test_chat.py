"""Chat templates (issue 41, point 2): encode_conversation's ids and loss mask equal
transformers' apply_chat_template(..., return_assistant_tokens_mask=True) token by token
where the template marks generations; without marks the assistant turns come from
rendering prefixes (checked by decoding the learned tokens); hostile templates stay in
the sandbox and fail in one line."""
import json

import numpy as np
import pytest

pytest.importorskip("transformers")
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from jaxmp.train.chat import encode_conversation, load_chat_template, render_conversation  # noqa: E402

# Templates written for these tests in two released formats: ChatML (Qwen's
# <|im_start|>role ... <|im_end|>) and Llama 3's headers (<|start_header_id|>role
# <|end_header_id|> ... <|eot_id|>), each with and without generation marks.
CHATML_GEN = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_GEN = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "It is 4."}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "Seven."},
     {"role": "user", "content": "And an even one?"},
     {"role": "assistant", "content": "Two, the only even prime."}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer with the templates' special tokens, trained here."""
    path = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["system user assistant"]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    return path


def _with_template(directory, template):
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "bos_token": "<|begin_of_text|>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize("template", [CHATML_GEN, LLAMA3_GEN], ids=["chatml", "llama3"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_ids_and_mask_equal_transformers_apply_chat_template(tokenizer_dir, template,
                                                             conversation):
    directory = _with_template(tokenizer_dir, template)
    messages = CONVERSATIONS[conversation]
    ids, mask = encode_conversation(messages, directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == list(theirs["input_ids"])
    assert mask.astype(int).tolist() == list(theirs["assistant_masks"])
    assert 0 < mask.sum() < len(mask)


def test_without_generation_marks_the_turns_come_from_prefixes(tokenizer_dir):
    directory = _with_template(tokenizer_dir, CHATML)
    messages = CONVERSATIONS[1]
    ids, mask = encode_conversation(messages, directory)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    assert ids.tolist() == list(hf.apply_chat_template(messages, tokenize=True,
                                                       return_dict=True)["input_ids"])
    # the learned tokens, decoded run by run, are each assistant reply and its end of turn
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(int(i))
        elif current:
            runs.append(current)
            current = []
    runs.append(current) if current else None
    assert [hf.decode(r) for r in runs] == ["Seven.<|im_end|>\n",
                                            "Two, the only even prime.<|im_end|>\n"]


def test_a_template_that_renders_history_differently_is_refused(tokenizer_dir):
    """A template that rewrites earlier assistant turns (as Qwen3's drops their reasoning)
    has no prefix property: one line, pointing at generation marks."""
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
                "{{ '<|im_start|>assistant\\n(earlier)<|im_end|>\\n' }}{% else %}"
                "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match=r"^chat template: rendering the conversation up to "
                                         r"message 2 \(assistant\) is not a prefix"):
        encode_conversation(CONVERSATIONS[1], _with_template(tokenizer_dir, template))


@pytest.mark.parametrize("template, match", [
    ("{{ raise_exception('no system role here') }}", r"^chat template raised: no system role"),
    ("{{ messages.__class__.__mro__ }}", r"^chat template raised: .*unsafe|access to attribute"),
    ("{% set ns = namespace(_x=1) %}", r"^chat template raised: .*_x"),
    ("{% for %}", r"^chat template does not compile: "),
])
def test_hostile_or_failing_templates_are_one_line(template, match):
    with pytest.raises(ValueError, match=match) as info:
        render_conversation(CONVERSATIONS[0], template)
    assert "\n" not in str(info.value)


def test_the_sandbox_hides_internals():
    """An unsafe attribute is undefined in the sandbox: nothing of the process leaks."""
    assert render_conversation(CONVERSATIONS[0], "{{ ''.join.__globals__ }}|") == ("|", [])
    with pytest.raises(ValueError, match=r"^chat template raised: access to attribute "
                                         r"'__init__' of 'type' object is unsafe"):
        render_conversation(CONVERSATIONS[0], "{{ cycler.__init__.__globals__ }}")


@pytest.mark.parametrize("messages, match", [
    ([], r"non-empty list"),
    ([{"role": "wizard", "content": "hi"}], r"message 0 has role 'wizard'; allowed: system, user"),
    ([{"role": "user", "content": "   "}], r"message 0 \(user\) has empty content"),
    ([{"role": "user", "content": 3}], r"message 0 \(user\) has content of type int"),
])
def test_bad_messages_are_one_line(tokenizer_dir, messages, match):
    with pytest.raises(ValueError, match=match):
        encode_conversation(messages, _with_template(tokenizer_dir, CHATML_GEN))


def test_the_template_comes_from_the_directory_or_a_named_list(tokenizer_dir, tmp_path):
    directory = _with_template(tokenizer_dir, [{"name": "tool_use", "template": "x"},
                                               {"name": "default", "template": CHATML}])
    assert load_chat_template(directory)[0] == CHATML
    with pytest.raises(ValueError, match=r"no template named 'rag'"):
        load_chat_template(directory, "rag")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no chat template"):
        load_chat_template(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text(CHATML_GEN)
    assert load_chat_template(str(tmp_path)) == (CHATML_GEN, str(tmp_path / "chat_template.jinja"))


def test_a_tokenizer_without_the_templates_special_tokens_is_refused(tokenizer_dir, tmp_path):
    """A template of another model (DeepSeek's fullwidth-bar markup, Gemma's turns) or a
    special token the tokenizer splits into text: one line naming the tokenizer file and
    the tokens; the markup this tokenizer has passes."""
    from jaxmp.train.chat import check_special_tokens
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    check_special_tokens(LLAMA3_GEN, tok, {"bos_token": "<|begin_of_text|>"})
    other = "{{ '<\uff5cUser\uff5c>' + messages[0]['content'] + '<start_of_turn><|im_end|>' }}"
    with pytest.raises(ValueError, match=r"^tok.json: the tokenizer lacks 2 of the chat "
                                         r"template's special tokens \(<start_of_turn>, "
                                         r"<\uff5cUser\uff5c>\)"):
        check_special_tokens(other, tok, {}, "tok.json")
    with pytest.raises(ValueError, match=r"lacks 1 .*\(<s>\)"):
        check_special_tokens(CHATML, tok, {"bos_token": "<s>"})
    directory = _with_template(tokenizer_dir, other)
    with pytest.raises(ValueError, match=r"tokenizer.json: the tokenizer lacks 2"):
        encode_conversation(CONVERSATIONS[0], directory)


@pytest.mark.parametrize("template, end", [(CHATML_GEN, "<|im_end|>"), (CHATML, "<|im_end|>"),
                                           (LLAMA3_GEN, "<|eot_id|>")],
                         ids=["chatml_gen", "chatml", "llama3"])
def test_the_end_of_turn_and_the_chat_prompt_are_transformers(tokenizer_dir, template, end,
                                                              tmp_path):
    """end_of_turn_ids: the token after an assistant's content, then eos_token; and the
    prompt ``jaxmp.sample --chat`` renders from a run's kept template and tokens is
    transformers' ``apply_chat_template(add_generation_prompt=True)`` on the same
    directory."""
    from tokenizers import Tokenizer

    from jaxmp.sample import chat_prompt
    from jaxmp.train.chat import end_of_turn_ids, keep_chat_template, special_tokens
    from jaxmp.train.tokenizer import HFTokenizer

    directory = _with_template(tokenizer_dir, template)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokens = special_tokens(directory)
    ids = end_of_turn_ids(template, tok, tokens)
    assert ids == list(dict.fromkeys([hf.convert_tokens_to_ids(end), hf.eos_token_id]))
    keep_chat_template(template, tmp_path, tokens)
    prompt, stops = chat_prompt(tmp_path, HFTokenizer(tok, "tok", hf.eos_token_id),
                                "Name a prime.", "You answer briefly.")
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Name a prime."}]
    assert prompt.tolist() == list(hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    assert stops == ids
    with pytest.raises(ValueError, match=r"kept no chat template"):
        chat_prompt(tmp_path / "nowhere", HFTokenizer(tok, "tok", hf.eos_token_id), "x")


@pytest.mark.parametrize("content, match", [
    ("[1]", r"not an object of special tokens"),
    ('{"bos_token": ""}', r"not an object of special tokens"),
    ('{"chat_template": "x"}', r"not an object of special tokens"),
    ("{", r"not JSON"),
])
def test_a_damaged_copy_of_the_special_tokens_is_one_line(tmp_path, content, match):
    from jaxmp.train.chat import KEPT_TOKENS, kept_chat_tokens

    (tmp_path / KEPT_TOKENS).write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        kept_chat_tokens(tmp_path)
    assert str(info.value).startswith(str(tmp_path / KEPT_TOKENS)) and "\n" not in str(info.value)


@pytest.mark.parametrize("template, match", [
    ("{{ 1 / 0 }}", r"^chat template raised ZeroDivisionError: "),
    ("{{ messages[0]['content'] + none }}", r"^chat template raised TypeError: "),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", r"^chat template raised RecursionError"),
])
def test_a_template_failing_in_python_is_one_line_too(template, match):
    """Not only Jinja's own errors: 1/0, None + str (a tool-call message with null
    content through a template that concatenates it), endless recursion."""
    with pytest.raises(ValueError, match=match) as info:
        render_conversation(CONVERSATIONS[0], template)
    assert "\n" not in str(info.value)


def test_a_tokenizer_config_json_file_is_read_for_its_template(tokenizer_dir, tmp_path):
    """data.chat_template naming a tokenizer_config.json takes its chat_template (it was
    rendered as a template of JSON text); blank templates and unhashable names are one line."""
    directory = _with_template(tokenizer_dir, CHATML_GEN)
    file = str(tokenizer_dir / "tokenizer_config.json")
    assert load_chat_template(file) == (CHATML_GEN, f"{file} (chat_template)")
    (tmp_path / "blank.jinja").write_text("  \n")
    with pytest.raises(ValueError, match=r"blank\.jinja: the chat template is empty"):
        load_chat_template(str(tmp_path / "blank.jinja"))
    _with_template(tokenizer_dir, "   ")
    with pytest.raises(ValueError, match=r"chat_template='   ' is not a template"):
        load_chat_template(directory)
    _with_template(tokenizer_dir, [{"name": ["x"], "template": "t"}])
    with pytest.raises(ValueError, match=r"has no template named 'default'"):
        load_chat_template(directory)


def test_the_end_of_turn_is_a_special_token_and_a_system_only_template_is_probed(tokenizer_dir):
    """A template that writes a line break before its end-of-turn token (DeepSeek-Coder's
    '\\n<|EOT|>\\n') stops at the token, not at every line break; one that requires a
    system message is probed with one."""
    from tokenizers import Tokenizer

    from jaxmp.train.chat import end_of_turn_ids

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eot = tok.token_to_id("<|eot_id|>")
    coder = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n<|eot_id|>\\n' }}"
             "{% endfor %}")
    assert end_of_turn_ids(coder, tok, {}) == [eot]
    system_first = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system "
                    "message first') }}{% endif %}" + CHATML)
    assert end_of_turn_ids(system_first, tok, {"eos_token": "<|eot_id|>"}) == [
        tok.token_to_id("<|im_end|>"), eot]


@pytest.mark.parametrize("message, match", [
    ({"role": "assistant", "content": None, "tool_calls": "x"}, r"tool_calls='x'; allowed: on "
                                                                r"an assistant message"),
    ({"role": "user", "content": None, "tool_calls": [{"name": "f"}]}, r"message 0 \(user\) has "
                                                                       r"tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [1]}, r"a non-empty list of objects"),
])
def test_tool_calls_are_an_assistants_list_of_objects(tokenizer_dir, message, match):
    from jaxmp.train.chat import check_messages

    with pytest.raises(ValueError, match=match):
        check_messages([message])
    assert check_messages([{"role": "assistant", "content": None,
                            "tool_calls": [{"name": "f", "arguments": {}}]}])
    with pytest.raises(ValueError, match=r"got an empty list"):
        check_messages([])


def test_generation_marks_in_a_comment_are_no_marks(tokenizer_dir):
    """A template that only mentions {% generation %} in a Jinja comment has no marks:
    its assistant turns come from prefixes (it learned nothing before)."""
    commented = "{# supports {% generation %} blocks #}" + CHATML
    ids, mask = encode_conversation(CONVERSATIONS[1], _with_template(tokenizer_dir, commented))
    plain, want = encode_conversation(CONVERSATIONS[1], _with_template(tokenizer_dir, CHATML))
    assert ids.tolist() == plain.tolist() and mask.tolist() == want.tolist() and mask.any()
