# SGLang's official image plus this project's wheel, installed with --no-deps: the image's
# SGLang, torch, transformers, pydantic and safetensors stay exactly as they are.
# Build from the repository root (docker/README.md has the run command):
#   docker build -f docker/sglang.Dockerfile -t specdec-sglang .
# SGLANG_IMAGE picks the engine image (lmsysorg/sglang tags are vX.Y.Z-cu130 style).
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.16-cu130

# Stage 1: this checkout's wheel (pure Python; setuptools comes in through build isolation).
FROM ${SGLANG_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kernels ./kernels
COPY dflash_plugin ./dflash_plugin
COPY spiffy_plugin ./spiffy_plugin
COPY specfold_plugin ./specfold_plugin
RUN python3 -m pip wheel --no-deps --no-cache-dir -w /wheels .

# Stage 2: the engine image, unchanged but for the wheel (entry points sglang.srt.plugins).
FROM ${SGLANG_IMAGE}
COPY --from=wheel /wheels /tmp/specdec-wheels
RUN python3 -m pip install --no-deps --no-cache-dir --break-system-packages \
        /tmp/specdec-wheels/*.whl \
    && rm -rf /tmp/specdec-wheels
