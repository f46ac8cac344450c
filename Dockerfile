# kvserver: the kvstash cache service. No torch, no GPU: the server only moves bytes.
#   docker build -t kvstash .
#   docker run -p 8765:8765 -v kvdata:/data kvstash
FROM python:3.11-slim

WORKDIR /app
# Only the packages (and the files setuptools reads) go into the image.
COPY pyproject.toml README.md ./
COPY hashing ./hashing
COPY storage ./storage
COPY kvserver ./kvserver
COPY kvstash ./kvstash
COPY bench ./bench
COPY connector ./connector
COPY gds ./gds
RUN pip install --no-cache-dir . \
    && useradd --system --uid 10001 kvstash \
    && mkdir -p /data && chown kvstash /data

USER kvstash
EXPOSE 8765
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/readyz', timeout=2)"]
ENTRYPOINT ["kvstash", "serve", "--host", "0.0.0.0", "--port", "8765"]
CMD ["--store", "file:///data/kv?capacity=50GiB"]
