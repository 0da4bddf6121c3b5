"""Flags and start-up checks (GPUs, model sources) of the simulated engines, no processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw_cli.core.engine.engine_flags import table
from llmgw_cli.errors import EngineStartError
from llmgw_cli.lab.engine_args import parse_argv
from llmgw_cli.lab.engine_checks import (
    SimGpu,
    check_model_source,
    parse_gpus_csv,
    select_gpus,
)

# The format the lab harness writes (one line per node), with a health column.
GPUS_CSV = "\n".join(
    f"{k},NVIDIA H100 80GB HBM3,81559,GPU-01-{k}-5f1c,550.54.15{',ok' if k != 7 else ',GPU requires reset'}"
    for k in range(8)
)


def test_vllm_serve_flags() -> None:
    cfg = parse_argv(
        [
            "vllm",
            "serve",
            "/data/models/L",
            "--host",
            "10.0.0.1",
            "--port",
            "8101",
            "-tp",
            "2",
            "-pp",
            "2",
            "--served-model-name",
            "llama",
            "--max-model-len",
            "32K",
            "--api-key",
            "K",
            "--gpu-memory-utilization",
            "0.92",
            "--distributed-executor-backend",
            "mp",
        ]
    )
    assert (cfg.kind, cfg.model, cfg.served_names, cfg.host, cfg.port) == (
        "vllm",
        "/data/models/L",
        ("llama",),
        "10.0.0.1",
        8101,
    )
    assert (cfg.tp, cfg.pp, cfg.max_model_len, cfg.api_key, cfg.gpus_per_node) == (2, 2, 32 * 1024, "K", 4)
    assert cfg.serves_api


def test_vllm_defaults_like_vllm() -> None:
    cfg = parse_argv(["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"])
    assert (cfg.port, cfg.host, cfg.served_names, cfg.tp) == (
        8000,
        "0.0.0.0",
        ("Qwen/Qwen2.5-7B-Instruct",),
        1,
    )


def test_vllm_multinode_worker_is_headless_and_per_node_share() -> None:
    base = ["vllm", "serve", "/m", "-tp", "8", "-pp", "2", "--nnodes", "2", "--master-addr", "10.0.0.1"]
    head = parse_argv([*base, "--node-rank", "0"])
    worker = parse_argv([*base, "--node-rank", "1", "--headless"])
    assert head.serves_api and not worker.serves_api
    assert head.gpus_per_node == worker.gpus_per_node == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["vllm", "serve", "/m", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        # flags vLLM 0.32 refuses, which the simulator once accepted
        (["vllm", "serve", "/m", "--swap-space", "4"], "unrecognized arguments: --swap-space 4"),
        (["vllm", "serve", "/m", "--disable-log-requests"], "unrecognized arguments: --disable-log-requests"),
        (["vllm", "serve", "/m", "--task", "embed"], "unrecognized arguments: --task embed"),
        (["vllm", "serve", "/m", "--served-model-name"], "expected at least one argument"),
        (["sglang", "--model-path", "/m", "--swap-space", "4"], "unrecognized arguments: --swap-space 4"),
        (["vllm", "serve", "/m", "--port", "x"], "invalid int value"),
        (["vllm", "serve"], "the following arguments are required: model_tag"),
        (["vllm", "bench", "/m"], "invalid choice: 'bench'"),
        (["vllm", "serve", "/m", "--nnodes", "2", "--node-rank", "1"], "requires --headless"),
        (["sglang", "-m", "sglang.launch_server", "--model-path", "/m", "--bogus"], "unrecognized arguments"),
        (["sglang", "--port", "1"], "the following arguments are required: --model-path"),
    ],
)
def test_bad_flags_exit_2_with_argparse_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_argv(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_sglang_with_and_without_interpreter_module() -> None:
    rest = ["--model-path", "/data/models/Q", "--tp", "2", "--port", "8201", "--mem-fraction-static", "0.85"]
    via_python = parse_argv(["sglang", "-m", "sglang.launch_server", *rest])
    bare = parse_argv(["sglang", *rest])
    twice = parse_argv(["sglang", "-m", "sglang.launch_server", "-m", "sglang.launch_server", *rest])
    assert via_python == bare == twice
    assert (bare.kind, bare.model, bare.served_names, bare.host, bare.tp) == (
        "sglang",
        "/data/models/Q",
        ("/data/models/Q",),
        "127.0.0.1",
        2,
    )


def test_sglang_defaults_and_worker_rank() -> None:
    cfg = parse_argv(
        [
            "sglang",
            "--model-path",
            "m",
            "--tp",
            "16",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            "10.0.0.1:5000",
        ]
    )
    assert cfg.port == 30000 and cfg.gpus_per_node == 8 and not cfg.serves_api


def test_sglang_wrong_module_fails_like_python() -> None:
    with pytest.raises(SystemExit, match=r"No module named sglang\.bench_serving"):
        parse_argv(["sglang", "-m", "sglang.bench_serving", "--model-path", "m"])


def test_gpus_csv_parses_harness_format_extra_columns_and_spaces() -> None:
    gpus = parse_gpus_csv("# comment\n\n" + GPUS_CSV + "\n8, A100, 40960, GPU-aa, 535, ok, extra\n")
    assert [g.index for g in gpus] == list(range(9))
    assert gpus[0] == SimGpu(0, "NVIDIA H100 80GB HBM3", "81559", "GPU-01-0-5f1c", "ok")
    assert gpus[8].uuid == "GPU-aa" and gpus[8].healthy
    assert not gpus[7].healthy
    assert parse_gpus_csv("0,H100,81559,GPU-x,550")[0].healthy  # no health column


GPUS = parse_gpus_csv(GPUS_CSV)


@pytest.mark.parametrize(
    ("visible", "needed", "indices"),
    [
        ("0,1", 2, [0, 1]),
        ("3", 1, [3]),
        ("GPU-01-5-5f1c,GPU-01-6-5f1c", 2, [5, 6]),
        ("01-4-5f1c", 1, [4]),  # CUDA also takes the UUID without GPU-
        ("GPU-01-2", 1, [2]),  # unique prefix
        (None, 2, [0, 1]),  # unset: the first N
    ],
)
def test_select_gpus_accepts(visible: str | None, needed: int, indices: list[int]) -> None:
    assert [g.index for g in select_gpus(visible, GPUS, needed)] == indices


@pytest.mark.parametrize(
    ("visible", "needed", "message"),
    [
        ("0,9", 2, "invalid device ordinal"),
        ("GPU-nope", 1, "invalid device ordinal"),
        ("GPU-01", 1, "invalid device ordinal"),  # ambiguous prefix
        ("1,1", 2, "twice"),
        ("", 1, "No CUDA GPUs are available"),
        ("0", 2, "World size (2) is larger than the number of available GPUs (1)"),
        ("0,1,2", 2, "exposes 3 GPUs but this node's share of the world is 2"),
        ("6,7", 2, "uncorrectable ECC error encountered on GPU 7"),
        (None, 9, "World size (9)"),
    ],
)
def test_select_gpus_rejects(visible: str | None, needed: int, message: str) -> None:
    with pytest.raises(EngineStartError) as exc:
        select_gpus(visible, GPUS, needed)
    assert message in str(exc.value)


def _model_dir(root: Path, shards: int = 2, present: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"max_position_embeddings": 131072}))
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"layer{i}.weight": n for i, n in enumerate(names)}})
    )
    for name in names[:present]:
        (root / name).write_bytes(b"x")
    return root


def test_complete_model_dir_gives_its_context(tmp_path: Path) -> None:
    assert check_model_source(str(_model_dir(tmp_path / "L")), "vllm", offline=True) == 131072


def test_missing_shard_is_named(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "L", shards=3, present=2)
    with pytest.raises(
        EngineStartError, match=r"No such file or directory: '.*model-00003-of-00003.safetensors'"
    ):
        check_model_source(str(model), "vllm", offline=False)


def test_partial_download_is_rejected(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "L")
    (model / "model-00002-of-00002.safetensors.part").write_bytes(b"x")
    with pytest.raises(EngineStartError, match=r"incomplete download .*safetensors\.part"):
        check_model_source(str(model), "sglang", offline=False)
    (model / "model-00002-of-00002.safetensors.part").rename(model / "x.incomplete")
    with pytest.raises(EngineStartError, match=r"x\.incomplete"):
        check_model_source(str(model), "vllm", offline=False)


def test_dir_without_config_or_weights(tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="Invalid repository ID or local directory specified"):
        check_model_source(str(tmp_path), "vllm", offline=False)
    with pytest.raises(EngineStartError, match=r"does not appear to have a file named config\.json"):
        check_model_source(str(tmp_path), "sglang", offline=False)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineStartError, match="Cannot find any model weights"):
        check_model_source(str(tmp_path), "vllm", offline=False)
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert check_model_source(str(tmp_path), "vllm", offline=False) is None


def test_hub_id_is_a_cache_hit_unless_offline(tmp_path: Path) -> None:
    assert check_model_source("Qwen/Qwen2.5-7B-Instruct", "vllm", offline=False) is None
    with pytest.raises(EngineStartError, match=r"couldn.t connect to .https://huggingface\.co."):
        check_model_source("Qwen/Qwen2.5-7B-Instruct", "vllm", offline=True)


def test_missing_absolute_path_is_an_invalid_repo_id(tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="Repo id must be in the form"):
        check_model_source(str(tmp_path / "absent"), "vllm", offline=False)


def test_data_parallel_counts_and_ray_share_is_unknown() -> None:
    assert parse_argv(["vllm", "serve", "m", "-tp", "2", "-dp", "2"]).gpus_per_node == 4
    assert parse_argv(["sglang", "--model-path", "m", "--tp", "2", "--dp", "2"]).gpus_per_node == 4
    ray = parse_argv(["vllm", "serve", "m", "-tp", "8", "-pp", "2", "--distributed-executor-backend", "ray"])
    assert ray.gpus_per_node is None
    assert [g.index for g in select_gpus("0,1,2,3,4,5,6", GPUS, ray.gpus_per_node)] == list(range(7))
    with pytest.raises(EngineStartError, match="GPU 7"):
        select_gpus(None, GPUS, ray.gpus_per_node)  # all visible, GPU 7 is unhealthy


def test_keys_come_from_where_the_real_engines_read_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM: --api-key, else $VLLM_API_KEY (what llmgw's units use: the key is never argv)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert parse_argv(["vllm", "serve", "/m"]).api_key == "from-env"
    assert parse_argv(["vllm", "serve", "/m", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("VLLM_API_KEY")
    assert parse_argv(["vllm", "serve", "/m"]).api_key is None
    # SGLang: no key variable; a --config YAML file (keys with - or _), which must be YAML or JSON
    config = tmp_path / "key.yaml"
    config.write_text('api-key: "0123e4"\n')  # quoted: unquoted, YAML would read a number
    assert parse_argv(["sglang", "--model-path", "/m", "--config", str(config)]).api_key == "0123e4"
    with pytest.raises(SystemExit, match="YAML or JSON"):
        parse_argv(["sglang", "--model-path", "/m", "--config", str(tmp_path / "key.txt")])


def test_multi_node_rendezvous_address() -> None:
    vllm = parse_argv(
        ["vllm", "serve", "/m", "--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29511"]
    )
    assert (vllm.control_addr, vllm.control_port) == ("10.0.0.1", 29511)
    sglang = parse_argv(
        ["sglang", "--model-path", "/m", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:29600"]
    )
    assert (sglang.control_addr, sglang.control_port) == ("10.0.0.1", 29600)
    assert parse_argv(["vllm", "serve", "/m"]).control_port is None


def _words(takes: str) -> list[str]:
    return {"switch": [], "value": ["1"], "optional": [], "list": ["1", "2"]}[takes]


@pytest.mark.parametrize(
    ("kind", "engine", "version"), [("vllm", "vllm", "0.32.0"), ("sglang", "sglang", "0.5.23")]
)
def test_every_flag_of_the_real_parser_is_accepted_with_what_it_takes(
    kind: str, engine: str, version: str
) -> None:
    flags = table(engine, version)
    assert flags is not None
    base = ["vllm", "serve", "/m"] if kind == "vllm" else ["sglang", "--model-path", "/m"]
    # the flags the simulation reads need values of their type: given once, in the base
    typed = {"--port", "-tp", "--tensor-parallel-size", "-pp", "--pipeline-parallel-size", "-dp"}
    typed |= {"--data-parallel-size", "--gpu-memory-utilization", "--max-model-len", "--nnodes"}
    typed |= {"--node-rank", "--master-port", "--distributed-executor-backend", "--tp-size", "--dp-size"}
    typed |= {"--context-length", "--mem-fraction-static", "--config"}
    for flag, takes in flags.flags.items():
        if flag not in typed:
            parse_argv([*base, flag, *_words(takes)])


def test_vllm_spellings_and_the_flags_vllm_032_has() -> None:
    cfg = parse_argv(
        [
            "vllm",
            "serve",
            "/m",
            "--runner",
            "pooling",
            "--max_model_len",
            "4K",
            "--compilation-config.mode",
            "3",
        ]
    )
    assert cfg.max_model_len == 4096
    assert parse_argv(["vllm", "serve", "/m", "--api-key", "K", "L"]).api_key == "K"
