# syntax=docker/dockerfile:1
# fairway: one image for the picker (`python -m picker`, the entrypoint) and the operator
# (`python -m fairway_operator`). Build: `make image` (docker build -t fairway:<the chart's
# appVersion> ., the tag the chart pulls by default).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: the project and its runtime dependencies (no dev extras) into a virtualenv ---------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/fairway
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY picker/ picker/
COPY operator/ operator/
RUN /opt/fairway/bin/pip install -c constraints.txt . \
 && /opt/fairway/bin/python -m compileall -q /opt/fairway/lib \
 && /opt/fairway/bin/python -c "import picker.server, fairway_operator.handlers"

# --- runtime: the virtualenv only, as a non-root user --------------------------------------------
FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 fairway \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
            --shell /usr/sbin/nologin fairway
COPY --from=build /opt/fairway /opt/fairway
ENV PATH=/opt/fairway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric, so that Kubernetes' runAsNonRoot can check it without an explicit runAsUser.
USER 10001:10001
WORKDIR /tmp
# ext_proc + gRPC health, metrics, admin API.
EXPOSE 9002 9003 9004 9090
ENTRYPOINT ["python", "-m", "picker"]
# The chart passes `serve ...`; the operator overrides the command (python -m fairway_operator).
CMD ["--help"]
