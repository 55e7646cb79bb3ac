# stagerl worker image: the checkout at /opt/stagerl, installed with a CPU or CUDA torch.
#   docker build -t stagerl .                                  # CPU
#   docker build -t stagerl-gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#       --build-arg EXTRAS=gpu .                               # GPU (vLLM rollout)
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=test
ENV PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
    TORCH_EXTENSIONS_DIR=/opt/stagerl/.cache/torch_extensions \
    PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_WORKER_QUERY_SECONDS=5
RUN apt-get update && apt-get install -y --no-install-recommends build-essential git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/stagerl
COPY pyproject.toml README.md ./
COPY configs configs
COPY flows flows
COPY stages stages
COPY storage storage
# torch is pinned first so nothing pulls another build (DESIGN.md, facts).
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX} torch==2.13.0 \
    && pip install --no-cache-dir -e ".[${EXTRAS}]" \
    && python -m stages.ranks.deepspeed_ops || true
COPY prefect.yaml ./
COPY tests tests
CMD ["prefect", "worker", "start", "--pool", "cpu"]
