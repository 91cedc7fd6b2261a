# The operator: `pagefleet operator` (kopf), no torch and no CUDA.
#   make image-operator   (or: docker build -f docker/operator.Dockerfile -t ghcr.io/pagefleet/operator:0.1.0 .)
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY kernels /src/kernels
COPY protocol /src/protocol
COPY runtime /src/runtime
COPY gateway /src/gateway
COPY operator /src/operator
COPY cli /src/cli
# --no-deps: the package's requirements include torch, which the operator never imports.
RUN pip install --no-deps /src && pip install "pydantic>=2.6" "pydantic-settings>=2.3" "redis[hiredis]>=5" \
    "pyyaml>=6" "kopf>=1.45,<2" "aiohttp>=3.9"
USER 1000:1000
ENV HOME=/tmp
EXPOSE 8080
ENTRYPOINT ["pagefleet"]
CMD ["operator"]
