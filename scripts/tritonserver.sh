#!/usr/bin/env bash
# Run the tritonserver binary of .venv-triton (scripts/setup_triton.sh) with its Python backend;
# arguments go to tritonserver, e.g.
#   bash scripts/tritonserver.sh --model-repository models --http-port 8000
# TRITON_VENV picks another environment with nvidia-pytriton installed [.venv-triton].
set -euo pipefail
venv=${TRITON_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv-triton}
py=$venv/bin/python
[ -x "$py" ] || { echo "error: $venv has no Python; run scripts/setup_triton.sh" >&2; exit 1; }
read -r package libs base version < <("$py" -c "import pathlib, sys, pytriton
p = pathlib.Path(pytriton.__file__).parent
print(p / 'tritonserver', p.parent / 'nvidia_pytriton.libs', sys.base_prefix, f'{sys.version_info[0]}.{sys.version_info[1]}')")
# a backend directory as tritonserver expects it: the wheel's Python backend beside the stub for
# this interpreter's version
backends=$venv/triton-backends
if [ ! -x "$backends/python/triton_python_backend_stub" ]; then
    mkdir -p "$backends/python"
    cp -r "$package"/backends/python/. "$backends/python/"
    cp "$package/python_backend_stubs/$version/triton_python_backend_stub" "$backends/python/"
fi
# the stub links libpython: the interpreter's own lib/ first (a pyenv build differs from the
# system's libpython3.11, which kills the stub with '_thread.RLock' ... '_recursion_count');
# its venv's bin/ first on PATH, so that the stub runs in that environment
export LD_LIBRARY_PATH=$base/lib:$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$venv/bin:$PATH
exec "$package/bin/tritonserver" --backend-directory "$backends" "$@"
