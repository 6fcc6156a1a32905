"""Shared by the vision tests: a SmolVLM tokenizer built from SmolLM2's, offline."""

from __future__ import annotations

from pathlib import Path

# SmolVLM-256M-Instruct's chat template (its processor_config.json / chat_template.json).
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def smolvlm_tokenizer(smollm2_dir: Path):
    """SmolLM2's tokenizer (SmolVLM's base vocabulary, 49152 tokens) with SmolVLM's added tokens
    at SmolVLM's ids: <global-img> 49152, the 36 <row_r_col_c>, <fake_token_around_image>
    49189, <image> 49190, reserved tokens, <end_of_utterance> 49279; and SmolVLM's template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tok) == 49152
    added = ["<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    added += ["<fake_token_around_image>", "<image>"] + [f"<|reserved_special_token_{i}|>" for i in range(88)]
    added += ["<end_of_utterance>"]
    tok.add_special_tokens({"additional_special_tokens": added})
    assert tok.convert_tokens_to_ids("<image>") == 49190 and tok.convert_tokens_to_ids("<end_of_utterance>") == 49279
    tok.chat_template = SMOLVLM_CHAT_TEMPLATE
    return tok
