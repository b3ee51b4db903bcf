#!/usr/bin/env bash
# Install real SGLang 0.5.23 for CPU into ./.venv-sglang, for the tests marked real_sglang (called by
# scripts/install.sh; runs alone too). Idempotent: a second run only checks.
#
# Its own venv, not .venv: SGLang pins transformers 5.19.0 and tokenizers 0.23.2 where verl 0.9.1's set
# (tests/verl_constraints.txt) has transformers 5.10.4, and with torchvision installed transformers itself
# stops importing its models on the CPU torch unless the torchvision hook below is active. The venv holds
# torch 2.13.0 (CPU), every package of requirements.txt with --no-deps, this project (for the receiver
# agent that runs beside SGLang) and the two support pieces of this folder: the sgl_kernel stand-in and
# the torchvision hook (sglang_cpu_hook.py, activated by a .pth file when SGLANG_USE_CPU_ENGINE=1).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
VENV=${SGLANG_VENV:-.venv-sglang}
HERE=scripts/sglang_cpu

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

# torch first and alone, so that the CPU build is the one in place (the list pins torch==2.13.0 too).
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
if ! "$VENV/bin/python" -I - "$HERE/requirements.txt" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        assert m.version(name).split("+")[0] == version, name
PY
then
  "${PIP[@]}" --no-deps -r "$HERE/requirements.txt" 2>&1 | grep -v -e "is ignored" -e "^sglang 0.5.23 requires" \
    -e "^ERROR: pip's dependency resolver" >&2 || true
fi
"$VENV/bin/python" -I -c "import rollout_manager" 2>/dev/null \
  || "${PIP[@]}" --no-deps -e .
# The support pieces, copied in (kept in step with this checkout on every run).
for f in sglang_cpu_hook.py sglang_cpu_hook.pth sgl_kernel/__init__.py; do
  mkdir -p "$(dirname "$SITE/$f")"
  cmp -s "$HERE/$f" "$SITE/$f" || cp "$HERE/$f" "$SITE/$f"
done
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -I -c "
import sgl_kernel, torch, torchvision, sglang.srt.entrypoints.http_server, mooncake, rollout_manager.weights.receiver_agent
assert not hasattr(torch.ops.sgl_kernel, 'convert_weight_packed')
" 2>/dev/null || { echo "install.sh: real SGLang in $VENV does not import; rerun with SGLANG_USE_CPU_ENGINE=1 $VENV/bin/python -c 'import sglang.srt.entrypoints.http_server' to see why" >&2; exit 1; }
echo "install.sh: real SGLang ready: $VENV ($("$VENV/bin/python" -c "import importlib.metadata as m; print('sglang', m.version('sglang'))"))"
