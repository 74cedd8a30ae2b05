"""Chat templates: found next to the model or in GGUF metadata, rendered the way transformers renders them.

Templates are untrusted code from model repositories, so they only ever run in
``jinja2.sandbox.ImmutableSandboxedEnvironment``. The environment matches transformers'
``apply_chat_template(tokenize=False)``: ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block tag, ``tojson`` without ASCII escaping, ``raise_exception``,
``strftime_now``, and the special token texts (``bos_token``, ``eos_token``...) as variables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from workbench.core.errors import ModelFormatError, WorkbenchError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set {name!r} on a namespace")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _dict(*args, **kwargs):
    return dict(*args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _dict
    return env


def _plain(value: Any) -> Any:
    """Rebuild the template's inputs from plain JSON types (nothing with methods reaches the sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _messages(messages: list[dict]) -> list[dict]:
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise WorkbenchError(f"a chat message must be a dict with role and content, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """One compiled chat template with the special token texts it sees.

    ``source``: the Jinja text. ``special_tokens``: e.g. ``{"bos_token": "<s>", "eos_token": "</s>"}``.
    """

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, name: str = "default"):
        self.source = source
        self.name = name
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelFormatError(f"chat template {name!r} does not parse: {e.message} (line {e.lineno})") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               documents: list[dict] | None = None, **kwargs) -> str:
        """The prompt text for ``messages`` (``[{"role": "user", "content": "..."}, ...]``).

        ``add_generation_prompt`` appends the assistant header the model answers after. Extra
        keyword arguments (e.g. ``enable_thinking=False``) are passed to the template as variables.
        """
        if not messages:
            raise WorkbenchError("a chat needs at least one message")
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=_messages(messages), tools=_plain(tools), documents=_plain(documents),
                add_generation_prompt=add_generation_prompt, **_plain(variables),
            )
        except jinja2.TemplateError as e:
            raise WorkbenchError(f"chat template {self.name!r}: {e}") from e


def find_chat_templates(path: str | Path, gguf_fields: dict | None = None) -> dict[str, str]:
    """Every chat template of a model, by name (``"default"``, ``"tool_use"``...).

    Sources, first found wins for each name: ``chat_template.jinja``, ``chat_template.json``,
    ``tokenizer_config.json`` (``chat_template`` as a string or a list of ``{name, template}``) in a
    model folder; GGUF ``tokenizer.chat_template`` and ``tokenizer.chat_template.NAME`` from
    ``gguf_fields`` (a GGUF's key/values).
    """
    templates: dict[str, str] = {}
    path = Path(path)
    folder = path if path.is_dir() else path.parent if path.suffix != ".gguf" else None
    if folder is not None:
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        extra = folder / "additional_chat_templates"
        if extra.is_dir():
            for f in sorted(extra.glob("*.jinja")):
                templates.setdefault(f.stem, f.read_text(encoding="utf-8"))
        for name in ("chat_template.json", "tokenizer_config.json"):
            f = folder / name
            if not f.is_file():
                continue
            try:
                value = json.loads(f.read_text(encoding="utf-8")).get("chat_template")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
                raise ModelFormatError(f"{f}: unreadable JSON ({e})") from e
            if isinstance(value, str):
                templates.setdefault("default", value)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, dict) and isinstance(item.get("template"), str):
                        templates.setdefault(str(item.get("name", "default")), item["template"])
    for key, value in (gguf_fields or {}).items():
        if key == "tokenizer.chat_template" and isinstance(value, str):
            templates.setdefault("default", value)
        elif key.startswith("tokenizer.chat_template.") and isinstance(value, str):
            templates.setdefault(key.removeprefix("tokenizer.chat_template."), value)
    return templates


def load_chat_template(path: str | Path, special_tokens: dict[str, str] | None = None,
                       gguf_fields: dict | None = None, name: str | None = None,
                       tools: bool = False) -> ChatTemplate | None:
    """The model's chat template (None when it has none), picked as transformers picks it.

    ``name`` selects a named template; otherwise ``tool_use`` when ``tools`` and it exists, else
    ``default``, else the only one.
    """
    templates = find_chat_templates(path, gguf_fields)
    if not templates:
        return None
    if name is not None:
        if name not in templates:
            raise WorkbenchError(f"no chat template named {name!r} (the model has {', '.join(sorted(templates))})")
        chosen = name
    elif tools and "tool_use" in templates:
        chosen = "tool_use"
    elif "default" in templates:
        chosen = "default"
    elif len(templates) == 1:
        chosen = next(iter(templates))
    else:
        raise WorkbenchError(f"the model has several chat templates and none is the default: {sorted(templates)}")
    return ChatTemplate(templates[chosen], special_tokens, chosen)
