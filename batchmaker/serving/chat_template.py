"""Chat templates: a checkpoint's Jinja template that turns a list of messages into the prompt
text, rendered in a sandbox with the variables HF templates expect.

Where a template comes from, first found: `--chat-template FILE`; the checkpoint's
`chat_template.jinja`; the `chat_template` of its `tokenizer_config.json` (a string, or a list of
named templates, of which "default"). A model with none cannot serve chat requests.

Rendering follows transformers' `apply_chat_template(..., tokenize=False)`: Jinja's
ImmutableSandboxedEnvironment (a template cannot reach Python objects' internals or change its
inputs) with trim_blocks and lstrip_blocks, the loop controls, a `tojson` that keeps non-ASCII
text, `raise_exception(message)`, `strftime_now(format)`, the `{% generation %}` tag, and the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) as strings.
"""
import datetime
import json
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused these messages (its raise_exception) or failed on them."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:  # at start-up, not at the first chat request
            raise ChatTemplateError(f"the chat template does not compile: {e} (line {e.lineno})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None


def load_chat_template(checkpoint: str | Path | None, override: str | Path | None = None) -> ChatTemplate | None:
    """The template of a checkpoint directory (or the override file), or None when there is none."""
    directory = Path(checkpoint) if checkpoint is not None else None
    config = _read_json(directory / "tokenizer_config.json") if directory is not None else {}
    source = _source(directory, config, override)
    if source is None:
        return None
    return ChatTemplate(source, special_tokens_of(directory, config))


def special_tokens_of(directory: Path | None, config: dict) -> dict[str, str]:
    """The special tokens' strings from tokenizer_config.json, else special_tokens_map.json."""
    found = {}
    fallback = _read_json(directory / "special_tokens_map.json") if directory is not None else {}
    for name in SPECIAL_TOKENS:
        value = config.get(name, fallback.get(name))
        if isinstance(value, dict):  # an AddedToken saved as {"content": ..., "lstrip": ...}
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def _source(directory: Path | None, config: dict, override) -> str | None:
    if override is not None:
        return Path(override).read_text()
    if directory is not None and (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return env


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise ChatTemplateError(message)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    keeps its body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)
