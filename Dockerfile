# One image for the API and the workers. The default torch wheel carries CUDA, so the same image
# serves the GPU worker (with the NVIDIA container runtime) and the CPU services.
FROM python:3.12-slim
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir -e '.[gpu,github]'
RUN useradd --create-home pathgate && mkdir -p /var/lib/pathgate && chown pathgate /var/lib/pathgate
USER pathgate
