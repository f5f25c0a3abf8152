"""vLLM's OpenAI server as a child process: started in a session of its own on a local Hugging
Face checkpoint (no tokenizer: prompts and answers are token ids), waited for until /health
answers, stopped with its engine core.

    python -m vllm.entrypoints.openai.api_server --model DIR --skip-tokenizer-init --dtype float32
        --max-model-len N --enforce-eager --port P --host 127.0.0.1

The CPU build reads `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache; 1 here) and `OMP_NUM_THREADS`,
and `VLLM_CPU_OMP_THREADS_BIND`, which is `nobind` here unless the environment sets it. vLLM's
default, `auto` (vllm.utils.ompmultiprocessing, 0.32), is made for one engine per NUMA node: it
gives the engine the node's cores less one it reserves, sets `OMP_NUM_THREADS` to their count
(whatever `threads` said) and pins the model worker to them (OMP_PROC_BIND). Every engine on a
machine then computes on the same cores: on a 2-core machine two replicas both on core 0, while
core 1 runs neither. Unbound, each engine runs `threads` compute threads wherever the kernel has
room; an operator placing engines on cores of their own sets `VLLM_CPU_OMP_THREADS_BIND` per engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from rose.child_server import free_port, stop_session, wait_http_ok


class ServerError(RuntimeError):
    """The server did not come up; the message says why and ends with its log's last lines."""


@dataclass(frozen=True)
class VllmServer:
    url: str  # http://127.0.0.1:PORT
    model: str  # the checkpoint directory, also the model name requests give
    log: Path
    proc: subprocess.Popen | None = None  # None: a server started elsewhere


def server_argv(model: str, port: int, max_model_len: int, python: str = "") -> list[str]:
    return [
        python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]


def start_server(
    model: str,
    log: Path,
    *,
    port: int = 0,
    max_model_len: int = 1024,
    threads: int = 1,
    python: str = "",
    timeout_s: float = 240.0,
    env: Mapping[str, str] | None = None,
) -> VllmServer:
    """Start the server (`port` 0: a free one) and wait until /health answers 200; ServerError
    (the server stopped) when it exits first or is not healthy within `timeout_s`. The child
    gets SIGTERM should this process die (`rose.rollout.launcher.spawn`)."""
    from rose.rollout.launcher import spawn

    port = port or free_port()
    full_env = {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # `threads` unbound: see the module's docstring
        **os.environ,
        **(env or {}),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": str(threads),
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        # a session of its own: the engine core is a child process, stopped with the server
        proc = spawn(
            server_argv(model, port, max_model_len, python),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    srv = VllmServer(f"http://127.0.0.1:{port}", str(model), log, proc)
    try:
        wait_healthy(srv, timeout_s)
    except BaseException:
        stop_server(srv)
        raise
    return srv


def wait_healthy(srv: VllmServer, timeout_s: float) -> None:
    wait_http_ok(srv.url + "/health", srv.proc, srv.log, timeout_s, what="vLLM server", error=ServerError)


def stop_server(srv: VllmServer) -> None:
    """SIGTERM the server's session, SIGKILL it after 30 s; also whatever of it outlived the server."""
    if srv.proc is not None:
        stop_session(srv.proc, 30)


def stream_tokens(srv: VllmServer, prompt: list[int], max_tokens: int, timeout_s: float = 120.0) -> Iterator[int]:
    """One streaming `/v1/completions` request with token ids as the prompt and exactly
    `max_tokens` answer tokens (`ignore_eos`); yields, as each server-sent event arrives, how many
    token ids it carried (the events carry ids, the text stays empty without a tokenizer)."""
    body = {
        "model": srv.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        srv.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - local server
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            k = sum(len(c.get("token_ids") or ()) for c in json.loads(line[5:])["choices"])
            if k:
                yield k
