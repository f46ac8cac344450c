# kvserver: the kvstash cache service. No torch, no GPU: the server only moves bytes.
#   docker build -t kvstash .
#   docker run -p 8765:8765 -v kvdata:/data kvstash
# BASE selects the base image: any Debian-like image with python3 >= 3.11 and venv
# (python:3.11-slim by default; scripts/compose-check.sh builds a Debian bookworm base with
# debootstrap where no registry is reachable). With wheels in .docker-wheels/ (the
# project's and its dependencies') the build installs from them alone, needing no network.
ARG BASE=python:3.11-slim
FROM ${BASE}

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
COPY .docker-wheels ./wheels
RUN python3 -m venv /opt/kvstash \
    && if ls wheels/*.whl > /dev/null 2>&1; then \
         /opt/kvstash/bin/pip install --no-cache-dir --no-index --find-links wheels kvstash; \
       else \
         /opt/kvstash/bin/pip install --no-cache-dir .; \
       fi \
    && rm -rf wheels \
    && groupadd --system --gid 10001 kvstash \
    && useradd --system --uid 10001 --gid 10001 --no-create-home kvstash \
    && mkdir -p /data && chown 10001:10001 /data

ENV PATH=/opt/kvstash/bin:$PATH
# Numeric, so runtimes check it is not root without reading the image's passwd file.
USER 10001:10001
EXPOSE 8765
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/readyz', timeout=2)"]
ENTRYPOINT ["kvstash", "serve", "--host", "0.0.0.0", "--port", "8765"]
CMD ["--store", "file:///data/kv?capacity=50GiB"]
