# pdserve, CPU only: one image for the router, the prefill and decode nodes and the
# one-shot model builder (see compose.yaml). Installs the project the README's way:
# torch pinned and installed first, then the project.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDSERVE_CACHE=/models

# The CPU wheel index, so pip never pulls a CUDA build of torch and its GPU libraries.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0

WORKDIR /opt/pdserve
COPY . .
RUN pip install .

# Run as a user; /models is the demo-model volume (a fresh named volume takes this owner).
RUN useradd --create-home --uid 10001 pdserve && mkdir -p /models && chown pdserve /models
USER pdserve

EXPOSE 50051 8000
CMD ["pdserve", "--help"]
