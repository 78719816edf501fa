"""Conversations as the trainer sees them: a chat template rendered in a sandbox, tokenized,
and the mask of the tokens the model learns (the assistant's).

A released model's chat template is Jinja2 code from the internet. It is rendered as
transformers renders it (``apply_chat_template``): in Jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension and the ``{% generation %}`` block, the globals
``raise_exception``, ``strftime_now`` and ``namespace`` (which refuses underscore names),
a ``tojson`` filter that does not escape HTML, and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as variables. Jinja2 3.1.6 or newer is needed: older
releases have known sandbox escapes (transformers requires the same).

Which tokens are learned (``loss_mask``):

* where the template marks the assistant's text with ``{% generation %} ...
  {% endgeneration %}``, the tokens that overlap those character spans, as transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` computes them, token by
  token;
* where it does not, the assistant turns come from rendering the conversation's prefixes,
  as TRL and torchtune do: the turn of assistant message ``i`` is the text that rendering
  ``messages[:i + 1]`` adds to rendering ``messages[:i]`` with the generation prompt, the
  end-of-turn markup included (the model learns to stop). A template whose renderings are
  not prefixes of one another (Qwen3's drops earlier turns' reasoning) is refused in one
  line: give one with generation marks (``data.chat_template``).

The template comes from the tokenizer's directory (``chat_template.jinja``, which
transformers 5 writes, or ``tokenizer_config.json``'s ``chat_template``: a string, or a
list of ``{"name", "template"}`` of which ``default`` is taken) or from a file of its own.
"""
from __future__ import annotations

import contextvars
import datetime
import json
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["ROLES", "load_chat_template", "special_tokens", "render_conversation",
           "encode_conversation", "encode_messages", "check_messages", "check_special_tokens",
           "compile_template", "prompt_ids",
           "end_of_turn_ids", "MIN_JINJA2", "KEPT_TEMPLATE", "KEPT_TOKENS", "keep_chat_template",
           "kept_chat_template", "kept_chat_tokens"]

# The run's own copy of the chat template it trained with, in its workdir, and of the
# special tokens it rendered the template with (a JSON object, bos_token ... pad_token).
KEPT_TEMPLATE = "chat_template.jinja"
KEPT_TOKENS = "chat_template_tokens.json"

# The roles a message may have (tool messages where the template knows them).
ROLES = ("system", "user", "assistant", "tool")
# The oldest Jinja2 whose sandbox has no known escape (transformers' floor for templates).
MIN_JINJA2 = (3, 1, 6)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_COMMENT = re.compile(r"\{#.*?#\}", re.S)
# Markup a template writes that must be one token of the tokenizer: the <|...|> tokens of
# ChatML, Llama 3, GLM and Phi (DeepSeek's with fullwidth bars, U+FF5C) and Gemma's
# <start_of_turn> / <end_of_turn>.
_MARKUP = re.compile(r"<[|\uff5c][^<>|\uff5c\s]{1,64}[|\uff5c]>|<(?:start|end)_of_turn>")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _jinja2():
    """The jinja2 module, refused below :data:`MIN_JINJA2` (one line)."""
    import jinja2

    version = tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < MIN_JINJA2:
        raise ImportError(f"chat templates need jinja2 >= {'.'.join(map(str, MIN_JINJA2))} "
                          f"(older releases have sandbox escapes); this is {jinja2.__version__}")
    return jinja2


def _read_text(file: str, what: str) -> str:
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{file}: cannot read the {what} ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: the {what} is not UTF-8 text (byte {e.start})") from None


def _read_json(file: str, what: str) -> Any:
    """The parsed JSON of ``file`` (UTF-8), or a one-line error naming it."""
    try:
        return json.loads(_read_text(file, what))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not JSON ({e.msg}, line {e.lineno})") from None


def _tokenizer_config(file: str) -> Dict[str, Any]:
    """A ``tokenizer_config.json``'s object; empty where there is no such file."""
    if not os.path.isfile(file):
        return {}
    data = _read_json(file, "tokenizer config")
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not a JSON object")
    return data


def load_chat_template(path: str, name: str = "default") -> Tuple[str, str]:
    """``(template, source)``: the chat template of a tokenizer directory, or of a file.

    Args:
      path: a tokenizer directory (its ``chat_template.jinja``, else its
        ``tokenizer_config.json``'s ``chat_template``), a ``.json`` file (such a
        ``tokenizer_config.json``: its ``chat_template``), or a template file (any other
        path: its whole text).
      name: which of a list of named templates (``tokenizer_config.json`` may hold
        ``[{"name": ..., "template": ...}]``).

    Returns:
      The template's text and where it came from, in words (for the banner).

    Raises:
      ValueError: one line naming the file: no template there, a template that is not a
        string or is blank, an unknown name, a file that is not UTF-8 or not JSON.
    """
    if not os.path.isdir(path) and not path.lower().endswith(".json"):
        return _nonblank(_read_text(path, "chat template"), path), path
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isdir(path) and os.path.isfile(jinja_file):
        return _nonblank(_read_text(jinja_file, "chat template"), jinja_file), jinja_file
    # a directory's tokenizer_config.json, or such a file named itself: its chat_template
    config_file = os.path.join(path, "tokenizer_config.json") if os.path.isdir(path) else path
    template = _tokenizer_config(config_file).get("chat_template")
    if template is None:
        raise ValueError(f"{path}: no chat template (neither chat_template.jinja nor "
                         f"tokenizer_config.json's chat_template); give one with "
                         f"data.chat_template=FILE")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template
                 if isinstance(t, dict) and isinstance(t.get("name"), str)}
        if name not in named:
            raise ValueError(f"{config_file}: chat_template has no template named {name!r}; "
                             f"it has {sorted(map(str, named))}")
        template = named[name]
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{config_file}: chat_template={str(template)[:60]!r} is not a "
                         f"template; allowed: a non-empty string or a list of named ones")
    return template, f"{config_file} (chat_template)"


def _nonblank(template: str, file: str) -> str:
    if not template.strip():
        raise ValueError(f"{file}: the chat template is empty")
    return template


def special_tokens(directory: str) -> Dict[str, str]:
    """The special tokens a template may read (``bos_token``, ``eos_token``, ``unk_token``,
    ``pad_token``) from ``tokenizer_config.json``: a string, or ``{"content": ...}``; those
    absent or null are left out (as transformers' ``special_tokens_map``)."""
    config = (_tokenizer_config(os.path.join(directory, "tokenizer_config.json"))
              if os.path.isdir(directory) else {})
    out = {}
    for key in _SPECIAL:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            out[key] = value
    return out


def check_messages(messages: Any, where: str = "conversation") -> List[Dict[str, Any]]:
    """``messages`` as a list of ``{"role", "content", ...}`` dicts, checked.

    Raises:
      ValueError: one line naming ``where`` and the message: not a list of objects, a role
        outside :data:`ROLES`, content that is neither a string nor null (an assistant's
        tool calls: ``tool_calls`` a non-empty list of objects), an empty one, or
        ``tool_calls`` anywhere else.
    """
    messages = list(messages) if isinstance(messages, tuple) else messages
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}} "
                         f"objects, got {got}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: message {i} is {type(m).__name__}, not an object "
                             f"{{role, content}}")
        if m.get("role") not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m.get('role')!r}; allowed: "
                             f"{', '.join(ROLES)}")
        content = m.get("content")
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)
                                  or not calls or not all(isinstance(c, dict) for c in calls)):
            raise ValueError(f"{where}: message {i} ({m['role']}) has tool_calls="
                             f"{str(calls)[:40]!r}; allowed: on an assistant message, a "
                             f"non-empty list of objects")
        if content is None and calls:
            continue
        if not isinstance(content, str):
            raise ValueError(f"{where}: message {i} ({m['role']}) has content of type "
                             f"{type(content).__name__}; allowed: a string")
        if not content.strip():
            raise ValueError(f"{where}: message {i} ({m['role']}) has empty content")
    return messages


def check_special_tokens(template: str, tokenizer, variables: Dict[str, Any],
                         where: str = "chat template") -> None:
    """Refuses a tokenizer that lacks the template's special tokens, which it would split
    into pieces of text instead (a template and a tokenizer of different models): each of
    the template's markup tokens (``<|...|>``, DeepSeek's ``<｜...｜>``, Gemma's
    ``<start_of_turn>`` / ``<end_of_turn>``, written literally in its text) and each
    special token it is given (``bos_token``, ``eos_token``, ...) must encode as exactly
    one id.

    Args:
      template: the template's text.
      tokenizer: a ``tokenizers.Tokenizer``.
      variables: the template's variables (:func:`special_tokens`).
      where: what to name in the error (the tokenizer file).

    Raises:
      ValueError: one line naming ``where`` and up to five missing tokens.
    """
    wanted = sorted(set(_MARKUP.findall(template)) | {
        v for k, v in variables.items() if k in _SPECIAL and isinstance(v, str) and v})
    missing = [t for t in wanted if len(tokenizer.encode(t, add_special_tokens=False).ids) != 1]
    if missing:
        raise ValueError(f"{where}: the tokenizer lacks {len(missing)} of the chat template's "
                         f"special tokens ({', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''}): it would split them into "
                         f"text; give the model's own tokenizer (data.tokenizer) or its "
                         f"template (data.chat_template)")


def end_of_turn_ids(template: str, tokenizer, variables: Dict[str, Any]) -> List[int]:
    """The ids that end an assistant's turn, where sampling stops: the first special
    (added) token the template writes after an assistant message's content
    (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, DeepSeek-Coder's ``<|EOT|>`` after
    its line break: text such as a line break never stops a reply), then the
    ``eos_token`` it is given, each once. The template is probed with a system, a user
    and an assistant message, or without the system one where it refuses that.

    Raises:
      ValueError: the template fails to render both probes, or neither token is found
        (one line).
    """
    probe = "jaxmp-end-of-turn-probe"
    turns = [{"role": "user", "content": "?"}, {"role": "assistant", "content": probe}]
    try:
        text, _ = render_conversation([{"role": "system", "content": "."}] + turns, template,
                                      **variables)
    except ValueError:  # a template without system messages
        text, _ = render_conversation(turns, template, **variables)
    added = set(tokenizer.get_added_tokens_decoder())
    ids: List[int] = []
    after = text[text.rfind(probe) + len(probe):] if probe in text else ""
    ids += [i for i in tokenizer.encode(after, add_special_tokens=False).ids if i in added][:1]
    eos = variables.get("eos_token")
    if isinstance(eos, str) and eos and tokenizer.token_to_id(eos) is not None:
        if tokenizer.token_to_id(eos) not in ids:
            ids.append(tokenizer.token_to_id(eos))
    if not ids:
        raise ValueError("chat template: no end-of-turn token (no special token follows an "
                         "assistant message, and there is no eos_token)")
    return ids


class _Templates:
    """The sandboxed environment, built once; compiled templates cached by text."""

    def __init__(self):
        jinja2 = _jinja2()
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        spans: contextvars.ContextVar = contextvars.ContextVar("jaxmp_chat_spans", default=None)
        self._spans = spans

        class Generation(Extension):
            """``{% generation %}...{% endgeneration %}``: records the character span of
            its body in the text rendered so far (transformers' ``AssistantTracker``)."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(
                    lineno)

            def _mark(self, caller):
                text = caller()
                tracking = spans.get()
                if tracking is not None:
                    blocks, found = tracking
                    start = sum(len(b) for b in blocks)
                    found.append((start, start + len(text)))
                return text

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            return datetime.datetime.now().strftime(fmt)

        class Namespace(jinja2.utils.Namespace):
            """``namespace(...)`` that refuses underscore attribute names."""

            def __init__(*args, **kwargs):  # noqa: N805  (Jinja's own signature trick)
                self, args = args[0], args[1:]
                attrs = dict(*args, **kwargs)
                for key in attrs:
                    Namespace._check(key)
                jinja2.utils.Namespace.__init__(self, attrs)

            def __setitem__(self, key, value):
                Namespace._check(key)
                jinja2.utils.Namespace.__setitem__(self, key, value)

            @staticmethod
            def _check(key):
                if isinstance(key, str) and key.startswith("_"):
                    raise jinja2.exceptions.SecurityError(
                        f"a chat template may not set {key!r} on a namespace")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                           namespace=Namespace)
        self.env, self.jinja2, self._compiled = env, jinja2, {}

    def compile(self, template: str):
        if template not in self._compiled:
            try:
                self._compiled[template] = self.env.from_string(template)
            except self.jinja2.exceptions.TemplateError as e:
                raise ValueError(f"chat template does not compile: {_one_line(e)}") from None
        return self._compiled[template]

    def render(self, template: str, variables: Dict[str, Any]) -> Tuple[str, List[Tuple]]:
        compiled = self.compile(template)
        blocks: List[str] = []
        found: List[Tuple[int, int]] = []
        token = self._spans.set((blocks, found))
        try:
            for block in compiled.generate(**variables):
                blocks.append(block)
        except self.jinja2.exceptions.TemplateError as e:  # raise_exception, SecurityError
            raise ValueError(f"chat template raised: {_one_line(e)}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
                RecursionError, MemoryError) as e:  # the template's own fault: 1/0, None + ''
            raise ValueError(f"chat template raised {type(e).__name__}: "
                             f"{_one_line(e)}") from None
        finally:
            self._spans.reset(token)
        return "".join(blocks), found


_TEMPLATES: List[_Templates] = []


def _templates() -> _Templates:
    if not _TEMPLATES:
        _TEMPLATES.append(_Templates())
    return _TEMPLATES[0]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def compile_template(template: str) -> None:
    """Compiles chat ``template`` in the sandbox (once per text: the compiled template is
    kept), so that a template that cannot compile is refused before any conversation is
    rendered.

    Raises:
      ValueError: ``chat template does not compile: ...`` (one line).
      ImportError: jinja2 older than :data:`MIN_JINJA2`.
    """
    _templates().compile(template)


def render_conversation(messages: Sequence[Dict[str, Any]], template: str, *,
                        add_generation_prompt: bool = False,
                        **variables: Any) -> Tuple[str, List[Tuple[int, int]]]:
    """``(text, spans)``: ``messages`` rendered by chat ``template`` in the sandbox, and the
    character spans ``[start, end)`` of its ``{% generation %}`` blocks (empty when it has
    none).

    Args:
      messages: ``[{"role", "content", ...}]`` (:func:`check_messages`).
      template: the template's text (:func:`load_chat_template`).
      add_generation_prompt: end with the markup that opens an assistant turn.
      variables: what else the template reads: the special tokens
        (:func:`special_tokens`), ``tools``, ``enable_thinking``, ...

    Raises:
      ValueError: the template does not compile, or raises while rendering (its
        ``raise_exception``, a sandbox violation): one line.
      ImportError: jinja2 older than :data:`MIN_JINJA2`.
    """
    return _templates().render(template, dict(variables, messages=list(messages),
                                              add_generation_prompt=add_generation_prompt))


def _prefix_spans(messages, template: str, variables: Dict[str, Any],
                  text: str) -> List[Tuple[int, int]]:
    """The assistant turns of a template without generation marks: what rendering
    ``messages[:i + 1]`` adds to ``messages[:i]`` with the generation prompt."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head, _ = render_conversation(messages[:i], template, add_generation_prompt=True,
                                      **variables) if i else ("", [])
        upto, _ = render_conversation(messages[:i + 1], template, **variables)
        if not (upto.startswith(head) and text.startswith(upto)):
            raise ValueError(f"chat template: rendering the conversation up to message {i} "
                             f"(assistant) is not a prefix of rendering all of it, so its "
                             f"turns cannot be told apart; give a template that marks them "
                             f"with {{% generation %}} (data.chat_template=FILE)")
        if len(upto) > len(head):
            spans.append((len(head), len(upto)))
    return spans


def encode_conversation(messages: Sequence[Dict[str, Any]], tokenizer_dir: str, *,
                        template: Optional[str] = None,
                        **variables: Any) -> Tuple[np.ndarray, np.ndarray]:
    """``(ids, loss_mask)``: what the trainer trains on for one conversation.

    The conversation is rendered by the chat template (module docstring), tokenized
    whole with ``tokenizer_dir``'s ``tokenizer.json`` without added special tokens (the
    template writes them, as transformers' ``apply_chat_template`` does), and a token is
    learned where it overlaps an assistant span: a ``{% generation %}`` block where the
    template has them (then ``ids`` and ``loss_mask`` equal transformers'
    ``apply_chat_template(messages, tokenize=True, return_dict=True,
    return_assistant_tokens_mask=True)``), else an assistant turn found by rendering the
    conversation's prefixes.

    Args:
      messages: ``[{"role": "system" | "user" | "assistant" | "tool", "content": str}]``.
      tokenizer_dir: a directory with ``tokenizer.json`` (and ``tokenizer_config.json``
        for the special tokens and the template).
      template: the template's text; None = the directory's (:func:`load_chat_template`).
      variables: more template variables (``enable_thinking``, ``tools``, ...).

    Returns:
      ``ids`` int32 ``[n]`` and ``loss_mask`` bool ``[n]``.

    Raises:
      ValueError: one line: bad messages (:func:`check_messages`), no template, a template
        that fails, one without generation marks whose renderings are not prefixes, a
        ``tokenizer.json`` that does not load or lacks the template's special tokens
        (:func:`check_special_tokens`).
    """
    if template is None:
        template, _ = load_chat_template(tokenizer_dir)
    from tokenizers import Tokenizer

    file = os.path.join(tokenizer_dir, "tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001  tokenizers raises a bare Exception
        raise ValueError(f"{file}: not a Hugging Face tokenizer.json ({_one_line(e)})") from None
    variables = {**special_tokens(tokenizer_dir), **variables}
    check_special_tokens(template, tokenizer, variables, file)
    return encode_messages(messages, template, tokenizer, **variables)


def encode_messages(messages: Sequence[Dict[str, Any]], template: str, tokenizer,
                    **variables: Any) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`encode_conversation` with the template, the ``tokenizers.Tokenizer`` and the
    template's variables (the special tokens included) already loaded: what a data
    pipeline calls for each of many conversations.

    Raises:
      ValueError: as :func:`encode_conversation`, but for the loading.
    """
    messages = check_messages(messages)
    text, spans = render_conversation(messages, template, **variables)
    if not _GENERATION.search(_COMMENT.sub("", template)):  # marks in a comment are none
        spans = _prefix_spans(messages, template, variables, text)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, np.int32)
    mask = np.zeros(len(ids), bool)
    s = 0
    for i, (start, end) in enumerate(encoding.offsets):  # spans and tokens both in order
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        mask[i] = end > spans[s][0]
    return ids, mask


def prompt_ids(messages: Sequence[Dict[str, Any]], template: str, tokenizer,
               **variables: Any) -> np.ndarray:
    """The ids a model continues to answer ``messages``: the conversation rendered with the
    generation prompt (the markup that opens an assistant turn), tokenized without added
    special tokens (the template writes them); int32 ``[n]``.

    Raises:
      ValueError: bad messages, a template that fails, or a rendering of no token (one
        line).
    """
    text, _ = render_conversation(check_messages(messages), template,
                                  add_generation_prompt=True, **variables)
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
    if not ids.size:
        raise ValueError("chat template: the conversation renders as no token")
    return ids


def keep_chat_template(template: str, workdir, tokens: Optional[Dict[str, str]] = None) -> str:
    """Keeps ``template`` in the run directory (:data:`KEPT_TEMPLATE`), and the special
    tokens it was rendered with (:data:`KEPT_TOKENS`, a JSON object), each written
    atomically (a file with the same contents is left as it is), so that the run's export
    and ``jaxmp.sample --chat`` render as training did whatever became of their source
    (:func:`jaxmp.train.artifacts.export_hf`). Returns the template copy's path."""
    from jaxmp.train.tokenizer import write_atomic

    path = os.path.join(str(workdir), KEPT_TEMPLATE)
    if kept_chat_template(workdir) != template:
        write_atomic(path, template.encode("utf-8"))
    tokens = {k: tokens[k] for k in sorted(tokens or {})}
    if kept_chat_tokens(workdir) != tokens:
        write_atomic(os.path.join(str(workdir), KEPT_TOKENS),
                     (json.dumps(tokens, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    return path


def kept_chat_template(workdir) -> Optional[str]:
    """The chat template a run kept (:func:`keep_chat_template`), or None.

    Raises:
      ValueError: the copy is not a regular file or not UTF-8 (one line naming it).
    """
    path = os.path.join(str(workdir), KEPT_TEMPLATE)
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):
        raise ValueError(f"{path}: not a regular file; the run's copy of its chat template")
    return _read_text(path, "chat template")


def kept_chat_tokens(workdir) -> Dict[str, str]:
    """The special tokens a run rendered its chat template with (:func:`keep_chat_template`);
    empty when it kept none.

    Raises:
      ValueError: the file is not a regular file, not JSON, or not an object whose keys are
        among ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` and whose values
        are non-empty strings (one line naming it).
    """
    path = os.path.join(str(workdir), KEPT_TOKENS)
    if not os.path.lexists(path):
        return {}
    if not os.path.isfile(path):
        raise ValueError(f"{path}: not a regular file; the run's copy of its chat template's "
                         f"special tokens")
    tokens = _read_json(path, "chat template's special tokens")
    if not isinstance(tokens, dict) or any(
            k not in _SPECIAL or not isinstance(v, str) or not v for k, v in tokens.items()):
        raise ValueError(f"{path}: not an object of special tokens ({', '.join(_SPECIAL)}: "
                         f"non-empty strings)")
    return tokens
