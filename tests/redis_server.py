"""A private redis-server for tests: its own port and folder, started and stopped by the test."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(host: str, port: int) -> bool:
    client = redis.Redis(host=host, port=port, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


class RedisServer:
    """redis-server on 127.0.0.1:<port> keeping its files in ``folder``.

    ``persistent``: AOF with fsync on every write and no RDB snapshots, so a SIGKILL loses
    nothing that was acknowledged; otherwise nothing is kept on disk.
    """

    def __init__(self, folder: Path, *, persistent: bool = True, port: int | None = None):
        self.folder = Path(folder)
        self.port = port or free_port()
        self.persistent = persistent
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        if answers("127.0.0.1", self.port):
            raise RuntimeError(f"a Redis server that this test did not start answers on port "
                               f"{self.port}: choose another port")
        self.folder.mkdir(parents=True, exist_ok=True)
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent \
            else ["--appendonly", "no"]
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.folder), "--save", "", *aof],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60  # generous: only a real failure to start
        while not answers("127.0.0.1", self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)
        # Whoever took the free port between its choice and the start would answer too: only
        # the server whose process this is counts.
        pid = redis.Redis(host="127.0.0.1", port=self.port).info("server")["process_id"]
        if pid != self.process.pid:
            self.stop()
            raise RuntimeError(f"the Redis server on port {self.port} is process {pid}, not the "
                               f"one this test started ({self.process.pid})")
        return self

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown save."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
