"""Figures for real SGLang 0.5.23 on CPU with the test model: start time and tokens/s.

    .venv/bin/python scripts/sglang_cpu/measure.py [--arch llama|qwen2]

Makes the tiny model (tests/real_sglang_model.py) in a temporary folder, starts SGLang with the flags the
real_sglang tests use (tests/real_sglang.py: CPU_FLAGS, SGLANG_USE_CPU_ENGINE=1, OMP_NUM_THREADS=1), and
prints one JSON line: seconds from start to /health 200, greedy tokens/s of one 512-token request, of one
512-token stream, and of a batch of 32 x 256 tokens. Stops SGLang (its whole process group) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from real_sglang import CPU_FLAGS, SGLANG_ENV, SGLANG_PY, make_tiny_model  # noqa: E402


def post(url: str, body: dict, stream: bool = False) -> tuple[float, int]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        raw = r.read()
    elapsed = time.perf_counter() - started
    if stream:
        chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        return elapsed, sum(len(c["output_ids"]) for c in chunks)
    out = json.loads(raw)
    outs = out if isinstance(out, list) else [out]
    return elapsed, sum(len(o["output_ids"]) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", args.arch)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(Path(tmp) / "sglang.log", "wb")
        started = time.perf_counter()
        proc = subprocess.Popen([str(SGLANG_PY), "-m", "sglang.launch_server", "--model-path", str(model),
                                 "--host", "127.0.0.1", "--port", str(port), "--incremental-streaming-output",
                                 *CPU_FLAGS], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **SGLANG_ENV})
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                assert proc.poll() is None, (Path(tmp) / "sglang.log").read_text()[-3000:]
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.2)
            start_s = time.perf_counter() - started
            greedy = {"temperature": 0, "ignore_eos": True}
            post(url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, **greedy}})
            one = post(url + "/generate", {"input_ids": [5, 6, 7],
                                           "sampling_params": {"max_new_tokens": 512, **greedy}})
            streamed = post(url + "/generate", {"input_ids": [5, 6, 7], "stream": True,
                                                "sampling_params": {"max_new_tokens": 512, **greedy}}, stream=True)
            batch = post(url + "/generate", {"input_ids": [[5, 6, 7 + i] for i in range(32)],
                                             "sampling_params": {"max_new_tokens": 256, **greedy}})
            print(json.dumps({"start_to_health_s": round(start_s, 1),
                              "one_512_tok_per_s": round(one[1] / one[0]),
                              "stream_512_tok_per_s": round(streamed[1] / streamed[0]),
                              "batch_32x256_tok_per_s": round(batch[1] / batch[0])}))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    main()
