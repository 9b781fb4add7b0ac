"""`turnkv serve` as a process: loopback by default, the API key from the environment, and a graceful
drain on SIGTERM (in-flight streams finish, /health turns 503, idle conversations go to the disk
tier, the process exits 0)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.serve.conftest import stream_in_background
from turnkv.cli import build_parser
from turnkv.serve import ServeConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_binds_loopback_by_default():
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.api_key is None and not args.no_reuse
    assert not args.no_tiers and args.state_disk_dir is None  # CPU tier on, disk only when asked


def test_sigterm_drains_in_flight_streams_then_exits(chat_model_dir, tmp_path):
    disk = tmp_path / "tier"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TURNKV_API_KEY": "from-env", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "turnkv.cli", "serve", "--model", str(chat_model_dir),
                             "--port", str(port), "--kv-memory", "16MiB", "--served-model-name", "tiny",
                             "--log-level", "warning", "--state-disk-dir", str(disk)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.2)
        key = {"Authorization": "Bearer from-env"}
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers=key).json()["data"][0]["id"] == "tiny"

        body = {"model": "tiny", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 400,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        reader, lines, started = stream_in_background(url + "/v1/chat/completions", body, key, timeout=60)
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # The stream that was running when SIGTERM came finished whole.
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 400
    # Its conversation, idle once it finished, was written to the disk tier (the CPU tier dies with
    # the process), with the history a restarted server continues it from.
    manifests = list(disk.glob("*.json"))
    assert len(manifests) == 1
    record = json.loads(manifests[0].read_text())["conversation"]
    assert record["messages"][-1]["role"] == "assistant" and len(record["tokens"]) > 400


def test_head_patterns_are_named_at_start(tmp_path):
    args = build_parser().parse_args(["serve", "--head-pattern", "smol=/srv/p.json", "--head-pattern", "duo=/srv/duo"])
    assert args.head_pattern == [("smol", "/srv/p.json"), ("duo", "/srv/duo")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--head-pattern", "no-equals-sign"])
    with pytest.raises(ValueError, match="does not exist"):
        ServeConfig(head_patterns={"smol": str(tmp_path / "missing.json")})
    with pytest.raises(ValueError, match="letters"):
        ServeConfig(head_patterns={"a/b": str(tmp_path)})
