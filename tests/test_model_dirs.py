"""Hugging Face directories as users bring them: what transformers would compute otherwise is
refused by name, the files its index names are the files read, an incomplete directory is one
line, and a tokenizer with tokens the model has no row for cannot take the server down."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen3Config

from caldrix.models import model_type
from caldrix.models.llama import DecoderConfig
from caldrix.models.llama_load import load_decoder
from caldrix.weights.tensor_files import model_files
from reliability_util import tiny_smol
from server_harness import ServerProcess

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def config_dir(tmp_path, cfg, **rewrite):
    """A directory holding only cfg's config.json (what the config checks read), with `rewrite`
    applied to the JSON as a hand-edited checkpoint would have it."""
    cfg.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(rewrite)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("cfg, says", [
    (LlamaConfig(**SMALL, attention_bias=True), "unsupported attention_bias: true"),
    (LlamaConfig(**SMALL, mlp_bias=True), "unsupported mlp_bias: true"),
    (LlamaConfig(**SMALL, hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
    (Qwen3Config(**SMALL, attention_bias=True), "unsupported attention_bias: true"),
    (Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=0),
     "unsupported sliding-window attention"),
    (LlamaConfig(**SMALL, rope_scaling={"rope_type": "linear", "factor": 2.0}), "unsupported rope_type 'linear'"),
])
def test_a_field_that_changes_what_transformers_computes_is_refused_by_name(tmp_path, cfg, says):
    with pytest.raises(ValueError, match=says):
        DecoderConfig.from_dir(config_dir(tmp_path, cfg))


@pytest.mark.parametrize("cfg", [
    LlamaConfig(**SMALL),
    Qwen3Config(**SMALL),
    # transformers' Qwen3 attends fully on every layer without use_sliding_window, or when the
    # window starts past the last layer: what real Qwen3 checkpoints say
    Qwen3Config(**SMALL, use_sliding_window=False, sliding_window=4, max_window_layers=0),
    Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=2),
    LlamaConfig(**SMALL, hidden_act="swish"),  # transformers' other name for SiLU
])
def test_what_real_checkpoints_say_still_loads(tmp_path, cfg):
    assert DecoderConfig.from_dir(config_dir(tmp_path, cfg)).num_layers == 2


def test_model_type_decides_the_architecture_as_for_transformers(tmp_path):
    # A Mistral (sliding window 4) relabelled LlamaForCausalLM: transformers' Auto classes load
    # it as a Mistral, so serving it as a llama would drop the window.
    d = config_dir(tmp_path, MistralConfig(**SMALL, sliding_window=4), architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"unsupported architecture model_type 'mistral' \(architectures \['LlamaForCausalLM'\]\)"):
        model_type(d)
    with pytest.raises(ValueError, match="unsupported architecture"):
        DecoderConfig.from_dir(d)
    raw = json.loads((d / "config.json").read_text())
    del raw["model_type"]  # a config with class names only: they decide
    (d / "config.json").write_text(json.dumps(raw))
    assert model_type(d) == "llama"


def _tiny_llama(path, seed=0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()
    return model


def test_the_index_names_the_files_read_and_a_stray_shard_is_not_one(tmp_path):
    model = _tiny_llama(tmp_path)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    named = sorted(set(index["weight_map"].values()))
    assert len(named) >= 3
    # An older save's leftover shard, with another embedding under the same name.
    save_file({"model.embed_tokens.weight": torch.full((256, 32), 7.0)}, tmp_path / "model-99999-of-99999.safetensors")
    assert [f.name for f in model_files(tmp_path)] == named
    decoder = load_decoder(tmp_path, torch.float32)
    assert torch.equal(decoder.embed.weight, model.model.embed_tokens.weight)

    index["weight_map"]["model.norm.weight"] = "model-00077-of-00077.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="is incomplete: its model.safetensors.index.json maps weights to "
                                         "model-00077-of-00077.safetensors, which is not there"):
        model_files(tmp_path)


def test_a_directory_missing_a_weight_is_one_line_naming_it(tmp_path, smollm2_dir):
    model = _tiny_llama(tmp_path)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks the weight model.layers.1.mlp.down_proj.weight"):
        load_decoder(tmp_path, torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    run = subprocess.run([sys.executable, "-m", "caldrix", "run", str(tmp_path), "hi", "--max-tokens", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith(
        "lacks the weight model.layers.1.mlp.down_proj.weight, which its config.json calls for")


@pytest.fixture(scope="module")
def added_token_dir(tmp_path_factory, smollm2_dir):
    """The tiny SmolLM2-shaped model with one token added to its tokenizer and its embedding
    never resized: a fine-tune folder in a common state."""
    base = tiny_smol(tmp_path_factory.getbasetemp(), smollm2_dir)
    path = tmp_path_factory.mktemp("added-token")
    shutil.copytree(base, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.add_tokens(["zzznewtok"]) == 1
    tok.save_pretrained(path)
    return path, len(tok) - 1


def test_a_prompt_with_a_token_the_model_has_no_row_for_is_a_400_and_the_server_goes_on(added_token_dir):
    path, new_id = added_token_dir
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    assert new_id == vocab  # one past the embedding's last row
    with ServerProcess.start(path) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        assert f"note: the tokenizer has {vocab + 1} tokens and the model embeds {vocab}" in srv.stderr
        model = http.get("/v1/models").json()["data"][0]["id"]
        chat = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "say zzznewtok"}], "max_tokens": 2})
        text = http.post("/v1/completions", json={"model": model, "prompt": "zzznewtok", "max_tokens": 2})
        for r, param in ((chat, "messages"), (text, "prompt")):
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param
            assert err["message"].startswith(f"the prompt tokenizes to token id {vocab} ('zzznewtok'), which this "
                                             f"model has no embedding for (its vocabulary is 0 to {vocab - 1})")
        so = http.post("/v1/systemone", json={"model": model, "state": "a note on zzznewtok",
                                              "questions": {"ok": {"type": "noul", "instructions": "Is it fine?"}}})
        assert so.status_code == 400, so.text
        assert so.json()["error"]["param"] is None  # the model's fault, not a field's
        assert so.json()["error"]["message"].startswith(f"the prompt tokenizes to token id {vocab} ('zzznewtok')")
        assert http.get("/healthz").text == "ok"
        ok = http.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
