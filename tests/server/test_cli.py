"""`kvtier serve`: settings from a TOML/YAML file and flags, bad settings, and the real process."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import httpx
import pytest

from kvtier.cli import main
from kvtier.config import EngineConfig
from kvtier.errors import UserError
from kvtier.server.config import ServeConfig
from server_support import free_port


def test_defaults_are_smollm2_with_dram_and_ssd():
    config = ServeConfig.load()
    assert config.model == "smollm2" and config.engine == EngineConfig()
    assert config.engine.device_kv_budget_bytes == 512 << 20
    assert [t.kind for t in config.tiers] == ["dram", "ssd"] and config.tiers[0].capacity_bytes == 1 << 30


def test_file_then_flags(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text('model = "tiny"\nport = 9001\ntiers = ["dram:64MiB"]\ndevice-kv-budget = "8MiB"\nblock_tokens = 16\n')
    config = ServeConfig.load(toml, port=9002, max_num_seqs=None, block_tokens=32)
    assert (config.model, config.port, [str(t) for t in config.tiers]) == ("tiny", 9002, ["dram:64MiB"])
    assert config.engine == EngineConfig(device_kv_budget_bytes=8 << 20, block_tokens=32)  # the flag won
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("model: tiny\nmax_num_seqs: 4\nkv-codec: int4\n")
    assert (ServeConfig.load(yaml).engine.max_num_seqs, ServeConfig.load(yaml).engine.kv_codec) == (4, "int4")


@pytest.mark.parametrize("text, message", [
    ("modle = 'tiny'", "unknown serve setting(s) modle; known: block_tokens, codec, device_kv_budget, "
                       "generation_config, host, kv_codec, kv_events_config, kv_offload, max_model_tokens, "
                       "max_num_seqs, max_prefill_tokens, model, offload_fetch_blocks, offload_page_tokens, "
                       "offload_recent_blocks, offload_sink_blocks, port, prefix_caching, record_trace, "
                       "served_model_name, tier_writes, tiers"),
    ("kv_offload = 'sometimes'", "kv_offload must be 'off', 'exact' or 'sparse:BUDGET'"),
    ("preemption = 'swap'", "unknown serve setting(s) preemption; known: "),  # one preemption path: the setting is gone
    ("device_kv_budget = 'lots'", "device_kv_budget: cannot parse byte size 'lots' (expected e.g. 128k, 256MiB, 80GB)"),
    ("device_kv_budget_bytes = 1024", "unknown serve setting(s) device_kv_budget_bytes; known: "),
    ("port = [", "cannot parse "),
    ("port = 'eighty'", "port must be an integer, got 'eighty'"),
    ("port = 70000", "port must be 1-65535, got 70000"),
    ("block_tokens = 0", "block_tokens must be positive (>= 1), got 0"),
    ("prefix_caching = 'yes'", "prefix_caching must be true or false, got 'yes'"),
    ("kv_codec = 'int3'", "kv_codec must be one of raw, fp8, int8, int4, int2, got 'int3'"),
    ("tier_writes = 'never'", "tier_writes must be 'full' or 'evict', got 'never'"),
    ("generation_config = 'model'", "generation_config must be auto or vllm, got 'model'"),
    ("kv_events_config = '{\"enable_kv_cache_events\": true, \"endpiont\": \"tcp://*:5557\"}'",
     "--kv-events-config: unknown field(s) endpiont (known: buffer_steps, enable_kv_cache_events, endpoint, hwm, "),
    ("kv_events_config = 'yes'", "--kv-events-config is not JSON: "),
    ("codec = 'int3'", "unknown codec 'int3': use one of raw, fp8, int8, int4, int2, optionally with '+zstd'"),
    ("tiers = ['ssd:1GiB']", "ssd tier spec needs a directory and a size: ssd:/path:10GiB, got 'ssd:1GiB'"),
    ("tiers = 3", "tiers must be a list of tier specs (dram:SIZE, ssd:DIR:SIZE, shm:DIR:SIZE, mooncake://HOST:PORT, "
                  "redis://HOST:PORT/DB), got 3"),
])
def test_bad_settings_are_one_line_user_errors(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        ServeConfig.load(path)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_serve_options_are_the_config_fields():
    """One place: every setting of ServeConfig and its EngineConfig is a flag, with the field's default in its help."""
    import typer.main

    from kvtier.cli import _register_all, app

    _register_all()
    command = typer.main.get_command(app).commands["serve"]
    options = {p.name: p for p in command.params}
    names = {s.name for s in ServeConfig.settings()}
    assert set(options) == names | {"config_file", "no_tiers"}
    assert names == {f.name for f in fields(ServeConfig) if f.name != "engine"} | \
        {f.name for f in fields(EngineConfig) if f.name not in ("device_kv_budget_bytes", "synchronous_transfers")} | \
        {"device_kv_budget"}
    assert options["tiers"].opts == ["--tier"] and options["device_kv_budget"].opts == ["--device-kv-budget"]
    assert all(options[name].default is None for name in names)  # unset flags leave the file's values alone
    assert options["block_tokens"].help == "tokens per KV block (default: 256)"
    assert options["device_kv_budget"].help == "device KV arena size, e.g. 512MiB (default: 512MiB)"


def test_deriving_the_options_imports_no_torch():
    code = "import sys; from kvtier.cli import _register_all; _register_all(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_cli_flags_reach_the_config(monkeypatch, tmp_path):
    import kvtier.server.cli as serve_cli

    seen = []
    monkeypatch.setattr(serve_cli, "build_app", lambda config: seen.append(config) or (_ for _ in ()).throw(SystemExit(0)))
    toml = tmp_path / "serve.toml"
    toml.write_text("max_num_seqs = 4\nblock_tokens = 64\n")
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(toml), "--model", "tiny", "--block-tokens", "16", "--device-kv-budget", "1MiB",
              "--no-prefix-caching", "--tier", "dram:16MiB", "--tier", f"ssd:{tmp_path}:16MiB",
              "--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/kv.sock", "hwm": 10}'])
    [config] = seen
    assert config.model == "tiny" and [t.kind for t in config.tiers] == ["dram", "ssd"]
    events = config.kv_events_config
    assert (events.enabled, events.endpoint, events.hwm, events.replay_endpoint) == \
        (True, "ipc:///tmp/kv.sock", 10, None)
    assert config.engine == EngineConfig(device_kv_budget_bytes=1 << 20, block_tokens=16, max_num_seqs=4,
                                         prefix_caching=False)
    with pytest.raises(SystemExit):
        main(["serve", "--no-tiers"])
    assert seen[-1].tiers == [] and seen[-1].engine == EngineConfig()


@pytest.mark.parametrize("argv, message", [
    (["--tier", "tape:1GiB"], "kvtier: error: unknown tier 'tape:1GiB': use dram:SIZE, ssd:DIR:SIZE, shm:DIR:SIZE, "
                              "mooncake://HOST:PORT, redis://HOST:PORT/DB\n"),
    (["--kv-codec", "int3"], "kvtier: error: kv_codec must be one of raw, fp8, int8, int4, int2, got 'int3'\n"),
    (["--device-kv-budget", "lots"], "kvtier: error: device_kv_budget: cannot parse byte size 'lots' "
                                     "(expected e.g. 128k, 256MiB, 80GB)\n"),
])
def test_cli_bad_flags_exit_2_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2 and capsys.readouterr().err == message


def test_cli_bad_config_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("modle = 'tiny'")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", str(path)])
    assert info.value.code == 2
    assert "unknown serve setting" in capsys.readouterr().err


def _became_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> bool:
    """Poll /health (bounded: imports + model load, which took over 30 s on 2 busy cores); a server process
    that exits fails at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        time.sleep(0.05)
    return False


def test_serve_process_answers(tmp_path):
    import zmq

    from kvtier.events.wire import decode_batch

    port = free_port()
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path)}
    endpoint = f"ipc://{tmp_path}/events.sock"
    events = zmq.Context.instance().socket(zmq.SUB)  # a router's view of the process's KV events
    events.setsockopt(zmq.SUBSCRIBE, b"")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "kvtier"), "serve", "--model", "tiny", "--port", str(port),
                             "--device-kv-budget", "1MiB", "--block-tokens", "16", "--tier", "dram:16MiB",
                             "--tier", f"ssd:{tmp_path / 'ssd'}:16MiB", "--served-model-name", "x",
                             "--served-model-name", "y",
                             "--kv-events-config", f'{{"enable_kv_cache_events": true, "endpoint": "{endpoint}"}}'],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert _became_healthy(url, proc), "kvtier serve never answered /health"
        # subscribed once the endpoint is bound: a SUB that connects to an ipc path before it exists sometimes
        # never connects (libzmq; 2 runs in 4 here), and a new subscription takes a moment to reach the PUB
        events.connect(endpoint)
        time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": "Once more unto the breach, dear friends",
                                                      "max_tokens": 5, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["x", "y"]
        unknown = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "a"}, timeout=30)
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
        assert "'x', 'y'" in unknown.json()["error"]["message"]
        tiers = [t["name"] for t in httpx.get(url + "/dashboard/data").json()["tiers"]]
        assert tiers == ["dram", "ssd"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # never left running (a SIGINT during its start is not a shutdown)
            proc.kill()
            proc.wait()
            raise
    # shutdown flushed the device's cached blocks (43 tokens of KV: 2 full blocks of 16) down to the SSD
    assert len(list((tmp_path / "ssd").rglob("*.kvb"))) == 2
    held: dict[str, set[int]] = {}
    while events.poll(1000):  # every batch was sent before the process exited
        for event in decode_batch(events.recv_multipart()[2])[1]:
            hashes = held.setdefault(event["medium"], set())
            (hashes.update if event["type"] == "BlockStored" else hashes.difference_update)(event["block_hashes"])
    events.close(linger=0)
    assert {medium: len(hashes) for medium, hashes in held.items()} == {"GPU": 2, "CPU": 2, "STORAGE": 2}


def test_the_model_as_given_is_a_served_name():
    """`make run`'s README request says "model": "smollm2": the model as given is served beside its name."""
    from kvtier.server.config import ServeConfig

    assert ServeConfig(model="smollm2").model_names("SmolLM2-135M-Instruct") == ["smollm2", "SmolLM2-135M-Instruct"]
    assert ServeConfig(model="tiny").model_names("tiny") == ["tiny"]
    assert ServeConfig(model="smollm2", served_model_name=["a", "b"]).model_names("SmolLM2-135M-Instruct") == ["a", "b"]
