# One image for every hetsched service; the compose file and k8s manifests pick the module to run.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md alembic.ini ./
COPY shared ./shared
COPY services ./services
COPY hetsched ./hetsched
COPY migrations ./migrations
# /creds: where `hetsched credentials init` writes NKeys (a volume takes this directory's owner).
RUN pip install --no-cache-dir . && useradd --system hetsched && mkdir -p /creds && chown hetsched /creds && chmod 700 /creds
USER hetsched
CMD ["python", "-m", "services.placement"]
