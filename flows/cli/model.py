"""`stagerl model tiny --out DIR`: build the tiny Qwen2-style model and its tokenizer in-process
(no hub) and write them as an HF folder (stages/model/tiny.py).
`stagerl model qwen2.5-0.5b --out DIR [--dtype bf16|fp32]` (and the other names of
stages/model/shapes.py ARCHITECTURES): a model of that real architecture with random weights, for
checking memory and speed at real size without a download (real weights go in by path)."""
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
    tiny.add_argument("--max-positions", type=int, default=1024,
                      help="max_position_embeddings: the longest prompt + response (default 1024)")
    tiny.set_defaults(func=run_tiny)
    from stages.model.shapes import ARCHITECTURES, DTYPES

    for name in ARCHITECTURES:
        shaped = kinds.add_parser(name, help=f"{name}'s architecture with random weights and the tiny "
                                               f"tokenizer (HF folder; real weights: point model.path at them)")
        shaped.add_argument("--out", required=True, help="output folder")
        shaped.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="weight dtype (default bf16)")
        shaped.add_argument("--seed", type=int, default=0, help="weight-init seed (default 0)")
        shaped.add_argument("--num-layers", type=int, default=None,
                            help="fewer layers of the same widths (default: the architecture's)")
        shaped.set_defaults(func=run_shaped, architecture=name)


def run_tiny(args) -> int:
    from stages.model.tiny import TinyModelOptions, describe, save_tiny_model

    options = dict(
        seed=args.seed,
        init_std=args.init_std,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads or args.num_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_positions,
    )
    try:
        TinyModelOptions(**options).validate()
    except ValueError as exc:
        print(f"stagerl model tiny: {exc}", file=sys.stderr)
        return 2
    out = save_tiny_model(args.out, **options)
    print(describe(out))
    return 0


def run_shaped(args) -> int:
    from stages.model.shapes import describe, parameter_count, save_shaped_model

    try:
        parameter_count(args.architecture, args.num_layers)  # checks the arguments, costs nothing
    except ValueError as exc:
        print(f"stagerl model {args.architecture}: {exc}", file=sys.stderr)
        return 2
    out = save_shaped_model(args.architecture, args.out, args.dtype, args.seed, args.num_layers)
    print(describe(args.architecture, out))
    return 0
