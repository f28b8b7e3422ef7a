"""The model families the engine hooks cover, each with its position scheme and its proof.

Theory of operation: the hooks rewrite what a model's forward reads — RoPE positions (the 1D
offset of ``positions.py``, the maintained 3-D tensor of ``mrope.py``), compacted KV blocks,
multimodal offsets and encoder-cache entries, rotated keys. Whether that still computes what the
model computes is a property of the model family (its position function, its attention layout,
how its placeholders map to features), and it is only known where a test compares a session
with transformers' own forward of the same weights (the masked dense oracle of
docs/architecture.md). So a family is served only if it is in this table, which names the test
that proves it; any other family is refused, with its name and the reason, when the server
starts (``realtime/hub.py``) and when a bounded session reaches the scheduler
(``session_scheduler.py``), never served on a guess.

A family is keyed by the architecture vLLM instantiates (``config.json``'s ``architectures``).
The position scheme is checked against the engine too: a covered architecture whose config
asks for the other scheme (e.g. mRoPE on a Llama) is refused.

This table is the one place these facts live: the README's family table is generated from it
(`readme_table`, checked by tests/retention/test_model_families.py), and the server reads
whether a family's video sessions can be stored from its `stores_frames` column. The module is
pure (no vLLM import), so the serving layer may read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from retention.vllm_adapter.errors import VLLMAdapterError

PositionScheme = Literal["1D", "mRoPE"]


@dataclass(frozen=True)
class ModelFamily:
    """One covered family: the architecture vLLM serves it with, and what proves it."""

    architecture: str
    family: str
    positions: PositionScheme
    proven_by: tuple[str, ...]
    """Test modules (repository paths) whose oracles run sessions of this family."""
    note: str = ""
    scheme_note: str = ""
    """What the README's positions column adds to the scheme."""
    media: bool = True
    """Whether its sessions carry images or clips (a text family has no video sessions)."""
    stores_frames: bool = False
    """Whether its video sessions are stored (rebuilt elsewhere from their frames). Only where
    frames are one run of one placeholder token each (images and clips alike), so a rebuild can
    pass them again from single pads (realtime/engine_session.media_prompt), and a test rebuilds
    one (tests/retention/test_restore_video.py, the default model). Qwen2.5-VL has the same
    layout but scales a clip's temporal positions, and no test rebuilds one yet; Qwen3-VL writes
    a clip's timestamps between its frames' runs; SmolVLM splits an image into tiles with their
    own tokens. Their video sessions stay resumable on their own replica only."""


COVERED_FAMILIES: Final[tuple[ModelFamily, ...]] = (
    ModelFamily(
        "LlamaForCausalLM",
        "Llama (text; SmolLM2)",
        "1D",
        (
            "tests/retention/test_text_retention.py",
            "tests/retention/test_rotation_consolidation.py",
            "tests/retention/test_preemption.py",
        ),
        media=False,
    ),
    ModelFamily(
        "Qwen2VLForConditionalGeneration",
        "Qwen2-VL",
        "mRoPE",
        (
            "tests/retention/test_video_retention.py",
            "tests/retention/test_video_preemption.py",
            "tests/retention/test_mrope.py",
        ),
        stores_frames=True,
    ),
    ModelFamily(
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2.5-VL",
        "mRoPE",
        ("tests/retention/test_mrope_families.py",),
        "temporal scaling of clips (second_per_grid_ts x tokens_per_second)",
        scheme_note="temporal scaling",
    ),
    ModelFamily(
        "Qwen3VLForConditionalGeneration",
        "Qwen3-VL",
        "mRoPE",
        ("tests/retention/test_mrope_families.py",),
        "interleaved mRoPE, deepstack features, timestamps as text",
        scheme_note="interleaved",
    ),
    ModelFamily(
        "SmolVLMForConditionalGeneration",
        "SmolVLM (Idefics3 vision + Llama)",
        "1D",
        ("tests/retention/test_smolvlm_retention.py",),
        "images with their splitting tokens; no clips (vLLM serves SmolVLM with images only)",
        scheme_note="images with splitting tokens",
    ),
    ModelFamily(
        "Idefics3ForConditionalGeneration",
        "Idefics3",
        "1D",
        ("tests/retention/test_smolvlm_retention.py",),
        "vLLM's SmolVLM model is this class with SmolVLM's processor: the same hooks run",
        scheme_note="vLLM's SmolVLM is this class",
    ),
)

FAMILIES: Final[dict[str, ModelFamily]] = {f.architecture: f for f in COVERED_FAMILIES}


class UncoveredModelFamily(VLLMAdapterError, RuntimeError):
    """The served model's family is not one the engine hooks are proven on."""


def stores_frames(architectures: Sequence[str] | None) -> bool:
    """Whether a model of these architectures has its video sessions stored."""
    return any(FAMILIES[a].stores_frames for a in architectures or () if a in FAMILIES)


README_HEADER: Final = (
    "| family (vLLM architecture) | positions | proven by | video sessions stored |\n"
    "| --- | --- | --- | --- |"
)


def readme_table() -> str:
    """The README's family table, generated from `COVERED_FAMILIES`."""
    rows = [README_HEADER]
    for f in COVERED_FAMILIES:
        scheme = f"{f.positions}, {f.scheme_note}" if f.scheme_note else f.positions
        proofs = ", ".join(f"`{path}`" for path in f.proven_by)
        stored = "yes" if f.stores_frames else "no (resumable on its own replica)"
        stored = stored if f.media else "text only"
        rows.append(f"| {f.family} (`{f.architecture}`) | {scheme} | {proofs} | {stored} |")
    return "\n".join(rows)


def covered_names() -> str:
    return ", ".join(f"{f.family} ({f.positions})" for f in COVERED_FAMILIES)


def _why_not(hf_config: Any, uses_mrope: bool, multimodal: bool) -> str:
    """The most specific reason this family is not covered, from its config."""
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    layer_types = set(getattr(text, "layer_types", None) or ())
    if len(layer_types) > 1 or getattr(text, "sliding_window", None):
        kinds = ", ".join(sorted(layer_types)) or "sliding-window attention"
        return (
            f"its layers mix attention kinds ({kinds}): a hybrid KV cache, where one token "
            "range cannot be evicted across groups of different layouts"
        )
    if uses_mrope:
        return "its multimodal RoPE positions are not a scheme the mRoPE hooks were proven on"
    if multimodal:
        return (
            "its multimodal placeholders, encoder outputs and positions were never checked "
            "against the dense oracle"
        )
    return "no oracle test runs bounded sessions on it (positions, eviction, consolidation)"


def family_problem(
    architectures: Sequence[str] | None,
    *,
    uses_mrope: bool,
    multimodal: bool = False,
    hf_config: Any = None,
) -> str | None:
    """Why this model may not run bounded sessions (naming its family), or None if covered."""
    names = list(architectures or ())
    if len(names) != 1:
        return f"the model declares architectures {names}; exactly one covered family is served"
    (arch,) = names
    family = FAMILIES.get(arch)
    if family is None:
        model_type = getattr(hf_config, "model_type", None)
        label = f"{arch} (model_type {model_type!r})" if model_type else arch
        return (
            f"model family {label} is not covered by vllm-realtime's engine hooks: "
            f"{_why_not(hf_config, uses_mrope, multimodal)}. Covered: {covered_names()}"
        )
    wants = "mRoPE" if uses_mrope else "1D"
    if wants != family.positions:
        return (
            f"model family {family.family} ({arch}) is covered with {family.positions} "
            f"positions, but this checkpoint's config gives {wants} positions"
        )
    return None


def model_config_problem(model_config: Any) -> str | None:
    """`family_problem` for a vLLM ``ModelConfig``."""
    return family_problem(
        getattr(model_config, "architectures", None),
        uses_mrope=bool(getattr(model_config, "uses_mrope", False)),
        multimodal=bool(getattr(model_config, "is_multimodal_model", False)),
        hf_config=getattr(model_config, "hf_config", None),
    )


def check_model_family(model_config: Any) -> ModelFamily:
    """The covered family of a vLLM ``ModelConfig``; raises UncoveredModelFamily otherwise."""
    problem = model_config_problem(model_config)
    if problem is not None:
        raise UncoveredModelFamily(problem)
    return FAMILIES[model_config.architectures[0]]
