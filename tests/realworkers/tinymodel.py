"""Makes the tiny model of the real-worker tests: `python tinymodel.py OUT RECIPE_JSON`.

Run by the modelkit venv's python (.ci/real-workers: torch, transformers, tokenizers, gguf),
never imported by the tests (their venv has none of those). Writes into OUT:
  hf/          a random-weight Llama (transformers' save_pretrained) and a byte-level BPE
               tokenizer trained here on generated text, with a chat template: for vLLM
  model.gguf   the same weights and vocabulary in llama.cpp's format (the gguf package)
No download: this machine reaches no model hub, so the tests make what they serve.
Random weights answer gibberish; the tests only count tokens.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS = "<s>", "</s>"
# The chat template both servers render (vLLM from the tokenizer's config, llama.cpp from
# the GGUF's tokenizer.chat_template, with its jinja engine).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus(seed: int, lines: int) -> list[str]:
    """Generated text: syllables into words into lines, enough for the BPE to fill its
    vocabulary (English-like so that test prompts tokenize into several tokens)."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(3000)]
    words += ["one", "two", "three", "four", "hello", "world", "the", "a", "of", "to", "is"]
    return [" ".join(rng.choices(words, k=12)) for _ in range(lines)]


def tokenizer(recipe: dict[str, Any]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe["vocab_size"],
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(recipe["seed"], 20000), trainer)
    return tok


def save_hf(out: Path, recipe: dict[str, Any], tok: Tokenizer) -> LlamaForCausalLM:
    """The model and tokenizer in Hugging Face's layout; the vocabulary is the tokenizer's
    own size, so that no id the model can pick lacks a token."""
    torch.manual_seed(recipe["seed"])
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=recipe["hidden"],
        intermediate_size=recipe["intermediate"],
        num_hidden_layers=recipe["layers"],
        num_attention_heads=recipe["heads"],
        num_key_value_heads=recipe["heads"],
        max_position_embeddings=recipe["context"],
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = recipe["context"]
    fast.save_pretrained(out)
    _template_in_config(out)
    return model


def _template_in_config(out: Path) -> None:
    """The chat template also in tokenizer_config.json (transformers 5 writes it to
    chat_template.jinja only): older readers look there."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2))


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Q and K rows from Hugging Face's rotary layout to llama.cpp's (as its converter)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def gguf_tensors(model: LlamaForCausalLM, heads: int) -> dict[str, np.ndarray]:
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    out: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().to(torch.float32).numpy()
        if name in names:
            out[names[name]] = array
            continue
        _, _, layer, *rest = name.split(".")
        part = ".".join(rest[:-1])
        if part in ("self_attn.q_proj", "self_attn.k_proj"):
            array = _permute(array, heads)
        out[f"blk.{layer}.{per_layer[part]}.weight"] = array
    return out


def save_gguf(path: Path, recipe: dict[str, Any], tok: Tokenizer, model: Any) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("gateway-tiny-llama")
    writer.add_context_length(recipe["context"])
    writer.add_embedding_length(recipe["hidden"])
    writer.add_block_count(recipe["layers"])
    writer.add_feed_forward_length(recipe["intermediate"])
    writer.add_head_count(recipe["heads"])
    writer.add_head_count_kv(recipe["heads"])
    writer.add_rope_dimension_count(recipe["hidden"] // recipe["heads"])
    writer.add_layer_norm_rms_eps(model.config.rms_norm_eps)
    writer.add_rope_freq_base(float(model.config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(tok.get_vocab_size())
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _gguf_vocab(writer, tok)
    for name, array in gguf_tensors(model, recipe["heads"]).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_vocab(writer: gguf.GGUFWriter, tok: Tokenizer) -> None:
    """The BPE as llama.cpp's `gpt2` tokenizer with GPT-2's pre-tokenizer (the byte-level
    one trained above): tokens by id, their types, the merges, and the chat template."""
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {BOS, EOS}
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    merges = json.loads(tok.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([control if t in special else normal for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(vocab[BOS])
    writer.add_eos_token_id(vocab[EOS])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def main(out: Path, recipe: dict[str, Any]) -> None:
    tok = tokenizer(recipe)
    model = save_hf(out / "hf", recipe, tok)
    save_gguf(out / "model.gguf", recipe, tok, model)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
