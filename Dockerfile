# One image for every hetsched service; the compose file and k8s manifests pick the module to run.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md alembic.ini ./
COPY shared ./shared
COPY services ./services
COPY hetsched ./hetsched
COPY migrations ./migrations
RUN pip install --no-cache-dir . && useradd --system hetsched
USER hetsched
CMD ["python", "-m", "services.placement"]
