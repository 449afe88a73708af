# One image for every part: router, node agent, mock engine, demo.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY index ./index
COPY policies ./policies
COPY router ./router
COPY sim ./sim
COPY agent ./agent
RUN pip install --no-cache-dir '.[demo,sim]'
ENTRYPOINT ["cache-router"]
