"""The tests' fork server (tests/prefork.py) runs a launch as `python ARGV` would: the same argv, environment, working
directory, output, exit code and signal behaviour, so the multi-process tests that use it still test what a real
launch does. Each check runs the same command both ways and compares."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import prefork
import pytest

SCRIPT = """
import os, sys
print("argv", sys.argv[1:])
print("cwd", os.getcwd())
print("env", os.environ.get("PREFORK_PROBE"), "RANK" in os.environ)
print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("name", __name__)
import torch
print("threads", torch.get_num_threads())
x = torch.arange(1 << 22, dtype=torch.float64)  # large enough for an OpenMP parallel region on every thread
print("sum", float((x * x).sum()), float((torch.ones(512, 512) @ torch.ones(512, 512)).sum()))
sys.stderr.write("to stderr\\n")
sys.exit(int(sys.argv[1]))
"""


def both(argv: list[str], env: dict, **kw) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    plain = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120, **kw)
    forked_cmd = prefork.command(argv, env)
    assert forked_cmd[:2] == [sys.executable, prefork.__file__], "the fork server did not start"
    forked = subprocess.run(forked_cmd, env=env, capture_output=True, text=True, timeout=120, **kw)
    return plain, forked


@pytest.fixture
def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PREFORK_PROBE="x y", PYTHONWARNINGS="ignore")


def test_a_script_runs_as_in_a_fresh_interpreter(tmp_path, env):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    (tmp_path / "cwd").mkdir()
    for code in ("0", "3"):
        plain, forked = both([str(script), code, "--flag=é"], env | {"OMP_NUM_THREADS": "2"}, cwd=tmp_path / "cwd")
        assert forked.returncode == plain.returncode == int(code)
        assert forked.stdout == plain.stdout and "threads 2" in plain.stdout and "name __main__" in plain.stdout
        assert forked.stderr == plain.stderr == "to stderr\n"


def test_c_code_and_exceptions(env):
    for code in ("import sys; sys.exit('a message')", "raise ValueError('boom')", "print(__name__, end='')"):
        plain, forked = both(["-c", code, "arg"], env)
        assert (forked.returncode, forked.stdout) == (plain.returncode, plain.stdout), code
        assert forked.stderr.splitlines()[-1:] == plain.stderr.splitlines()[-1:], code


def test_an_uncaught_ctrl_c_and_a_forwarded_sigterm_end_as_they_would(tmp_path, env):
    plain, forked = both(["-c", "raise KeyboardInterrupt"], env)
    assert forked.returncode == plain.returncode == -signal.SIGINT
    ready = tmp_path / "ready"
    code = (f"import pathlib, signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *a: sys.exit(7))\n"
            f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(60)\nsys.exit(0)")
    for sig, expected in ((signal.SIGUSR1, 7), (signal.SIGTERM, -signal.SIGTERM)):
        ready.unlink(missing_ok=True)
        proc = subprocess.Popen(prefork.command(["-c", code], env), env=env)
        deadline = time.time() + 60
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == expected


def test_killing_the_launch_kills_what_it_runs(tmp_path, env):
    pid_file = tmp_path / "pid"
    code = f"import os, pathlib, time\npathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\ntime.sleep(120)"
    proc = subprocess.Popen(prefork.command(["-c", code], env), env=env)
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.02)
    child = int(pid_file.read_text())
    assert child != proc.pid  # forked from the server, not the launch itself
    proc.kill()
    proc.wait()
    deadline = time.time() + 30
    while Path(f"/proc/{child}").exists() and time.time() < deadline:
        state = Path(f"/proc/{child}/stat").read_text().split(") ")[-1][0] if Path(f"/proc/{child}").exists() else ""
        if state == "Z":  # exited, waiting for its monitor to reap it
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists() or state == "Z"


def test_off_means_plain(env, monkeypatch):
    monkeypatch.setenv("MINDVL_TEST_PREFORK", "0")
    assert prefork.command(["-c", "pass"], env) == [sys.executable, "-c", "pass"]
