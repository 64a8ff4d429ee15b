#!/usr/bin/env bash
# benchmarks/bench_router.py on a many-core machine without internet (the router's scaling with
# --processes shows only where the cores are not all taken by the workers and the load generator).
# Beforehand, where pip can download, put the router's wheels for the target's Python in .whl/:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 -d .whl fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
#     httptools==0.9.0 orjson==3.13.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types \
#     typing-inspection typing-extensions opentelemetry-api smg==1.13.0 setproctitle grpcio-health-checking
# (the machine is assumed to have aiohttp, uvloop, httpx, prometheus-client, pyyaml and grpcio).
#   bash benchmarks/bench_router_host.sh OUT_DIR [bench_router.py flags]   (from the repository root)
set -euo pipefail
out=${1:?usage: bench_router_host.sh OUT_DIR [bench_router.py flags]}
shift
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/pd .
export PYTHONPATH=/tmp/pd:/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
mkdir -p "$out"
python3 -m benchmarks.bench_router --out "$out/bench_router.json" "$@" 2>&1 | tee "$out/bench_router.log"
