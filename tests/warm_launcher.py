"""A warm launcher for the tests: one long-lived process per test worker that imports the training stack once, then
forks the ranks of each launch from that state.

A rank started by torchrun spends about 6.5 s of CPU importing torch, transformers, FSDP and the rest before it
runs a step, and the suite launches a few hundred jobs on 2 cores. A forked rank starts with those modules loaded.
After the fork it does what torchrun's ranks do: torchrun's environment variables (RANK, WORLD_SIZE, ...,
MASTER_ADDR/MASTER_PORT), a real gloo process group, the script run as `__main__` with its arguments, output to
shared files, a normal interpreter exit, and the job's status as torchrun reports it (0, or 1 when any rank failed;
a failed rank's peers are stopped). What needs torchrun itself (signals sent to it, a dead rank, several nodes)
launches torchrun.

It serves launches whose environment is the one it was started with, but for PYTEST_CURRENT_TEST (tests/conftest.py
starts it with worker_env() and starts a new one when that changes): a variable read at import (HF_HUB_OFFLINE) was
read here. Protocol: one JSON request per line on stdin ({script, args, nproc, timeout, stdout, stderr, env}); one
JSON reply per line on the channel that was stdout ({returncode, timed_out}).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from typing import TextIO

from qlora_fsdp.parallel.distributed import free_port

# What a training rank imports (the CLI imports lazily): loaded once here, before any fork.
PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
    "transformers.models.llama.modeling_llama", "peft", "datasets", "bitsandbytes", "hqq.core.quantize", "fire",
    "qlora_fsdp.cli", "qlora_fsdp.train.trainer",
)  # fmt: skip
# A failed rank's peers get this long to finish on their own (printing their own error line) before SIGTERM, and
# as long again before SIGKILL.
GRACE_S = 2.0
PR_SET_PDEATHSIG = 1
LAUNCHER_PID = os.getpid()


class RankExit(BaseException):
    """Raised in a forked rank once its script is done: it unwinds to this module's `__main__`, which exits the
    interpreter normally (threads joined, atexit handlers, C++ teardown), so an abort at exit shows in the status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _become_rank(request: dict, rank_env: dict[str, str], channel: TextIO) -> None:
    """In the forked child: its own process group (a stop reaches the workers it forks), death with the launcher,
    /dev/null in and the launch's files out, the launch's environment and torchrun's variables."""
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != LAUNCHER_PID:  # the launcher died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, channel.fileno()):  # the channel's file object stays, writing nowhere, and closes cleanly at exit
        os.dup2(null, fd)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.update(request["env"])
    os.environ.update(rank_env)
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))


def _run_rank(request: dict, rank_env: dict[str, str], channel: TextIO) -> int:
    """The rank's script as `python script` runs it; its exit status."""
    try:
        _become_rank(request, rank_env, channel)
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:  # what an uncaught exception does to a process: a traceback and status 1
        traceback.print_exc()
        return 1
    return 0


def _signal_once(pids: list[int], sig: int, sent: set[int]) -> None:
    """`sig` to each rank's process group, once."""
    if sig in sent:
        return
    sent.add(sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


def _launch(request: dict, channel: TextIO) -> dict:
    """Fork the ranks, wait for them as torchrun's agent does, and report the job's status. Whatever stops this
    (a timeout, SIGTERM or SIGINT to the launcher) stops the ranks too."""
    nproc = request["nproc"]
    port = str(free_port())
    pids: list[int] = []
    codes: dict[int, int] = {}
    timed_out = False
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        for rank in range(max(nproc, 1)):
            rank_env = {} if nproc == 0 else {
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
                "MASTER_ADDR": "localhost", "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": "warm-launcher",
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            }  # fmt: skip
            pid = os.fork()
            if pid == 0:
                raise RankExit(_run_rank(request, rank_env, channel))
            os.setpgid(pid, pid)  # here too: a stop sent before the child ran its own setpgid still reaches it
            pids.append(pid)
        deadline = time.monotonic() + request["timeout"]
        failed_at: float | None = None
        sent: set[int] = set()
        while len(codes) < len(pids):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.monotonic()
                continue
            now = time.monotonic()
            running = [p for p in pids if p not in codes]
            if now > deadline:
                timed_out = True
                _signal_once(running, signal.SIGKILL, sent)
            elif failed_at is not None and now > failed_at + 2 * GRACE_S:
                _signal_once(running, signal.SIGKILL, sent)
            elif failed_at is not None and now > failed_at + GRACE_S:
                _signal_once(running, signal.SIGTERM, sent)
            time.sleep(0.02)
    finally:
        if os.getpid() == LAUNCHER_PID:
            for pid in (p for p in pids if p not in codes):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    failed = any(code != 0 for code in codes.values())
    returncode = codes[pids[0]] if nproc == 0 else int(failed)  # torchrun: 1 when any rank failed
    return {"returncode": returncode, "timed_out": timed_out}


def _stop(signum: int, _frame: object) -> None:
    """SIGTERM to the launcher (pytest's worker ending, conftest replacing it): unwind, stopping the ranks."""
    raise SystemExit(128 + signum)


def main() -> None:
    """Import PRELOAD, say ready, then serve launches until stdin closes."""
    channel = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # a stray print here must not corrupt the channel
    os.close(null)
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()
    if threading.active_count() != 1:  # a Python thread would not survive the fork, and might hold a lock
        raise RuntimeError(f"threads after importing the stack: {threading.enumerate()}")
    signal.signal(signal.SIGTERM, _stop)
    channel.write(json.dumps({"ready": True}) + "\n")
    channel.flush()
    for line in sys.stdin:
        reply = _launch(json.loads(line), channel)
        channel.write(json.dumps(reply) + "\n")
        channel.flush()


if __name__ == "__main__":
    try:
        main()
    except RankExit as done:  # a forked rank, its script done: the interpreter's own exit, with the script's status
        sys.exit(done.code)
