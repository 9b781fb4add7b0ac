"""What a new user meets first on the command line: --version, defaults in --help, every mistake
answered with one line and a non-zero exit (no traceback), chat commands, piped chat output line by
line, whole method descriptions, the loading line, calibration messages, and the state tier named
by the name every command uses."""

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
    for argv, defaults in ((["chat"], ["(default: 256, or what the context has left)", "(default: 0.0)",
                                       "(default: 1.0)"]),
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
    # One name for the KV pool's tier, as the recipe, `methods --presets` and `serve` spell it.
    assert "state=gpu" in out and "state=resident" not in out
    assert re.search(r"^state: gpu", out, flags=re.MULTILINE)


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


def test_mistakes_are_refused_before_the_model_loads(monkeypatch, capsys, tmp_path, chat_model_dir):
    """Each names the limit or the minimum, and no weight is read: a model load takes a minute on a
    small machine."""
    import socket

    def no_weights(*args, **kwargs):
        raise AssertionError("the model's weights were read")

    monkeypatch.setattr("turnkv.model.safetensors_folder.read_tensors", no_weights)
    model = str(chat_model_dir)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    # The tiny model: 2 layers x 2 KV heads x one page of 16 tokens x K and V of 16 fp32 values.
    smallest = 2 * 2 * 16 * 2 * 16 * 4
    cases = [
        (["serve", "--model", model, "--port", str(port)],
         f"port {port} on 127.0.0.1 is already in use (another server?); stop it or choose another with --port"),
        (["chat", "--model", model, "--kv-memory", "1KiB"],
         f"a KV pool of 1 KiB cannot hold one page of 16 tokens per KV head in every layer; this model needs at "
         f"least 8 KiB ({smallest} bytes)"),
        (["generate", "", "--model", model], "the prompt is empty"),
        (["generate", "hi", "--model", model, "--max-new-tokens", "512"],
         f"--max-new-tokens 512 does not fit {model}'s context of 512 tokens: a reply can take at most 511"),
        (["serve", "--model", model, "--max-tokens", "100000"], "--max-tokens 100000 does not fit"),
    ]
    try:
        for argv, says in cases:
            code, _, err = run_cli(monkeypatch, capsys, argv)
            assert code == 2 and err.splitlines()[-1].startswith("error: ") and says in err, (argv, err)
            assert "loading" not in err and "Traceback" not in err, (argv, err)
    finally:
        taken.close()
    with pytest.raises(turnkv.KVCacheFullError, match=rf"needs at least 8 KiB \({smallest} bytes\)"):
        turnkv.LLM(model, device="cpu", kv_memory="1KiB")
    with pytest.raises(turnkv.KVCacheFullError, match="needs at least"):
        turnkv.LLM(model, device="cpu", kv_memory=lambda config, dtype: 100)  # sized from the config, before weights


def test_ctrl_c_while_torch_imports_prints_one_line():
    """An interrupt raised inside `import torch`, in a process that runs as the `turnkv` command: one
    line on stderr, no traceback, and the process dies of SIGINT as an interrupted command does."""
    code = ("import sys\n"
            "sys.argv[0] = 'turnkv'\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "from turnkv.cli import main\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.stderr == "interrupted\n" and run.returncode == -2, (run.returncode, run.stderr)


@pytest.mark.parametrize("delay", [0.5, 2.0])
def test_ctrl_c_at_any_time_prints_at_most_one_line(delay):
    """SIGINT while `python -m turnkv info` starts, imports or runs: never a traceback."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "turnkv", "info", "--model", "llama-3.1-8b"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and len(err.splitlines()) <= 1, err
    assert err in ("", "interrupted\n") or proc.returncode == 0, (proc.returncode, err)
