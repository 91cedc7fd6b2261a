# Container images (need a Docker engine; none is available on the development machines).
REGISTRY ?= ghcr.io/pagefleet
TAG ?= 0.1.0

.PHONY: images image-engine image-gateway image-operator
images: image-engine image-gateway image-operator

image-engine:
	docker build -f docker/engine.Dockerfile -t $(REGISTRY)/engine:$(TAG) .

image-gateway:
	docker build -f docker/gateway.Dockerfile -t $(REGISTRY)/gateway:$(TAG) .

image-operator:
	docker build -f docker/operator.Dockerfile -t $(REGISTRY)/operator:$(TAG) .
