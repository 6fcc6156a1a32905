"""The registry of cli.md: the models caldrix knows by a short alias.

The repo id is also the served name. Sizes are approximate download sizes of the weights
(the safetensors files of the repository), for `caldrix models` to show before a fetch.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class RegistryEntry:
    alias: str
    repo_id: str  # the Hugging Face repository, and the name the server answers to
    architecture: str  # the config's model_type
    notes: str
    approx_bytes: int

    @property
    def size(self) -> str:
        """The approximate size for people, e.g. "270 MB" or "1.5 GB"."""
        mb = self.approx_bytes / 1e6
        return f"{mb / 1000:.1f} GB" if mb >= 1000 else f"{mb:.0f} MB"


ENTRIES: tuple[RegistryEntry, ...] = (
    RegistryEntry(
        "smollm2-135m-instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "llama",
        "the embedded default",
        269_000_000,
    ),
    RegistryEntry(
        "smollm2-135m",
        "HuggingFaceTB/SmolLM2-135M",
        "llama",
        "base model: no chat template, so chat is refused",
        269_000_000,
    ),
    RegistryEntry(
        "qwen3-0.6b",
        "Qwen/Qwen3-0.6B",
        "qwen3",
        "thinking model; the seed's examples were captured on it",
        1_500_000_000,
    ),
    RegistryEntry(
        "smolvlm-256m",
        "HuggingFaceTB/SmolVLM-256M-Instruct",
        "idefics3",
        "SigLIP vision tower + llama text; images, on the cpu lane only",
        513_000_000,
    ),
    RegistryEntry(
        "decider-0.8b",
        "Mapika/decider-0.8b",
        "qwen3_5",
        "hybrid gated delta-net + full attention; a decider (decider_config.json); "
        "cpu lane and --backend host only",
        1_700_000_000,
    ),
)

DEFAULT_ALIAS = "smollm2-135m-instruct"


def lookup(name: str) -> RegistryEntry | None:
    """The entry whose alias is `name` (any case), or None."""
    name = name.lower()
    return next((e for e in ENTRIES if e.alias == name), None)


def by_repo_id(repo_id: str) -> RegistryEntry | None:
    """The entry for a repo id (any case, as the hub treats them), or None."""
    repo_id = repo_id.lower()
    return next((e for e in ENTRIES if e.repo_id.lower() == repo_id), None)
