# One image for every part: router, node agent, mock engine, demo.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY index ./index
COPY policies ./policies
COPY router ./router
COPY sim ./sim
COPY agent ./agent
# g++ builds the native core (index._native) and leaves again.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && pip install --no-cache-dir '.[demo,sim,epp]' \
    && apt-get purge -y g++ && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["cache-router"]
