"""Chat and instruction rows as text, and which of that text is the answer (`dataset=chat`, and
`dpt-generate` on a chat run).

A row is a conversation (`messages`: a list of `{role, content}`) rendered by a chat template
(Jinja, as transformers renders one: the model folder's, `dataset.chat_template`, or ChatML), or
a `prompt` and a `response` put into `dataset.template`'s two parts. The answer is what the
assistant says, with the end of its turn (so that a model learns to stop): its text found by
rendering the conversation up to each assistant turn and through it. A row becomes segments of
text, each an answer or not; each segment is tokenized on its own, so an answer's first token
never merges with the prompt's last.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from dpt.errors import DptError

ROLES = ("system", "user", "assistant")
ASSISTANT = "assistant"
# ChatML (Qwen's, OpenAI's): what a model folder without a template of its own is trained with.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROBE = "\x00"  # an answer's stand-in, to find the text a template puts after an answer


@dataclass(frozen=True)
class ChatFormat:
    """How rows become text: a chat template (rows with `messages`), or a prompt and a response
    template (`{prompt}`, `{response}`: rows with those fields). Kept in the run folder
    (chat_format.json): dpt-generate renders a prompt as training did."""

    template: str | None = None
    prompt: str | None = None
    response: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, record: dict[str, Any]) -> ChatFormat:
        return cls(**{k: record[k] for k in asdict(cls()) if k in record})

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return _compiled(self.template or CHATML).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token,
        )  # fmt: skip

    def generation_prompt(self, text: str) -> str:
        """`text` as the user's turn, up to where the answer starts (dpt-generate's prompt)."""
        if self.prompt is not None:
            return self.prompt.format(prompt=text)
        return self.render([{"role": "user", "content": text}], add_generation_prompt=True)

    def stop(self) -> str | None:
        """The text that ends an answer (`<|im_end|>`, an eos token), where there is one."""
        if self.prompt is not None:
            end = (self.response or "{response}").split("{response}", 1)[1]
        else:
            asked = [{"role": "user", "content": "q"}]
            before = self.render(asked, add_generation_prompt=True)
            after = self.render([*asked, {"role": ASSISTANT, "content": PROBE}])
            end = after[len(before) :].split(PROBE, 1)[-1]
        return end.strip() or end or None  # `<|im_end|>`; a newline where that is all


def segments(fmt: ChatFormat, row: dict[str, Any], where: str) -> list[tuple[str, bool]]:
    """The row's text in order, as (text, is_answer) pieces. `where`: the row, for errors
    (`dataset.root=chat.jsonl: row 7`)."""
    from jinja2.exceptions import TemplateError

    try:
        return _segments(fmt, row, where)
    except TemplateError as error:  # raise_exception's (roles must alternate), a syntax error
        raise DptError(f"{where}: the chat template fails on it ({error})") from error


def _segments(fmt: ChatFormat, row: dict[str, Any], where: str) -> list[tuple[str, bool]]:
    if fmt.prompt is None:
        if row.get("messages") is None:
            raise DptError(f"{where} has no 'messages' (or set dataset.template for rows of "
                           "'prompt' and 'response')")  # fmt: skip
        return _conversation(fmt, _checked_messages(row["messages"], where), where)
    for field in ("prompt", "response"):
        if row.get(field) is None:
            raise DptError(f"{where} has no '{field}' (dataset.template renders 'prompt' and "
                           "'response')")  # fmt: skip
    answer = (fmt.response or "{response}").format(response=row["response"])
    return [(fmt.prompt.format(prompt=row["prompt"]), False), (answer, True)]


def _checked_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if isinstance(messages, str):  # a CSV's column: the list as JSON
        try:
            messages = json.loads(messages)
        except ValueError:
            messages = None
    if not isinstance(messages, list) or not messages:
        raise DptError(f"{where}: 'messages' is not a list of {{role, content}}")
    for i, message in enumerate(messages):
        for field in ("role", "content"):
            if not isinstance(message, dict) or message.get(field) is None:
                raise DptError(f"{where}: messages[{i}] has no '{field}'")
        if message["role"] not in ROLES:
            raise DptError(f"{where}: messages[{i}] has the role '{message['role']}' (roles: "
                           f"{', '.join(ROLES)})")  # fmt: skip
    return [{"role": m["role"], "content": str(m["content"])} for m in messages]


def _conversation(
    fmt: ChatFormat, messages: list[dict[str, str]], where: str
) -> list[tuple[str, bool]]:
    """Each assistant turn's text: the conversation rendered up to it (with the generation
    prompt) and through it; the template must render turns one after another."""
    text = fmt.render(messages)
    pieces, done = [], 0
    for i, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        start = len(fmt.render(messages[:i], add_generation_prompt=True))
        end = len(fmt.render(messages[: i + 1]))
        if not (done <= start <= end and text.startswith(fmt.render(messages[: i + 1]))):
            raise DptError(f"{where}: the chat template does not render the conversation turn "
                           "by turn (a turn's text changes with what follows it)")  # fmt: skip
        pieces += [(text[done:start], False), (text[start:end], True)]
        done = end
    pieces.append((text[done:], False))
    return [(piece, answer) for piece, answer in pieces if piece]


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """A template compiled as transformers compiles chat templates (utils/chat_template_utils):
    sandboxed, trimmed blocks, `{% break %}`, `raise_exception`, `strftime_now` (Llama 3's
    templates), its `tojson` (unsorted, unescaped), `{% generation %}` blocks (rendered as
    they are: the answers are found by rendering prefixes)."""
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)  # fmt: skip

    def strftime_now(pattern: str) -> str:
        return datetime.now().strftime(pattern)

    extensions = [Generation, jinja2.ext.loopcontrols]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


def folder_format(tokenizer: str | None) -> ChatFormat | None:
    """The chat template and special tokens of a model folder (`dataset.tokenizer`, by default
    `model.path`): `chat_template.jinja`, else tokenizer_config.json's `chat_template`."""
    if tokenizer is None or not Path(tokenizer).is_dir():
        return None
    folder = Path(tokenizer)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    jinja = folder / "chat_template.jinja"
    template = jinja.read_text() if jinja.is_file() else config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return ChatFormat(template=template, bos_token=_token(config.get("bos_token")),
                      eos_token=_token(config.get("eos_token")))  # fmt: skip


def _token(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)
