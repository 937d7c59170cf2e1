"""Text: a checkpoint's tokenizer, chat template and generation defaults, read as its files say.

``Text.load(dir)`` reads ``tokenizer.json`` (through the ``tokenizers`` library),
``tokenizer_config.json`` (special tokens, ``chat_template``), ``chat_template.jinja`` (which
wins over the config's template, as in transformers) and ``generation_config.json`` (stop ids
and sampling defaults). The template is compiled as transformers compiles it: a jinja2
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, its ``tojson`` filter and its ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace`` globals; it renders with ``messages``, ``tools``,
``documents``, ``add_generation_prompt`` and the special tokens (``bos_token``,
``eos_token`` ...) as keywords.

Laws:

1. ``decode(encode(s, special=False)) == s`` for text the tokenizer covers (byte-level BPE
   covers all text).
2. Concatenating a :class:`TextStream`'s deltas and its final ``flush()`` gives
   ``decode(ids)``.

Every bad file or field is a :class:`~metrale.lkb.errors.ConfigError` naming the file and the
field.

>>> t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
...                  "{% if add_generation_prompt %}<assistant>{% endif %}")
>>> t.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
'<user>hi<assistant>'
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.errors import ConfigError

__all__ = ["ChatTemplate", "GenerationDefaults", "Text", "TextStream"]

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")
"""The ``tokenizer_config.json`` keys a chat template sees as variables (transformers'
``special_tokens_map``)."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"not valid JSON: {e.msg}", file=path, line=e.lineno,
                          col=e.colno) from None
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text", file=path) from None
    if not isinstance(data, dict):
        raise ConfigError("must hold a JSON object", file=path, found=type(data).__name__)
    return data


def _token_text(value: Any, path: Path, key: str) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ConfigError("a special token is a string or an object with a string 'content'",
                      file=path, key=key, found=repr(value))


# -- the chat template ---------------------------------------------------------------------


@attrs.frozen
class ChatTemplate:
    """A chat template compiled as transformers compiles it (see the module docstring).

    ``source`` names where it came from, for errors. A template that calls
    ``raise_exception`` or fails to render raises a ``ConfigError`` naming that source.

    >>> ChatTemplate("{{ raise_exception('no system role') }}", source="t.jinja").render([])
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.ConfigError: t.jinja: chat_template: the template refused the messages: no system role
    """

    text: str
    source: str = "chat_template"
    special: Mapping[str, str] = attrs.field(factory=dict, converter=lambda d: dict(d))
    _compiled: Any = attrs.field(init=False, eq=False, hash=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_compiled", _compile(self.text, self.source))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text of ``messages``, as ``tokenizer.apply_chat_template(..., tokenize=False)``
        gives it for the same files."""
        import jinja2

        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise ConfigError("a chat message is an object", key=f"messages[{i}]",
                                  found=type(m).__name__)
        kwargs = {**self.special, **extra}
        try:
            return self._compiled.render(messages=[dict(m) for m in messages],
                                         tools=None if tools is None else list(tools),
                                         documents=None if documents is None else list(documents),
                                         add_generation_prompt=add_generation_prompt, **kwargs)
        except jinja2.TemplateError as e:
            raise ConfigError(f"the template refused the messages: {e}", file=self.source,
                              key="chat_template") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"the template failed to render: {type(e).__name__}: {e}",
                              file=self.source, key="chat_template") from None


def _compile(text: str, source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: rendered as its body (transformers
        tracks assistant spans with it; a prompt needs only the text)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            values = dict(*args, **kwargs)
            for name in values:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a namespace attribute may not start with '_': {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"chat template syntax error: {e.message}", file=source,
                          key="chat_template", line=e.lineno) from None


# -- generation defaults -------------------------------------------------------------------


@attrs.frozen
class GenerationDefaults:
    """What ``generation_config.json`` says: stop ids and sampling defaults (``None``: unset).

    >>> GenerationDefaults.from_dict({"eos_token_id": [2, 7], "temperature": 0.6}).eos_ids
    (2, 7)
    """

    eos_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    do_sample: bool | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], file: Any = "generation_config.json"
                  ) -> GenerationDefaults:
        """Read the fields Metrale uses; a field of the wrong type is a ``ConfigError``."""
        eos = data.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, int) and not isinstance(eos, bool):
            eos_ids = (eos,)
        elif isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool)
                                           for e in eos):
            eos_ids = tuple(eos)
        else:
            raise ConfigError("a token id or a list of token ids", file=file, key="eos_token_id",
                              found=repr(eos))
        out: dict[str, Any] = {"eos_ids": eos_ids}
        for key, kind in (("temperature", float), ("top_p", float), ("min_p", float),
                          ("top_k", int), ("max_new_tokens", int), ("do_sample", bool)):
            v = data.get(key)
            if v is None:
                out[key] = None
                continue
            ok = (isinstance(v, bool) if kind is bool else
                  isinstance(v, int) and not isinstance(v, bool) if kind is int else
                  isinstance(v, int | float) and not isinstance(v, bool))
            if not ok or (kind is not bool and v < 0):
                raise ConfigError("bad generation default", file=file, key=key,
                                  expected=f"a non-negative {kind.__name__}", found=repr(v))
            out[key] = kind(v)
        return cls(**out)


# -- the tokenizer -------------------------------------------------------------------------


@attrs.frozen
class Text:
    """A checkpoint's text side: tokenizer, chat template (or ``None``), defaults, stop ids.

    Build with :meth:`load`. ``stop_ids`` joins ``generation_config.json``'s ``eos_token_id``
    and the tokenizer's ``eos_token``.
    """

    tokenizer: Any
    template: ChatTemplate | None
    defaults: GenerationDefaults
    special: Mapping[str, str]
    stop_ids: tuple[int, ...]
    path: str

    @classmethod
    def load(cls, directory: str | Path) -> Text:
        """Read the text files of a checkpoint directory (``tokenizer.json`` is required)."""
        import tokenizers

        d = Path(directory)
        tok_path = d / "tokenizer.json"
        if not tok_path.is_file():
            raise ConfigError("the checkpoint has no tokenizer", file=tok_path,
                              expected="a tokenizer.json beside config.json")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as e:  # the library's own error type is a bare Exception
            raise ConfigError(f"tokenizers cannot read it: {e}", file=tok_path) from None
        cfg_path = d / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        special = {k: v for k in SPECIAL_TOKEN_KEYS
                   if (v := _token_text(cfg.get(k), cfg_path, k)) is not None}
        template_text, source = None, str(cfg_path)
        jinja_path = d / "chat_template.jinja"
        if jinja_path.is_file():
            template_text, source = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        elif "chat_template" in cfg:
            template_text = cfg["chat_template"]
            if isinstance(template_text, list):  # named templates: transformers uses "default"
                named = {t.get("name"): t.get("template") for t in template_text
                         if isinstance(t, dict)}
                template_text = named.get("default")
            if not isinstance(template_text, str):
                raise ConfigError("a chat template is a string (or a list of named ones with "
                                  "a 'default')", file=cfg_path, key="chat_template",
                                  found=type(cfg["chat_template"]).__name__)
        template = (ChatTemplate(template_text, source, special)
                    if template_text is not None else None)
        gen_path = d / "generation_config.json"
        defaults = (GenerationDefaults.from_dict(_read_json(gen_path), gen_path)
                    if gen_path.is_file() else GenerationDefaults())
        stops = list(defaults.eos_ids)
        eos = special.get("eos_token")
        if eos is not None:
            eid = tokenizer.token_to_id(eos)
            if eid is None:
                raise ConfigError("the eos token is not in the tokenizer's vocabulary",
                                  file=cfg_path, key="eos_token", found=repr(eos))
            if eid not in stops:
                stops.append(eid)
        return cls(tokenizer, template, defaults, special, tuple(stops), str(d))

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special`` adds the post-processor's tokens (a BOS, say), as
        a transformers tokenizer called on text does."""
        if not isinstance(text, str):
            raise ConfigError("a prompt is a string", key="prompt", found=type(text).__name__)
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """The text of ``ids`` (special tokens left out unless ``skip_special`` is false)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
             **extra: Any) -> str:
        """The chat prompt of ``messages`` through the checkpoint's template."""
        if self.template is None:
            raise ConfigError("the checkpoint has no chat template", file=self.path,
                              key="chat_template",
                              expected="chat_template.jinja or tokenizer_config.json's "
                                       "chat_template")
        return self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                    **extra)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> list[int]:
        """Token ids of the chat prompt: encoded without added special tokens, as transformers'
        ``apply_chat_template(tokenize=True)`` does (the template writes them)."""
        return self.encode(self.chat(messages, **extra), special=False)

    def stream(self, prompt_ids: Sequence[int] = ()) -> TextStream:
        """A :class:`TextStream` that decodes tokens generated after ``prompt_ids``."""
        return TextStream(self, list(prompt_ids))


class TextStream:
    """Incremental decoding: ``push(id)`` returns the text that id completes (``""`` while a
    multi-byte character is incomplete), through ``tokenizers``' ``DecodeStream`` primed with
    the prompt's last ids (so a word-piece's leading space comes out right).

    Concatenated deltas and the final :meth:`flush` equal ``Text.decode`` of every id pushed.
    """

    PRIME = 8

    def __init__(self, text: Text, prompt_ids: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self.text = text
        self.ids: list[int] = []
        self.emitted = ""
        self._stream = DecodeStream(ids=prompt_ids[-self.PRIME:], skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add one generated id; the text it completes."""
        self.ids.append(int(token))
        out = self._stream.step(self.text.tokenizer, int(token)) or ""
        self.emitted += out
        return out

    def flush(self) -> str:
        """The text still held back at the end (an incomplete character, decoded as the
        tokenizer decodes it, usually U+FFFD), so that the deltas add up to ``decode(ids)``."""
        full = self.text.decode(self.ids)
        rest = full[len(self.emitted):] if full.startswith(self.emitted) else ""
        self.emitted += rest
        return rest
