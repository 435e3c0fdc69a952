# Shared by the bench/gpu_*.sh scripts (source it after `cd` to the repository root).

failed=()
step() {  # step NAME COMMAND...: run, time, and remember failures without stopping the rest
    local name=$1 start=$SECONDS rc
    shift
    echo "== $name: $*"
    "$@"
    rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

device_name() {  # the GPU's name as bench/common.device_name spells it (results files' names)
    python3 -c 'import sys; sys.path.insert(0, "."); from bench.common import device_name; print(device_name("cuda:0"))'
}

install() {  # offline: the GPU machine has torch, numpy, msgpack, networkx but no network
    if compgen -G ".whl/*.whl" > /dev/null; then  # wheels carried along (pyzmq, ...: bench/README.md)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
            export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    python3 -m pip install --no-build-isolation --no-deps --no-index -q -e . ||
        python3 -m pip install --no-build-isolation --no-deps --no-index -q .
}

import_check() {  # every module but the ZeroMQ ones must import without pyzmq (the GPU box has none)
    python3 - <<'PY'
import importlib, pkgutil, sys
try:
    import zmq  # noqa: F401
    have_zmq = True
except ImportError:
    have_zmq = False
print("pyzmq", "present" if have_zmq else "absent")
needs_zmq = {"batchmaker.serving.server", "batchmaker.serving.client", "batchmaker.serving.demo",
             "batchmaker.replica", "batchmaker.replica_front", "batchmaker.replica_wire", "batchmaker.replicas"}
bad = []
for pkg in ("batchmaker", "batchmaker.core", "batchmaker.exec", "batchmaker.serving", "batchmaker.cells", "batchmaker.unfolders", "batchmaker.kernels"):
    for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__):
        name = f"{pkg}.{m.name}"
        if name in needs_zmq and not have_zmq:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:
            bad.append(f"{name}: {type(e).__name__}: {e}")
print("import failures:", bad or "none")
sys.exit(1 if bad else 0)
PY
}
