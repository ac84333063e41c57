# SkipKey's app as a Hugging Face Docker Space, or anywhere:
#   docker build -t skipkey .                      # CPU-only torch (small image)
#   docker build --build-arg TORCH=cuda -t skipkey . # PyPI's default torch, with CUDA
#   docker run -p 7860:7860 skipkey
FROM python:3.11-slim

# cpu: torch's CPU-only wheels; cuda: the default PyPI build, for GPU hardware. Either way the torch the
# README pins (tests/test_dockerfile.py checks they agree).
ARG TORCH=cpu
ARG TORCH_VERSION=2.13.0

# A C++ compiler for SkipKey's fused CPU kernels (skipkey/core/kernels.py): KV eviction at full speed on CPU.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# Spaces run the container as uid 1000 and send traffic to port 7860.
RUN useradd --create-home --uid 1000 user
USER user
ENV HOME=/home/user \
    PATH=/home/user/.local/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False
WORKDIR $HOME/app

COPY --chown=user requirements.txt .
RUN if [ "$TORCH" = "cpu" ]; then \
        pip install --user "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu; \
    else \
        pip install --user "torch==$TORCH_VERSION"; \
    fi \
    && pip install --user -r requirements.txt

COPY --chown=user . .
# Convert the embedded model at build time, as the user that serves it, so the first visitor does not wait.
# (The kernels are compiled when the app starts, for the CPU it runs on: a Space builds on other hardware.)
RUN python -c "from skipkey.core.loading import embedded_model_dir; embedded_model_dir()"

EXPOSE 7860
# Healthy once the page answers; the start period covers loading the model and compiling the kernels.
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/', timeout=8)" || exit 1
CMD ["python", "app.py"]
