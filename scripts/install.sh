#!/usr/bin/env bash
# Install rollout-manager into ./.venv on a fresh machine (CPU build of Mooncake; tests included).
# Idempotent: a second run only checks. Env: PYTHON (default python3), EXTRAS (default: every extra but cuda, sglang and bench),
# WITH_VERL (default 1: verl 0.9.1 for the trainer plugin and its tests), WITH_SGLANG (default 1: real SGLang
# 0.5.23 for CPU in its own ./.venv-sglang, for the tests marked real_sglang; scripts/sglang_cpu/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-cpu,agent,cpu-engine,demo,verl,test,lint}

# Mooncake's transfer engine links libibverbs even in its TCP-only CPU build.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "install.sh: installing libibverbs1 (needed by mooncake-transfer-engine)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    echo "install.sh: warning: libibverbs.so.1 not found; install your distribution's libibverbs package" >&2
  fi
fi

# Debian's Chromium renders the status page in the tests (headless); they skip without it.
if [ ! -x /usr/bin/chromium ] && [ "${WITH_CHROMIUM:-1}" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "install.sh: installing chromium (status-page test)"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
    || echo "install.sh: warning: chromium not installed; the status-page test will skip" >&2
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first and pinned, so that no later dependency range pulls a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[${EXTRAS}]"
# SGLang 0.5.23's own /generate contract (sglang/api/v1/api_types.py, which needs only msgspec) for the CPU
# engine and the contract tests: the wheel alone, --no-deps, so none of its GPU stack comes along; that
# one file is loaded by path and the sglang package itself is never imported.
.venv/bin/python -c "import importlib.metadata as m; assert m.version('sglang') == '0.5.23'" 2>/dev/null \
  || "${PIP[@]}" --no-deps "sglang==0.5.23"
# verl 0.9.1 for the trainer plugin, after torch so no range replaces the CPU build; every version pinned.
# TransferQueue (verl V1's store of finished rollouts), cachetools (its load balancer) and fastapi/uvicorn
# (its rollout utilities) are imported on verl's V1 trainer path, but verl 0.9.1 declares them only in
# its verl-core extra, whose other members (flash-attn, nvtx, ...) do not belong on a CPU box.
if [ "${WITH_VERL:-1}" = 1 ]; then
  .venv/bin/python -c "import importlib.metadata as m; assert m.version('verl') == '0.9.1'
m.version('TransferQueue'); m.version('cachetools'); m.version('uvicorn')" 2>/dev/null \
    || "${PIP[@]}" -c tests/verl_constraints.txt "verl==0.9.1" "TransferQueue==0.1.11" "cachetools==8.0.1" "fastapi==0.165.0" "uvicorn==0.54.0"
fi
if [ "${WITH_SGLANG:-1}" = 1 ]; then
  PYTHON="$PYTHON" bash scripts/sglang_cpu/install.sh
fi
echo "install.sh: ready: $(.venv/bin/rollout-manager --version)"
