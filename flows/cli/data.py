"""`stagerl data arith|gsm8k`: write datasets in verl's RL parquet schema (stages/data/tools.py)."""
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="build datasets in verl's RL parquet schema")
    kinds = parser.add_subparsers(dest="data_command", required=True, metavar="KIND")

    arith = kinds.add_parser("arith", help="synthetic arithmetic questions (data_source stagerl/arith)")
    arith.add_argument("--out", required=True, help="output parquet file")
    arith.add_argument("--n", type=int, default=1000, help="number of rows (default 1000)")
    arith.add_argument("--seed", type=int, default=0)
    arith.add_argument("--difficulty", type=int, default=1, choices=[1, 2, 3, 4, 5],
                       help="1: single-digit +; 2: two-digit +/-; 3: adds *; 4: three-digit; "
                            "5: three operands (see stages/data/tools.py)")
    arith.add_argument("--split", default="train", choices=["train", "test"])
    arith.set_defaults(func=run_arith)

    gsm8k = kinds.add_parser("gsm8k", help="convert GSM8K (HF form: jsonl/parquet) to verl's rows")
    gsm8k.add_argument("--input", required=True, help="local .jsonl or .parquet with question, answer")
    gsm8k.add_argument("--out", required=True, help="output parquet file")
    gsm8k.add_argument("--split", default="train", choices=["train", "test"])
    gsm8k.add_argument("--agent", default=None, choices=["tool_agent"],
                       help="tool_agent: the rows of verl's gsm8k_tool_agent_loop.py (system prompt, "
                            "agent_name, tools_kwargs for calc_gsm8k_reward), for its multi-turn scripts")
    gsm8k.set_defaults(func=run_gsm8k)


def run_arith(args) -> int:
    from stages.data.tools import write_arith_dataset

    out = write_arith_dataset(args.out, n=args.n, seed=args.seed, difficulty=args.difficulty,
                              split=args.split)
    print(f"wrote {args.n} rows to {out}")
    return 0


def run_gsm8k(args) -> int:
    from stages.data.tools import convert_gsm8k, read_records

    try:
        out = convert_gsm8k(args.input, args.out, split=args.split, agent=args.agent)
    except (ValueError, FileNotFoundError) as exc:
        print(f"stagerl data gsm8k: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(read_records(out))} rows to {out}")
    return 0
