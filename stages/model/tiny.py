"""A tiny Qwen2-style causal LM and its tokenizer, built entirely in-process (no hub).

Used by tests and the CPU demo (docs/architecture.md). The tokenizer is a byte-level BPE trained
with the `tokenizers` library on a corpus generated here (arithmetic questions and answers, the
GSM8K instruction, simple English), using exactly Qwen2's normaliser (NFC), pre-tokeniser (Qwen2's
Split regex + ByteLevel) and ByteLevel decoder: transformers 5 rebuilds a Qwen2Tokenizer's pipeline
from those components on reload, so anything else would be silently swapped. The model is a
transformers Qwen2ForCausalLM with head_dim >= 32 (CPU vLLM kernels refuse smaller heads).

Determinism: the tokenizer depends only on `vocab_size`; the weights depend on `seed` and the
shape options, so the same options give byte-identical model.safetensors.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Qwen2's pre-tokeniser regex (transformers/models/qwen2/tokenization_qwen2.py). Digits are split
# one per token (\p{N}), as in Qwen2.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2-Instruct's ChatML layout, without the default system message (keeps prompts short).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
CORPUS_SEED = 1234  # the tokenizer is the same for every model seed

_WORDS = (
    "the a an is are was were be to of and in on at for with by from as it this that what which "
    "who how many much more less than each every total left after before add plus minus times "
    "divided sum difference product answer question number numbers think step first then so "
    "final result equals has have had buys sells gives gets makes spends pays costs dollars cents "
    "apples books pens cookies eggs hours minutes days weeks friends students people there her his "
    "their she he they we you i do does did not yes no can will would should if half twice per "
    "user assistant system hello please thanks"
).split()


@dataclass(frozen=True)
class TinyModelOptions:
    seed: int = 0
    init_std: float = 0.02  # config.initializer_range; use ~0.3 for varied greedy output
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    vocab_size: int = 512  # BPE target size (specials included)
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.head_dim < 32:
            raise ValueError(
                f"head_dim = hidden_size / num_attention_heads = {self.head_dim}; must be >= 32 "
                "(CPU vLLM kernels reject smaller heads)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size {self.vocab_size} < 300 (256 byte symbols + specials + merges)")


def training_corpus(n_lines: int = 4000, seed: int = CORPUS_SEED) -> list[str]:
    """Lines shaped like the prompts and answers the tiny model will see (arithmetic questions,
    ChatML turns, GSM8K-style text), so those tokenise compactly."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 10)))
        lines.append(f"What is {a} {op} {b}? Answer after ####.")
        lines.append(f"{a} {op} {b} = {value}. #### {value}")
        lines.append(f"{words.capitalize()}? {GSM8K_INSTRUCTION}")
        lines.append(f"user\n{words}\nassistant\n#### {value}\n")
    return lines


def train_tokenizer(vocab_size: int = 512):
    """A Qwen2Tokenizer whose BPE vocab and merges were trained here."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2Tokenizer

    backend = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(training_corpus(), trainer=trainer)
    vocab, merges = _vocab_and_merges(backend)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=32768,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _vocab_and_merges(backend) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The trained BPE model's vocab and merges, read from its JSON serialisation."""
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def build_tiny_model(tokenizer, options: TinyModelOptions):
    """A freshly initialised Qwen2ForCausalLM sized for `tokenizer`, seeded by options.seed."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    options.validate()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=options.hidden_size,
        intermediate_size=options.intermediate_size,
        num_hidden_layers=options.num_hidden_layers,
        num_attention_heads=options.num_attention_heads,
        num_key_value_heads=options.num_key_value_heads,
        head_dim=options.head_dim,
        max_position_embeddings=options.max_position_embeddings,
        initializer_range=options.init_std,
        tie_word_embeddings=options.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        use_sliding_window=False,
        max_window_layers=options.num_hidden_layers,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [
        tokenizer.convert_tokens_to_ids(IM_END),
        tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    ]
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    model.generation_config.bos_token_id = None
    return model.eval()


def save_tiny_model(out_dir, **options) -> Path:
    """Build the tiny model and tokenizer and write an HF folder (config.json, model.safetensors,
    generation_config.json, tokenizer files, chat template). Options: see TinyModelOptions."""
    opts = TinyModelOptions(**options)
    opts.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(opts.vocab_size)
    model = build_tiny_model(tokenizer, opts)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def safetensors_summary(model_dir) -> tuple[int, set, int]:
    """(parameters, dtypes, bytes) of the *.safetensors files of a folder, from their headers."""
    n_params, dtypes, size = 0, set(), 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        size += file.stat().st_size
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                n_params += count
                dtypes.add(tensor["dtype"])
    return n_params, dtypes, size


def describe(model_dir) -> str:
    """One line about a saved tiny model folder (reads config.json and the safetensors header)."""
    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text())
    n_params = safetensors_summary(folder)[0]
    return (
        f"tiny Qwen2 in {folder}: {n_params:,} params, vocab {config['vocab_size']}, "
        f"hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
        f"{config['num_attention_heads']} heads (head_dim {config['head_dim']}), "
        f"initializer_range {config['initializer_range']}"
    )
