"""What a new user meets first on the command line: --version, defaults in --help, every mistake
answered with one line and a non-zero exit (no traceback), chat commands, piped chat output line by
line, whole method descriptions, the loading line, calibration messages, and the state tier named
for the machine."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading

import pytest
import torch

import turnkv
from tests.conftest import save_tiny
from turnkv.cli import main
from turnkv.methods.registry import describe


def run_cli(monkeypatch, capsys, argv, stdin=""):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def no_tokenizer_dir(tmp_path_factory):
    """A tiny random llama saved without a tokenizer."""
    path = tmp_path_factory.mktemp("no-tokenizer")
    save_tiny(path, "llama")
    return path


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"turnkv {turnkv.__version__} (torch {torch.__version__}")


def test_help_shows_the_defaults(capsys):
    for argv, defaults in ((["chat"], ["(default: 256)", "(default: 0.0)", "(default: 1.0)"]),
                           (["serve"], ["(default: 8000)", "(default: 32)", "(default: 30.0)"]),
                           (["bench", "speed"], ["(default: 1024,4096)", "(default: benchmarks/decode/results/latest)"])):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        out = " ".join(capsys.readouterr().out.split())  # as one line: help wraps at the terminal's width
        for default in defaults:
            assert default in out, (argv, default)
        assert "(default: None)" not in out and "(default: False)" not in out


def _cases(tmp_path, model, bare):
    cuda = "cuda:99" if torch.cuda.is_available() else "cuda"
    return [
        # (argv, what the one-line message says)
        (["generate", "hello", "--model", model, "--device", cuda], "--device cpu"),
        (["generate", "hello", "--model", model, "--device", "gpu"], "unknown device 'gpu'"),
        (["info", "--model", model, "--device", "gpu"], "unknown device 'gpu'"),
        (["info", "--model", "~/no-such-model.gguf"], "not found (looked for "),
        (["generate", "hello", "--model", bare, "--tokenizer", str(tmp_path / "missing")], "tokenizer"),
        (["generate", "hello", "--model", bare, "--tokenizer", str(tmp_path)], "holds no tokenizer"),
        (["generate", "hello", "--model", bare, "--kv-memory", "8MiB"], "no tokenizer"),
        (["chat", "--model", bare, "--kv-memory", "8MiB"], "--tokenizer"),
        (["chat", "--model", model, "--budget", "64"], "--budget sets how much an eviction recipe keeps"),
        (["chat", "--model", model, "--recipe", "snap-kv"], "unknown recipe 'snap-kv'"),
        (["info", "--model", model, "--kv-memory", "lots"], "cannot read 'lots' as a size"),
        (["bench", "speed", "--model", model, "--contexts", "1k"], "--contexts takes comma-separated integers"),
        (["bench", "speed", "--model", model, "--contexts", "16", "--new-tokens", "2", "--turns", "0", "--peers",
          "none", "--out", "/dev/null/speed"], "/dev/null/speed"),
    ]


def test_every_mistake_is_one_line_and_a_non_zero_exit(monkeypatch, capsys, tmp_path, chat_model_dir,
                                                       no_tokenizer_dir):
    for argv, says in _cases(tmp_path, str(chat_model_dir), str(no_tokenizer_dir)):
        code, _, err = run_cli(monkeypatch, capsys, argv, "Hello.\n")
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and says in errors[0], (argv, err)
        assert "Traceback" not in err


@pytest.mark.parametrize("argv,says", [
    (["chat", "--budget", "-5"], "argument --budget: must be an integer >= 1, got -5"),
    (["chat", "--recipe", "snapkv", "--keep-ratio", "1.5"], "argument --keep-ratio: must be a number in (0, 1]"),
])
def test_out_of_range_amounts_are_named_before_anything_loads(capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_an_unknown_conversation_id_is_a_turnkv_error(chat_llm):
    with pytest.raises(turnkv.InvalidRequestError, match="no stored conversation has the id 'no-such-id'"):
        chat_llm.resume("no-such-id")


def test_chat_commands_and_the_tier_by_device(monkeypatch, capsys, chat_model_dir):
    stdin = "/help\n/bogus\n//etc is a folder?\n/stats\n"
    code, out, err = run_cli(monkeypatch, capsys, ["chat", "--model", str(chat_model_dir), "--max-new-tokens", "3",
                                                   "--kv-memory", "32MiB"], stdin)
    assert code == 0, err
    for command in ("/help", "/stats", "/reset", "/quit"):
        assert re.search(rf"^  {command} ", out, flags=re.MULTILINE), command
    assert "unknown command /bogus; /help lists the commands" in err
    # Neither /help nor /bogus went to the model; "//etc ..." did, as one turn.
    assert len(re.findall(r"reused tokens", out)) == 1 and "turns: 1" in out
    assert re.search(r"loading .*: \d+\.\d s", err)
    tier = "gpu" if torch.cuda.is_available() else "resident"
    assert f"state={tier}" in out and f"state: {tier}" in out


def test_krul_says_when_it_calibrates(monkeypatch, capsys, chat_model_dir):
    code, _, err = run_cli(monkeypatch, capsys, ["chat", "--model", str(chat_model_dir), "--max-new-tokens", "3",
                                                 "--kv-memory", "32MiB", "--recipe", "state=krul"], "Hello.\nAgain.\n")
    assert code == 0, err
    assert "calibrating state restores on this machine" in err
    assert len(re.findall(r"calibrated state restores for the cpu tier in \d+\.\d s", err)) == 1  # once


def test_resident_is_the_gpu_strategy_by_its_cpu_name(chat_llm):
    conv = chat_llm.conversation(recipe="state=resident")
    assert conv.recipe.state.offloads_between_turns is False
    conv.send("Hello.", max_new_tokens=2)
    assert conv.location == "gpu"  # the pool, whatever its device
    conv.close()


def test_methods_prints_whole_descriptions_wrapped(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, ["methods"])
    assert code == 0 and max(map(len, out.splitlines())) <= 100
    flat = " ".join(out.split())
    for row in describe():
        assert row["doc"] in flat, row["name"]
    assert "moves down with its full KV (restored like `load`)." in flat  # the gpu strategy's second line


def test_piped_chat_prints_each_line_as_it_is_complete(chat_model_dir):
    """A reader of the chat's stdout gets the reply line while stdin is still open (per-turn stats on
    stderr, so nothing after the reply forces a flush)."""
    proc = subprocess.Popen([sys.executable, "-m", "turnkv", "chat", "--model", str(chat_model_dir), "--max-new-tokens",
                             "3", "--kv-memory", "16MiB", "--quiet-stats"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        proc.stdin.write("Hello there.\n")
        proc.stdin.flush()
        line = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(300)
        assert line and line[0].endswith("\n"), "the reply line did not arrive while the chat was open"
        proc.stdin.close()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_says_what_it_serves_and_where(chat_llm, caplog, monkeypatch):
    from turnkv.serve import server
    from turnkv.serve.config import ServeConfig

    config = ServeConfig(host="127.0.0.1", port=8123, served_model_name="tiny")
    line = server.startup_summary(chat_llm, config)
    info = chat_llm.info()
    for part in (f"serving tiny ({chat_llm.name})", f"on {info['device']}", info["dtype"],
                 f"{info['kv_pool_bytes'] / 2**20:,.0f} MiB", f"{info['kv_pool_tokens']:,} tokens",
                 f"recipe: {chat_llm.recipe}", "at http://127.0.0.1:8123/v1"):
        assert part in line, part
    # serve() logs it once the app is built, before the server starts listening.
    monkeypatch.setattr(server.DrainingServer, "run", lambda self: None)
    with caplog.at_level("INFO", logger="turnkv.serve"):
        server.serve(chat_llm, config, tiers=None)
    assert line in caplog.text


def test_stats_say_when_a_budget_has_not_acted_yet(monkeypatch, capsys, chat_model_dir):
    stdin = "Hello there, how are you today?\nAnd again?\n/stats\n"
    said = {}
    for budget in ("1024", "8"):
        code, out, err = run_cli(monkeypatch, capsys, ["chat", "--model", str(chat_model_dir), "--max-new-tokens", "3",
                                                       "--kv-memory", "32MiB", "--recipe", "snapkv", "--budget", budget],
                                 stdin)
        assert code == 0, err
        said[budget] = "nothing evicted yet" in out and "within budget=1024" in out
    assert said == {"1024": True, "8": False}
