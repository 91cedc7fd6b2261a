# The gateway and the picker: `pagefleet gateway` and `pagefleet picker`, no torch and no
# CUDA (they share only the small protocol and runtime packages with the engine).
#   make image-gateway   (or: docker build -f docker/gateway.Dockerfile -t ghcr.io/pagefleet/gateway:0.1.0 .)
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
# --no-deps: the package's requirements include torch, which the gateway never imports.
RUN pip install --no-deps /src && pip install "pydantic>=2.6" "pydantic-settings>=2.3" "redis[hiredis]>=5" \
    "pyyaml>=6" "fastapi>=0.110" "uvicorn[standard]>=0.30" "prometheus-client>=0.20" "httpx>=0.27" \
    "grpcio>=1.74" "grpcio-health-checking>=1.74" "xds-protos>=1.74"
USER 1000:1000
ENV HOME=/tmp
EXPOSE 8000 9002 9090
ENTRYPOINT ["pagefleet"]
CMD ["gateway", "--host", "0.0.0.0"]
