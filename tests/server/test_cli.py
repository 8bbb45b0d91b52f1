"""`kvtier serve`: settings from a TOML/YAML file and flags, bad settings, and the real process."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtier.cli import main
from kvtier.errors import UserError
from kvtier.server.config import ServeConfig
from server_support import free_port


def test_defaults_are_smollm2_with_dram_and_ssd():
    config = ServeConfig.load()
    assert config.model == "smollm2" and config.device_kv_budget == "512MiB"
    assert [t.split(":")[0] for t in config.tiers] == ["dram", "ssd"]


def test_file_then_flags(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text('model = "tiny"\nport = 9001\ntiers = ["dram:64MiB"]\ndevice-kv-budget = "8MiB"\n')
    config = ServeConfig.load(toml, port=9002, max_num_seqs=None)
    assert (config.model, config.port, config.tiers, config.device_kv_budget) == ("tiny", 9002, ["dram:64MiB"], "8MiB")
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("model: tiny\nmax_num_seqs: 4\nkv-codec: int4\n")
    assert (ServeConfig.load(yaml).max_num_seqs, ServeConfig.load(yaml).kv_codec) == (4, "int4")


@pytest.mark.parametrize("text, message", [
    ("modle = 'tiny'", "unknown serve setting"),
    ("preemption = 'swap'", "unknown serve setting.*preemption"),  # one preemption path: the setting is gone
    ("device_kv_budget = 'lots'", "lots"),
    ("port = [", "cannot parse"),
    ("kv_codec = 'int3'", "kv_codec"),
    ("tier_writes = 'never'", "tier_writes"),
])
def test_bad_settings_are_user_errors(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises((UserError, ValueError), match=message):
        ServeConfig.load(path)


def test_cli_bad_config_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("modle = 'tiny'")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", str(path)])
    assert info.value.code == 2
    assert "unknown serve setting" in capsys.readouterr().err


def _became_healthy(url: str, proc: subprocess.Popen, attempts: int = 600) -> bool:
    """Poll /health (bounded: imports + model load); a server process that exits fails at once."""
    for _ in range(attempts):
        assert proc.poll() is None, proc.stdout.read()
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        time.sleep(0.05)
    return False


def test_serve_process_answers(tmp_path):
    port = free_port()
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "kvtier"), "serve", "--model", "tiny", "--port", str(port),
                             "--device-kv-budget", "1MiB", "--block-tokens", "16", "--tier", "dram:16MiB",
                             "--tier", f"ssd:{tmp_path / 'ssd'}:16MiB", "--served-model-name", "x",
                             "--served-model-name", "y"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert _became_healthy(url, proc), "kvtier serve never answered /health"
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
        proc.wait(timeout=30)
    # shutdown flushed the device's cached blocks (43 tokens of KV: 2 full blocks of 16) down to the SSD
    assert len(list((tmp_path / "ssd").rglob("*.kvb"))) == 2
