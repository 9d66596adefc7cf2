"""A fork server for the tests' training processes: torch and mindvl imported once, every rank forked from that.

Why: a training process on this CI machine spends ~5 CPU-s importing torch, torch._dynamo (AdamW's first
`add_param_group` pulls it in), torch.distributed and mindvl before its first step, and the multi-process tests
start ~200 of them (RESULTS.md "CI cost"). Forked from a process that has done those imports, a rank starts in
~0.1 s. What runs in the child is exactly what `python SCRIPT ARGS` would run (`__main__` from the script or
`-c` code, argv, environment, working directory, stdin/stdout/stderr, exit code), so the launch helpers stay
faithful; real launches remain where a test is about them (torchrun in test_requeue.py, the README's commands,
anything killed with SIGKILL or watched line by line). `MINDVL_TEST_PREFORK=0` turns it off.

Three processes per launch:
- the client (`python prefork.py run SOCKET SCRIPT ARGS...`): what the test's Popen holds. It imports nothing
  heavy, hands its argv, environment, working directory and fds 0-2 to the server, forwards the signals it gets,
  and exits as the child did (a child killed by signal N: the client kills itself with N, returncode -N);
- the monitor, forked by the server per connection: forks the child, relays the client's signals to it, kills it
  if the client dies (a test's `proc.kill()` kills the client), and reports its wait status;
- the child, forked by the monitor: runs the script.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor", "mindvl.cli", "mindvl.train.trainer", "mindvl.data.loader")
# (torch._dynamo: AdamW's first add_param_group imports it in every training process)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("client closed the connection")
        data += chunk
    return data


# ---------------------------------------------------------------------------------------------------- the server
def serve(path: str) -> None:
    import importlib

    # Imports only: no tensor op runs here, so no OpenMP thread pool exists to be lost in the forked children.
    for name in PRELOAD:
        importlib.import_module(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    server.settimeout(5.0)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test process is gone (killed): so is the need for a server
                os._exit(0)
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            server.close()
            try:
                _monitor(conn)
            finally:
                os._exit(70)
        conn.close()


def _monitor(conn: socket.socket) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    request = json.loads(_recv_exact(conn, struct.unpack("!I", head)[0]))
    pid = os.fork()
    if pid == 0:
        conn.close()
        _child(request, fds)  # never returns
    for fd in fds:
        os.close(fd)

    import threading

    def relay() -> None:  # the client's signals; its death (EOF) kills the child, as `proc.kill()` would
        while True:
            try:
                b = conn.recv(1)
            except OSError:
                b = b""
            if not b:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return
            try:
                os.kill(pid, b[0])
            except ProcessLookupError:
                return

    threading.Thread(target=relay, daemon=True).start()
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall(struct.pack("!i", status))
    except OSError:
        pass
    os._exit(0)


def _child(request: dict, fds: list[int]) -> None:
    import atexit
    import io
    import runpy
    import threading
    import traceback

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter installs
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    import torch

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # read by the OpenMP runtime at load, i.e. in the server
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    argv = request["argv"]
    code = 0
    try:
        for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(1, entry)
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    # What interpreter shutdown does: wait for non-daemon threads, run atexit, flush.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


# ---------------------------------------------------------------------------------------------------- the client
_server: dict = {}


def command(argv: list[str], env: dict) -> list[str]:
    """The command line that runs `python ARGV` (a script path or `-c CODE`, then its arguments) forked from this
    test process's server (started on first use with `env`, the launches' common environment), or plainly when
    prefork is off or its server failed to start."""
    path = _server_path(env)
    if path is None:
        return [sys.executable, *argv]
    return [sys.executable, os.path.abspath(__file__), "run", path, *argv]


def _server_path(env: dict) -> str | None:
    if os.environ.get("MINDVL_TEST_PREFORK", "1") == "0":
        return None
    if "path" not in _server:
        import atexit
        import subprocess
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="prefork-"), "socket")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path], env=env,
                                stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True)
        ready = proc.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        _server["path"] = path if ready else None
        atexit.register(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
    return _server["path"]


def run_client(path: str, argv: list[str]) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:  # no server (it died): run the script as a plain interpreter would
        os.execv(sys.executable, [sys.executable, *argv])
    payload = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(sock, [struct.pack("!I", len(payload))], [0, 1, 2])
    sock.sendall(payload)
    for sig in FORWARDED:
        signal.signal(sig, lambda n, _frame: sock.send(bytes([n])))
    status = struct.unpack("!i", _recv_exact(sock, 4))[0]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        run_client(sys.argv[2], sys.argv[3:])
