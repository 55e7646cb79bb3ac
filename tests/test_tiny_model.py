"""The tiny Qwen2-style model and its in-process tokenizer (stages/model/tiny.py)."""
import pytest

torch = pytest.importorskip("torch")
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Tokenizer  # noqa: E402

from stages.model.tiny import (  # noqa: E402
    CHAT_TEMPLATE, TinyModelOptions, build_tiny_model, save_tiny_model, train_tokenizer,
)

SAMPLES = [
    "What is 12 + 7? Answer after ####.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "  leading spaces\n\nand newlines\tand tabs  ",
    "café naïve 日本語 emoji 🙂",
    "#### 1,000",
    "<|im_start|>user\nhi<|im_end|>\n",
]
MESSAGES = [{"role": "user", "content": "What is 3 + 4? Answer after ####."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _ids(encoding):
    return encoding["input_ids"] if not isinstance(encoding, list) else encoding


def test_tokenizer_reload_round_trip(tiny_dir):
    built = train_tokenizer()
    reloaded = AutoTokenizer.from_pretrained(tiny_dir)
    assert isinstance(reloaded, Qwen2Tokenizer)
    assert len(reloaded) == len(built)
    # Qwen2's pipeline kept (transformers rebuilds it from these components on reload)
    assert str(reloaded.backend_tokenizer.pre_tokenizer) == str(built.backend_tokenizer.pre_tokenizer)
    assert "Split" in str(reloaded.backend_tokenizer.pre_tokenizer)
    assert str(reloaded.backend_tokenizer.normalizer) == "NFC()"
    for text in SAMPLES:
        ids = built(text)["input_ids"]
        assert reloaded(text)["input_ids"] == ids, text
        assert reloaded.decode(ids) == text
    assert reloaded.eos_token == "<|im_end|>" and reloaded.pad_token == "<|endoftext|>"
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(reloaded(token)["input_ids"]) == 1
    assert reloaded.chat_template == CHAT_TEMPLATE


def test_chat_template_same_after_reload_and_compact(tiny_dir):
    built = train_tokenizer()
    reloaded = AutoTokenizer.from_pretrained(tiny_dir)
    text = reloaded.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 3 + 4? Answer after ####.<|im_end|>\n<|im_start|>assistant\n"
    assert text == built.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = _ids(reloaded.apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert ids == _ids(built.apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert len(ids) <= 24  # the arithmetic prompt tokenises compactly


def test_model_reload_gives_identical_logits(tiny_dir):
    options = TinyModelOptions(seed=0)
    fresh = build_tiny_model(train_tokenizer(), options)
    reloaded = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    assert reloaded.config.head_dim >= 32 and reloaded.config.vocab_size == options.vocab_size
    ids = torch.tensor([[1, 5, 77, 300, 2, 9]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, reloaded(ids).logits)


def test_same_seed_same_bytes_other_seed_differs(tiny_dir, tmp_path):
    again = save_tiny_model(tmp_path / "again", seed=0)
    other = save_tiny_model(tmp_path / "other", seed=1)
    original = (tiny_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == original
    assert (again / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != original


def test_generate_runs_and_stops_on_eos(tmp_path):
    folder = save_tiny_model(tmp_path / "wide", seed=3, init_std=0.3)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, tokenizer.pad_token_id]
    ids = torch.tensor([_ids(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 12
    assert len(set(out[0, ids.shape[1]:].tolist())) > 1  # a larger init std varies greedy output


def test_options_reject_small_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        TinyModelOptions(hidden_size=64, num_attention_heads=4).validate()


def test_cli_model_tiny(tiny_dir, tmp_path, capsys):
    from flows.cli import main

    out = tmp_path / "cli"
    assert main(["model", "tiny", "--out", str(out), "--seed", "0"]) == 0
    assert (out / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    assert "vocab 512" in capsys.readouterr().out
    assert main(["model", "tiny", "--out", str(tmp_path / "bad"), "--num-heads", "4"]) == 2
    assert "head_dim" in capsys.readouterr().err


def test_decode_batch_gives_batch_decodes_strings(tiny_dir):
    """stages.model.models.decode_batch (the rollout's and the engine workers' decode) goes
    through the Rust tokenizer's batch decode only where that gives batch_decode's strings."""
    from stages.model.models import decode_batch, load_tokenizer

    tok = load_tokenizer(tiny_dir)
    ids = [_ids(tok(text)) + [tok.eos_token_id] for text in SAMPLES] + [[], [tok.eos_token_id]]
    assert tok.clean_up_tokenization_spaces is False  # the Rust path is the one taken
    for skip in (True, False):
        fast = decode_batch(tok, ids, skip_special_tokens=skip)
        assert fast == tok.batch_decode(ids, skip_special_tokens=skip)
        assert fast[:len(SAMPLES)] == ([text.replace("<|im_start|>", "").replace("<|im_end|>", "") for text in SAMPLES]
                                       if skip else [text + tok.eos_token for text in SAMPLES])
    tok.clean_up_tokenization_spaces = True  # the Python layer would change the text: its path
    assert decode_batch(tok, ids, skip_special_tokens=True) == tok.batch_decode(ids, skip_special_tokens=True)
