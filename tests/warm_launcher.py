"""A warm launcher for the tests: one long-lived process per test worker that imports the training stack once, then
forks the ranks of each launch from that state.

A rank started by torchrun spends about 6.5 s of CPU importing torch, transformers, FSDP and the rest before it
runs a step, and the suite launches a few hundred jobs on 2 cores. A forked rank starts with those modules loaded.
Everything after the fork is what torchrun's ranks do: torchrun's environment variables (RANK, WORLD_SIZE, ...,
MASTER_ADDR/MASTER_PORT), a real gloo process group, the script run as `__main__` with its arguments, output to
shared files, and the job's exit status as torchrun reports it (0, or 1 when any rank failed; a failed rank's
peers are stopped). What needs torchrun itself (signals sent to it, a dead rank, several nodes) launches torchrun.

It serves launches whose environment is the one it was started with (tests/conftest.py starts it with
worker_env() and launches anything else for real): a variable read at import (HF_HUB_OFFLINE) was read here.
Protocol: one JSON request per line on stdin ({script, args, nproc, timeout, stdout, stderr}); one JSON reply per
line on the channel that was stdout ({returncode, timed_out}).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several ranks, before torch loads OpenMP

# What a training rank imports (the CLI imports lazily): loaded once here, before any fork.
PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
    "transformers.models.llama.modeling_llama", "peft", "datasets", "bitsandbytes", "hqq.core.quantize", "fire",
    "qlora_fsdp.cli", "qlora_fsdp.trainer",
)  # fmt: skip
# A failed rank's peers get this long to finish on their own (printing their own error line) before SIGTERM, and
# as long again before SIGKILL.
GRACE_S = 2.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(request: dict, rank_env: dict[str, str]) -> None:
    """In the forked child: become the rank (environment, output files, argv) and run the script; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group, so a timeout also stops the workers it forks
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.update(rank_env)
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:  # what an uncaught exception does to a process: a traceback and status 1
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # what the interpreter runs at a normal exit; os._exit below skips it
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


def _launch(request: dict, channel_fds: tuple[int, ...]) -> dict:
    """Fork the ranks, wait for them as torchrun does, and report the job's status."""
    nproc = request["nproc"]
    port = str(_free_port())
    pids: dict[int, int] = {}
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
            for fd in channel_fds:
                os.close(fd)
            _run_rank(request, rank_env)
        os.setpgid(pid, pid)  # here too: a stop sent before the child ran its own setpgid still reaches it
        pids[pid] = rank
    deadline = time.monotonic() + request["timeout"]
    codes: dict[int, int] = {}
    failed_at: float | None = None
    timed_out = False
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        now = time.monotonic()
        running = set(pids) - set(codes)
        if now > deadline and not timed_out:
            timed_out = True
            _stop(running, signal.SIGKILL)
        elif failed_at is not None and now > failed_at + 2 * GRACE_S:
            _stop(running, signal.SIGKILL)
        elif failed_at is not None and now > failed_at + GRACE_S:
            _stop(running, signal.SIGTERM)
        time.sleep(0.02)
    failed = any(code != 0 for code in codes.values())
    returncode = next(iter(codes.values())) if nproc == 0 else int(failed)  # torchrun: 1 when any rank failed
    return {"returncode": returncode, "timed_out": timed_out}


def main() -> None:
    channel = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # a stray print here must not corrupt the channel
    os.close(null)
    for name in PRELOAD:
        importlib.import_module(name)
    channel.write(json.dumps({"ready": True}) + "\n")
    channel.flush()
    for line in sys.stdin:
        reply = _launch(json.loads(line), (0, channel.fileno()))
        channel.write(json.dumps(reply) + "\n")
        channel.flush()


if __name__ == "__main__":
    main()
