# The gateway and the operator: no torch, no CUDA (they share only the small protocol package
# with the engine). One Dockerfile, two targets:
#   docker build -f docker/slim.Dockerfile --target gateway -t ghcr.io/pagefleet/gateway:0.1.0 .
#   docker build -f docker/slim.Dockerfile --target operator -t ghcr.io/pagefleet/operator:0.1.0 .
FROM python:3.11-slim AS base
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY kernels /src/kernels
COPY protocol /src/protocol
COPY gateway /src/gateway
COPY operator /src/operator
COPY cli /src/cli
# --no-deps: the package's own requirements include torch, which these images never import.
RUN pip install --no-deps /src && pip install "pydantic>=2.6" "pydantic-settings>=2.3" "redis[hiredis]>=5" "pyyaml>=6"
USER 1000:1000
ENV HOME=/tmp
ENTRYPOINT ["pagefleet"]

FROM base AS gateway
RUN pip install "fastapi>=0.110" "uvicorn[standard]>=0.30" "prometheus-client>=0.20" "aiohttp>=3.9" "httpx>=0.27"
EXPOSE 8000
CMD ["gateway", "--host", "0.0.0.0"]

FROM base AS operator
RUN pip install "kopf>=1.45,<2" "aiohttp>=3.9"
EXPOSE 8080
CMD ["operator"]
