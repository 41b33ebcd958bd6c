# CPU image: the gateway serving the demo model (SmolLM2-135M-Instruct, FP8 block) out of the box.
#   docker build -t warmgate .
#   docker run -p 8000:8000 -v warmgate-run:/run/warmgate warmgate
# Another model: mount it and pass --model, or a config file (docs/operations.md). The GPU image is
# deploy/Dockerfile.cuda. tests/test_deploy.py runs this image's command outside Docker in CI.
FROM python:3.11-slim

# make: the install steps are the Makefile's. tini runs as PID 1: it passes signals on to the gateway (a PID 1
# ignores a signal it has no handler for: a SIGTERM during the gateway's start-up would be lost) and reaps
# orphans (engines whose fork server died are re-parented to PID 1; the gateway would never reap them).
RUN apt-get update && apt-get install -y --no-install-recommends make tini && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 1000 warmgate
WORKDIR /opt/warmgate
COPY Makefile pyproject.toml README.md ./
COPY app ./app
COPY cache ./cache
COPY common ./common
COPY engine ./engine

# The install steps are the Makefile's (`make setup`, as for `make demo`), without the dev tools.
# PyPI's Linux torch wheel is a CUDA build (several GB): for a small image pass PyTorch's CPU wheel index,
#   --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH=torch==2.13.0
ARG EXTRAS=
ARG PIP_EXTRA_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN make setup VENV=/opt/venv TORCH="$TORCH" EXTRAS="$EXTRAS"

# The demo is built into the image (read-only at run time); the run dir (sockets, engine logs, the admin
# token) lives on a volume. The gateway makes it mode 0700 itself: a subdirectory, so that a fresh volume
# of any mode (a Kubernetes emptyDir is 0777) works.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    WARMGATE_CACHE_DIR=/var/cache/warmgate \
    WARMGATE_RUN_DIR=/run/warmgate/gateway \
    WARMGATE_GATEWAY__HOST=0.0.0.0 \
    WARMGATE_GATEWAY__PORT=8000
RUN warmgate model demo --scheme fp8-block --quiet \
 && install -d -o warmgate -m 0700 /run/warmgate
VOLUME /run/warmgate
USER warmgate
EXPOSE 8000

# /ready answers once the active engine has generated a token (a real 1-token probe).
HEALTHCHECK --interval=30s --timeout=35s --start-period=600s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${WARMGATE_GATEWAY__PORT}/ready', timeout=30)"

ENTRYPOINT ["tini", "--", "warmgate"]
CMD ["serve"]
