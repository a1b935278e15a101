# The app on a GPU host:  docker build -t kv-arena . && docker run --gpus all -p 7860:7860 kv-arena
# PyPI's Linux torch wheels bring their own CUDA libraries; the host needs the NVIDIA container toolkit.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    HF_HOME=/home/user/.cache/huggingface

# Hugging Face Spaces (and good practice) run the app as a non-root user with uid 1000
RUN useradd --create-home --uid 1000 user
WORKDIR /home/user/app

COPY --chown=user requirements.txt requirements-lock.txt ./
RUN pip install -r requirements.txt -c requirements-lock.txt

COPY --chown=user . .
USER user
EXPOSE 7860
CMD ["python", "app.py"]
