"""What SGLang's tensor read-back costs on one big parameter: the time and host memory of
``/get_weights_by_name`` on a tensor the size of an 8B model's embedding (128,256 x 4,096).

SGLang 0.5.23's ``LlamaForCausalLM.get_weights_by_name`` (``srt/models/llama.py``) converts the *whole*
parameter with ``.cpu().to(torch.float32).numpy().tolist()`` and only then keeps ``truncate_size`` rows;
this script runs exactly that conversion on a tensor of the given shape and dtype, on the given device, and
prints its wall time and the growth of the process's peak resident memory. It is why the manager does not
read tensors back inside an activation pause.

    python benchmarks/bench_readback.py                       # 128256 x 4096 bf16 on cuda if present, else cpu
    python benchmarks/bench_readback.py --rows 32000 --device cpu
"""

from __future__ import annotations

import argparse
import gc
import resource
import time

import torch


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128_256)
    ap.add_argument("--cols", type=int, default=4_096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--truncate", type=int, default=4, help="rows kept, as the receiver asks (truncate_size)")
    args = ap.parse_args()

    t = torch.randn(args.rows, args.cols, dtype=getattr(torch, args.dtype), device=args.device)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    gc.collect()
    base = _peak_rss_bytes()
    start = time.perf_counter()
    rows = t.cpu().to(torch.float32).numpy().tolist()[: args.truncate]  # SGLang's conversion, verbatim in effect
    elapsed = time.perf_counter() - start
    grown = _peak_rss_bytes() - base
    assert len(rows) == args.truncate
    # The probe that replaces it reads back nothing: the same rows sliced before conversion cost this much.
    start = time.perf_counter()
    t[: args.truncate].cpu().to(torch.float32).tolist()
    sliced = time.perf_counter() - start
    n = args.rows * args.cols
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'host'}), "
          f"tensor {args.rows} x {args.cols} {args.dtype} ({n * t.element_size() / 2**30:.2f} GiB)")
    print(f"read-back as SGLang does it: {elapsed:.1f} s, peak host memory +{grown / 2**30:.1f} GiB "
          f"({grown / n:.0f} bytes per element); the same {args.truncate} rows sliced first: {sliced * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
