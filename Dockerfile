# One image for the API and the workers. The CPU build of torch keeps it small; a GPU worker
# image installs the CUDA build instead (pip install torch) plus the [gpu] extra.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir torch==2.13.0 -e .
RUN useradd --create-home pathgate && mkdir -p /var/lib/pathgate && chown pathgate /var/lib/pathgate
USER pathgate
