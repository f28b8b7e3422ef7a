"""How a chunk's prompt is written for the served model: its turn delimiters and media placeholders.

A session is one long request fed a chunk at a time, so the server never renders a whole
conversation with the chat template: it writes each chunk's turns itself, with the delimiters
the template uses. `ChatFormat.from_template` finds them by rendering probe conversations whose
contents are sentinels and splitting the output around the sentinels. The embedded models
register their format (realtime/models); any other model's comes from its template, and a
template that cannot be split this way is refused at start-up (`ChatFormatError`), never
guessed. A model whose template writes no image placeholder serves text sessions only.

Pure: rendering is a callable given by the caller (the tokenizer's `apply_chat_template`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Renderer = Callable[[list[dict[str, Any]], bool], str]
"""Renders messages with the model's chat template; the flag is `add_generation_prompt`."""

MediaKind = Literal["image", "video"]

# Alphanumeric, so that templates that trim or escape contents leave them intact.
_SYSTEM = "SentinelSystemQx7"
_USER = "SentinelUserQx7"
_ASSISTANT = "SentinelAssistantQx7"
_USER_AGAIN = "SentinelUserAgainQx7"


class ChatFormatError(ValueError):
    """The model's chat template cannot be split into turn delimiters."""


@dataclass(frozen=True)
class ChatFormat:
    """The strings around each turn of the model's chat format, and its media placeholders."""

    system_open: str
    system_close: str
    user_open: str
    user_close: str
    assistant_open: str
    """Also the generation prompt: an answered chunk ends with it and the reply fills it."""
    assistant_close: str
    """What a chunk after an answered one starts with: it closes the reply's turn."""
    image: str | None = None
    """The text vLLM's processor expands into an image's tokens; None: no images."""
    video: str | None = None
    """The same for a clip; None: no clips."""

    def system_turn(self, instructions: str) -> str:
        return f"{self.system_open}{instructions}{self.system_close}"

    def placeholder(self, kind: MediaKind) -> str:
        text = self.image if kind == "image" else self.video
        if text is None:
            raise ChatFormatError(f"the model's chat template writes no {kind} placeholder")
        return text

    def chunk(
        self,
        content: str,
        *,
        media: MediaKind | None = None,
        instructions: str | None = None,
        close_reply: bool = False,
        reply: bool = False,
    ) -> str:
        """One chunk: the instructions' system turn (`instructions`: a first chunk's) or the
        close of the previous reply's turn (`close_reply`), then a user turn with the media
        placeholder and `content`, then the open assistant turn if the chunk is answered."""
        parts: list[str] = []
        if instructions:
            parts.append(self.system_turn(instructions))
        elif close_reply:
            parts.append(self.assistant_close)
        parts.append(self.user_open)
        if media is not None:
            parts.append(self.placeholder(media))
        parts += [content, self.user_close]
        if reply:
            parts.append(self.assistant_open)
        return "".join(parts)

    @classmethod
    def from_template(cls, render: Renderer, *, strip_prefix: str | None = None) -> ChatFormat:
        """The format the template renders, found from probe conversations.

        `strip_prefix`: text the template puts before the first turn that the tokenizer adds by
        itself (a BOS token), so it is not written twice. Raises ChatFormatError when the
        template renders turns that do not split into the same open/close strings everywhere
        (the only thing this module could then do is guess)."""
        system = {"role": "system", "content": _SYSTEM}
        user = {"role": "user", "content": _USER}
        assistant = {"role": "assistant", "content": _ASSISTANT}
        again = {"role": "user", "content": _USER_AGAIN}
        try:
            full = render([system, user, assistant, again], True)
            after_assistant = render([system, user, assistant], False)
            after_user = render([system, user], False)
        except Exception as exc:  # a template may raise anything (jinja, its own checks)
            raise ChatFormatError(f"the chat template cannot render a probe: {exc}") from exc
        cuts = _cut(full, [_SYSTEM, _USER, _ASSISTANT, _USER_AGAIN])
        system_open, system_to_user, user_to_assistant, assistant_to_user, generation = cuts
        user_close = _tail(after_user, full, _USER)
        assistant_close = _tail(after_assistant, full, _ASSISTANT)
        assistant_open = _after_prefix(user_to_assistant, user_close, "the user turn's close")
        user_open = _after_prefix(assistant_to_user, assistant_close, "the reply turn's close")
        if not system_to_user.endswith(user_open):
            raise ChatFormatError("the user turn opens differently after a system turn")
        system_close = system_to_user[: len(system_to_user) - len(user_open)]
        if generation != user_close + assistant_open:
            raise ChatFormatError("the generation prompt is not the assistant turn's opening")
        if strip_prefix and system_open.startswith(strip_prefix):
            system_open = system_open[len(strip_prefix) :]
        if not (system_open and user_open and assistant_open):
            raise ChatFormatError("the chat template writes no turn delimiters")
        return cls(
            system_open=system_open,
            system_close=system_close,
            user_open=user_open,
            user_close=user_close,
            assistant_open=assistant_open,
            assistant_close=assistant_close,
            image=_placeholder(render, "image"),
            video=_placeholder(render, "video"),
        )


def _cut(text: str, sentinels: list[str]) -> list[str]:
    """`text` split around each sentinel, which must occur once each, in this order."""
    pieces: list[str] = []
    rest = text
    for sentinel in sentinels:
        if text.count(sentinel) != 1 or sentinel not in rest:
            raise ChatFormatError(
                f"the chat template does not write a message's content once ({sentinel})"
            )
        head, rest = rest.split(sentinel)
        pieces.append(head)
    return [*pieces, rest]


def _tail(shorter: str, full: str, last: str) -> str:
    """What `shorter` (a conversation ending with the message `last`) writes after `last`,
    checking it renders the same as `full` up to there."""
    end = full.index(last) + len(last)
    if shorter.count(last) != 1 or shorter[: shorter.index(last) + len(last)] != full[:end]:
        raise ChatFormatError("the chat template renders a turn differently when it is last")
    return shorter[end:]


def _after_prefix(text: str, prefix: str, what: str) -> str:
    if not text.startswith(prefix):
        raise ChatFormatError(f"the chat template closes turns inconsistently ({what})")
    return text[len(prefix) :]


def _placeholder(render: Renderer, kind: MediaKind) -> str | None:
    """What the template writes for one image (or clip) before a user turn's text; None when
    it writes nothing, or cannot render a list content (a text-only template)."""
    text_only = [{"role": "user", "content": [{"type": "text", "text": _USER}]}]
    with_media = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": _USER}]}]
    try:
        plain = render(text_only, False)
        rendered = render(with_media, False)
    except Exception:  # a text-only template may fail on list contents
        return None
    if plain.count(_USER) != 1 or rendered.count(_USER) != 1:
        return None
    cut = plain.index(_USER)
    head, tail = rendered.split(_USER)
    if tail != plain[cut + len(_USER) :] or not head.startswith(plain[:cut]):
        return None
    return head[cut:] or None
