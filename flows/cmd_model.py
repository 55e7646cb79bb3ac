"""`stagerl model tiny --out DIR`: build the tiny Qwen2-style model and its tokenizer in-process
(no hub) and write them as an HF folder (stages/tiny_model.py)."""
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser("model", help="build models without a hub")
    kinds = parser.add_subparsers(dest="model_command", required=True, metavar="KIND")
    tiny = kinds.add_parser("tiny", help="a tiny Qwen2-style causal LM + BPE tokenizer (HF folder)")
    tiny.add_argument("--out", required=True, help="output folder")
    tiny.add_argument("--seed", type=int, default=0, help="weight-init seed (default 0)")
    tiny.add_argument("--init-std", type=float, default=0.02,
                      help="initializer_range (default 0.02; ~0.3 gives varied greedy output)")
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--intermediate-size", type=int, default=128)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--num-heads", type=int, default=2, help="head_dim = hidden / heads must be >= 32")
    tiny.add_argument("--num-kv-heads", type=int, default=None, help="default: --num-heads")
    tiny.add_argument("--vocab-size", type=int, default=512, help="BPE vocab size (specials included)")
    tiny.set_defaults(func=run_tiny)


def run_tiny(args) -> int:
    from stages.tiny_model import TinyModelOptions, describe, save_tiny_model

    options = dict(
        seed=args.seed,
        init_std=args.init_std,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads or args.num_heads,
        vocab_size=args.vocab_size,
    )
    try:
        TinyModelOptions(**options).validate()
    except ValueError as exc:
        print(f"stagerl model tiny: {exc}", file=sys.stderr)
        return 2
    out = save_tiny_model(args.out, **options)
    print(describe(out))
    return 0
