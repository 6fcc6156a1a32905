"""decider-0.8b in the registry: the alias resolves to Mapika/decider-0.8b, and `caldrix fetch`
asks the hub for its decider_config.json beside the weights (the hub itself is replaced by a
stand-in for huggingface_hub.snapshot_download that filters a repository's file list with the
hub's own pattern matcher, then writes the chosen files into a fake cache)."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from caldrix.weights import commands, registry, source

# What a decider's repository may hold: the model, its tokenizer, the decider's own config, and
# things a server never reads (other exports, docs).
REPO_FILES = ["config.json", "decider_config.json", "generation_config.json", "model.safetensors",
              "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "README.md", ".gitattributes",
              "pytorch_model.bin", "onnx/model.onnx", "decider-0.8b-Q4_K_M.gguf"]
WANTED = {"config.json", "decider_config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json", "chat_template.jinja"}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake hub: records each snapshot_download call and writes what its patterns select into a
    fake Hugging Face cache; returns the list of (repo_id, files written)."""
    cache = tmp_path / "hf-hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    calls = []

    def snapshot_download(repo_id, *, allow_patterns=None, ignore_patterns=None, **kwargs):
        assert not kwargs, kwargs  # nothing else is asked of the hub
        chosen = set(filter_repo_objects(REPO_FILES, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snap = repo / "snapshots" / ("0" * 40)
        for name in chosen:
            (snap / name).parent.mkdir(parents=True, exist_ok=True)
            (snap / name).write_text(json.dumps({"model_type": "qwen3_5"}) if name == "config.json" else "x")
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text("0" * 40)
        calls.append((repo_id, chosen))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_the_alias_names_the_repository():
    entry = registry.lookup("decider-0.8b")
    assert (entry.repo_id, entry.architecture) == ("Mapika/decider-0.8b", "qwen3_5")
    assert registry.by_repo_id("mapika/DECIDER-0.8B") is entry


@pytest.mark.parametrize("name", ["decider-0.8b", "Mapika/decider-0.8b"])
def test_fetch_takes_decider_config_json_with_the_model(hub, capsys, name):
    assert commands.fetch(name) == 0
    [(repo_id, files)] = hub
    assert repo_id == "Mapika/decider-0.8b"
    assert files == WANTED
    assert "Mapika/decider-0.8b is on this machine" in capsys.readouterr().out
    # and the alias now serves from the cache, under the repository's name
    got = source.resolve("decider-0.8b")
    assert got.served_name == "Mapika/decider-0.8b" and (Path(got.path) / "decider_config.json").is_file()
