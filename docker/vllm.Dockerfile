# vLLM's official OpenAI-server image plus this project's wheel, installed with --no-deps: the
# image's vLLM, torch, transformers, pydantic and safetensors stay exactly as they are.
# Build from the repository root (docker/README.md has the run command):
#   docker build -f docker/vllm.Dockerfile -t specdec-vllm .
# VLLM_IMAGE picks the engine image (any vllm/vllm-openai tag); its ENTRYPOINT `vllm serve` is kept.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.26.0

# Stage 1: this checkout's wheel (pure Python; setuptools comes in through build isolation).
FROM ${VLLM_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kernels ./kernels
COPY dflash_plugin ./dflash_plugin
COPY spiffy_plugin ./spiffy_plugin
COPY specfold_plugin ./specfold_plugin
RUN python3 -m pip wheel --no-deps --no-cache-dir -w /wheels .

# Stage 2: the engine image, unchanged but for the wheel (entry point vllm.general_plugins).
FROM ${VLLM_IMAGE}
COPY --from=wheel /wheels /tmp/specdec-wheels
RUN python3 -m pip install --no-deps --no-cache-dir --break-system-packages \
        /tmp/specdec-wheels/*.whl \
    && rm -rf /tmp/specdec-wheels
