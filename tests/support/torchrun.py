"""Launching torchrun agents on localhost for the fault-tolerance tests, and failing their ranks.

Not a test module.  :class:`Agent` starts one ``python -m torch.distributed.run`` (one node: an agent
and its workers) running a script, reads its output line by line as it comes (with arrival times,
to measure recovery), waits for lines, and kills its ranks by process id: the workers print
``worker rank R pid P world W`` when they start (examples/train_elastic.py does), so the test knows
them.  torchrun starts each worker in a session of its own, so killing an agent leaves its workers
running: :meth:`Agent.kill_node` kills the agent and every worker it started, as a lost node would
lose them.  Everything is bounded in time: a wait that runs out fails with the output so far.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["REPO", "Agent", "free_port", "run_torchrun"]

REPO = Path(__file__).resolve().parents[2]
# Searched, not matched: another process's unfinished line may stand in front of it.
_WORKER = re.compile(r"worker rank (\d+) pid (\d+) world (\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=str(REPO))


class Agent:
    """One torchrun agent running ``script`` with ``script_args`` under ``torchrun_args``."""

    def __init__(self, torchrun_args: list[str], script: str | Path, script_args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun_args, str(script),
                                      *script_args], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append((time.time(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> tuple[int, re.Match]:
        """The first line from index ``start`` on matching ``pattern``: its index and match."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for i in range(start, len(self.lines)):
                    m = regex.search(self.lines[i][1])
                    if m:
                        return i, m
                start = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s; output:\n"
                                         + self.text[-6000:])
                self._changed.wait(min(left, 1.0))

    def workers(self) -> dict[int, int]:
        """Rank -> pid of the workers of the latest start seen so far."""
        out: dict[int, int] = {}
        for _, line in self.lines:
            m = _WORKER.search(line)
            if m:
                out[int(m.group(1))] = int(m.group(2))
        return out

    def kill_rank(self, pid: int) -> float:
        """SIGKILL one worker (a process this test started, by its id); the time it was sent."""
        os.kill(pid, signal.SIGKILL)
        return time.time()

    def kill_node(self) -> float:
        """SIGKILL this agent and each worker it started: the node is gone."""
        pids = set(self.workers().values()) | self._children()
        sent = time.time()
        self.proc.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return sent

    def finish(self, timeout: float) -> int:
        """The agent's exit status; killed (with its session) and failed if it runs past ``timeout``."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"torchrun did not finish within {timeout:.0f} s; output:\n{self.text[-6000:]}")
        self._reader.join(10)
        return self.proc.returncode

    def _children(self) -> set[int]:
        """The ids of the agent's live child processes (its workers, whatever they printed)."""
        out = set()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rpartition(")")[2].split()
                except OSError:
                    continue
                if int(fields[1]) == self.proc.pid:  # the field after the state: the parent's id
                    out.add(int(entry))
        return out

    def stop(self) -> None:
        """Kill whatever is left of this agent: its workers (by their ids), it and its session."""
        for pid in set(self.workers().values()) | (self._children() if self.proc.poll() is None else set()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def run_torchrun(torchrun_args: list[str], script, script_args: list[str], timeout: float) -> Agent:
    """One agent run to its end (status 0 asserted); the agent, for its output."""
    agent = Agent(torchrun_args, script, script_args)
    rc = agent.finish(timeout)
    assert rc == 0, f"torchrun exited {rc}:\n{agent.text[-6000:]}"
    return agent
