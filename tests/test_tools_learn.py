"""The calculator task learns (issue 36: "`stagerl train --config tools-tiny-cpu` learns on the CPU
... and `stagerl query "select tool, count(*), avg(latency) from turns group by tool"` answers").

A real run (`stagerl train --config tools-tiny-cpu` against a real Prefect server): the demo's
tiny model (flows.demo.MODEL_OPTIONS), the calculator task's rows (stages.data.tools
make_tool_arith_dataset: verl's tool-agent schema, single-digit products) and the multi-turn warm
start on their demonstrations (whole trajectories, the calculator's real responses masked), then
GRPO through the real stages with the hf engine and the real calculator in its tool workers. The
config as shipped (24 prompts x 8 per step at temperature 1.3) but a warm start of 16-row batches
and STEPS steps. The reward and the
correct-tool-use rate are read back from the stored rollout and reward manifests; the turns table
answers a query through the CLI."""
import json

import pytest

from test_flows import PROJECT, server, stagerl  # noqa: F401 (fixtures)
from flows.cli import main
from storage.artifacts import read_file, read_manifest
from storage.layout import RunLayout
from storage.store import Store

STEPS = 10


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    from flows.demo import MODEL_OPTIONS
    from stages.data.tools import make_tool_arith_dataset, write_tool_rows
    from stages.model.tiny import save_tiny_model

    base = tmp_path_factory.mktemp("tools")
    save_tiny_model(base / "model", **MODEL_OPTIONS)
    write_tool_rows(make_tool_arith_dataset(1000, seed=1), base / "train.parquet")
    write_tool_rows(make_tool_arith_dataset(8, seed=2, split="test"), base / "test.parquet")
    return base


def small_overrides(base, root) -> list:
    return [f"actor_rollout_ref.model.path={base}/model", f"data.train_files={base}/train.parquet",
            f"data.val_files={base}/test.parquet", f"storage.root={root}", f"storage.cache_dir={root}-cache",
            "reward.num_workers=1", "orchestration.retry_delay_s=0.5", "warmstart.batch_size=16",
            f"trainer.total_training_steps={STEPS}"]


def test_the_calculator_task_learns_and_the_turns_table_answers(server, tool_assets, tmp_path, capsys):  # noqa: F811
    root = tmp_path / "runs"
    run = stagerl(server, ["train", "--config", "tools-tiny-cpu", "--experiment", "tools",
                           *small_overrides(tool_assets, root)])
    assert run.returncode == 0, run.stdout[-4000:]
    store, layout = Store.from_config({"root": str(root)}), RunLayout(PROJECT, "tools")
    steps = range(1, STEPS + 1)
    rewards = [read_manifest(store, layout, k, "reward")["extra"]["metrics"]["reward/score/mean"] for k in steps]
    tool_use = [read_manifest(store, layout, k, "rollout")["extra"]["multi_turn"]["correct_tool_use"] for k in steps]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= 1.5 * first, [round(r, 3) for r in rewards]
    assert sum(tool_use[-3:]) / 3 > sum(tool_use[:3]) / 3, [round(r, 3) for r in tool_use]
    # the rate is what the stored turns say: rows with a calculator call that answered the truth
    turns = read_file(store, layout, STEPS, "rollout", "rollout/turns.parquet").to_pydict()
    truth = read_file(store, layout, STEPS, "rollout").column("ground_truth").to_pylist()
    right = {r for r, role, err, text in zip(turns["row"], turns["role"], turns["error"], turns["response"])
             if role == "tool" and err is None and text == truth[r]}
    assert len(right) / len(truth) == tool_use[-1] and right

    capsys.readouterr()
    code = main(["query", "select tool, count(*) as n, avg(latency_s) as latency from turns where role = 'tool' "
                 "group by tool order by n desc", "--experiment", "tools", "--root", str(root), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    by_tool = {r["tool"]: r for r in json.loads(out.out)}   # calculator, None (bad_json) and misspelt names
    calc = by_tool["calculator"]
    assert calc["n"] >= 24 * 8 * STEPS // 10 and 0 < calc["latency"] < 5, by_tool
