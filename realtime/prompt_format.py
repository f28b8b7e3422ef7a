"""How a chunk's prompt is written for the served model: its turn delimiters and media placeholders.

A session is one long request fed a chunk at a time, so the server never renders a whole
conversation with the chat template: it writes each chunk's turns itself, with the delimiters
the template uses. `ChatFormat.from_template` finds them by rendering probe conversations whose
contents are sentinels and splitting the output around the sentinels. The embedded models
register their format (realtime/models); any other model's comes from its template, and a
template that cannot be split this way is refused at start-up (`ChatFormatError`), never
guessed. A model whose template writes no image placeholder serves text sessions only.

Published templates differ in ways the split allows for: contents read as lists of parts only
(SmolVLM), a conversation opened once rather than each turn (SmolVLM's `<|im_start|>`), a
generation prompt that is a prefix of a past reply's opening (`Assistant:` against
`Assistant: `), a user turn that opens differently when it starts with an image, and a default
system turn written when the conversation has none (Qwen2-VL, SmolLM2): the first chunk without
instructions starts with that `preamble`, so the prompt equals the template's own.

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
    preamble: str = ""
    """What a first chunk without instructions starts with: the template's default system turn
    or its conversation opening ("" when it writes none)."""
    media_user_open: str | None = None
    """The user turn's opening when the turn starts with media (None: `user_open`)."""

    def system_turn(self, instructions: str) -> str:
        return f"{self.system_open}{instructions}{self.system_close}"

    def opening(self, instructions: str | None) -> str:
        """What a session's first chunk starts with: its instructions' system turn, else the
        template's preamble. Counted at open and pinned with the first chunk."""
        return self.system_turn(instructions) if instructions else self.preamble

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
        first: bool = False,
        close_reply: bool = False,
        reply: bool = False,
    ) -> str:
        """One chunk: a first chunk's opening (`first`: its `instructions`' system turn, else
        the preamble) or the close of the previous reply's turn (`close_reply`), then a user
        turn with the media placeholder and `content`, then the open assistant turn if the
        chunk is answered."""
        parts: list[str] = []
        if first or instructions:
            parts.append(self.opening(instructions))
        elif close_reply:
            parts.append(self.assistant_close)
        if media is not None:
            parts += [self.media_user_open or self.user_open, self.placeholder(media)]
        else:
            parts.append(self.user_open)
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
        (the only thing this module could then do is guess). Contents are probed as strings,
        then as lists of text parts (templates that read lists only)."""
        try:
            turns = _split_turns(render, as_list=False)
        except ChatFormatError as exc:
            try:
                turns = _split_turns(render, as_list=True)
            except ChatFormatError as as_list:
                raise ChatFormatError(f"{exc}; with list contents: {as_list}") from None
        if strip_prefix:
            for key in ("system_open", "preamble"):
                if turns[key].startswith(strip_prefix):
                    turns[key] = turns[key][len(strip_prefix) :]
        if not (turns["system_open"] and turns["user_open"] and turns["assistant_open"]):
            raise ChatFormatError("the chat template writes no turn delimiters")
        user_open = turns["user_open"]
        image = _placeholder(render, "image")
        video = _placeholder(render, "video")
        if _media_open(user_open, image) is None:
            image = None  # what it trimmed is no part of the user turn's opening: no placeholder
        if _media_open(user_open, video) is None:
            video = None
        media_open = _media_open(user_open, image or video)
        if video is not None and _media_open(user_open, video) != media_open:
            video = None  # a clip's turn would open differently from an image's: images only
        return cls(
            **turns,
            image=image[1] if image else None,
            video=video[1] if video else None,
            media_user_open=media_open if media_open != user_open else None,
        )


def _content(text: str, as_list: bool) -> Any:
    return [{"type": "text", "text": text}] if as_list else text


def _split_turns(render: Renderer, *, as_list: bool) -> dict[str, str]:
    """The turn delimiters of the probe conversations, contents as strings or as lists."""
    system = {"role": "system", "content": _content(_SYSTEM, as_list)}
    user = {"role": "user", "content": _content(_USER, as_list)}
    assistant = {"role": "assistant", "content": _content(_ASSISTANT, as_list)}
    again = {"role": "user", "content": _content(_USER_AGAIN, as_list)}
    try:
        full = render([system, user, assistant, again], True)
        after_assistant = render([system, user, assistant], False)
        after_user = render([system, user], False)
        user_only = render([user], False)
    except Exception as exc:  # a template may raise anything (jinja, its own checks)
        raise ChatFormatError(f"the chat template cannot render a probe: {exc}") from exc
    cuts = _cut(full, [_SYSTEM, _USER, _ASSISTANT, _USER_AGAIN])
    system_open, system_to_user, user_to_assistant, assistant_to_user, generation = cuts
    user_close = _tail(after_user, full, _USER)
    assistant_close = _tail(after_assistant, full, _ASSISTANT)
    reply_open = _after_prefix(user_to_assistant, user_close, "the user turn's close")
    user_open = _after_prefix(assistant_to_user, assistant_close, "the reply turn's close")
    if not system_to_user.endswith(user_open):
        raise ChatFormatError("the user turn opens differently after a system turn")
    system_close = system_to_user[: len(system_to_user) - len(user_open)]
    # The reply fills the generation prompt, which may be a prefix of a past reply's opening
    # (SmolVLM: `Assistant:` against `Assistant: `; the model writes the space itself).
    assistant_open = generation[len(user_close) :]
    if not (
        generation.startswith(user_close)
        and assistant_open
        and reply_open.startswith(assistant_open)
    ):
        raise ChatFormatError("the generation prompt is not the assistant turn's opening")
    if user_only.count(_USER) != 1 or not user_only.split(_USER)[0].endswith(user_open):
        raise ChatFormatError("the user turn opens differently without a system turn")
    head = user_only.split(_USER)[0]
    return {
        "system_open": system_open,
        "system_close": system_close,
        "user_open": user_open,
        "user_close": user_close,
        "assistant_open": assistant_open,
        "assistant_close": assistant_close,
        "preamble": head[: len(head) - len(user_open)],
    }


def _media_open(user_open: str, found: tuple[str, str] | None) -> str | None:
    """The user turn's opening before media, from `_placeholder`'s trimmed tail."""
    if found is None:
        return None
    trim = found[0]
    if trim and not user_open.endswith(trim):
        return None
    return user_open[: len(user_open) - len(trim)]


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


def _placeholder(render: Renderer, kind: MediaKind) -> tuple[str, str] | None:
    """What the template writes for one image (or clip) before a user turn's text, with what it
    no longer writes of the user turn's opening then (SmolVLM: `User: ` becomes `User:<image>`,
    so " " is trimmed); None when it writes nothing, or cannot render a list content."""
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
    if tail != plain[cut + len(_USER) :]:
        return None
    prefix = plain[:cut]
    n = 0
    while n < min(len(head), len(prefix)) and head[n] == prefix[n]:
        n += 1
    common = head[:n]
    placeholder = head[len(common) :]
    if not placeholder:
        return None
    return plain[len(common) : cut], placeholder
