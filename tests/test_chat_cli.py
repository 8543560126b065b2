"""`oled chat` (driven through stdin, as a user would) and `oled serve`'s refusal of bad flags and models."""
from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

CLI = "import sys; from oled.cli import main; sys.exit(main(sys.argv[1:]))"
STATS = re.compile(r"^\[(\d+) tokens, TPOT [\d.]+ ms, [\d.]+ tok/forward \(\d+ forwards\), hit rate [\d.]+%, "
                   r"prefill [\d.]+ ms, finish (stop|length)\]$", re.M)


def oled(*args, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-c", CLI, *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_chat_streams_answers_and_stats():
    expected = json.loads(oled("generate", "--chat", "Hi", "--random-weights", "tiny", "--gen-length", "32",
                               "--json").stdout)["text"]
    r = oled("chat", "--random-weights", "tiny", "--gen-length", "32", stdin="Hi\nAgain\n/reset\nHi\n/exit\nnever\n")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    stats = STATS.findall(r.stderr)
    assert len(stats) == 3, r.stderr                      # one line per answer; nothing after /exit
    assert all(0 < int(n) <= 32 for n, _ in stats)
    assert "[history cleared]" in r.stderr
    # the first answer is the chat template's answer to "Hi"; after /reset the same question gets the same answer
    assert r.stdout.startswith(expected + "\n")
    assert r.stdout.endswith("\n" + expected + "\n")


def test_chat_quits_at_end_of_input():
    r = oled("chat", "--random-weights", "tiny", "--gen-length", "8", stdin="Hello\n/nonsense\n")
    assert r.returncode == 0, r.stderr
    assert len(STATS.findall(r.stderr)) == 1
    assert "unknown command /nonsense" in r.stderr


def test_chat_streams_block_by_block():
    """Each committed block reaches the terminal as it commits (one write per block)."""
    from oled.cli.chat import Chat
    from oled.config import EngineConfig
    from oled.decoding.params import DecodeParams
    from oled.engine import Engine

    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes: list[str] = []

        def write(self, s):
            self.writes.append(s)
            return super().write(s)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(EngineConfig(random_weights="tiny", device="cpu", dtype="float32"))
        out, err = Recorder(), io.StringIO()
        chat = Chat(engine, DecodeParams(gen_length=96, threshold=1.0), out=out, err=err)
        answer = chat.turn("Tell me a story")
    finally:
        torch.set_num_threads(threads)
    blocks = [w for w in out.writes if w != "\n"]
    assert len(blocks) >= 2, out.writes                     # 96 tokens in blocks of 32
    assert "".join(blocks) == answer
    assert chat.history == [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": answer}]
    assert STATS.search(err.getvalue().strip())


def test_serve_rejects_a_bad_model():
    r = oled("serve", "--model", "/nonexistent/oled-model", "--port", "0", timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["oled serve: error: /nonexistent/oled-model: not a directory"], r.stderr


@pytest.mark.parametrize("args, message", [
    (["--port", "abc"], "argument --port: invalid int value"),
    (["--random-weights", "tiny", "--policy", "nope"], "unknown policy 'nope'; choose from oled, oled-retain"),
    (["--random-weights", "no-such-preset"], "unknown preset"),
    (["--random-weights", "tiny", "--port", "70000"], "--port must be between 0 and 65535"),
    (["--random-weights", "tiny", "--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--random-weights", "tiny", "--threshold", "2"], "threshold must be in [0, 1]"),
])
def test_serve_rejects_bad_flags(args, message, capsys):
    """The same entry point as the `oled` script, in-process (no interpreter start per case)."""
    from oled.cli import main

    try:
        rc = main(["serve", *args] + ([] if "--port" in args else ["--port", "0"]))
    except SystemExit as e:                               # argparse: usage, then one error line
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("oled serve: error:") and message in err[-1], err
    assert not any("Traceback" in line for line in err)
    if "argument --" not in message:                      # argparse adds its usage; ours are exactly one line
        assert len(err) == 1, err


def test_serve_reports_busy_port(capsys):
    from oled.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--random-weights", "tiny", "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip() == f"oled serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_serve_without_fastapi_says_how_to_install(monkeypatch, capsys):
    import importlib.util

    from oled.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve", "--random-weights", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "oled serve: error: the server needs fastapi (not installed): pip install 'oled[serve]'"
