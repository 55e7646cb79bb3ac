"""Config loading: base.yaml + config file + Hydra-style overrides, checked against the schema
that base.yaml's comments declare."""
import pytest

from configs.loader import get_path, load_config, parse_value
from configs.schema import ConfigError, load_schema, parse_schema_text
from flows.cli import main


def refused(overrides, config="tiny-cpu") -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, overrides)
    return str(info.value)


@pytest.mark.parametrize("text,value", [
    ("1e-6", 1e-6), ("3", 3), ("0.5", 0.5), ("True", True), ("false", False), ("null", None),
    ("[console,wandb]", ["console", "wandb"]), ("['console','wandb']", ["console", "wandb"]),
    ("'error'", "error"), ("abc", "abc"), ("", ""), ("[0.9, 1e-3]", [0.9, 1e-3]), ("-2", -2),
])
def test_override_values_parse_as_hydra_does(text, value):
    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def test_every_key_has_a_doc_and_a_type():
    specs = load_schema().specs
    assert len(specs) > 200
    for path, spec in specs.items():
        assert spec.doc, f"{path} has no one-line comment in base.yaml"
        assert spec.types, f"{path} has no type"


def test_schema_tags_parse():
    schema = parse_schema_text("a:\n  b: null  # [int?] <deprecated> old size\n  c: x  # {x|y} <inert> pick\n")
    b, c = schema.specs["a.b"], schema.specs["a.c"]
    assert (b.types, b.nullable, b.deprecated, b.doc) == ((int,), True, True, "old size")
    assert (c.choices, c.inert, c.doc) == (("x", "y"), True, "pick")
    with pytest.raises(ConfigError, match="needs a type tag"):
        parse_schema_text("a: null  # no tag\n")


def test_overrides_set_add_delete_and_interpolate():
    cfg = load_config("tiny-cpu", ["actor_rollout_ref.actor.ppo_mini_batch_size=30",
                             "actor_rollout_ref.actor.optim.lr=1e-6",
                             "+data.apply_chat_template_kwargs.enable_thinking=false",
                             "++trainer.seed=7"])
    assert cfg["critic"]["ppo_mini_batch_size"] == 30  # follows the actor's through ${...}
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-6
    assert cfg["data"]["apply_chat_template_kwargs"] == {"enable_thinking": False}
    assert cfg["trainer"]["seed"] == 7
    cfg = load_config("tiny-cpu", ["~trainer.total_training_steps"])
    assert get_path(cfg, "trainer.total_training_steps", "gone") == "gone"
    assert load_config("tiny-cpu", ["~trainer.total_training_steps", "+trainer.total_training_steps=5"])["trainer"][
        "total_training_steps"] == 5


def test_ints_become_floats_and_single_logger_becomes_list():
    cfg = load_config("base", ["actor_rollout_ref.actor.optim.lr=1", "trainer.logger=console"])
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1.0
    assert isinstance(cfg["actor_rollout_ref"]["actor"]["optim"]["lr"], float)
    assert cfg["trainer"]["logger"] == ["console"]


@pytest.mark.parametrize("overrides,needle", [
    (["actor_rollout_ref.actor.ppo_mini_batchsize=4"], "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'"),
    (["actor_rollout_ref.ppo_mini_batch_size=4"], "'actor_rollout_ref.actor.ppo_mini_batch_size'"),
    (["data.rollout_batch_size=4"], "unknown config key 'data.rollout_batch_size'"),
    (["+data.rollout_batch_size=4"], "unknown config key"),
    (["data.train_batch_size=many"], "data.train_batch_size: expected int, got str 'many'"),
    (["data.train_batch_size=null"], "data.train_batch_size: null is not allowed"),
    (["actor_rollout_ref.actor.use_kl_loss=3"], "expected bool"),
    (["algorithm.adv_estimator=ppo2"], "'ppo2' is not one of"),
    (["actor_rollout_ref.actor.loss_agg_mode=token-sum"], "'token-sum' is not one of"),
    (["actor_rollout_ref.rollout.ignore_eos=true"], "ignore_eos=True: stagerl does not implement"),
    (["actor_rollout_ref.model.lora_rank=-1"], "lora_rank=-1: must be >= 0"),
    (["actor_rollout_ref.rollout.multi_turn.interaction_config_path=i.yaml"], "interaction_config_path='i.yaml': stagerl does not implement"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"], "'bypass_mode' is not one of ['vanilla', 'gspo'"),
    (["+data.train_batch_size=4"], "already in the config; use 'data.train_batch_size=4'"),
    (["~trainer.total_training_steps", "trainer.total_training_steps=3"], "add it with '+trainer.total_training_steps=3'"),
    (["~data.nothing"], "cannot delete 'data.nothing'"),
    (["data"], "not of the form key=value"),
    (["data=3"], "'data' is a group of keys"),
    (["~data.train_batch_size"], "was deleted but is required"),
    (["actor_rollout_ref.rollout.val_kwargs.do_sample=true"], "validation gen temperature should be greater than 0"),
    (["actor_rollout_ref.actor.clip_ratio_c=1.0"], "should be greater than 1.0"),
    (["trainer.logger=[console,slack]"], "'slack' is not one of"),
    (["actor_rollout_ref.actor.cpu_affinity=[one]"], "actor.cpu_affinity=['one']: expected a list of CPU core numbers"),
    (["actor_rollout_ref.rollout.cpu_affinity=[0,-1]"], "rollout.cpu_affinity=[0, -1]: expected a list of CPU core numbers"),
])
def test_bad_overrides_are_refused_by_name(overrides, needle):
    assert needle in refused(overrides)


def test_unknown_config_file_and_unknown_key_in_a_file(tmp_path):
    assert "not found" in refused([], config="nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train_batch_sise: 4\n")
    msg = refused([], config=str(bad))
    assert "data.train_batch_sise" in msg and "bad.yaml" in msg and "data.train_batch_size" in msg


def test_config_file_on_top_of_base(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("data:\n  train_batch_size: 8\ntrainer:\n  n_gpus_per_node: 2\n")
    cfg = load_config(str(good), ["data.max_prompt_length=16"])
    assert (cfg["data"]["train_batch_size"], cfg["trainer"]["n_gpus_per_node"], cfg["data"]["max_prompt_length"]) == (8, 2, 16)
    assert cfg["actor_rollout_ref"]["rollout"]["name"] == "vllm"  # untouched keys keep verl's default


def test_inert_and_deprecated_keys_warn_and_aliases_map():
    cfg = load_config("tiny-cpu", ["data.dataloader_num_workers=2", "actor_rollout_ref.actor.ppo_micro_batch_size=60",
                             "actor_rollout_ref.fsdp_config.offload_params=true"])
    text = "\n".join(cfg.warnings)
    assert "data.dataloader_num_workers=2 is accepted and ignored" in text
    assert "actor_rollout_ref.actor.ppo_micro_batch_size is deprecated" in text
    assert "'actor_rollout_ref.fsdp_config.offload_params' is not a verl key" in text
    assert cfg["actor_rollout_ref"]["actor"]["fsdp_config"]["param_offload"] is True
    assert cfg["actor_rollout_ref"]["ref"]["fsdp_config"]["param_offload"] is True
    assert load_config("tiny-cpu", []).warnings == []


def test_kl_notice_and_clip_ratio_as_verl():
    cfg = load_config("tiny-cpu", ["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.clip_ratio=0.3"])
    assert "NOTICE: You have both enabled in-reward kl and kl loss." in cfg.warnings
    assert any("clip_ratio has no effect" in w for w in cfg.warnings)


def test_shipped_configs_load_clean():
    for name in ["base", "tiny-cpu", "gsm8k-qwen2.5-0.5b"]:
        cfg = load_config(name)
        assert cfg.warnings == [], name
    tiny = load_config("tiny-cpu")
    assert tiny["data"]["train_batch_size"] * tiny["actor_rollout_ref"]["rollout"]["n"] == 720
    assert tiny["trainer"]["n_gpus_per_node"] == 2 and tiny["storage"]["root"] == "./runs"


def test_cli_config_show_and_keys(capsys):
    assert main(["config", "show", "data.train_batch_size=12"]) == 0
    assert "train_batch_size: 12" in capsys.readouterr().out
    assert main(["config", "keys"]) == 0
    out = capsys.readouterr().out
    assert "| `data.train_batch_size` | `1024` | prompts per RL step" in out
    assert main(["config", "show", "data.nope=1"]) == 2
    assert "unknown config key 'data.nope'" in capsys.readouterr().err


@pytest.mark.parametrize("override, needle", [
    ("warmstart.steps=-5", "warmstart.steps=-5: must be >= 1"),
    ("trainer.total_training_steps=-1", "trainer.total_training_steps=-1: must be >= 1"),
    ("trainer.total_training_steps=0", "trainer.total_training_steps=0: must be >= 1"),
    ("trainer.total_epochs=0", "trainer.total_epochs=0: must be >= 1"),
    ("storage.lock_stale_seconds=-1", "storage.lock_stale_seconds=-1: must be > 0"),
    ("orchestration.storage_retries=-1", "orchestration.storage_retries=-1: must be >= 0"),
    ("orchestration.retry_delay_s=-0.5", "orchestration.retry_delay_s=-0.5: must be >= 0"),
    ("data.max_prompt_length=-1", "data.max_prompt_length=-1: must be >= 1"),
    ("data.max_response_length=0", "data.max_response_length=0: must be >= 1"),
    ("actor_rollout_ref.rollout.temperature=-1", "actor_rollout_ref.rollout.temperature=-1.0: must be >= 0"),
    ("reward.num_workers=-1", "reward.num_workers=-1: must be >= 0"),
    ("reward.timeout_s=0", "reward.timeout_s=0.0: must be > 0"),
])
def test_values_below_a_keys_bound_are_refused_before_start_up(override, needle, capsys):
    """Bounds come from base.yaml's <min N>/<above N> tags; `stagerl plan` exits 2 naming the key."""
    assert needle in refused([override])
    assert main(["plan", "--config", "tiny-cpu", override]) == 2
    assert needle in capsys.readouterr().err


def test_bounds_accept_their_edge_and_null():
    cfg = load_config("tiny-cpu", ["orchestration.storage_retries=0", "actor_rollout_ref.rollout.temperature=0",
                                   "trainer.total_training_steps=1", "trainer.total_training_steps=null"])
    assert cfg["orchestration"]["storage_retries"] == 0 and cfg["trainer"]["total_training_steps"] is None
    assert load_schema().specs["data.max_response_length"].bound == ("min", 1.0)


def test_malformed_or_binary_config_files_are_refused_in_one_line(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("data:\n  train_batch_size: 4\n  max_prompt_length: [1, 2\nother: 3\n")
    msg = refused([], config=str(broken))
    assert "broken.yaml" in msg and "malformed YAML" in msg and "line " in msg and "\n" not in msg
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"data:\n  x: 1\n\x89PNG\r\n\x1a\n\x00\xff\xfe")
    msg = refused([], config=str(binary))
    assert msg.startswith(f"config file {binary}, line 3: not UTF-8 text") and "\n" not in msg
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"data:\n  x: 1\n\x00\x00")
    assert "line 3: a NUL byte" in refused([], config=str(nul))
    assert main(["plan", "--config", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "broken.yaml" in err and "Traceback" not in err


def test_registry_backed_keys_accept_what_is_registered():
    """Validation of an extension point's key comes from its registry (configs/registries.py): a
    newly registered estimator is accepted without touching configs/, an unknown name is refused
    with the registered names."""
    from configs.registries import REGISTRY_KEYS, registered_names
    from stages.algos.advantages import ADV_ESTIMATORS, register_adv_estimator

    @register_adv_estimator("my_constant_baseline")
    def my_estimator(token_level_rewards, response_mask, index):
        return token_level_rewards - 1.0, token_level_rewards - 1.0

    try:
        assert load_config("tiny-cpu", ["algorithm.adv_estimator=my_constant_baseline"])["algorithm"][
            "adv_estimator"] == "my_constant_baseline"
    finally:
        del ADV_ESTIMATORS["my_constant_baseline"]
    with pytest.raises(ConfigError, match=r"'my_constant_baseline' is not one of \[.*'grpo'.*\] \(the registered names\)"):
        load_config("tiny-cpu", ["algorithm.adv_estimator=my_constant_baseline"])
    for key in REGISTRY_KEYS:  # every declared registry can be read
        assert len(registered_names(key)) >= 2, key


def test_a_user_registered_metric_sink_is_accepted_and_an_unknown_one_refused(tmp_path, capsys):
    """trainer.logger is validated from the sink registry (storage/sinks.py) like the other
    extension points: a sink registered by the user's code is accepted by config validation and
    opened for the run; an unknown name is refused naming the key (`stagerl plan`: exit 2)."""
    from flows.metric_sinks import MetricSinks
    from storage.sinks import SINKS, register_sink

    logged = []

    @register_sink("my_list_sink")
    class ListSink:
        def __init__(self, cfg, secret_values=()):
            self.experiment = cfg["trainer"]["experiment_name"]

        def log(self, step, metrics):
            logged.append((self.experiment, step, dict(metrics)))

        def close(self):
            logged.append("closed")

    try:
        cfg = load_config("tiny-cpu", ["trainer.logger=[console,my_list_sink]", "trainer.experiment_name=e"])
        assert cfg["trainer"]["logger"] == ["console", "my_list_sink"]
        assert load_config("tiny-cpu", ["trainer.logger=my_list_sink"])["trainer"]["logger"] == ["my_list_sink"]
        sinks = MetricSinks(cfg)
        sinks.log(1, {"actor/pg_loss": 0.5})
        sinks.close()
        assert logged == [("e", 1, {"actor/pg_loss": 0.5}), "closed"]
    finally:
        del SINKS["my_list_sink"]
    with pytest.raises(ConfigError, match=r"trainer.logger: 'my_list_sink' is not one of "
                                          r"\['console', 'tensorboard', 'wandb'\] \(the registered names\)"):
        load_config("tiny-cpu", ["trainer.logger=[console,my_list_sink]"])
    capsys.readouterr()
    assert main(["plan", "--config", "tiny-cpu", "trainer.logger=[console,mlflow]"]) == 2
    err = capsys.readouterr().err
    assert "trainer.logger: 'mlflow' is not one of" in err and "Traceback" not in err


def test_the_longest_sequence_is_checked_against_the_models_positions(tmp_path):
    """prompt + response beyond config.json's max_position_embeddings is refused naming both keys
    (also a multimodal model's text_config); a scaled RoPE (YaRN, linear, dynamic) is left to vLLM."""
    import json

    from configs.local_paths import check_context_length

    def check(model_config, *overrides):
        (tmp_path / "config.json").write_text(json.dumps(model_config))
        check_context_length(load_config("tiny-cpu", [f"actor_rollout_ref.model.path={tmp_path}",
                                                      "data.max_prompt_length=1024", *overrides]))

    with pytest.raises(ConfigError, match=r"data.max_prompt_length 1024 \+ data.max_response_length 512 = 1536 tokens "
                                          r"is longer than the model's context: max_position_embeddings 1024"):
        check({"max_position_embeddings": 1024}, "data.max_response_length=512")
    with pytest.raises(ConfigError, match=r"rollout.max_model_len = 2048 tokens"):
        check({"text_config": {"max_position_embeddings": 1024}}, "data.max_response_length=8",
              "actor_rollout_ref.rollout.max_model_len=2048")
    check({"max_position_embeddings": 1024, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "data.max_response_length=512")
    check({"max_position_embeddings": 1536}, "data.max_response_length=512")
